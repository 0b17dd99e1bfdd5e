"""An offset allocator over one arena: segregated free lists, 64-byte units, coalescing on free.

The arena itself (memory, a file, device memory) is someone else's; this class only hands out
``[offset, offset + size)`` ranges. State is a handful of dicts keyed by offset — one entry per
extent, never per byte — so a 64 GiB arena of 4 KiB blocks costs a few dozen MB of bookkeeping.

Free extents are kept in bins by size class (``size.bit_length() - 1``), with a bitmask of the
non-empty bins: an allocation looks at a few extents of its own class and otherwise takes the
first extent of the smallest larger class, which always fits (good fit, O(1) in the common
case). Freeing merges with the free neighbours on both sides, so freeing everything always
restores one extent of the whole capacity. Deterministic: no randomness, no clock, insertion-
ordered dicts only.
"""

from __future__ import annotations

from itertools import islice

ALIGNMENT_BYTES = 64
"""Every allocation starts on, and is rounded up to, this many bytes (a cache line)."""

_SAME_CLASS_SCAN = 8
"""Extents of the request's own size class looked at before a larger class is split."""


class Allocator:
    """Hands out aligned, non-overlapping ranges of ``[0, capacity_bytes)``."""

    def __init__(self, capacity_bytes: int, alignment_bytes: int = ALIGNMENT_BYTES) -> None:
        if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
            raise ValueError(f"alignment must be a power of two, not {alignment_bytes}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity must not be negative, not {capacity_bytes}")
        self._unit = alignment_bytes
        self._capacity = capacity_bytes // alignment_bytes * alignment_bytes
        self._free_start: dict[int, int] = {}  # free extent start -> size
        self._free_end: dict[int, int] = {}  # free extent end -> start
        self._bins: list[dict[int, None]] = [{} for _ in range(64)]  # size class -> starts
        self._nonempty = 0  # bit k set <=> _bins[k] is not empty
        self._live: dict[int, int] = {}  # allocated start -> size
        self._used = 0
        if self._capacity:
            self._insert_free(0, self._capacity)

    # --- queries ------------------------------------------------------------------------------

    @property
    def alignment_bytes(self) -> int:
        return self._unit

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def free_bytes(self) -> int:
        return self._capacity - self._used

    @property
    def allocations(self) -> int:
        return len(self._live)

    def footprint(self, size_bytes: int) -> int:
        """Bytes an allocation of ``size_bytes`` takes: rounded up, at least one unit."""
        unit = self._unit
        return max(unit, -(-size_bytes // unit) * unit)

    def size_of(self, offset: int) -> int:
        """Allocated size at ``offset``; raises ValueError when nothing is allocated there."""
        try:
            return self._live[offset]
        except KeyError:
            raise ValueError(f"no allocation at offset {offset}") from None

    def largest_free_bytes(self) -> int:
        """The largest single allocation that would succeed right now."""
        if not self._nonempty:
            return 0
        top = self._nonempty.bit_length() - 1
        return max(self._free_start[start] for start in self._bins[top])

    def fragmentation(self) -> float:
        """0.0 when all free space is one extent, towards 1.0 as it splinters."""
        free = self.free_bytes
        if free == 0:
            return 0.0
        return 1.0 - self.largest_free_bytes() / free

    # --- alloc and free ---------------------------------------------------------------------

    def alloc(self, size_bytes: int) -> int | None:
        """Offset of a new allocation of at least ``size_bytes`` (zero takes one unit), or None
        when no free extent is large enough."""
        if size_bytes < 0:
            raise ValueError(f"size must not be negative, not {size_bytes}")
        need = self.footprint(size_bytes)
        if need > self.free_bytes:
            return None
        start = self._find(need)
        if start is None:
            return None
        size = self._free_start[start]
        self._remove_free(start, size)
        if size > need:
            self._insert_free(start + need, size - need)
        self._live[start] = need
        self._used += need
        return start

    def free(self, offset: int) -> None:
        """Return an allocation; raises ValueError for an offset that is not allocated."""
        size = self._live.pop(offset, None)
        if size is None:
            raise ValueError(f"free of offset {offset}, which is not allocated")
        self._used -= size
        start, end = offset, offset + size
        prev_start = self._free_end.get(start)
        if prev_start is not None:
            self._remove_free(prev_start, start - prev_start)
            start = prev_start
        next_size = self._free_start.get(end)
        if next_size is not None:
            self._remove_free(end, next_size)
            end += next_size
        self._insert_free(start, end - start)

    # --- internals ----------------------------------------------------------------------------

    def _find(self, need: int) -> int | None:
        cls = need.bit_length() - 1
        own = self._bins[cls] if self._nonempty >> cls & 1 else None
        if own:
            for start in islice(own, _SAME_CLASS_SCAN):
                if self._free_start[start] >= need:
                    return start
        larger = self._nonempty >> (cls + 1)
        if larger:
            k = cls + 1 + (larger & -larger).bit_length() - 1
            return next(iter(self._bins[k]))
        if own and len(own) > _SAME_CLASS_SCAN:
            for start in own:
                if self._free_start[start] >= need:
                    return start
        return None

    def _insert_free(self, start: int, size: int) -> None:
        self._free_start[start] = size
        self._free_end[start + size] = start
        cls = size.bit_length() - 1
        self._bins[cls][start] = None
        self._nonempty |= 1 << cls

    def _remove_free(self, start: int, size: int) -> None:
        del self._free_start[start]
        del self._free_end[start + size]
        cls = size.bit_length() - 1
        members = self._bins[cls]
        del members[start]
        if not members:
            self._nonempty &= ~(1 << cls)

    def check_invariants(self) -> None:
        """Raise AssertionError unless the bookkeeping is consistent (tests, debugging)."""
        extents = sorted(
            [(s, n, False) for s, n in self._live.items()]
            + [(s, n, True) for s, n in self._free_start.items()]
        )
        pos = 0
        prev_free = False
        for start, size, is_free in extents:
            assert start == pos, f"gap or overlap at {pos}: next extent starts at {start}"
            assert size > 0, f"empty extent at {start}"
            assert size % self._unit == 0, f"bad extent size {size} at {start}"
            assert start % self._unit == 0, f"unaligned extent at {start}"
            assert not (is_free and prev_free), f"uncoalesced free extents at {start}"
            if is_free:
                cls = size.bit_length() - 1
                assert start in self._bins[cls], f"free extent {start} missing from bin {cls}"
                assert self._free_end[start + size] == start
            prev_free = is_free
            pos = start + size
        assert pos == self._capacity, f"extents cover {pos} of {self._capacity} bytes"
        assert self._used == sum(self._live.values())
        assert len(self._free_end) == len(self._free_start)
        binned = 0
        for k, members in enumerate(self._bins):
            assert bool(members) == bool(self._nonempty >> k & 1), f"bin mask wrong at {k}"
            binned += len(members)
        assert binned == len(self._free_start)
