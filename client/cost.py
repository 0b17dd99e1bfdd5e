"""Read or recompute? The cost model an engine consults before loading KV blocks.

A KV block is worth reading only when reading it is faster than recomputing it. Reading costs a
request's round trip plus, per block, a fixed part and its bytes over the tier's bandwidth
(the SSD tier is slower than the CPU tier); recomputing costs the prefill time of the block's
tokens, which the engine measures on its own prefills. :meth:`CostModel.plan` answers, for a
block size, the slowest tier still worth reading — the ``max_tier`` to pass to the client, so
blocks held only on slower tiers are skipped (``slow_tier`` misses, counted in the client's
stats) and recomputed instead — or that no read is worth it at all.

Pure: no clocks, no I/O. The engine times its prefills and reads and feeds them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpool.errors import InvalidArgumentError

TIER_ORDER: tuple[str, ...] = ("gpu", "cpu", "ssd")
"""Fastest first; ``max_tier=t`` accepts ``t`` and every tier before it."""


@dataclass(frozen=True, slots=True)
class TierSpeed:
    """How fast a block read from a tier reaches the engine (over the data plane)."""

    bytes_per_s: float
    per_block_s: float
    """Fixed cost of each block read (frame, seek) on top of its bytes."""


DEFAULT_TIER_SPEEDS: Mapping[str, TierSpeed] = {
    "gpu": TierSpeed(bytes_per_s=3.0e9, per_block_s=50e-6),
    "cpu": TierSpeed(bytes_per_s=2.0e9, per_block_s=50e-6),
    "ssd": TierSpeed(bytes_per_s=0.7e9, per_block_s=200e-6),
}
"""Loopback-TCP reads as measured by ``kvpool-bench tiers`` (CPU 2.3-4.4 GB/s, SSD 0.7-2.4 GB/s
for 1 MiB blocks), taken at the low end. Engines on real networks should pass their own."""
DEFAULT_REQUEST_S = 2e-3
"""One lookup and one batched read: two round trips (README: get p50 ~1 ms)."""


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What to read for a prompt of ``blocks`` full blocks of ``block_bytes`` each."""

    fetch: bool
    """False: recomputing every block is faster than any read; do not even look the keys up."""
    max_tier: str | None
    """The slowest tier worth reading (None: any tier, when no recompute time is known yet)."""
    skipped_tiers: tuple[str, ...]
    """Tiers whose blocks are recomputed rather than read."""
    recompute_s_per_block: float | None
    read_s_per_block: Mapping[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        if self.recompute_s_per_block is None:
            return "no prefill measured yet: read from any tier"
        reads = ", ".join(f"{t} {s * 1e3:.2f} ms" for t, s in self.read_s_per_block.items())
        head = f"per block: recompute {self.recompute_s_per_block * 1e3:.2f} ms, read {reads}"
        if not self.fetch:
            return f"{head}; recompute is faster than any read: skip the cache"
        if self.skipped_tiers:
            return f"{head}; read up to {self.max_tier}, skip {'/'.join(self.skipped_tiers)}"
        return f"{head}; read from any tier"


class CostModel:
    """Estimates of read and recompute time; see the module doc."""

    def __init__(
        self,
        tier_speeds: Mapping[str, TierSpeed] | None = None,
        *,
        request_s: float = DEFAULT_REQUEST_S,
        recompute_s_per_token: float | None = None,
        smoothing: float = 0.3,
    ) -> None:
        self.tier_speeds = dict(tier_speeds if tier_speeds is not None else DEFAULT_TIER_SPEEDS)
        unknown = set(self.tier_speeds) - set(TIER_ORDER)
        if unknown:
            raise InvalidArgumentError(f"unknown tiers {sorted(unknown)}; expected {TIER_ORDER}")
        if not 0 < smoothing <= 1:
            raise InvalidArgumentError("smoothing: must be in (0, 1]")
        self.request_s = request_s
        self.recompute_s_per_token = recompute_s_per_token
        self.smoothing = smoothing

    def observe_recompute(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` tokens took ``seconds`` (exponentially smoothed)."""
        if tokens <= 0 or seconds <= 0:
            return
        sample = seconds / tokens
        old = self.recompute_s_per_token
        self.recompute_s_per_token = (
            sample if old is None else old + self.smoothing * (sample - old)
        )

    def observe_read(self, tier: str, blocks: int, nbytes: int, seconds: float) -> None:
        """``blocks`` blocks (``nbytes`` bytes in all) were read from ``tier`` in one request
        that took ``seconds``: what the per-block estimate does not explain is the request's
        fixed cost (lookups, round trips), and the estimate of it moves toward that."""
        speed = self.tier_speeds.get(tier)
        if speed is None or blocks <= 0 or seconds <= 0:
            return
        transfer_s = blocks * speed.per_block_s + nbytes / speed.bytes_per_s
        sample = max(0.0, seconds - transfer_s)
        self.request_s += self.smoothing * (sample - self.request_s)

    def read_s(self, tier: str, blocks: int, block_bytes: int) -> float:
        """Estimated time to read ``blocks`` blocks from ``tier`` in one request."""
        speed = self.tier_speeds[tier]
        return self.request_s + blocks * (speed.per_block_s + block_bytes / speed.bytes_per_s)

    def recompute_s(self, tokens: int) -> float | None:
        if self.recompute_s_per_token is None:
            return None
        return tokens * self.recompute_s_per_token

    def plan(self, *, blocks: int, block_bytes: int, block_tokens: int) -> ReadPlan:
        """What to read for a prompt of ``blocks`` full blocks."""
        tiers = [t for t in TIER_ORDER if t in self.tier_speeds]
        per_block = {
            t: self.tier_speeds[t].per_block_s + block_bytes / self.tier_speeds[t].bytes_per_s
            for t in tiers
        }
        recompute = self.recompute_s(block_tokens)
        if recompute is None:
            return ReadPlan(True, None, (), None, per_block)
        worth: list[str] = []
        for t in tiers:  # a leading run: max_tier=t accepts every faster tier too
            if per_block[t] >= recompute:
                break
            worth.append(t)
        fastest_total = self.read_s(tiers[0], blocks, block_bytes) if tiers else float("inf")
        if not worth or blocks < 1 or fastest_total >= blocks * recompute:
            return ReadPlan(False, None, tuple(tiers), recompute, per_block)
        max_tier = worth[-1]
        skipped = tuple(t for t in tiers if t not in worth)
        return ReadPlan(True, max_tier, skipped, recompute, per_block)
