"""A replica the index names on a node that never received it — a put committed it while its
bytes were on their way (the client's commit overlaps its stage) and they never came: the node
remembers the reads that missed it, and once any put's bytes would have come
(``staged_ttl_s``), reports it gone if the index still names exactly that write there."""

from __future__ import annotations

import asyncio
from typing import Any

from kvpool.checksum import block_checksum
from kvpool.config import NodeConfig
from kvpool.proto.v1 import common_pb2, master_pb2
from kvpool.proto.wire import MissReason, Status
from kvpool.store_node import block_store as block_store_module
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.eviction import LruPolicy
from kvpool.store_node.registration import NodeRegistration
from kvpool.store_node.tiers.cpu import CpuTier
from tests.unit.test_block_store import FakeClock

BLOCK = 4096
MEMBER = 5
TTL_S = 30.0


class Masters:
    """Lookup answers from ``index`` (key -> (write id, member ids)); ReportEvictions
    recorded."""

    def __init__(self, index: dict[str, tuple[int, list[int]]]) -> None:
        self.index = index
        self.lookups: list[list[str]] = []
        self.reported: list[tuple[str, int]] = []

    async def call(self, method: str, request: Any, **_: Any) -> Any:
        if method == "Lookup":
            assert request.internal
            self.lookups.append(list(request.keys))
            entries = []
            for key in request.keys:
                held = self.index.get(key)
                if held is None:
                    entries.append(common_pb2.BlockEntry(key=key, found=False))
                else:
                    write_id, replicas = held
                    entries.append(
                        common_pb2.BlockEntry(
                            key=key, found=True, write_id=write_id, replicas=replicas
                        )
                    )
            return master_pb2.LookupResponse(entries=entries)
        if method == "ReportEvictions":
            assert request.member_id == MEMBER
            self.reported += [(b.key, b.write_id) for b in request.blocks]
            return master_pb2.ReportEvictionsResponse(dropped=len(request.blocks))
        raise AssertionError(method)


def put(store: BlockStore, key: str, write_id: int, version: int) -> None:
    data = bytes([write_id % 256]) * BLOCK
    verdict = store.reserve(key, write_id, BLOCK, block_checksum(data))
    assert verdict.block is not None
    store.view(verdict.block)[:] = data
    assert store.finish_put(verdict.block) == Status.OK
    assert store.publish(key, write_id, version).status == Status.OK


def setup(
    index: dict[str, tuple[int, list[int]]],
) -> tuple[BlockStore, NodeRegistration, Masters, FakeClock]:
    clock = FakeClock()
    store = BlockStore(CpuTier(64 * BLOCK), LruPolicy(), max_block_size=BLOCK, clock=clock)
    masters = Masters(index)
    registration = NodeRegistration(
        NodeConfig(masters=("127.0.0.1:1",), staged_ttl_s=TTL_S),
        store,
        masters,  # type: ignore[arg-type]
        data_address="tcp://127.0.0.1:2",
        admin_address="",
        clock=clock,
    )
    registration.member_id = MEMBER
    return store, registration, masters, clock


def report_all(registration: NodeRegistration) -> None:
    async def run() -> None:
        while await registration.report_evictions_once():
            pass

    asyncio.run(run())


def test_a_write_the_index_names_here_and_never_came_is_reported_after_the_ttl() -> None:
    store, registration, masters, clock = setup(
        {"never": (7, [MEMBER]), "elsewhere": (8, [MEMBER + 1]), "newer": (10, [MEMBER])}
    )
    try:
        assert store.get("never", 7).reason == MissReason.ABSENT
        assert store.get("elsewhere", 8).reason == MissReason.ABSENT
        assert store.get("newer", 9).reason == MissReason.ABSENT  # the index names write 10
        assert store.get("gone", 3).reason == MissReason.ABSENT  # the index has no such key
        clock.now += TTL_S - 1
        assert asyncio.run(registration.check_missing_once()) == 0
        assert masters.lookups == []  # too soon: a put's bytes may still be on their way
        clock.now += 1
        assert asyncio.run(registration.check_missing_once()) == 1
        assert masters.lookups == [["never", "elsewhere", "newer", "gone"]]
        report_all(registration)
        assert masters.reported == [("never", 7)]  # only the exact write, only on this member
        assert store.counters.missing_reported == 1
        assert asyncio.run(registration.check_missing_once()) == 0  # each is checked once
    finally:
        store.tier.close()


def test_a_write_that_came_after_the_read_missed_it_is_not_reported() -> None:
    store, registration, masters, clock = setup({"late": (7, [MEMBER])})
    try:
        assert store.get("late", 7).reason == MissReason.ABSENT  # read between commit and stage
        put(store, "late", 7, 1)  # the bytes arrive: the put goes on and returns True
        clock.now += TTL_S
        assert asyncio.run(registration.check_missing_once()) == 0
        assert masters.lookups == []
        report_all(registration)
        assert masters.reported == []
        assert store.get("late", 7).status == Status.OK
    finally:
        store.tier.close()


def test_a_read_of_an_old_write_beside_the_held_one_is_checked_too() -> None:
    store, registration, masters, clock = setup({"k": (2, [MEMBER])})
    try:
        put(store, "k", 1, 1)  # this node holds write 1; the index moved on to write 2
        assert store.get("k", 2).reason == MissReason.WRONG_VERSION
        clock.now += TTL_S
        assert asyncio.run(registration.check_missing_once()) == 1
        report_all(registration)
        assert masters.reported == [("k", 2)]
    finally:
        store.tier.close()


def test_reads_of_recently_evicted_writes_and_direct_reads_are_not_suspects() -> None:
    store, registration, masters, clock = setup({})
    try:
        for i in range(60):  # past the high watermark: the oldest are evicted (and reported)
            put(store, f"k{i}", 1, 1)
        store.evict_if_needed()
        evicted = [i for i in range(60) if store.get(f"k{i}", 1).status != Status.OK]
        assert evicted
        assert store.get(f"k{evicted[0]}", 1).reason == MissReason.EVICTED
        assert store.get("direct", 0).reason == MissReason.ABSENT  # by content: no write named
        clock.now += TTL_S
        assert asyncio.run(registration.check_missing_once()) == 0
        assert masters.lookups == []
    finally:
        store.tier.close()


def test_at_most_missing_suspects_are_remembered(monkeypatch: Any) -> None:
    monkeypatch.setattr(block_store_module, "MISSING_SUSPECTS", 3)
    store, registration, masters, clock = setup({f"k{i}": (1, [MEMBER]) for i in range(5)})
    try:
        for i in range(5):
            store.get(f"k{i}", 1)
        clock.now += TTL_S
        assert asyncio.run(registration.check_missing_once()) == 3
        assert masters.lookups == [["k2", "k3", "k4"]]  # the oldest were forgotten
    finally:
        store.tier.close()
