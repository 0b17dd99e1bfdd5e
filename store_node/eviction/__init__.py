"""Eviction policies: told of inserts, reads and removals; asked for the next victim.

"Advise, then act": a policy only ranks. The tier manager asks :meth:`EvictionPolicy.pop_victim`
with its own eligibility test (committed, not pinned, not leased to a reader or a copy job), then
acts on the block it got — drops the copy, demotes it to a slower tier, reports it — and tells
nobody else. A policy never sees staged blocks and never frees anything itself.

Reads only count when bytes were really served: nothing on the data plane touches a block
without reading it (there is no probe that renews anything), and a reader's lease ends when its
bytes have left. Eviction therefore cannot be starved the way Mooncake's was (0 keys evicted in
649 attempts because existence probes kept renewing leases): an ineligible block met during a
scan is rotated away from the eviction end, so the next scan starts with other candidates, and
every scan is bounded.

Policies are picked by name from :data:`POLICIES` (config ``eviction_policy``):

- ``s3fifo`` (default) — S3-FIFO (Yang et al., SOSP 2023), see :mod:`.s3fifo`: frequency-aware,
  scan-resistant, O(1) per operation, no per-read list surgery.
- ``lru`` — least recently used (kept for comparison and for tests that want plain recency).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvpool.errors import ConfigError
from kvpool.store_node.eviction.lru import LruPolicy
from kvpool.store_node.eviction.s3fifo import S3FifoPolicy

BlockId = tuple[str, int]
"""A block's identity on a node: (key, write id)."""


class EvictionPolicy(Protocol):
    """Ranks the evictable copies of one tier. Every method is O(1) amortised except
    :meth:`pop_victim`, whose scan is bounded by a small multiple of :meth:`__len__`."""

    def inserted(self, block: BlockId, size_bytes: int) -> None:
        """A copy became evictable on this tier (committed, or promoted/restored here)."""

    def touched(self, block: BlockId) -> None:
        """The copy served a read (never called for a probe or a lookup)."""

    def removed(self, block: BlockId) -> None:
        """The copy left the tier (deleted, replaced, moved). Unknown ids are ignored."""

    def pop_victim(
        self, eligible: Callable[[BlockId], bool], max_refusals: int | None = None
    ) -> BlockId | None:
        """The least valuable block that ``eligible`` accepts, already removed from the
        policy; None when no eligible block was met within a bounded scan (at most
        ``max_refusals`` refused candidates, when given; refused ones rotate away, so the
        next call looks at others)."""
        ...

    def __contains__(self, block: object) -> bool: ...

    def __len__(self) -> int: ...


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"s3fifo": S3FifoPolicy, "lru": LruPolicy}
"""Policy name (config ``eviction_policy``) → factory."""

DEFAULT_POLICY = "s3fifo"


def make_policy(name: str) -> EvictionPolicy:
    """A new policy by name; raises ConfigError naming the known ones."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ConfigError(
            f"eviction_policy: unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})"
        )
    return factory()


__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "BlockId",
    "EvictionPolicy",
    "LruPolicy",
    "S3FifoPolicy",
    "make_policy",
]
