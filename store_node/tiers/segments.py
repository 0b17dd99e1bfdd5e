"""The SSD tier's space: fixed-size segments filled append-only, freed whole.

Pure bookkeeping (no I/O). The SSD space ``[0, capacity)`` is cut into ``segment_bytes``
segments. Blocks are appended to the one *open* segment at 4 KiB-aligned offsets, so that the
demotions picked together land in one contiguous extent and go to the device as one large
aligned write; when the next block does not fit, the segment is *sealed* and the next free one
opened. A freed block leaves a hole (dead bytes) in its segment; a segment is reused only when
all its blocks are gone — freed one by one, or all at once when the tier manager *reclaims* the
oldest sealed segment (segment FIFO, as flash caches do: CacheLib's BlockCache regions). The
device therefore sees whole-segment sequential rewrites and no read-modify-write of small
pieces, which keeps write amplification low, and there is never a free list of small extents.

Each opening of a segment gets a new *generation* (one counter over the whole tier), recorded in
the manifest: a block record is only valid for the generation it was written in, so nothing
written before a segment was reused can come back after a restart.

Fragmentation here is the share of bytes in use by segments that are dead (freed blocks,
padding to 4 KiB, the unfilled tail of a sealed segment): ``1 - live / used``.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

SSD_ALIGNMENT_BYTES = 4096
"""Block offsets and write extents on the SSD are multiples of this (O_DIRECT's strictest
logical block size in practice)."""


class SegmentState(enum.IntEnum):
    FREE = 0
    OPEN = 1
    SEALED = 2


@dataclass(frozen=True, slots=True)
class SegmentOpened:
    """A segment was (re)opened for appends with a new generation (a manifest record)."""

    segment: int
    generation: int


class SegmentAllocator:
    """Append-only allocation in segments; see the module doc."""

    def __init__(
        self, capacity_bytes: int, segment_bytes: int, alignment_bytes: int = SSD_ALIGNMENT_BYTES
    ) -> None:
        if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
            raise ValueError(f"alignment must be a power of two, not {alignment_bytes}")
        if segment_bytes < alignment_bytes or segment_bytes % alignment_bytes:
            raise ValueError(
                f"segment size {segment_bytes} must be a positive multiple of {alignment_bytes}"
            )
        count = capacity_bytes // segment_bytes
        if count < 2:
            raise ValueError(
                f"capacity {capacity_bytes} holds {count} segment(s) of {segment_bytes} bytes; "
                "at least 2 are needed"
            )
        self._unit = alignment_bytes
        self.segment_bytes = segment_bytes
        self.segment_count = count
        self._state = [SegmentState.FREE] * count
        self._fill = [0] * count  # append pointer inside the segment
        self._live = [0] * count  # bytes of live extents
        self._blocks = [0] * count  # live extents
        self._generation = [0] * count
        self._next_generation = 1
        self._free: deque[int] = deque(range(count))
        self._sealed: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._open: int | None = None
        self._sizes: dict[int, int] = {}  # live extent offset -> footprint
        self._opened: list[SegmentOpened] = []

    # --- queries ------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self.segment_count * self.segment_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of segments in use: every sealed segment whole, the open one up to its fill."""
        used = len(self._sealed) * self.segment_bytes
        if self._open is not None:
            used += self._fill[self._open]
        return used

    @property
    def live_bytes(self) -> int:
        return sum(self._live)

    @property
    def allocations(self) -> int:
        return len(self._sizes)

    @property
    def free_segments(self) -> int:
        return len(self._free)

    @property
    def open_segment(self) -> int | None:
        return self._open

    def footprint(self, size_bytes: int) -> int:
        unit = self._unit
        return max(unit, -(-size_bytes // unit) * unit)

    def fragmentation(self) -> float:
        used = self.used_bytes
        return 0.0 if used == 0 else 1.0 - self.live_bytes / used

    def segment_of(self, offset: int) -> int:
        return offset // self.segment_bytes

    def generation(self, segment: int) -> int:
        return self._generation[segment]

    def state(self, segment: int) -> SegmentState:
        return self._state[segment]

    def size_of(self, offset: int) -> int:
        try:
            return self._sizes[offset]
        except KeyError:
            raise ValueError(f"no SSD allocation at offset {offset}") from None

    def sealed_oldest_first(self) -> Iterator[int]:
        """Sealed segments in the order they were sealed (reclaim candidates)."""
        return iter(list(self._sealed))

    def take_opened(self) -> list[SegmentOpened]:
        """Segments opened since the last call, in order (to record in the manifest)."""
        out, self._opened = self._opened, []
        return out

    # --- alloc and free -----------------------------------------------------------------------

    def alloc(self, size_bytes: int) -> int | None:
        """Offset of ``size_bytes`` appended to the open segment (opening the next free one
        when it does not fit), or None when no free segment is left or the block is larger
        than a segment."""
        need = self.footprint(size_bytes)
        if need > self.segment_bytes:
            return None
        seg = self._open
        if seg is None or self._fill[seg] + need > self.segment_bytes:
            if seg is not None:
                self.seal()
            if not self._free:
                return None
            seg = self._free.popleft()
            self._state[seg] = SegmentState.OPEN
            self._fill[seg] = 0
            self._generation[seg] = self._next_generation
            self._next_generation += 1
            self._opened.append(SegmentOpened(seg, self._generation[seg]))
            self._open = seg
        offset = seg * self.segment_bytes + self._fill[seg]
        self._fill[seg] += need
        self._live[seg] += need
        self._blocks[seg] += 1
        self._sizes[offset] = need
        return offset

    def free(self, offset: int) -> bool:
        """Return a block's extent; True when this emptied a sealed segment (now free)."""
        need = self._sizes.pop(offset, None)
        if need is None:
            raise ValueError(f"free of SSD offset {offset}, which is not allocated")
        seg = offset // self.segment_bytes
        self._live[seg] -= need
        self._blocks[seg] -= 1
        if self._blocks[seg] == 0 and self._state[seg] is SegmentState.SEALED:
            self._release(seg)
            return True
        return False

    def seal(self) -> None:
        """Close the open segment for appends (it is reclaimed in FIFO order from now on)."""
        seg = self._open
        if seg is None:
            return
        self._open = None
        if self._blocks[seg] == 0:
            self._release(seg)
            return
        self._state[seg] = SegmentState.SEALED
        self._sealed[seg] = None

    def restore(self, segments: Iterable[tuple[int, int, list[tuple[int, int]]]]) -> None:
        """Rebuild after a restart from ``(segment, generation, [(offset, size_bytes)])`` in
        the order the segments were opened; every restored segment is sealed. Call once, on a
        fresh allocator."""
        if self._sizes or self._open is not None:
            raise ValueError("restore() needs a fresh allocator")
        taken: set[int] = set()
        for seg, generation, extents in segments:
            if not 0 <= seg < self.segment_count or seg in taken:
                raise ValueError(f"bad or repeated segment {seg} in a restore")
            taken.add(seg)
            self._generation[seg] = generation
            self._next_generation = max(self._next_generation, generation + 1)
            for offset, size_bytes in extents:
                need = self.footprint(size_bytes)
                if offset // self.segment_bytes != seg or offset % self._unit:
                    raise ValueError(f"offset {offset} is not an aligned offset in segment {seg}")
                self._sizes[offset] = need
                self._live[seg] += need
                self._blocks[seg] += 1
            self._fill[seg] = self.segment_bytes
            if self._blocks[seg]:
                self._state[seg] = SegmentState.SEALED
                self._sealed[seg] = None
        self._free = deque(s for s in range(self.segment_count) if s not in self._sealed)

    # --- internals ----------------------------------------------------------------------------

    def _release(self, seg: int) -> None:
        self._state[seg] = SegmentState.FREE
        self._sealed.pop(seg, None)
        self._fill[seg] = 0
        self._free.append(seg)

    def check_invariants(self) -> None:
        live = [0] * self.segment_count
        blocks = [0] * self.segment_count
        for offset, need in self._sizes.items():
            seg = offset // self.segment_bytes
            assert offset % self._unit == 0
            assert need % self._unit == 0
            assert offset + need <= (seg + 1) * self.segment_bytes, "extent crosses a segment"
            assert self._state[seg] is not SegmentState.FREE, f"live extent in free segment {seg}"
            live[seg] += need
            blocks[seg] += 1
        assert live == self._live
        assert blocks == self._blocks
        for seg in range(self.segment_count):
            state = self._state[seg]
            assert (seg in self._free) == (state is SegmentState.FREE)
            assert (seg in self._sealed) == (state is SegmentState.SEALED)
            assert (seg == self._open) == (state is SegmentState.OPEN)
            if state is SegmentState.SEALED:
                assert self._blocks[seg] > 0, f"empty sealed segment {seg} not released"
            assert self._live[seg] <= self._fill[seg] <= self.segment_bytes
        ordered = sorted(self._sizes)
        for a, b in itertools.pairwise(ordered):
            assert a + self._sizes[a] <= b, f"SSD extents overlap at {a}"
