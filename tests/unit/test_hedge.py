"""Hedged reads: a slow replica is hedged to the next one, the first good answer wins, and a
late answer never lands in a caller's buffer after the read returned. The pure rules first,
then both clients against a fake master with one slow node (answers after 0.6 s)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpool import AsyncClient, Client
from kvpool.checksum import block_checksum
from kvpool.client.hedge import Hedge, HedgePolicy
from kvpool.client.plans import ReadItem
from kvpool.errors import BlockMissError
from kvpool.proto.v1 import common_pb2
from tests.unit.test_client_core import FakeCluster

SLOW_S = 0.6


def _item(key: str, data: bytes, replicas: list[int], *, sink: bool) -> ReadItem:
    entry = common_pb2.BlockEntry(
        key=key,
        found=True,
        version=1,
        write_id=7,
        size_bytes=len(data),
        checksum=block_checksum(data),
        replicas=replicas,
    )
    return ReadItem(
        key,
        key.encode(),
        entry,
        sink=memoryview(bytearray(len(data))) if sink else None,
        caller_buffer=sink,
        replicas=replicas,
    )


# --- the pure rules ------------------------------------------------------------------------------


def test_the_hedge_delay_grows_with_the_bytes_of_the_round() -> None:
    policy = HedgePolicy(enabled=True, base_delay_s=0.01)
    assert policy.delay_s(0) == pytest.approx(0.01)
    assert policy.delay_s(16 << 20) == pytest.approx(0.01 + 0.016777216)
    one = _item("k", b"x", [1], sink=False)
    one.next = 1  # its only replica is being read
    two = _item("k2", b"x", [1, 2], sink=False)
    two.next = 1
    assert not policy.worth_it([one])
    assert policy.worth_it([one, two])
    assert not HedgePolicy(enabled=False).worth_it([two])


def test_a_clone_reads_into_its_own_buffer_and_is_copied_back_once_settled() -> None:
    data = b"block bytes" * 100
    it = _item("k", data, [1, 2], sink=True)
    it.next = 1
    caller = it.sink
    assert isinstance(caller, memoryview)
    hedge = Hedge([it])
    (clone,) = hedge.clones
    assert isinstance(clone.sink, memoryview)
    assert clone.sink.obj is not caller.obj
    clone.sink[:] = data
    clone.ok, clone.next, clone.tier = True, 2, 2
    assert hedge.resolved(lambda _it: False, lambda _c: False)  # read by the hedge: resolved
    assert bytes(caller) == bytes(len(data))  # nothing copied before settle
    assert hedge.settle() == 1
    assert it.ok
    assert bytes(caller) == data
    assert it.tier == 2
    assert it.next == 2


def test_a_key_read_as_bytes_takes_the_clones_value() -> None:
    it = _item("k", b"abc", [3, 4], sink=False)
    it.next = 1
    hedge = Hedge([it])
    (clone,) = hedge.clones
    clone.value, clone.ok = b"abc", True
    assert hedge.settle() == 1
    assert it.result() == b"abc"


def test_a_failed_hedge_adds_its_reason_and_skips_the_replica_it_tried() -> None:
    it = _item("k", b"abc", [1, 2, 3], sink=True)
    it.next = 1
    hedge = Hedge([it])
    (clone,) = hedge.clones
    clone.next = 2
    clone.fail("evicted", BlockMissError("evicted there", reason="evicted"))
    assert not hedge.resolved(lambda _it: False, lambda _c: True)  # the first read may still
    assert hedge.resolved(lambda _it: True, lambda _c: True)
    assert hedge.settle() == 0
    assert not it.ok
    assert it.reasons == ["evicted"]
    assert it.next == 2


def test_keys_read_already_or_without_another_replica_are_not_hedged() -> None:
    done = _item("a", b"a", [1, 2], sink=False)
    done.next, done.ok = 1, True
    last = _item("b", b"b", [1], sink=False)
    last.next = 1
    open_ = _item("c", b"c", [1, 2], sink=False)
    open_.next = 1
    hedge = Hedge([done, last, open_])
    assert [c.key for c in hedge.clones] == ["c"]
    hedge.forget(hedge.clones)
    assert len(hedge) == 0
    assert hedge.settle() == 0
    assert open_.next == 1


# --- both clients against one slow node ----------------------------------------------------------


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    c = FakeCluster(n_nodes=2).start()
    try:
        yield c
    finally:
        c.stop()


def _value(i: int) -> bytes:
    return bytes([i % 251]) * 65536


def _slow_first_node(cluster: FakeCluster, key: str) -> None:
    """Slow down the node the index lists first for ``key`` (the other stays fast)."""
    first = cluster.master.index[key].replicas[0]
    cluster.master.nodes[first].delay_s = SLOW_S


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


def test_a_slow_replica_is_hedged_and_the_late_answer_never_lands_in_the_buffer(
    cluster: FakeCluster,
) -> None:
    with Client([cluster.master_address], timeout_s=3.0, replicas=2, transport="tcp") as kv:
        assert kv.put("blk", _value(1))
        _slow_first_node(cluster, "blk")
        # A hedged node is read last for 2 s; without that, every read that starts at the slow
        # node is hedged — the second one after the first one's late answer has arrived.
        kv.placement._suspect_s = 0.0
        returned: list[bytearray] = []  # buffers of hedged reads, given back by the caller
        for attempt in range(60):  # reads start at a random replica: some at the slow one
            buf = bytearray(65536)
            wins = kv.stats["hedge_wins"]
            size, took = _timed(lambda: kv.get_into("blk", buf))  # noqa: B023
            assert size == 65536
            assert bytes(buf) == _value(1)
            assert took < SLOW_S / 2, f"read {attempt} waited {took:.3f} s for the slow node"
            if kv.stats["hedge_wins"] > wins:
                buf[:] = bytes(len(buf))  # the caller takes its buffer back
                returned.append(buf)
                if len(returned) == 2:
                    break
                time.sleep(SLOW_S + 0.1)  # the slow node's late answer arrives
        assert len(returned) == 2, "fewer than two reads started at the slow node"
        time.sleep(SLOW_S + 0.1)
        for _ in range(5):
            assert kv.get("blk") == _value(1)
        for buf in returned:
            assert bytes(buf) == bytes(len(buf)), "a late answer was written into a buffer"
        assert kv.stats["misses"] == 0


def test_a_batch_with_keys_on_a_slow_node_is_served_by_the_other_replicas(
    cluster: FakeCluster,
) -> None:
    keys = [f"batch/{i}" for i in range(8)]
    with Client([cluster.master_address], timeout_s=3.0, replicas=2, transport="tcp") as kv:
        assert all(kv.batch_put([(k, _value(i)) for i, k in enumerate(keys)]))
        cluster.nodes[0].delay_s = SLOW_S
        for _ in range(3):
            values, took = _timed(lambda: kv.batch_get(keys))
            assert values == [_value(i) for i in range(len(keys))]
            assert took < SLOW_S / 2
        assert kv.stats["hedge_wins"] >= 1


def test_without_hedging_a_read_waits_for_the_slow_replica(cluster: FakeCluster) -> None:
    with Client(
        [cluster.master_address], timeout_s=3.0, replicas=2, transport="tcp", hedge_reads=False
    ) as kv:
        assert kv.put("blk", _value(2))
        _slow_first_node(cluster, "blk")
        for _ in range(30):
            value, took = _timed(lambda: kv.get("blk"))
            assert value == _value(2)
            if took >= SLOW_S * 0.9:
                break
        else:
            pytest.fail("no read started at the slow node")
        assert kv.stats["hedged_reads"] == 0


def test_the_async_client_hedges_too(cluster: FakeCluster) -> None:
    async def run() -> tuple[float, dict[str, Any]]:
        kv = AsyncClient([cluster.master_address], timeout_s=3.0, replicas=2, transport="tcp")
        try:
            assert await kv.put("blk", _value(3))
            _slow_first_node(cluster, "blk")
            buf = bytearray(65536)
            worst = 0.0
            for _ in range(30):
                started = time.monotonic()
                assert await kv.get_into("blk", buf) == 65536
                worst = max(worst, time.monotonic() - started)
                assert bytes(buf) == _value(3)
                if kv.stats["hedge_wins"]:
                    break
            buf[:] = bytes(len(buf))
            await asyncio.sleep(SLOW_S + 0.2)
            assert bytes(buf) == bytes(len(buf)), "a late answer was written into the buffer"
            for _ in range(5):
                assert await kv.get("blk") == _value(3)
            return worst, kv.stats
        finally:
            await kv.close()

    worst, stats = asyncio.run(run())
    assert stats["hedge_wins"] >= 1, "no read started at the slow node"
    assert worst < SLOW_S / 2
    assert stats["misses"] == 0
