"""Eviction policies: told of inserts, hits and removals; asked which blocks could go.

"Advise, then act": a policy only ranks. The block store walks the policy's proposals, checks
each block's eligibility itself (committed, not pinned, not leased to a reader), frees what it
chose and then tells the policy. A policy therefore never sees staged blocks and never decides
anything on its own. Policies are picked by name from :data:`POLICIES` (config
``eviction_policy``), so adding one (S3-FIFO, frequency-weighted LRU) touches nothing else.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

from kvpool.errors import ConfigError

BlockId = tuple[str, int]
"""A block's identity on a node: (key, write id)."""


class EvictionPolicy(Protocol):
    """Ranks evictable blocks. Every method is O(1) amortised except :meth:`victims`."""

    def inserted(self, block: BlockId) -> None:
        """A block became evictable (it was committed)."""

    def touched(self, block: BlockId) -> None:
        """A block was read."""

    def removed(self, block: BlockId) -> None:
        """A block left the store (evicted, deleted, replaced). Unknown ids are ignored."""

    def victims(self) -> Iterator[BlockId]:
        """Candidates, least valuable first. The store stops iterating before it changes
        anything, so the iterator may walk live internal state."""
        ...

    def __len__(self) -> int: ...


class LruPolicy:
    """Least recently used first (inserts count as a use)."""

    def __init__(self) -> None:
        self._order: OrderedDict[BlockId, None] = OrderedDict()

    def inserted(self, block: BlockId) -> None:
        self._order[block] = None
        self._order.move_to_end(block)

    def touched(self, block: BlockId) -> None:
        if block in self._order:
            self._order.move_to_end(block)

    def removed(self, block: BlockId) -> None:
        self._order.pop(block, None)

    def victims(self) -> Iterator[BlockId]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LruPolicy}
"""Policy name (config ``eviction_policy``) → class."""


def make_policy(name: str) -> EvictionPolicy:
    """A new policy by name; raises ConfigError naming the known ones."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(
            f"eviction_policy: unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})"
        )
    return cls()
