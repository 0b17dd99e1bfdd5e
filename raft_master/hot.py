"""Hot-block detection: exponentially decayed read counters, fed by the lookups a master answers.

Pure: the caller passes ``now`` (a monotonic clock reading) with every event. No Raft write per
read: counting is local soft state; only the replica moves it leads to are replicated.

A counter decays with time constant ``tau = half_life_s / ln 2``; a steady rate of ``r`` reads/s
settles at ``r * tau``, so ``rate = value / tau``. A key is *hot* once its rate reaches
``hot_reads_per_s``, and stays hot until it falls below ``hot_reads_per_s * cool_ratio``
(hysteresis, so a key at the threshold does not flap).

Counts come from the store nodes, where every read lands (a client serves repeated lookups from
its cache, so a master sees few of them): each heartbeat carries the node's most-read keys since
the last one (:meth:`HotDetector.add`).

Prefix chains: the index does not store parent links, so the detector takes them from the
lookups the master answers (:meth:`HotDetector.link`): keys looked up in one request are
treated as a chain, key *i*'s parent being key *i - 1* (an engine looks up a prompt's blocks in
order, ``kvpool.keys`` chains them the same way). A hot key brings its ancestors along.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence

MAX_CHAIN_DEPTH = 4096


class HotDetector:
    """Decayed per-key read rates with a bounded number of tracked keys."""

    def __init__(
        self,
        *,
        hot_reads_per_s: float,
        half_life_s: float = 10.0,
        cool_ratio: float = 0.5,
        max_keys: int = 100_000,
    ) -> None:
        if hot_reads_per_s <= 0 or half_life_s <= 0 or not 0 < cool_ratio <= 1 or max_keys < 1:
            raise ValueError("hot detector limits must be positive (cool_ratio in (0, 1])")
        self.hot_reads_per_s = hot_reads_per_s
        self._tau_s = half_life_s / math.log(2)
        self._cool_ratio = cool_ratio
        self._max_keys = max_keys
        self._counts: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (value, t)
        self._parents: OrderedDict[str, str] = OrderedDict()
        self._hot: dict[str, None] = {}
        # keys whose counter reached the cooling threshold when last read: only these (and the
        # hot ones) can be hot now, since counters only decay between reads
        self._candidates: dict[str, None] = {}

    def _decayed(self, key: str, now: float) -> float:
        entry = self._counts.get(key)
        if entry is None:
            return 0.0
        value, t = entry
        return value * math.exp(-max(0.0, now - t) / self._tau_s)

    def record(self, keys: Sequence[str], now: float) -> None:
        """One read of each of ``keys``, looked up together (in request order: a chain)."""
        self.link(keys)
        for key in keys:
            self.add(key, 1, now)

    def add(self, key: str, reads: int, now: float) -> None:
        """``reads`` more reads of ``key`` (a node's heartbeat reports its counts)."""
        value = self._decayed(key, now) + reads
        self._counts[key] = (value, now)
        self._counts.move_to_end(key)
        if value / self._tau_s >= self.hot_reads_per_s * self._cool_ratio:
            self._candidates[key] = None
        while len(self._counts) > self._max_keys:
            old, _ = self._counts.popitem(last=False)  # least recently read
            self._hot.pop(old, None)
            self._candidates.pop(old, None)

    def link(self, keys: Sequence[str]) -> None:
        """Keys looked up together, in order: each one's parent is the key before it."""
        for previous, key in itertools.pairwise(keys):
            if previous != key:
                self._parents[key] = previous
                self._parents.move_to_end(key)
        while len(self._parents) > self._max_keys:
            self._parents.popitem(last=False)

    def rate(self, key: str, now: float) -> float:
        """Reads per second, as the decayed counter estimates it."""
        return self._decayed(key, now) / self._tau_s

    def update(self, now: float) -> tuple[list[str], list[str]]:
        """``(hot, cooled)``: the keys hot now, ancestors included and ancestors first, and the
        keys that stopped being hot since the last call."""
        hot: dict[str, None] = {}
        cool_below = self.hot_reads_per_s * self._cool_ratio
        for key in list(self._candidates):
            r = self.rate(key, now)
            if r >= self.hot_reads_per_s or (key in self._hot and r >= cool_below):
                hot[key] = None
            elif r < cool_below:
                del self._candidates[key]  # decayed below both thresholds: read again first
        with_chains: dict[str, None] = {}
        for key in hot:
            chain = [key]
            seen = {key}
            parent = self._parents.get(key)
            while parent is not None and parent not in seen and len(chain) < MAX_CHAIN_DEPTH:
                chain.append(parent)
                seen.add(parent)
                parent = self._parents.get(parent)
            for k in reversed(chain):
                with_chains[k] = None
        cooled = [k for k in self._hot if k not in with_chains]  # cost: candidates + hot only
        self._hot = with_chains
        return list(with_chains), cooled

    def forget(self, key: str) -> None:
        self._counts.pop(key, None)
        self._parents.pop(key, None)
        self._hot.pop(key, None)
        self._candidates.pop(key, None)

    def prune(self, now: float, below_reads_per_s: float = 0.01, limit: int = 5000) -> int:
        """Forget the least recently read keys while they are read less often than
        ``below_reads_per_s`` (and not hot), at most ``limit``; how many. Stops at the first
        one that is not, so a call costs what it removes."""
        gone = 0
        while self._counts and gone < limit:
            key = next(iter(self._counts))
            if key in self._hot or key in self._candidates:
                break
            if self.rate(key, now) >= below_reads_per_s:
                break
            del self._counts[key]
            self._parents.pop(key, None)
            gone += 1
        return gone

    def __len__(self) -> int:
        return len(self._counts)
