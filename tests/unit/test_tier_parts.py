"""The pieces of the tiered store: S3-FIFO, the SSD segment allocator, the manifest, the
allocator's fragmentation bound."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.store_node.allocator import Allocator
from kvpool.store_node.eviction import LruPolicy, S3FifoPolicy, make_policy
from kvpool.store_node.tiers import manifest
from kvpool.store_node.tiers.manifest import DropRecord, LandRecord, OpenRecord
from kvpool.store_node.tiers.segments import SegmentAllocator, SegmentState

KIB = 1024


def always(_block: object) -> bool:
    return True


# --- S3-FIFO -------------------------------------------------------------------------------------


def evict_all(policy: S3FifoPolicy | LruPolicy) -> list[tuple[str, int]]:
    order = []
    while (victim := policy.pop_victim(always)) is not None:
        order.append(victim)
    return order


def test_s3fifo_a_prefix_read_a_hundred_times_outlives_blocks_read_once() -> None:
    policy = S3FifoPolicy()
    policy.inserted(("prefix", 1), 4 * KIB)
    for _ in range(100):
        policy.touched(("prefix", 1))
    survived = 0
    for i in range(2000):  # a stream of blocks, each read once, flowing through the cache
        policy.inserted((f"once{i}", 1), 4 * KIB)
        policy.touched((f"once{i}", 1))
        if len(policy) > 50:  # a cache of 50 blocks
            victim = policy.pop_victim(always)
            assert victim != ("prefix", 1), f"the hot prefix went after {i} one-read blocks"
            survived = i
        policy.touched(("prefix", 1))  # the prefix keeps being read now and then
    assert survived == 1999
    policy.check_invariants()


def test_s3fifo_unread_blocks_go_before_read_ones_and_a_burst_does_not_flush_main() -> None:
    policy = S3FifoPolicy()
    for i in range(20):
        policy.inserted((f"hot{i}", 1), 4 * KIB)
        policy.touched((f"hot{i}", 1))
        policy.touched((f"hot{i}", 1))
    for i in range(40):  # hot blocks move to main on the first evictions
        policy.inserted((f"cold{i}", 1), 4 * KIB)
    victims = [policy.pop_victim(always) for _ in range(30)]
    assert victims == [(f"cold{i}", 1) for i in range(30)]
    for i in range(200):  # a scan of one-off blocks: no hot block leaves for it
        policy.inserted((f"scan{i}", 1), 4 * KIB)
        victim = policy.pop_victim(always)
        assert victim is not None
        assert not victim[0].startswith("hot")
    policy.check_invariants()


def test_s3fifo_a_key_evicted_recently_comes_back_into_main() -> None:
    policy = S3FifoPolicy()
    policy.inserted(("k", 1), 100)
    policy.inserted(("other", 1), 100)
    assert policy.pop_victim(always) == ("k", 1)  # unread: out of small, into the ghost
    policy.inserted(("k", 2), 100)  # the key is put again (a new write id)
    assert policy.in_main(("k", 2))
    policy.check_invariants()


def test_policies_skip_ineligible_blocks_and_the_scan_is_bounded() -> None:
    for policy in (S3FifoPolicy(), LruPolicy()):
        for i in range(100):
            policy.inserted((f"b{i}", 1), 100)
            policy.touched((f"b{i}", 1))
            policy.touched((f"b{i}", 1))
        leased = {(f"b{i}", 1) for i in range(99)}
        calls = 0

        def eligible(block: tuple[str, int], leased: set[tuple[str, int]] = leased) -> bool:
            nonlocal calls
            calls += 1
            return block not in leased

        assert policy.pop_victim(eligible) == ("b99", 1)
        assert policy.pop_victim(eligible) is None  # everything left is leased
        assert calls < 1000
        assert len(policy) == 99
        # Leases end: eviction resumes at once (nothing renewed them).
        leased.clear()
        assert policy.pop_victim(eligible) is not None


def test_policy_table() -> None:
    assert isinstance(make_policy("s3fifo"), S3FifoPolicy)
    assert isinstance(make_policy("lru"), LruPolicy)


@given(st.lists(st.tuples(st.sampled_from("itre"), st.integers(0, 30)), max_size=300))
@settings(max_examples=100, deadline=None)
def test_s3fifo_bookkeeping_stays_consistent(ops: list[tuple[str, int]]) -> None:
    policy = S3FifoPolicy(ghost_min=4)
    for op, n in ops:
        block = (f"k{n % 12}", n)
        if op == "i":
            policy.inserted(block, n * 10 + 1)
        elif op == "t":
            policy.touched(block)
        elif op == "r":
            policy.removed(block)
        else:

            def eligible(b: tuple[str, int], n: int = n) -> bool:
                return (b[1] + n) % 3 != 0

            victim = policy.pop_victim(eligible)
            assert victim is None or victim not in policy
        policy.check_invariants()


# --- segments -----------------------------------------------------------------------------------


def test_segments_append_contiguously_aligned_and_seal_when_full() -> None:
    seg = SegmentAllocator(4 * 64 * KIB, 64 * KIB)
    offsets = [seg.alloc(10 * KIB) for _ in range(6)]
    assert offsets == [0, 12 * KIB, 24 * KIB, 36 * KIB, 48 * KIB, 64 * KIB]  # 6th: next segment
    assert seg.state(0) is SegmentState.SEALED
    assert seg.state(1) is SegmentState.OPEN
    assert [o.segment for o in seg.take_opened()] == [0, 1]
    assert seg.alloc(65 * KIB) is None  # larger than a segment: never
    seg.check_invariants()


def test_a_segment_is_free_again_only_when_all_its_blocks_are_gone() -> None:
    seg = SegmentAllocator(2 * 64 * KIB, 64 * KIB)
    a = seg.alloc(32 * KIB)
    b = seg.alloc(32 * KIB)
    c = seg.alloc(32 * KIB)  # seals segment 0
    assert a is not None
    assert b is not None
    assert c == 64 * KIB
    assert seg.alloc(40 * KIB) is None  # segment 1 has 32 KiB left, no free segment
    assert seg.free(a) is False  # segment 0 still holds b
    assert seg.fragmentation() > 0
    assert seg.free(b) is True  # now empty: free again, with a new generation when reopened
    old_generation = seg.generation(0)
    d = seg.alloc(40 * KIB)
    assert d == 0
    assert seg.generation(0) > old_generation
    seg.check_invariants()


def test_segments_restore_after_a_restart() -> None:
    seg = SegmentAllocator(4 * 64 * KIB, 64 * KIB)
    seg.restore([(2, 7, [(128 * KIB, 5000), (136 * KIB, 100)]), (0, 9, [(0, 4096)])])
    assert list(seg.sealed_oldest_first()) == [2, 0]
    assert seg.free_segments == 2
    assert seg.alloc(1) == 64 * KIB  # a free segment, opened with a generation above 9
    assert seg.generation(1) == 10
    seg.check_invariants()
    with pytest.raises(ValueError, match="fresh"):
        seg.restore([])


# --- manifest -------------------------------------------------------------------------------------


def land(seg: int, gen: int, offset: int, key: str = "k", size: int = 100) -> LandRecord:
    return LandRecord(seg, gen, offset, size, 7, 1, 3, key)


def test_manifest_replay_keeps_what_landed_in_the_current_generation() -> None:
    records: list[manifest.Record] = [
        OpenRecord(0, 1),
        land(0, 1, 0, "a"),
        land(0, 1, 4096, "b"),
        OpenRecord(1, 2),
        land(1, 2, 65536, "c"),
        DropRecord(0, 1, 0),  # a left
        OpenRecord(0, 3),  # segment 0 reused: b is stale now
        land(0, 3, 0, "d"),
        DropRecord(0, 1, 4096),  # a late drop of the old generation changes nothing
    ]
    data = manifest.header(65536, 4 * 65536) + b"".join(manifest.encode(r) for r in records)
    state = manifest.replay(data, 65536, 4 * 65536)
    assert state.layout_ok
    assert [r.key for r in state.blocks()] == ["c", "d"]  # opening order: segment 1, then 0
    assert state.torn_bytes == 0


def test_manifest_replay_stops_at_a_torn_or_garbled_tail() -> None:
    good = manifest.header(65536, 4 * 65536) + manifest.encode(OpenRecord(0, 1))
    good += manifest.encode(land(0, 1, 0, "a"))
    torn = good + manifest.encode(land(0, 1, 4096, "b"))[:-3]
    state = manifest.replay(torn, 65536, 4 * 65536)
    assert [r.key for r in state.blocks()] == ["a"]
    assert state.torn_bytes > 0
    garbled = bytearray(good + manifest.encode(land(0, 1, 4096, "b")))
    garbled[-1] ^= 0xFF
    assert [r.key for r in manifest.replay(bytes(garbled), 65536, 4 * 65536).blocks()] == ["a"]


def test_manifest_of_another_layout_is_not_interpreted() -> None:
    data = manifest.header(65536, 4 * 65536) + manifest.encode(OpenRecord(0, 1))
    state = manifest.replay(data, 32768, 4 * 65536)
    assert not state.layout_ok
    assert state.blocks() == []


# --- the allocator's fragmentation bound --------------------------------------------------------


def test_uniform_block_sizes_never_fail_while_free_bytes_remain() -> None:
    """KV blocks of one model have one size: every free byte stays usable."""
    rng = random.Random(1)
    unit = 64 * KIB
    alloc = Allocator(256 * unit)
    live: list[int] = []
    for _ in range(20_000):
        if live and (rng.random() < 0.5 or alloc.free_bytes < unit):
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            offset = alloc.alloc(unit)
            assert offset is not None, "refused with free bytes left"
            live.append(offset)
    alloc.check_invariants()


def test_mixed_sizes_fragmentation_stays_bounded_under_watermark_churn() -> None:
    """Random sizes 4 KiB to 1 MiB in a 64 MiB arena, filled to the 85 % high watermark and
    evicted in random order to the 70 % low watermark, 1000 times (seeded, so exact).

    The bound, as measured: at the low watermark the largest free extent never fell below
    1.1 MiB (above the largest block), so a block always fits after an eviction round; 0.06 %
    of allocations failed, none below 75 % fill, each resolved by evicting further (what
    ``BlockStore.reserve`` does). The ratio 1 - largest/free reached 0.94: free space is split
    into many pieces, and every piece is reused by the segregated fits (an allocation fails
    only when no free extent is large enough)."""
    rng = random.Random(7)
    capacity = 64 << 20
    alloc = Allocator(capacity)
    live: list[int] = []
    smallest_largest = capacity
    attempts = failures = 0
    for _ in range(1000):
        while alloc.used_bytes < 0.85 * capacity:
            attempts += 1
            size = rng.randint(4 * KIB, 1 << 20)
            offset = alloc.alloc(size)
            if offset is None:
                failures += 1
                assert alloc.used_bytes > 0.75 * capacity, "failed far below the high mark"
                assert alloc.largest_free_bytes() < alloc.footprint(size)  # a true failure
                break
            live.append(offset)
        while alloc.used_bytes > 0.70 * capacity:
            alloc.free(live.pop(rng.randrange(len(live))))
        smallest_largest = min(smallest_largest, alloc.largest_free_bytes())
    alloc.check_invariants()
    assert smallest_largest > 1 << 20
    assert failures / attempts < 0.001
