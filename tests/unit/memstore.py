"""An in-memory stand-in for ``kvpool.Client`` (put/get/batch/prefix_match/exists/remove with
``max_tier``), for tests of code built on the client that need no cluster."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

TIERS = {"gpu": 1, "cpu": 2, "ssd": 3}


class MemoryStore:
    """Blocks in a dict. ``tier[key]`` says where a block "is" (default cpu); a read with
    ``max_tier`` faster than that is a ``slow_tier`` miss, as the real client counts it.
    ``down=True`` makes every call fail as a dead cluster would (misses, False, 0)."""

    def __init__(self) -> None:
        self.blocks: dict[str, bytes] = {}
        self.tier: dict[str, str] = {}
        self.down = False
        self.calls: list[str] = []
        self.misses: dict[str, int] = {"slow_tier": 0, "absent": 0, "unavailable": 0}
        self.hits = 0
        self.before_call: Callable[[str], None] | None = None

    def _enter(self, op: str) -> bool:
        self.calls.append(op)
        if self.before_call is not None:
            self.before_call(op)
        return not self.down

    def _read(self, key: str, max_tier: str | None) -> bytes | None:
        if self.down:
            self.misses["unavailable"] += 1
            return None
        data = self.blocks.get(key)
        if data is None:
            self.misses["absent"] += 1
            return None
        if max_tier and TIERS[self.tier.get(key, "cpu")] > TIERS[max_tier]:
            self.misses["slow_tier"] += 1
            return None
        self.hits += 1
        return data

    def put(self, key: str, value: Any, *, strict: bool | None = None) -> bool:
        if not self._enter("put"):
            return False
        self.blocks[key] = bytes(memoryview(value).cast("B"))
        return True

    def get(
        self, key: str, *, strict: bool | None = None, max_tier: str | None = None
    ) -> bytes | None:
        self._enter("get")
        return self._read(key, max_tier)

    def batch_put(self, items: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> list[bool]:
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        if not self._enter("batch_put"):
            return [False] * len(pairs)
        for key, value in pairs:
            self.blocks[key] = bytes(memoryview(value).cast("B"))
        return [True] * len(pairs)

    def batch_get(self, keys: Sequence[str], *, max_tier: str | None = None) -> list[bytes | None]:
        self._enter("batch_get")
        return [self._read(k, max_tier) for k in keys]

    def prefix_match(self, keys: Sequence[str]) -> int:
        if not self._enter("prefix_match"):
            return 0
        n = 0
        for key in keys:
            if key not in self.blocks:
                break
            n += 1
        return n

    def exists(self, key: str) -> bool:
        return self._enter("exists") and key in self.blocks

    def remove(self, key: str) -> bool:
        return self._enter("remove") and self.blocks.pop(key, None) is not None

    @property
    def stats(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "misses": sum(self.misses.values()),
            "misses_by_reason": dict(self.misses),
        }
