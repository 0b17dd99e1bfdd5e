"""Span attributes of the client's reads: what an operator asks of a trace (how many keys, how
many bytes, which tier served them, hit or miss and why). Only used when tracing is on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.client.plans import ReadItem
from kvpool.proto.wire import TierLevel

TIER_NAMES = {int(t): t.name.lower() for t in TierLevel if t is not TierLevel.ANY}


def read_attributes(items: Sequence[ReadItem | None] | None, reason: str = "") -> dict[str, Any]:
    """Attributes of a finished get/batch_get: ``kvpool.hits``, ``kvpool.misses``,
    ``kvpool.bytes`` (read), ``kvpool.tier`` (each tier that served a hit), ``kvpool.hit`` and
    ``kvpool.miss_reason`` (the distinct reasons: absent, evicted, node_down, version_mismatch,
    checksum_mismatch, timeout, ...). ``items`` None: the whole call failed with ``reason``."""
    if items is None:
        return {"kvpool.hit": False, "kvpool.hits": 0, "kvpool.miss_reason": [reason]}
    hits = 0
    size = 0
    tiers: set[str] = set()
    reasons: set[str] = set()
    for item in items:
        if item is None:
            reasons.add("absent")
        elif item.ok:
            hits += 1
            size += int(item.entry.size_bytes)
            tier = TIER_NAMES.get(item.tier)
            if tier:
                tiers.add(tier)
        else:
            reasons.add(item.reason)
    attrs: dict[str, Any] = {
        "kvpool.hit": hits == len(items),
        "kvpool.hits": hits,
        "kvpool.misses": len(items) - hits,
        "kvpool.bytes": size,
    }
    if tiers:
        attrs["kvpool.tier"] = sorted(tiers)
    if reasons:
        attrs["kvpool.miss_reason"] = sorted(reasons)
    return attrs
