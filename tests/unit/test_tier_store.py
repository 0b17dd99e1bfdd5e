"""The tiered block store: demotion to SSD, promotion, leases across tiers, warm restart.

The store is pure; jobs are run here synchronously with the real tier worker's blocking code
(:meth:`TierWorker.run_blocking`) against a real SSD tier in a temporary directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpool.checksum import block_checksum
from kvpool.proto.wire import MissReason, Status, TierLevel
from kvpool.store_node.allocator import Allocator
from kvpool.store_node.block_store import BlockStore, ReadResult
from kvpool.store_node.eviction import LruPolicy, S3FifoPolicy
from kvpool.store_node.jobs import WriteJob
from kvpool.store_node.tier_worker import TierWorker
from kvpool.store_node.tiers.cpu import CpuTier
from kvpool.store_node.tiers.ssd import SsdTier
from kvpool.store_node.warm_restart import recover_ssd, restore_into
from kvpool.transports.shm import shm_supported
from tests.unit.listing import Probe

KIB = 1024
BLOCK = 4 * KIB


class FakeGpuTier:
    """Host memory standing in for device memory (the GPU code paths without a GPU)."""

    level = TierLevel.GPU
    name = "gpu"
    detail = "host memory standing in for a GPU"

    def __init__(self, capacity: int) -> None:
        self._alloc = Allocator(capacity, alignment_bytes=256)
        self._mem = bytearray(capacity)

    @property
    def capacity_bytes(self) -> int:
        return self._alloc.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._alloc.used_bytes

    def footprint(self, size: int) -> int:
        return self._alloc.footprint(size)

    def alloc(self, size: int) -> int | None:
        return self._alloc.alloc(size)

    def free(self, offset: int) -> None:
        self._alloc.free(offset)

    def fragmentation(self) -> float:
        return self._alloc.fragmentation()

    def read_into(self, offset: int, dest: memoryview) -> None:
        dest[:] = self._mem[offset : offset + len(dest)]

    def write_from(self, offset: int, src: memoryview) -> None:
        self._mem[offset : offset + len(src)] = src

    def close(self) -> bool:
        return True


class Node:
    """A store with CPU + SSD (+ fake GPU) tiers and a worker run synchronously."""

    def __init__(
        self,
        path: Path,
        *,
        cpu: int = 16 * BLOCK,
        ssd: int = 16 * 64 * KIB,
        segment: int = 64 * KIB,
        gpu: int = 0,
        policy: str = "s3fifo",
        batch: int = 32 * KIB,
        direct_io: bool = True,
    ) -> None:
        self.path = path
        self.cpu = CpuTier(cpu)
        self.ssd = SsdTier(path, ssd, segment, direct_io=direct_io)
        self.gpu = FakeGpuTier(gpu) if gpu else None
        self.store = BlockStore(
            self.cpu,
            S3FifoPolicy() if policy == "s3fifo" else LruPolicy(),
            max_block_size=segment,
            clock=lambda: 0.0,
            ssd=self.ssd,
            gpu=self.gpu,
            write_batch_bytes=batch,
            gpu_promote_after_hits=3,
        )
        self.worker = TierWorker(self.store)
        self.version = 0

    def run(self) -> int:
        ran = self.worker.run_blocking()
        self.store.check_invariants()
        return ran

    def put(self, key: str, size: int = BLOCK, write_id: int = 1) -> Status:
        data = payload(key, write_id, size)
        verdict = self.store.reserve(key, write_id, size, block_checksum(data))
        if verdict.block is None:
            return verdict.status
        self.store.view(verdict.block)[:] = data
        assert self.store.finish_put(verdict.block) == Status.OK
        self.version += 1
        return self.store.publish(key, write_id, self.version).status

    def put_with_backpressure(self, key: str, size: int = BLOCK) -> None:
        for _ in range(10):
            status = self.put(key, size)
            if status == Status.OK:
                self.run()
                return
            assert status == Status.NO_SPACE
            assert self.run() > 0, "refused with nothing on its way out"
        raise AssertionError(f"{key} was never accepted")

    def get(self, key: str, write_id: int = 1, limit: TierLevel = TierLevel.ANY) -> ReadResult:
        return self.store.get(key, write_id, limit)

    def read(
        self, key: str, write_id: int = 1, limit: TierLevel = TierLevel.ANY
    ) -> tuple[bytes | MissReason | None, TierLevel]:
        """The bytes (None: a bad copy) or the miss reason, and the tier that served it."""
        result = self.get(key, write_id, limit)
        if result.copy is None:
            return result.reason, TierLevel.ANY
        level = result.copy.level
        if level is TierLevel.CPU:
            data = bytes(self.store.view(result.copy.block))
            self.store.release(result.copy)
            return data, level
        got = self.worker.read_blocking(result)
        self.store.check_invariants()
        return got, level

    def close(self) -> None:
        self.store.check_invariants()
        self.cpu.close()
        self.ssd.close()


def payload(key: str, write_id: int, size: int) -> bytes:
    seed = f"{key}/{write_id}/".encode()
    return (seed * (size // len(seed) + 1))[:size]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path / "ssd")
    yield n
    n.close()


# --- demotion and promotion ---------------------------------------------------------------------


def test_writing_three_times_the_cpu_tier_loses_nothing_and_ssd_reads_are_exact(
    node: Node,
) -> None:
    keys = [f"k{i}" for i in range(48)]  # 3 x 16 blocks of CPU
    for key in keys:
        node.put_with_backpressure(key)
    stats = node.store.stats()
    assert stats.evictions == 0  # nothing lost
    assert stats.committed == 48
    assert node.cpu.used_bytes <= 0.85 * node.cpu.capacity_bytes
    served = {TierLevel.CPU: 0, TierLevel.SSD: 0}
    for key in keys:
        data, level = node.read(key)
        assert data == payload(key, 1, BLOCK), f"{key} read wrong from {level.name}"
        served[level] += 1
    assert served[TierLevel.SSD] >= 32  # most of them came off the SSD, byte for byte
    tiers = {t.name: t for t in stats.tiers}
    assert tiers["cpu"].demotions >= 32
    assert tiers["ssd"].blocks >= 32


def test_a_second_ssd_hit_promotes_the_block_and_its_ssd_copy_stays(node: Node) -> None:
    for i in range(20):
        node.put_with_backpressure(f"k{i}")
    first, level = node.read("k0")
    assert level is TierLevel.SSD
    assert first == payload("k0", 1, BLOCK)
    block = node.store.block("k0", 1)
    assert block is not None
    assert TierLevel.CPU not in block.copies
    second, level = node.read("k0")
    assert level is TierLevel.SSD
    assert second == first
    assert set(block.copies) == {TierLevel.CPU, TierLevel.SSD}  # promoted, SSD copy kept
    third, level = node.read("k0")
    assert level is TierLevel.CPU
    assert third == first
    changes = node.store.take_tier_changes(100)
    assert [c.level for c in changes if c.key == "k0"] == [TierLevel.CPU]  # back in memory
    # Leaving CPU again costs no write: the SSD copy is still there.
    demotions = node.store.counters.tiers[TierLevel.CPU].demotions
    node.store.tiers.evict(TierLevel.CPU, node.cpu.capacity_bytes)
    assert node.store.block("k0", 1) is not None
    assert node.store.counters.tiers[TierLevel.CPU].demotions == demotions
    assert node.read("k0") == (first, TierLevel.SSD)


def test_a_tier_limit_turns_a_block_on_a_slower_tier_into_a_miss(node: Node) -> None:
    for i in range(20):
        node.put_with_backpressure(f"k{i}")
    on_ssd = [f"k{i}" for i in range(20) if node.store.block(f"k{i}", 1).fastest().level  # type: ignore[union-attr]
              is TierLevel.SSD]  # fmt: skip
    in_cpu = [f"k{i}" for i in range(20) if f"k{i}" not in on_ssd]
    assert on_ssd
    assert in_cpu
    assert node.read(on_ssd[0], limit=TierLevel.CPU) == (MissReason.SLOW_TIER, TierLevel.ANY)
    assert node.read(in_cpu[0], limit=TierLevel.CPU)[1] is TierLevel.CPU
    assert node.read(in_cpu[0], limit=TierLevel.GPU) == (MissReason.SLOW_TIER, TierLevel.ANY)
    assert node.store.stats().misses["slow_tier"] == 2
    data, level = node.read(on_ssd[0], limit=TierLevel.SSD)
    assert level is TierLevel.SSD
    assert data == payload(on_ssd[0], 1, BLOCK)


def test_a_block_stays_readable_from_cpu_while_its_demotion_is_in_flight(node: Node) -> None:
    for i in range(14):
        assert node.put(f"k{i}") == Status.OK
    jobs = node.store.take_jobs()  # planned, not run
    writes = [j for j in jobs if isinstance(j, WriteJob)]
    assert writes
    moving = writes[0].items[0].source.block
    data, level = node.read(moving.key)
    assert level is TierLevel.CPU
    assert data == payload(moving.key, 1, BLOCK)
    for job in writes:
        node.worker._write(job)
        node.store.finish_write(job, True)
    node.store.check_invariants()
    assert node.read(moving.key) == (payload(moving.key, 1, BLOCK), TierLevel.SSD)


def test_a_block_deleted_during_its_demotion_leaves_nothing_behind(node: Node) -> None:
    for i in range(14):
        assert node.put(f"k{i}") == Status.OK
    jobs = node.store.take_jobs()
    write = next(j for j in jobs if isinstance(j, WriteJob))
    victim = write.items[0].source.block
    assert node.store.delete(victim.key, 1)
    node.worker._write(write)
    node.store.finish_write(write, True)
    node.run()
    assert node.read(victim.key) == (MissReason.ABSENT, TierLevel.ANY)
    assert node.ssd.segments.allocations == node.store.tiers.copies_on(TierLevel.SSD)


def test_full_cpu_tier_refuses_puts_while_demotions_are_on_their_way(node: Node) -> None:
    for i in range(13):
        assert node.put(f"k{i}") == Status.OK  # no job run: nothing has left yet
    statuses = [node.put(f"more{i}") for i in range(10)]
    assert Status.NO_SPACE in statuses
    verdict = node.store.reserve("x", 1, BLOCK, 0)
    assert verdict.status == Status.NO_SPACE
    assert "on their way to the SSD" in verdict.message
    assert node.store.stats().evictions == 0
    node.run()
    assert node.put("x") == Status.OK


def test_full_node_without_room_anywhere_refuses_with_a_clear_message(tmp_path: Path) -> None:
    n = Node(tmp_path / "ssd", cpu=8 * BLOCK, ssd=2 * 16 * KIB, segment=16 * KIB)
    try:
        leases = []
        for i in range(6):
            n.put_with_backpressure(f"k{i}")
            result = n.get(f"k{i}")
            leases.append(result)  # every block read and held
        statuses = {n.put(f"more{i}") for i in range(20)}
        n.run()
        assert Status.NO_SPACE in statuses
        for result in leases:
            if result.copy is not None and result.copy.level is TierLevel.CPU:
                n.store.release(result.copy)
            else:
                n.worker.read_blocking(result)
        for i in range(6):
            data, _ = n.read(f"k{i}")
            assert data == payload(f"k{i}", 1, BLOCK) or data is MissReason.EVICTED
    finally:
        n.close()


# --- eviction safety --------------------------------------------------------------------------


def test_a_segment_is_never_reclaimed_under_a_reader_or_with_a_pinned_block(
    tmp_path: Path,
) -> None:
    n = Node(tmp_path / "ssd", cpu=8 * BLOCK, ssd=4 * 16 * KIB, segment=16 * KIB)
    try:
        n.put_with_backpressure("read-me")
        n.put_with_backpressure("pin-me")
        for i in range(6):
            n.put_with_backpressure(f"fill{i}")
        read_me = n.store.block("read-me", 1)
        pin_me = n.store.block("pin-me", 1)
        assert read_me is not None
        assert pin_me is not None
        assert TierLevel.SSD in read_me.copies
        assert TierLevel.SSD in pin_me.copies
        n.store.set_pinned("pin-me", 1, True)
        lease = n.get("read-me", 1)  # a reader holds the SSD copy
        assert lease.copy is not None
        assert lease.copy.level is TierLevel.SSD
        for i in range(60):  # many times the SSD's size
            n.put_with_backpressure(f"flood{i}")
        assert n.store.counters.tiers[TierLevel.SSD].evictions > 10
        assert n.worker.read_blocking(lease) == payload("read-me", 1, BLOCK)
        assert n.read("pin-me")[0] == payload("pin-me", 1, BLOCK)
    finally:
        n.close()


def test_reads_between_every_put_never_starve_eviction(tmp_path: Path) -> None:
    n = Node(tmp_path / "ssd", cpu=16 * BLOCK, ssd=4 * 16 * KIB, segment=16 * KIB)
    try:
        for i in range(200):
            n.put_with_backpressure(f"k{i}")
            for j in range(max(0, i - 20), i + 1):  # everything recent is read, again and again
                n.read(f"k{j}")
        stats = n.store.stats()
        assert stats.evictions > 100  # the SSD is small: old blocks had to go, and went
        assert n.cpu.used_bytes <= 0.85 * n.cpu.capacity_bytes + BLOCK
    finally:
        n.close()


def test_a_corrupt_ssd_copy_is_dropped_and_never_served(node: Node) -> None:
    for i in range(20):
        node.put_with_backpressure(f"k{i}")
    block = next(b for b in node.store.committed_blocks() if set(b.copies) == {TierLevel.SSD})
    offset = block.copies[TierLevel.SSD].offset
    fd = os.open(node.ssd.data_path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xff" * 16, offset + 100)
    finally:
        os.close(fd)
    assert node.read(block.key) == (None, TierLevel.SSD)  # checked, refused
    assert node.read(block.key) == (MissReason.EVICTED, TierLevel.ANY)
    assert node.store.take_evicted(100) == [(block.key, 1)]  # the index hears it is gone


def test_failed_ssd_writes_keep_blocks_in_memory_then_switch_demotion_off(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(offset: int, buffer: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(node.ssd, "write_extent", broken)
    for i in range(13):
        assert node.put(f"k{i}") == Status.OK
        node.run()
    assert node.store.counters.evictions == 0 or not node.store.tiers.ssd_enabled
    for _ in range(3):
        node.put(f"extra{_}")
        node.run()
    assert not node.store.tiers.ssd_enabled  # three failures: the node goes on without it
    for i in range(40):
        assert node.put(f"later{i}") == Status.OK  # CPU-only now: plain eviction
        node.run()
    held = 0
    for i in range(40):
        data, _ = node.read(f"later{i}")
        assert data in (payload(f"later{i}", 1, BLOCK), MissReason.EVICTED)
        held += data != MissReason.EVICTED
    assert held >= 2
    assert node.read("later39")[0] == payload("later39", 1, BLOCK)


# --- shedding for a nearly full index (index_shed) ----------------------------------------------


def test_shedding_drops_the_oldest_ssd_blocks_first_and_reports_exactly_what_left(
    node: Node,
) -> None:
    keys = [f"k{i}" for i in range(24)]  # more than the CPU tier: the oldest are on the SSD only
    for key in keys:
        node.put_with_backpressure(key)
    node.store.set_pinned("k0", 1, True)
    k1 = node.store.block("k1", 1)
    assert k1 is not None
    assert set(k1.copies) == {TierLevel.SSD}  # the oldest are on the SSD only
    assert node.store.shed(3) == 3
    node.run()
    gone = [k for k in keys if node.store.block(k, 1) is None]
    assert gone == ["k1", "k2", "k3"]  # the oldest SSD segment's, the pinned k0 kept
    assert sorted(node.store.take_evicted(100)) == [(k, 1) for k in gone]
    assert node.store.counters.shed == 3
    for key in keys:
        want = MissReason.EVICTED if key in gone else payload(key, 1, BLOCK)
        assert node.read(key)[0] == want


def test_shedding_with_no_ssd_takes_the_coldest_cpu_blocks_and_never_a_pinned_one(
    tmp_path: Path,
) -> None:
    cpu = CpuTier(16 * BLOCK)
    store = BlockStore(cpu, S3FifoPolicy(), max_block_size=BLOCK, clock=lambda: 0.0)
    try:
        for i in range(8):
            key = f"k{i}"
            data = payload(key, 1, BLOCK)
            verdict = store.reserve(key, 1, BLOCK, block_checksum(data))
            assert verdict.block is not None
            store.view(verdict.block)[:] = data
            assert store.finish_put(verdict.block) == Status.OK
            assert store.publish(key, 1, i + 1).status == Status.OK
        store.set_pinned("k0", 1, True)
        for i in range(4, 8):  # read: hotter than k1..k3
            result = store.get(f"k{i}", 1, TierLevel.ANY)
            assert result.copy is not None
            store.release(result.copy)
        assert store.shed(2) == 2
        assert [store.block(f"k{i}", 1) is None for i in range(8)] == [
            False, True, True, False, False, False, False, False,
        ]  # fmt: skip
        assert store.shed(100) == 5  # all the others but the pinned one
        assert store.block("k0", 1) is not None
        assert store.shed(0) == 0
        store.check_invariants()
    finally:
        cpu.close()


# --- GPU (a host-memory stand-in) ---------------------------------------------------------------


def test_hot_blocks_move_up_to_the_gpu_and_come_back_byte_exact(tmp_path: Path) -> None:
    n = Node(tmp_path / "ssd", gpu=8 * BLOCK)
    try:
        n.put_with_backpressure("hot")
        for _ in range(3):
            assert n.read("hot")[1] is TierLevel.CPU
        n.run()  # the copy job: CPU -> GPU
        block = n.store.block("hot", 1)
        assert block is not None
        assert TierLevel.GPU in block.copies
        assert n.store.counters.tiers[TierLevel.GPU].promotions == 1
        n.store.tiers.evict(TierLevel.CPU, n.cpu.capacity_bytes)  # CPU copy goes, GPU stays
        assert set(block.copies) == {TierLevel.GPU}
        assert n.read("hot") == (payload("hot", 1, BLOCK), TierLevel.GPU)
        n.store.tiers.evict(TierLevel.GPU, n.gpu.capacity_bytes)  # type: ignore[union-attr]
        assert n.store.block("hot", 1) is None  # evict() drops: nothing else held it
        for i in range(8):
            n.put_with_backpressure(f"warm{i}")
            for _ in range(3):
                n.read(f"warm{i}")
            n.run()
        on_gpu = [b for b in n.store.committed_blocks() if TierLevel.GPU in b.copies]
        assert on_gpu
        n.store.tiers.relieve(force_bytes=n.cpu.capacity_bytes)  # CPU empties: nothing lost
        n.run()
        assert all(TierLevel.CPU not in b.copies for b in n.store.committed_blocks())
        for i in range(8):
            data, level = n.read(f"warm{i}")
            assert data == payload(f"warm{i}", 1, BLOCK)
            assert level in (TierLevel.GPU, TierLevel.SSD)
        # A GPU copy with no other copy left is demoted to the SSD, not dropped.
        gpu_only = [b for b in n.store.committed_blocks() if set(b.copies) == {TierLevel.GPU}]
        for block in gpu_only:
            n.store.tiers.drain(TierLevel.GPU, block.copies[TierLevel.GPU].footprint)
        n.run()
        assert n.store.stats().evictions == 1  # only "hot", dropped on purpose above
        for i in range(8):
            assert n.read(f"warm{i}")[0] == payload(f"warm{i}", 1, BLOCK)
    finally:
        n.close()


# --- warm restart --------------------------------------------------------------------------------


def test_restart_finds_ssd_blocks_again_and_drops_the_ones_that_do_not_check_out(
    tmp_path: Path,
) -> None:
    n = Node(tmp_path / "ssd")
    for i in range(40):
        n.put_with_backpressure(f"k{i}")
    n.store.delete("k39", 1)  # gone before the restart: must not come back
    n.run()
    on_ssd = {b.key: b for b in n.store.committed_blocks() if TierLevel.SSD in b.copies}
    assert len(on_ssd) >= 20
    bad = next(iter(on_ssd.values()))
    bad_offset = bad.copies[TierLevel.SSD].offset
    n.close()
    fd = os.open(tmp_path / "ssd" / "data.kvp", os.O_WRONLY)
    try:
        os.pwrite(fd, b"garbage!", bad_offset)  # a bad sector while the node was down
    finally:
        os.close(fd)

    again = Node(tmp_path / "ssd")
    try:
        recovery = recover_ssd(again.ssd)
        assert recovery.layout_ok
        assert recovery.corrupt == 1
        held = restore_into(again.store, recovery)
        assert held == len(on_ssd) - 1
        again.store.check_invariants()
        assert again.read(bad.key)[0] is MissReason.ABSENT
        assert again.read("k39")[0] is MissReason.ABSENT
        for key in on_ssd:
            if key != bad.key:
                assert again.read(key) == (payload(key, 1, BLOCK), TierLevel.SSD)
        # The tier goes on working after a restart: demotions land in free segments.
        for i in range(40):
            again.put_with_backpressure(f"new{i}")
        assert again.read("new0")[0] == payload("new0", 1, BLOCK)
    finally:
        again.close()


def test_a_tier_of_another_layout_starts_cold(tmp_path: Path) -> None:
    n = Node(tmp_path / "ssd")
    for i in range(30):
        n.put_with_backpressure(f"k{i}")
    n.close()
    other = Node(tmp_path / "ssd", segment=32 * KIB)
    try:
        recovery = recover_ssd(other.ssd)
        assert not recovery.layout_ok
        assert restore_into(other.store, recovery) == 0
    finally:
        other.close()


def test_a_second_node_on_the_same_ssd_path_is_refused(node: Node) -> None:
    from kvpool.store_node.tiers.ssd import SsdTierError

    with pytest.raises(SsdTierError, match="in use"):
        SsdTier(node.path, 16 * 64 * KIB, 64 * KIB)


def test_an_ssd_tier_larger_than_the_free_disk_is_refused(tmp_path: Path) -> None:
    from kvpool.store_node.tiers.ssd import SsdTierError

    huge = 1 << 60
    with pytest.raises(SsdTierError, match="free space"):
        SsdTier(tmp_path / "big", huge, 64 << 20)


# --- the first rule, under random operations across tiers -----------------------------------


class TieredStoreMachine(RuleBasedStateMachine):
    """Whatever happens, a read returns the exact bytes of that (key, write id) or a miss."""

    keys = st.sampled_from(["a", "b", "c", "d", "e", "f"])
    write_ids = st.integers(1, 3)

    @initialize()
    def start(self) -> None:
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.node = Node(Path(self.tmp.name) / "ssd", cpu=6 * BLOCK, ssd=4 * 8 * KIB,
                         segment=8 * KIB, gpu=2 * BLOCK, batch=8 * KIB)  # fmt: skip
        self.held: list[tuple[ReadResult, bytes]] = []
        self.probe = Probe(self.node.store) if shm_supported() else None

    @rule(key=keys, write_id=write_ids, size=st.sampled_from([0, 100, 3000, BLOCK, 6000]))
    def put(self, key: str, write_id: int, size: int) -> None:
        self.node.put(key, size, write_id)

    @rule(key=keys, write_id=write_ids, hold=st.booleans(), limit=st.sampled_from(list(TierLevel)))
    def get(self, key: str, write_id: int, hold: bool, limit: TierLevel) -> None:
        result = self.node.get(key, write_id, limit)
        if result.copy is None:
            return
        block = result.copy.block
        event(f"served from {result.copy.level.name}")
        want = payload(key, write_id, block.size_bytes)
        assert not limit or result.copy.level <= limit
        if result.copy.level is TierLevel.CPU:
            data = bytes(self.node.store.view_copy(result.copy))
            assert data == want, "read another write's bytes"
            if hold:
                self.held.append((result, data))
            else:
                self.node.store.release(result.copy)
        else:
            got = self.node.worker.read_blocking(result)
            assert got is None or got == want, "read another write's bytes from a slow tier"

    @rule(index=st.integers(0, 50), hold=st.booleans(), times=st.integers(1, 4))
    def read_held_block(self, index: int, hold: bool, times: int) -> None:
        blocks = sorted(self.node.store.committed_blocks(), key=lambda b: b.id)
        if blocks:
            block = blocks[index % len(blocks)]
            for _ in range(times):
                self.get(block.key, block.write_id, hold, TierLevel.ANY)

    @rule()
    def release_oldest(self) -> None:
        if self.held:
            result, data = self.held.pop(0)
            assert result.copy is not None
            assert bytes(self.node.store.view_copy(result.copy)) == data, "bytes changed"
            self.node.store.release(result.copy)

    @rule(key=keys, write_id=st.integers(0, 4))
    def delete(self, key: str, write_id: int) -> None:
        self.node.store.delete(key, write_id)

    @rule(key=keys, write_id=write_ids)
    def pin(self, key: str, write_id: int) -> None:
        self.node.store.set_pinned(key, write_id, True)

    @rule()
    def run_jobs(self) -> None:
        self.node.run()

    @rule(key=keys)
    def read_through_the_directory(self, key: str) -> None:
        """A same-host client's read with no message: a committed write's exact bytes."""
        if self.probe is not None and self.probe.read_checked(key, payload):
            event("read through the directory")

    @rule()
    def restart(self) -> None:
        """Stop the node (every job done) and start it again on the same SSD files: every
        block that was on the SSD comes back, byte for byte; nothing else does."""
        for result, _ in self.held:
            assert result.copy is not None
            self.node.store.release(result.copy)
        self.held = []
        self.node.run()
        on_ssd = {
            b.id: b.version for b in self.node.store.committed_blocks() if TierLevel.SSD in b.copies
        }
        version = self.node.version
        if self.probe is not None:
            self.probe.close()
        self.node.close()
        self.node = Node(Path(self.tmp.name) / "ssd", cpu=6 * BLOCK, ssd=4 * 8 * KIB,
                         segment=8 * KIB, gpu=2 * BLOCK, batch=8 * KIB)  # fmt: skip
        self.node.version = version
        recovery = recover_ssd(self.node.ssd)
        assert recovery.corrupt == 0
        restore_into(self.node.store, recovery)
        back = {b.id: b.version for b in self.node.store.committed_blocks()}
        assert back == on_ssd
        self.probe = Probe(self.node.store) if shm_supported() else None
        event("restarted")

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "node"):
            self.node.store.check_invariants()
            for result, data in self.held:
                assert result.copy is not None
                assert bytes(self.node.store.view_copy(result.copy)) == data
            if self.probe is not None:
                self.probe.check()

    def teardown(self) -> None:
        if hasattr(self, "node"):
            for result, _ in self.held:
                assert result.copy is not None
                self.node.store.release(result.copy)
            self.node.run()
            if self.probe is not None:
                self.probe.close()
            self.node.close()
            self.tmp.cleanup()


TestTieredStoreMachine = TieredStoreMachine.TestCase
TestTieredStoreMachine.settings = settings(
    max_examples=150,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
