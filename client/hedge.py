"""Hedged reads: a read that is slow on one replica is also asked of the next one.

A node that stalls (a GC pause, a full disk queue, a dying host not yet declared down) would hold
a get for up to its whole deadline. When a round of reads has not finished after
:meth:`HedgePolicy.delay_s`, the shell sends the keys still waiting to their next replica too and
takes whichever answer is judged good first. Pure: no sockets, no clock; both data planes (the
event loop's and the synchronous fast path's) drive it.

A hedge never writes into the caller's buffer while the first read may still write there: each
hedged key is read by a *clone* into a buffer of its own, and the bytes are copied into the
caller's buffer (:meth:`Hedge.settle`) only after the first read has been stopped or has
finished — one extra copy, only for keys the hedge served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvpool.buffers import copy_bytes
from kvpool.client.plans import ReadItem
from kvpool.errors import DeadlineExceededError

HEDGE_BYTES_PER_S = 1e9
"""Transfer rate a hedge delay allows for: a round reading N bytes waits N / this longer before
hedging, so a large read that is merely moving bytes is not asked twice."""


@dataclass(frozen=True, slots=True)
class HedgePolicy:
    """When to hedge: after ``base_delay_s`` plus the round's bytes at
    :data:`HEDGE_BYTES_PER_S`; never when ``enabled`` is false."""

    enabled: bool = True
    base_delay_s: float = 0.01

    def delay_s(self, round_bytes: int) -> float:
        return self.base_delay_s + round_bytes / HEDGE_BYTES_PER_S

    def worth_it(self, items: Iterable[ReadItem]) -> bool:
        """Whether a round over ``items`` could hedge at all: some key has a replica left."""
        if not self.enabled:
            return False
        return any(it.next < len(it.replicas) for it in items)


def round_bytes(items: Iterable[ReadItem]) -> int:
    return sum(it.entry.size_bytes for it in items)


class Hedge:
    """The second reads of a round's slow keys: one clone per key that has another replica,
    reading into its own buffer (or into ``value`` when the key is read as bytes)."""

    def __init__(self, slow: Iterable[ReadItem]) -> None:
        self.pairs: list[tuple[ReadItem, ReadItem]] = []
        for it in slow:
            if it.ok or it.next >= len(it.replicas):
                continue
            clone = ReadItem(
                it.key,
                it.key_bytes,
                it.entry,
                sink=memoryview(bytearray(it.entry.size_bytes)) if it.sink is not None else None,
                caller_buffer=False,
                replicas=it.replicas,
                max_tier=it.max_tier,
                from_cache=it.from_cache,
            )
            clone.next = it.next
            self.pairs.append((it, clone))

    @property
    def clones(self) -> list[ReadItem]:
        return [clone for _, clone in self.pairs]

    def __len__(self) -> int:
        return len(self.pairs)

    def forget(self, clones: Iterable[ReadItem]) -> None:
        """Do not hedge these keys after all (their clones were never sent)."""
        gone = {id(c) for c in clones}
        self.pairs = [(it, c) for it, c in self.pairs if id(c) not in gone]

    def resolved(
        self, first_done: Callable[[ReadItem], bool], hedge_done: Callable[[ReadItem], bool]
    ) -> bool:
        """True when waiting longer cannot change the outcome of any hedged key: it was read
        (by either), or both its reads are over."""
        return all(
            it.ok or clone.ok or (first_done(it) and hedge_done(clone)) for it, clone in self.pairs
        )

    def settle(self) -> int:
        """Fold the clones back into their keys; call only once no first read can still write
        into a key's buffer. Returns how many keys the hedge served."""
        won = 0
        for it, clone in self.pairs:
            if not it.ok and clone.ok:
                if it.sink is not None:
                    assert clone.sink is not None
                    copy_bytes(it.sink, clone.sink)
                else:
                    it.value = clone.value
                it.ok = True
                it.tier = clone.tier
                won += 1
            elif not it.ok:
                for reason, error in zip(clone.reasons, clone.errors, strict=True):
                    it.fail(reason, error)
            it.next = max(it.next, clone.next)
        return won


def fail_unanswered(items: Iterable[ReadItem], address: str, *, hedged: bool = True) -> None:
    """A slow node's first reads of ``items`` were given up on (when ``hedged``, the hedge's
    reads are settled): each key still unread fails as a timeout there."""
    why = "no answer (hedged)" if hedged else "no answer in the round's time"
    for it in items:
        if not it.ok:
            it.fail("timeout", DeadlineExceededError(f"{address}: {it.key!r}: {why}"))
