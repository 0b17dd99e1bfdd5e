"""The offset allocator and the CPU tier's arena."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from kvpool.store_node.allocator import ALIGNMENT_BYTES, Allocator
from kvpool.store_node.cpu_tier import CpuTier


def test_allocations_are_aligned_and_zero_size_takes_one_unit() -> None:
    a = Allocator(4096)
    offsets = [a.alloc(n) for n in (1, 0, 63, 64, 65)]
    assert all(o is not None and o % ALIGNMENT_BYTES == 0 for o in offsets)
    assert [a.size_of(o) for o in offsets if o is not None] == [64, 64, 64, 64, 128]
    assert a.used_bytes == 384
    a.check_invariants()


def test_capacity_is_rounded_down_to_the_alignment() -> None:
    a = Allocator(1000)
    assert a.capacity_bytes == 960
    assert a.alloc(960) == 0
    assert a.alloc(0) is None


def test_full_arena_refuses_then_accepts_after_a_free() -> None:
    a = Allocator(64 * 4)
    offsets = [a.alloc(64) for _ in range(4)]
    assert None not in offsets
    assert a.alloc(1) is None
    a.free(offsets[2])  # type: ignore[arg-type]
    assert a.alloc(64) == offsets[2]


def test_freeing_neighbours_coalesces_into_one_extent() -> None:
    a = Allocator(64 * 8)
    offsets = [a.alloc(64) for _ in range(8)]
    for o in (offsets[1], offsets[3], offsets[2]):  # middle last: merges both sides
        a.free(o)  # type: ignore[arg-type]
    assert a.largest_free_bytes() == 3 * 64
    assert a.alloc(3 * 64) == offsets[1]
    a.check_invariants()


def test_a_request_never_lands_in_a_too_small_extent() -> None:
    # Holes of 64 bytes everywhere, one hole of 256: a 256-byte request must find that one.
    a = Allocator(64 * 32)
    offsets = [a.alloc(64) for _ in range(32)]
    for i in range(0, 24, 2):
        a.free(offsets[i])  # type: ignore[arg-type]
    for i in range(26, 30):
        a.free(offsets[i])  # type: ignore[arg-type]
    assert a.largest_free_bytes() == 256
    assert a.alloc(256) == offsets[26]
    assert a.alloc(128) is None  # 12 free units, but no two adjacent
    assert a.fragmentation() > 0.9
    a.check_invariants()


def test_double_free_and_unknown_offsets_are_refused() -> None:
    a = Allocator(4096)
    o = a.alloc(100)
    assert o is not None
    a.free(o)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(o)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(64)
    with pytest.raises(ValueError, match="negative"):
        a.alloc(-1)


def test_fragmentation_is_zero_for_one_free_extent() -> None:
    a = Allocator(4096)
    assert a.fragmentation() == 0.0
    a.alloc(1000)
    assert a.fragmentation() == 0.0
    assert a.free_bytes == 4096 - 1024


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocs and frees: no overlap, inside the arena, used + free == capacity."""

    live = Bundle("live")

    @initialize(capacity=st.integers(min_value=0, max_value=1 << 16))
    def start(self, capacity: int) -> None:
        self.allocator = Allocator(capacity)
        self.spans: dict[int, tuple[int, int]] = {}  # offset -> (requested, footprint)

    @rule(target=live, size=st.one_of(st.integers(0, 200), st.integers(0, 1 << 14)))
    def alloc(self, size: int) -> int | None:
        a = self.allocator
        largest = a.largest_free_bytes()
        offset = a.alloc(size)
        need = a.footprint(size)
        if offset is None:
            assert need > largest, f"refused {size} bytes with an extent of {largest} free"
            return None
        assert offset % ALIGNMENT_BYTES == 0
        assert offset >= 0
        assert offset + need <= a.capacity_bytes
        new = range(offset, offset + need)
        for start, (_, footprint) in self.spans.items():
            assert not (start < new.stop and new.start < start + footprint), "overlap"
        self.spans[offset] = (size, need)
        return offset

    @rule(offset=consumes(live))
    def free(self, offset: int | None) -> None:
        if offset is None:
            return
        self.allocator.free(offset)
        del self.spans[offset]

    @invariant()
    def accounting_holds(self) -> None:
        if not hasattr(self, "allocator"):
            return
        a = self.allocator
        assert a.used_bytes + a.free_bytes == a.capacity_bytes
        assert a.used_bytes == sum(fp for _, fp in self.spans.values())
        a.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "allocator"):
            return
        for offset in list(self.spans):
            self.allocator.free(offset)
        assert self.allocator.used_bytes == 0
        assert self.allocator.largest_free_bytes() == self.allocator.capacity_bytes
        if self.allocator.capacity_bytes:
            assert self.allocator.alloc(self.allocator.capacity_bytes) == 0


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_cpu_tier_views_are_shared_memory_and_close_releases_it() -> None:
    tier = CpuTier(1 << 20)
    try:
        assert tier.fd is not None
        assert os.readlink(f"/proc/self/fd/{tier.fd}").startswith("/memfd:kvpool-cpu-tier")
        o = tier.alloc(5)
        assert o is not None
        view = tier.view(o, 5)
        view[:] = b"hello"
        # Another mapping of the same memfd sees the bytes: the arena can be shared by fd.
        assert os.pread(tier.fd, 5, o) == b"hello"
        del view
        with pytest.raises(ValueError, match="outside the arena"):
            tier.view((1 << 20) - 4, 8)
    finally:
        fd = tier.fd
        assert tier.close() is True
    assert tier.closed
    assert fd is not None
    try:  # the number may have been reused since, but not for our memfd
        target = os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        target = ""
    assert "kvpool-cpu-tier" not in target
    assert tier.close() is True  # idempotent


def test_cpu_tier_close_with_a_view_still_held_reports_it() -> None:
    tier = CpuTier(1 << 16)
    o = tier.alloc(10)
    assert o is not None
    held = tier.view(o, 10)
    assert tier.close() is False
    held.release()


def test_cpu_tier_prefault_faults_everything_in_and_keeps_the_bytes() -> None:
    tier = CpuTier(8 << 20)
    try:
        o = tier.alloc(11)
        assert o is not None
        tier.view(o, 11)[:] = b"still here!"
        done = tier.prefault(chunk_bytes=1 << 20)
        if done == 0:
            pytest.skip("kernel without MADV_POPULATE_WRITE (Linux < 5.14)")
        assert done == tier.capacity_bytes
        assert bytes(tier.view(o, 11)) == b"still here!"
    finally:
        tier.close()


def test_cpu_tier_prefault_stops_when_asked_or_closed() -> None:
    import threading

    tier = CpuTier(8 << 20)
    stop = threading.Event()
    stop.set()
    assert tier.prefault(stop, chunk_bytes=1 << 20) == 0
    tier.close()
    assert tier.prefault(chunk_bytes=1 << 20) == 0
