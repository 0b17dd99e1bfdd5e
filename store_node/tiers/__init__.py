"""A store node's tiers: GPU (device memory), CPU (shared memory) and SSD (preallocated files).

Every tier is an arena addressed by offset with an allocator over it (offsets, never a Python
object per free range) and moves bytes in and out by offset. The tier manager decides what lives
where; a tier only stores.

- :mod:`.cpu` — :class:`CpuTier`: a memfd arena; blocks are served straight from it.
- :mod:`.segments` — :class:`SegmentAllocator`: the SSD's space as append-only segments.
- :mod:`.ssd` — :class:`SsdTier`: a preallocated data file, large aligned writes, positional
  reads, O_DIRECT where the filesystem allows, and the manifest of :mod:`.manifest`.
- :mod:`.gpu` — :class:`GpuTier`: cupy device memory, present only where cupy and a device are.
"""

from __future__ import annotations

from typing import Protocol

from kvpool.proto.wire import TierLevel

TIER_NAMES: dict[TierLevel, str] = {
    TierLevel.GPU: "gpu",
    TierLevel.CPU: "cpu",
    TierLevel.SSD: "ssd",
}
LEVELS_BY_NAME: dict[str, TierLevel] = {name: level for level, name in TIER_NAMES.items()}


class Tier(Protocol):
    """An arena of one kind of memory with an allocator over it, addressed by offset."""

    @property
    def level(self) -> TierLevel: ...

    @property
    def name(self) -> str: ...

    @property
    def detail(self) -> str:
        """One line for operators: what backs the tier."""
        ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def footprint(self, size_bytes: int) -> int:
        """Bytes an allocation of ``size_bytes`` really takes (alignment, minimum unit)."""
        ...

    def alloc(self, size_bytes: int) -> int | None:
        """Offset of a new allocation, or None when there is no room."""
        ...

    def free(self, offset: int) -> None: ...

    def fragmentation(self) -> float:
        """0.0 when free space is one piece, towards 1.0 as it splinters."""
        ...

    def read_into(self, offset: int, dest: memoryview) -> None:
        """Copy ``len(dest)`` bytes at ``offset`` out of the tier (blocking: call it from a
        worker thread for the SSD and GPU tiers)."""
        ...

    def write_from(self, offset: int, src: memoryview) -> None:
        """Copy ``src`` into the tier at ``offset`` (blocking, as :meth:`read_into`)."""
        ...

    def close(self) -> bool:
        """Release the arena; False when views were still held (released once they go)."""
        ...


__all__ = ["LEVELS_BY_NAME", "TIER_NAMES", "Tier", "TierLevel"]
