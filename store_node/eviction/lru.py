"""Least recently used first (an insert counts as a use)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

BlockId = tuple[str, int]


class LruPolicy:
    """Plain recency. An ineligible block met by a scan moves to the recent end: it is being
    read or is pinned, so it is not the next thing to go, and the next scan starts elsewhere."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[BlockId, None] = OrderedDict()

    def inserted(self, block: BlockId, size_bytes: int = 0) -> None:
        self._order[block] = None
        self._order.move_to_end(block)

    def touched(self, block: BlockId) -> None:
        if block in self._order:
            self._order.move_to_end(block)

    def removed(self, block: BlockId) -> None:
        self._order.pop(block, None)

    def pop_victim(
        self, eligible: Callable[[BlockId], bool], max_refusals: int | None = None
    ) -> BlockId | None:
        scan = len(self._order) if max_refusals is None else min(len(self._order), max_refusals + 1)
        for _ in range(scan):
            block = next(iter(self._order))
            if eligible(block):
                del self._order[block]
                return block
            self._order.move_to_end(block)
        return None

    def __contains__(self, block: object) -> bool:
        return block in self._order

    def __len__(self) -> int:
        return len(self._order)
