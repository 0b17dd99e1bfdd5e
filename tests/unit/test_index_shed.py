"""Shedding for a nearly full index (``index_shed``): the leader's share of the excess per node,
and the node dropping its coldest blocks when a heartbeat's answer asks, once per report."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvpool.checksum import block_checksum
from kvpool.config import NodeConfig
from kvpool.proto.v1 import master_pb2
from kvpool.proto.wire import Status
from kvpool.raft_master.service import shed_share
from kvpool.store_node import registration as registration_module
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.eviction import S3FifoPolicy
from kvpool.store_node.registration import NodeRegistration
from kvpool.store_node.tiers.cpu import CpuTier

BLOCK = 4096


def test_a_node_is_asked_for_its_share_of_the_entries_past_nine_tenths() -> None:
    assert shed_share(held=900, limit=1000, mine=900) == 0  # at nine tenths: nothing
    assert shed_share(held=901, limit=1000, mine=901) == 1
    assert shed_share(held=1000, limit=1000, mine=500) == 50  # half the entries, half the 100
    assert shed_share(held=1000, limit=1000, mine=1) == 1  # a share is never rounded to none
    assert shed_share(held=1000, limit=1000, mine=0) == 0
    assert shed_share(held=1200, limit=1000, mine=1200) == 300  # past the limit (puts in flight)
    assert shed_share(held=0, limit=0, mine=0) == 0
    assert shed_share(held=5, limit=0, mine=5) == 0  # index_shed off


class _Masters:
    """Heartbeat answers asking for ``shed`` blocks; ReportEvictions accepted."""

    def __init__(self, shed: int) -> None:
        self.shed = shed
        self.reported: list[tuple[str, int]] = []

    async def call(self, method: str, request: Any, **_: Any) -> Any:
        if method == "Heartbeat":
            return master_pb2.HeartbeatResponse(known=True, shed_blocks=self.shed)
        if method == "ReportEvictions":
            self.reported += [(b.key, b.write_id) for b in request.blocks]
            return master_pb2.ReportEvictionsResponse(dropped=len(request.blocks))
        raise AssertionError(method)


def _store(blocks: int) -> tuple[BlockStore, CpuTier]:
    cpu = CpuTier(64 * BLOCK)
    store = BlockStore(cpu, S3FifoPolicy(), max_block_size=BLOCK, clock=lambda: 0.0)
    for i in range(blocks):
        key = f"k{i}"
        data = bytes([i]) * BLOCK
        verdict = store.reserve(key, 1, BLOCK, block_checksum(data))
        assert verdict.block is not None
        store.view(verdict.block)[:] = data
        assert store.finish_put(verdict.block) == Status.OK
        assert store.publish(key, 1, i + 1).status == Status.OK
    return store, cpu


def test_a_heartbeat_asking_for_room_drops_the_coldest_blocks_once_per_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, cpu = _store(10)
    masters = _Masters(shed=3)
    registration = NodeRegistration(
        NodeConfig(masters=("127.0.0.1:1",)),
        store,
        masters,  # type: ignore[arg-type]
        data_address="tcp://127.0.0.1:2",
        admin_address="",
    )
    registration.member_id = 5

    async def run() -> None:
        assert await registration.heartbeat_once()  # asked 3, at most 2 a heartbeat (here)
        assert store.stats().blocks == 8
        # Until the index has heard of those, its count does not show them: asked again, the
        # node drops nothing more.
        assert await registration.heartbeat_once()
        assert store.stats().blocks == 8
        while await registration.report_evictions_once():
            pass
        assert sorted(masters.reported) == [("k0", 1), ("k1", 1)]  # the coldest: never read
        assert await registration.heartbeat_once()
        assert store.stats().blocks == 6
        masters.shed = 0  # the index has room again
        while await registration.report_evictions_once():
            pass
        assert await registration.heartbeat_once()
        assert store.stats().blocks == 6

    monkeypatch.setattr(registration_module, "MAX_SHED_PER_HEARTBEAT", 2)
    try:
        asyncio.run(run())
        assert store.counters.shed == 4
    finally:
        cpu.close()
