"""The block table: staging, publishing, exact reads, leases, eviction, reaping."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpool.checksum import block_checksum
from kvpool.errors import ConfigError
from kvpool.proto.v1 import common_pb2
from kvpool.proto.wire import MissReason, Status
from kvpool.store_node.block_store import Block, BlockState, BlockStore, StagedBlock
from kvpool.store_node.cpu_tier import CpuTier
from kvpool.store_node.eviction import LruPolicy, make_policy
from kvpool.store_node.registration import staged_verdicts
from kvpool.transports.shm import shm_supported
from tests.unit.listing import Probe

KIB = 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_store(clock: FakeClock, capacity: int = 64 * KIB, max_block: int = 64 * KIB) -> BlockStore:
    return BlockStore(
        CpuTier(capacity),
        LruPolicy(),
        max_block_size=max_block,
        clock=clock,
        high_watermark=0.85,
        low_watermark=0.70,
    )


@pytest.fixture
def store(clock: FakeClock) -> Iterator[BlockStore]:
    s = make_store(clock)
    yield s
    s.check_invariants()
    s.tier.close()


def data_for(key: str, write_id: int, size: int) -> bytes:
    seed = f"{key}/{write_id}/".encode()
    return (seed * (size // len(seed) + 1))[:size]


def stage(store: BlockStore, key: str, write_id: int, size: int = 4 * KIB) -> Status:
    data = data_for(key, write_id, size)
    verdict = store.reserve(key, write_id, size, block_checksum(data))
    if verdict.block is None:
        return verdict.status
    store.view(verdict.block)[:] = data
    return store.finish_put(verdict.block)


def commit(store: BlockStore, key: str, write_id: int, version: int, size: int = 4 * KIB) -> Status:
    status = stage(store, key, write_id, size)
    if status != Status.OK:
        return status
    return store.publish(key, write_id, version).status


def read(store: BlockStore, key: str, write_id: int) -> bytes | MissReason:
    result = store.get(key, write_id)
    if result.block is None:
        assert result.status == Status.MISS
        return result.reason
    data = bytes(store.view(result.block))
    store.release(result.block)
    return data


# --- put, publish, get ----------------------------------------------------------------------


def test_round_trip_returns_exact_bytes_with_version_and_checksum(store: BlockStore) -> None:
    assert commit(store, "k", 7, version=3, size=5000) == Status.OK
    result = store.get("k", 7)
    assert result.status == Status.OK
    assert result.block is not None
    assert result.block.version == 3
    assert result.block.checksum == block_checksum(data_for("k", 7, 5000))
    assert bytes(store.view(result.block)) == data_for("k", 7, 5000)
    store.release(result.block)
    assert store.stats().hits == 1


def test_write_id_0_reads_the_committed_block_of_the_key(
    store: BlockStore, clock: FakeClock
) -> None:
    assert stage(store, "k", 7) == Status.OK
    assert store.resolve("k") == 0
    assert read(store, "k", 0) == MissReason.WRONG_VERSION, "staged: not served by content"
    store.retire_older("k", 7, 3)  # its PUBLISH came: the index is being asked
    assert read(store, "k", 0) == data_for("k", 7, 4 * KIB)
    clock.now += 2.0  # past the staged read window: unconfirmed, not served
    assert read(store, "k", 0) == MissReason.WRONG_VERSION
    assert store.publish("k", 7, 3).status == Status.OK
    assert store.resolve("k") == 7
    assert read(store, "k", 0) == data_for("k", 7, 4 * KIB)
    assert commit(store, "k", 8, version=4) == Status.OK  # a newer write replaces it
    assert read(store, "k", 0) == data_for("k", 8, 4 * KIB)
    assert read(store, "absent", 0) == MissReason.ABSENT
    status, _level, copy = store.get_in_memory("k", 0)
    assert status == Status.OK
    assert copy is not None
    assert copy.block.write_id == 8
    store.release(copy)
    assert store.delete("k", 8)
    assert read(store, "k", 0) == MissReason.ABSENT


def test_read_counts_name_the_most_read_keys_then_start_over(store: BlockStore) -> None:
    for key, reads in (("a", 1), ("b", 3), ("c", 2), ("d", 2)):
        assert commit(store, key, 1, version=1) == Status.OK
        for _ in range(reads):
            assert read(store, key, 1) == data_for(key, 1, 4 * KIB)
    # The two most read, most first; a tie goes to the key read first.
    assert store.take_read_counts(2) == [("b", 3), ("c", 2)]
    assert store.take_read_counts(2) == []  # counted afresh after each report
    assert read(store, "a", 1) == data_for("a", 1, 4 * KIB)
    assert store.take_read_counts(2) == [("a", 1)]


def test_a_staged_block_is_read_only_by_its_exact_write_id(store: BlockStore) -> None:
    # Readers learn write ids from the index, which names only committed writes: a staged block
    # asked for by its write id is committed, its PUBLISH still on the way.
    assert stage(store, "k", 1) == Status.OK
    assert read(store, "k", 1) == data_for("k", 1, 4 * KIB)
    assert read(store, "k", 2) == MissReason.WRONG_VERSION
    assert store.publish("k", 1, 10).status == Status.OK
    assert read(store, "k", 1) == data_for("k", 1, 4 * KIB)


def test_a_staged_block_whose_publish_never_came_stops_being_served(
    store: BlockStore, clock: FakeClock
) -> None:
    """Its PUBLISH lost on a broken link while newer writes of the key were published: a reader
    whose cached entry names it must miss (and look again), not read the replaced value."""
    assert stage(store, "k", 1) == Status.OK
    clock.now += store.staged_read_window_s
    assert read(store, "k", 1) == data_for("k", 1, 4 * KIB)  # its PUBLISH may still come
    assert commit(store, "k", 2, version=20) == Status.OK  # a newer write, published
    clock.now += 0.001
    assert read(store, "k", 1) == MissReason.STAGED
    assert read(store, "k", 2) == data_for("k", 2, 4 * KIB)
    assert store.publish("k", 1, 10).status == Status.MISS  # older than what is held


def test_a_staged_block_behind_a_published_write_of_its_key_is_not_served(
    store: BlockStore,
) -> None:
    """Two writers overwrite a key; the newer write's PUBLISH arrives first. Until the older
    one's own PUBLISH says which is newer, a reader holding the older one's entry misses."""
    assert stage(store, "k", 1) == Status.OK  # older: committed first, PUBLISH still on the way
    assert stage(store, "k", 2) == Status.OK
    assert read(store, "k", 1) == data_for("k", 1, 4 * KIB)  # nothing published yet
    assert store.publish("k", 2, 20).status == Status.OK
    assert read(store, "k", 1) == MissReason.STAGED
    assert read(store, "k", 2) == data_for("k", 2, 4 * KIB)
    assert stage(store, "k", 3) == Status.OK
    store.retire_older("k", 3, 30)  # its PUBLISH arrived claiming a newer version
    assert read(store, "k", 3) == data_for("k", 3, 4 * KIB)


def test_get_returns_only_the_exact_write_id(store: BlockStore) -> None:
    assert commit(store, "k", 1, version=5) == Status.OK
    assert read(store, "k", 2) == MissReason.WRONG_VERSION
    assert read(store, "other", 1) == MissReason.ABSENT
    assert read(store, "k", 1) == data_for("k", 1, 4 * KIB)
    misses = store.stats().misses
    assert misses["wrong_version"] == 1
    assert misses["absent"] == 1


def test_lower_version_never_replaces_a_higher_one(store: BlockStore) -> None:
    assert commit(store, "k", 2, version=20) == Status.OK
    assert stage(store, "k", 1) == Status.OK
    late = store.publish("k", 1, 10)  # an older write's PUBLISH arrives late
    assert (late.status, late.reason) == (Status.MISS, MissReason.WRONG_VERSION)
    assert store.state_of("k", 1) is None  # the loser is dropped, not kept staged
    assert read(store, "k", 2) == data_for("k", 2, 4 * KIB)
    assert read(store, "k", 1) == MissReason.WRONG_VERSION


def test_higher_version_replaces_the_committed_one(store: BlockStore) -> None:
    assert commit(store, "k", 1, version=10) == Status.OK
    used_one = store.tier.used_bytes
    assert commit(store, "k", 2, version=20) == Status.OK
    assert store.tier.used_bytes == used_one  # the old block's memory is back
    assert read(store, "k", 2) == data_for("k", 2, 4 * KIB)
    assert read(store, "k", 1) == MissReason.WRONG_VERSION
    assert store.stats().committed == 1


def test_publish_is_idempotent_and_unknown_write_ids_miss(store: BlockStore) -> None:
    assert commit(store, "k", 1, version=10) == Status.OK
    assert store.publish("k", 1, 10).status == Status.OK
    unknown = store.publish("k", 99, 11)
    assert (unknown.status, unknown.reason) == (Status.MISS, MissReason.ABSENT)
    assert read(store, "k", 1) == data_for("k", 1, 4 * KIB)


def test_checksum_mismatch_is_refused_and_frees_the_memory(store: BlockStore) -> None:
    data = data_for("k", 1, 4 * KIB)
    verdict = store.reserve("k", 1, len(data), block_checksum(data))
    assert verdict.block is not None
    store.view(verdict.block)[:] = data[:-1] + b"!"
    assert store.finish_put(verdict.block) == Status.CHECKSUM_MISMATCH
    assert store.tier.used_bytes == 0
    assert read(store, "k", 1) == MissReason.ABSENT


def test_bad_puts_are_refused_before_any_memory_is_taken(store: BlockStore) -> None:
    assert store.reserve("k", 0, 10, 0).status == Status.BAD_REQUEST
    assert store.reserve("", 1, 10, 0).status == Status.BAD_REQUEST
    too_large = store.reserve("k", 1, store.max_block_size + 1, 0)
    assert too_large.status == Status.TOO_LARGE
    assert "limit" in too_large.message
    assert store.tier.used_bytes == 0


def test_a_retried_put_is_accepted_once_and_a_reused_write_id_is_refused(
    store: BlockStore,
) -> None:
    assert stage(store, "k", 1, 100) == Status.OK
    data = data_for("k", 1, 100)
    again = store.reserve("k", 1, 100, block_checksum(data))
    assert (again.status, again.block) == (Status.OK, None)  # payload discarded
    other = store.reserve("k", 1, 100, block_checksum(b"x" * 100))
    assert other.status == Status.BAD_REQUEST
    assert store.stats().blocks == 1


def test_zero_size_blocks_round_trip(store: BlockStore) -> None:
    assert commit(store, "empty", 1, version=1, size=0) == Status.OK
    assert read(store, "empty", 1) == b""


def test_aborted_put_leaves_nothing_behind(store: BlockStore) -> None:
    verdict = store.reserve("k", 1, 1000, 0)
    assert verdict.block is not None
    assert read(store, "k", 1) == MissReason.STAGED
    store.abort_put(verdict.block)
    assert store.tier.used_bytes == 0
    assert read(store, "k", 1) == MissReason.ABSENT


# --- delete and leases --------------------------------------------------------------------------


def test_delete_one_write_id_or_every_block_of_a_key(store: BlockStore) -> None:
    assert commit(store, "k", 1, version=1) == Status.OK
    assert stage(store, "k", 2) == Status.OK
    assert store.delete("k", 9) is False
    assert store.delete("k", 1) is True
    assert read(store, "k", 1) == MissReason.WRONG_VERSION  # write 2 still staged
    assert commit(store, "j", 1, version=1) == Status.OK
    assert store.delete("k", 0) is True
    assert read(store, "k", 2) == MissReason.ABSENT
    assert store.delete("k", 0) is False
    assert read(store, "j", 1) == data_for("j", 1, 4 * KIB)


def test_a_leased_block_keeps_its_bytes_after_delete_until_released(store: BlockStore) -> None:
    assert commit(store, "k", 1, version=1) == Status.OK
    result = store.get("k", 1)
    assert result.block is not None
    view = store.view(result.block)
    assert store.delete("k", 1) is True
    assert read(store, "k", 1) == MissReason.ABSENT  # gone from the table at once
    # Memory stays allocated: a new block cannot land on the bytes being sent.
    for i in range(10):
        assert commit(store, f"new{i}", 1, version=1) == Status.OK
    assert bytes(view) == data_for("k", 1, 4 * KIB)
    assert store.stats().leased_bytes_lingering == 4 * KIB
    store.check_invariants()
    used = store.tier.used_bytes
    store.release(result.block)
    assert store.tier.used_bytes == used - 4 * KIB
    # Freed memory is no longer listed, and the block↔copy cycle is gone (freed by refcount).
    assert result.block.copies == {}


def test_replacing_a_leased_committed_block_defers_its_free(store: BlockStore) -> None:
    assert commit(store, "k", 1, version=1) == Status.OK
    result = store.get("k", 1)
    assert result.block is not None
    assert commit(store, "k", 2, version=2) == Status.OK
    assert bytes(store.view(result.block)) == data_for("k", 1, 4 * KIB)
    store.release(result.block)
    store.check_invariants()
    assert store.tier.used_bytes == 4 * KIB


# --- eviction -------------------------------------------------------------------------------


def test_eviction_never_takes_pinned_leased_or_staged_blocks(clock: FakeClock) -> None:
    store = make_store(clock, capacity=64 * KIB)
    try:
        assert commit(store, "pinned", 1, version=1) == Status.OK
        assert store.set_pinned("pinned", 1, True)
        assert commit(store, "leased", 1, version=1) == Status.OK
        lease = store.get("leased", 1)
        assert lease.block is not None
        assert stage(store, "staged", 1) == Status.OK
        for i in range(40):  # ten times more than fits
            assert commit(store, f"filler{i}", 1, version=1) == Status.OK
            store.check_invariants()
        assert store.stats().evictions > 20
        assert read(store, "pinned", 1) == data_for("pinned", 1, 4 * KIB)
        assert bytes(store.view(lease.block)) == data_for("leased", 1, 4 * KIB)
        assert store.state_of("leased", 1) is BlockState.COMMITTED
        assert store.state_of("staged", 1) is BlockState.STAGED
        store.release(lease.block)
    finally:
        store.tier.close()


def test_watermarks_evict_least_recently_used_down_to_the_low_mark(clock: FakeClock) -> None:
    store = make_store(clock, capacity=100 * 4 * KIB)
    try:
        for i in range(85):
            assert commit(store, f"k{i}", 1, version=1) == Status.OK
        assert store.stats().evictions == 0  # at 85 %: not above the high watermark
        assert read(store, "k0", 1) == data_for("k0", 1, 4 * KIB)  # k0 becomes recent
        assert commit(store, "k85", 1, version=1) == Status.OK  # 86 % > 85 %
        assert store.tier.used_bytes <= 0.70 * store.tier.capacity_bytes
        assert store.stats().evictions == 16
        assert read(store, "k0", 1) == data_for("k0", 1, 4 * KIB)
        assert read(store, "k1", 1) == MissReason.EVICTED
        assert read(store, "k16", 1) == MissReason.EVICTED
        assert read(store, "k17", 1) == data_for("k17", 1, 4 * KIB)
        reported = store.take_evicted(1024)
        assert reported == [(f"k{i}", 1) for i in range(1, 17)]
        assert store.take_evicted(1024) == []
    finally:
        store.tier.close()


def test_full_store_answers_no_space_without_losing_anything(clock: FakeClock) -> None:
    store = make_store(clock, capacity=16 * 4 * KIB)
    try:
        for i in range(8):
            assert commit(store, f"c{i}", 1, version=1) == Status.OK
            lease = store.get(f"c{i}", 1)  # keep every committed block leased
        for i in range(8):
            assert stage(store, f"s{i}", 1) == Status.OK
        verdict = store.reserve("more", 1, 4 * KIB, 0)
        assert verdict.status == Status.NO_SPACE
        assert "no room" in verdict.message
        assert store.stats().evictions == 0
        for i in range(8):
            assert store.state_of(f"c{i}", 1) is BlockState.COMMITTED
            assert store.state_of(f"s{i}", 1) is BlockState.STAGED
        store.check_invariants()
        del lease
    finally:
        store.tier.close()


def test_allocation_failure_evicts_then_retries(clock: FakeClock) -> None:
    store = make_store(clock, capacity=16 * 4 * KIB)
    try:
        for i in range(8):  # half full: below every watermark
            assert commit(store, f"c{i}", 1, version=1) == Status.OK
        big = 12 * 4 * KIB
        assert commit(store, "big", 1, version=1, size=big) == Status.OK
        assert read(store, "big", 1) == data_for("big", 1, big)
        assert store.stats().evictions >= 4
    finally:
        store.tier.close()


def test_policy_names_are_looked_up_in_the_table() -> None:
    assert isinstance(make_policy("lru"), LruPolicy)
    with pytest.raises(ConfigError, match="eviction_policy"):
        make_policy("nope")


# --- staged reaping, re-registration --------------------------------------------------------


def test_expired_staged_blocks_are_listed_oldest_first(store: BlockStore, clock: FakeClock) -> None:
    assert stage(store, "a", 1) == Status.OK
    clock.now += 10
    assert stage(store, "b", 1) == Status.OK
    clock.now += 25
    assert store.expired_staged(clock.now, 30.0, 10) == [StagedBlock("a", 1, 35.0)]
    clock.now += 10
    assert [s.key for s in store.expired_staged(clock.now, 30.0, 10)] == ["a", "b"]
    assert [s.key for s in store.expired_staged(clock.now, 30.0, 1)] == ["a"]
    assert store.reap("a", 1, report=False) is True
    assert store.reap("a", 1, report=False) is False
    assert store.reap("b", 1, report=True) is True
    assert store.take_evicted(10) == [("b", 1)]


def test_reap_never_frees_a_committed_block(store: BlockStore) -> None:
    assert commit(store, "k", 1, version=1) == Status.OK
    assert store.reap("k", 1, report=False) is False
    assert read(store, "k", 1) == data_for("k", 1, 4 * KIB)


def test_staged_verdicts_publish_only_what_the_index_names_on_this_member() -> None:
    candidates = [StagedBlock(k, w, 40.0) for k, w in [("a", 1), ("b", 2), ("c", 3), ("d", 4)]]
    entries = {
        "a": common_pb2.BlockEntry(key="a", found=True, version=7, write_id=1, replicas=[5]),
        "b": common_pb2.BlockEntry(key="b", found=True, version=8, write_id=9, replicas=[5]),
        "c": common_pb2.BlockEntry(key="c", found=True, version=9, write_id=3, replicas=[6]),
        "d": common_pb2.BlockEntry(key="d", found=False),
    }
    publish, free = staged_verdicts(candidates, entries, member_id=5)
    assert publish == [("a", 1, 7)]
    assert free == [("b", 2), ("c", 3), ("d", 4)]


def test_drop_all_forgets_every_block_but_not_a_put_in_flight(store: BlockStore) -> None:
    assert commit(store, "k", 1, version=1) == Status.OK
    assert stage(store, "s", 1) == Status.OK
    receiving = store.reserve("r", 1, 100, block_checksum(b"r" * 100))
    assert receiving.block is not None
    assert store.drop_all() == 2
    assert read(store, "k", 1) == MissReason.ABSENT
    store.view(receiving.block)[:] = b"r" * 100
    assert store.finish_put(receiving.block) == Status.OK
    assert store.stats().blocks == 1


# --- the first rule, under random operations ----------------------------------------------


class StoreMachine(RuleBasedStateMachine):
    """Whatever happens, a read returns the exact bytes of that (key, write id) or a miss."""

    keys = st.sampled_from(["a", "b", "c", "d"])
    write_ids = st.integers(1, 6)

    @initialize()
    def start(self) -> None:
        self.clock = FakeClock()
        self.store = make_store(self.clock, capacity=24 * KIB, max_block=12 * KIB)
        self.leases: list[tuple[Block, bytes]] = []
        self.versions = 0
        self.probe = Probe(self.store) if shm_supported() else None

    @rule(key=keys, write_id=write_ids, size=st.integers(0, 6 * KIB), corrupt=st.booleans())
    def put(self, key: str, write_id: int, size: int, corrupt: bool) -> None:
        data = data_for(key, write_id, size)
        verdict = self.store.reserve(key, write_id, size, block_checksum(data))
        if verdict.block is None:
            return
        self.store.view(verdict.block)[:] = (b"\xff" + data[1:]) if corrupt and size else data
        status = self.store.finish_put(verdict.block)
        assert status == (Status.CHECKSUM_MISMATCH if corrupt and size else Status.OK)

    @rule(key=keys, write_id=write_ids)
    def publish(self, key: str, write_id: int) -> None:
        self.versions += 1
        self.store.publish(key, write_id, self.versions)

    @rule(key=keys, write_id=write_ids, hold=st.booleans())
    def get(self, key: str, write_id: int, hold: bool) -> None:
        result = self.store.get(key, write_id)
        if result.block is None:
            return
        data = bytes(self.store.view(result.block))
        size = result.block.size_bytes
        assert data == data_for(key, write_id, size), "read another write's bytes"
        assert block_checksum(data) == result.block.checksum
        if hold:
            self.leases.append((result.block, data))
        else:
            self.store.release(result.block)

    @rule()
    def release_oldest(self) -> None:
        if self.leases:
            block, data = self.leases.pop(0)
            assert bytes(self.store.view(block)) == data, "bytes changed under a reader"
            self.store.release(block)

    @rule(key=keys)
    def read_through_the_directory(self, key: str) -> None:
        """A same-host client's read with no message: a committed write's exact bytes."""
        if self.probe is not None:
            self.probe.read_checked(key, data_for)

    @rule(key=keys, write_id=st.integers(0, 6))
    def delete(self, key: str, write_id: int) -> None:
        self.store.delete(key, write_id)

    @rule(key=keys, write_id=write_ids)
    def pin(self, key: str, write_id: int) -> None:
        self.store.set_pinned(key, write_id, True)

    @rule(seconds=st.floats(0, 40))
    def reap(self, seconds: float) -> None:
        self.clock.now += seconds
        for block in self.store.expired_staged(self.clock.now, 30.0, 100):
            self.store.reap(block.key, block.write_id, report=False)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "store"):
            self.store.check_invariants()
            for block, data in self.leases:
                assert bytes(self.store.view(block)) == data
            if self.probe is not None:
                self.probe.check()

    def teardown(self) -> None:
        if hasattr(self, "store"):
            for block, _ in self.leases:
                self.store.release(block)
            self.store.check_invariants()
            if self.probe is not None:
                self.probe.close()
            self.store.tier.close()


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
