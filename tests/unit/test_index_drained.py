"""A drained node does not rejoin until its process restarts (issue 6): the index remembers the
drained incarnation of each node and refuses it; a new incarnation joins and clears the record."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest

from kvpool.config import NodeConfig
from kvpool.errors import NodeDrainedError
from kvpool.raft_master.commands import (
    PUT_COMMITTED,
    PUT_NO_LIVE_REPLICA,
    ChangeReplicas,
    MarkMemberDown,
    MarkMemberDownResult,
    RegisterMember,
    RegisterMemberResult,
    ReplicaChange,
    SetDraining,
)
from kvpool.raft_master.index import BlockIndex, IndexSnapshot
from kvpool.raft_master.members import (
    DRAINED,
    DRAINED_MEMORY,
    REFUSED_DRAINED,
    check_registered,
)

from .test_index import put, register, rid


def register_result(index: BlockIndex, node: str, incarnation: int) -> RegisterMemberResult:
    result = index.apply(RegisterMember(rid(), node, incarnation, f"tcp://{node}:1", "", 100, ""))
    assert isinstance(result, RegisterMemberResult)
    index.check_invariants()
    return result


def drain_out(index: BlockIndex, member_id: int, to: int | None = None) -> None:
    """Mark ``member_id`` draining, move its keys to ``to``, declare it left ("drained")."""
    assert index.apply(SetDraining(rid(), member_id, True))
    keys = index.member_keys(member_id, 1 << 20)
    if keys:
        assert to is not None
        changes = []
        for key in keys:
            view = index.lookup([key])[0]
            assert view is not None
            changes.append(ReplicaChange(key, view.write_id, to, member_id))
        index.apply(ChangeReplicas(rid(), tuple(changes)))
    done = index.apply(MarkMemberDown(rid(), member_id, DRAINED))
    assert isinstance(done, MarkMemberDownResult)
    assert done.changed
    index.check_invariants()


def test_a_drained_incarnation_is_refused_and_changes_nothing() -> None:
    index = BlockIndex()
    a, b = register(index, "a", incarnation=7), register(index, "b")
    put(index, "k", 1, (a,))
    drain_out(index, a, to=b)
    assert index.drained_incarnation("a") == 7
    before = index.canonical_state()

    refused = register_result(index, "a", 7)  # the drained process, still running
    assert refused == RegisterMemberResult(REFUSED_DRAINED, index.ring_version)
    assert index.member_of_node("a") is None
    assert [m.node_id for m in index.live_members()] == ["b"]
    # Only the dedupe memory of the request changed: no member, no ring or revision bump.
    assert index.canonical_state()[:-1] == before[:-1]
    with pytest.raises(NodeDrainedError, match="restart its process to rejoin"):
        check_registered(refused, "a", 7)


def test_a_put_naming_the_drained_member_commits_nothing_on_it() -> None:
    index = BlockIndex()
    a, b = register(index, "a", incarnation=7), register(index, "b")
    drain_out(index, a)
    register_result(index, "a", 7)  # refused
    stale = put(index, "k", 1, (a,), ring=index.ring_version).outcomes[0]  # a stale client
    assert stale.status == PUT_NO_LIVE_REPLICA
    both = put(index, "j", 2, (a, b)).outcomes[0]
    assert (both.status, both.replicas) == (PUT_COMMITTED, (b,))
    assert index.lookup(["k"]) == [None]
    index.check_invariants()


def test_a_new_incarnation_joins_as_a_new_member_and_clears_the_record() -> None:
    index = BlockIndex()
    a = register(index, "a", incarnation=7)
    register(index, "b")
    drain_out(index, a)
    ring = index.ring_version

    joined = register_result(index, "a", 8)  # the process restarted
    assert joined.member_id not in (REFUSED_DRAINED, a)
    assert joined.ring_version == ring + 1
    check_registered(joined, "a", 8)  # no error
    assert index.drained_incarnation("a") is None
    rec = index.member(joined.member_id)
    assert rec is not None
    assert rec.live
    assert not rec.draining
    assert put(index, "k", 1, (joined.member_id,)).outcomes[0].status == PUT_COMMITTED
    # The record is gone: even the old incarnation number is a plain registration now.
    again = register_result(index, "a", 7)
    assert again.member_id not in (REFUSED_DRAINED, joined.member_id)


def test_only_a_drain_is_remembered_not_a_death_or_a_leave() -> None:
    index = BlockIndex()
    a, b = register(index, "a", incarnation=7), register(index, "b", incarnation=9)
    index.apply(MarkMemberDown(rid(), a, "heartbeat_timeout"))
    index.apply(MarkMemberDown(rid(), b, "left"))
    assert index.drained_incarnation("a") is None
    assert index.drained_incarnation("b") is None
    assert register_result(index, "a", 7).member_id != REFUSED_DRAINED  # rejoins as before
    assert register_result(index, "b", 9).member_id != REFUSED_DRAINED


def test_a_refused_drain_leaves_no_record() -> None:
    index = BlockIndex()
    a = register(index, "a", incarnation=7)
    put(index, "k", 1, (a,))
    index.apply(SetDraining(rid(), a, True))
    refused = index.apply(MarkMemberDown(rid(), a, DRAINED))  # still holds "k"
    assert refused == MarkMemberDownResult(False, index.ring_version)
    assert index.drained_incarnation("a") is None


def test_a_node_restarted_mid_drain_is_remembered_by_its_new_incarnation() -> None:
    index = BlockIndex()
    first = register(index, "a", incarnation=1)
    index.apply(SetDraining(rid(), first, True))
    second = register(index, "a", incarnation=2)  # restarted: the drain carries on
    done = index.apply(MarkMemberDown(rid(), second, DRAINED))
    assert isinstance(done, MarkMemberDownResult)
    assert done.changed
    assert index.drained_incarnation("a") == 2
    assert register_result(index, "a", 2).member_id == REFUSED_DRAINED
    assert register_result(index, "a", 1).member_id != REFUSED_DRAINED  # not the drained one


def test_the_record_is_bounded_oldest_forgotten_first() -> None:
    index = BlockIndex()
    for i in range(DRAINED_MEMORY + 2):
        m = register(index, f"n{i}", incarnation=i + 1)
        drain_out(index, m)
    assert index.drained_incarnation("n0") is None  # forgotten: the oldest two
    assert index.drained_incarnation("n1") is None
    assert index.drained_incarnation("n2") == 3
    assert index.drained_incarnation(f"n{DRAINED_MEMORY + 1}") == DRAINED_MEMORY + 2
    # Draining a node again moves it to the newest end.
    m = register(index, "n2", incarnation=100)
    drain_out(index, m)
    m = register(index, "late", incarnation=1)
    drain_out(index, m)
    assert index.drained_incarnation("n2") == 100
    assert index.drained_incarnation("n3") is None  # it was the oldest left
    index.check_invariants()


def test_two_indexes_fed_the_same_commands_agree_on_the_record() -> None:
    def run() -> BlockIndex:
        index = BlockIndex()
        a, b = register(index, "a", incarnation=5), register(index, "b", incarnation=6)
        drain_out(index, a)
        drain_out(index, b)
        register(index, "a", incarnation=5)  # refused
        register(index, "b", incarnation=60)  # restarted
        return index

    one, two = run(), run()
    # Everything but the dedupe memory, whose request ids differ between the two runs.
    assert one.canonical_state()[:-1] == two.canonical_state()[:-1]
    assert one.drained_incarnation("a") == 5
    assert one.drained_incarnation("b") is None


def test_snapshots_carry_the_record_and_old_snapshots_load_without_it() -> None:
    index = BlockIndex()
    a, b = register(index, "a", incarnation=7), register(index, "b")
    put(index, "k", 1, (a,))
    drain_out(index, a, to=b)
    blob = pickle.dumps(IndexSnapshot(index.export_state()), protocol=2)
    restored = BlockIndex.import_state(pickle.loads(blob))
    assert restored.canonical_state() == index.canonical_state()
    assert restored.drained_incarnation("a") == 7
    assert register_result(restored, "a", 7).member_id == REFUSED_DRAINED

    old: dict[str, Any] = dict(index.export_state())
    del old["drained"]  # written before the record existed
    loaded = BlockIndex.import_state(old)
    loaded.check_invariants()
    assert loaded.drained_incarnation("a") is None
    assert [m.node_id for m in loaded.live_members()] == ["b"]
    assert register_result(loaded, "a", 7).member_id != REFUSED_DRAINED


# --- the node's side: refused as drained, it stops and waits -------------------------------------


class _Masters:
    """A MasterClient stand-in: RegisterNode answers the ``member_ids`` in turn, then refuses
    as drained."""

    def __init__(self, member_ids: list[int]) -> None:
        self.member_ids = member_ids
        self.calls: list[str] = []

    async def call(self, method: str, request: Any, **_: Any) -> Any:
        from kvpool.proto.v1 import master_pb2

        self.calls.append(method)
        if method == "RegisterNode":
            if self.member_ids:
                return master_pb2.RegisterNodeResponse(member_id=self.member_ids.pop(0))
            raise NodeDrainedError(f"node {request.node_id!r} was drained")
        if method == "LeaveNode":
            return master_pb2.LeaveNodeResponse()
        if method == "Heartbeat":
            return master_pb2.HeartbeatResponse(known=False)
        raise AssertionError(method)


class _Store:
    def __init__(self) -> None:
        self.dropped = 0
        self.tier = type("Tier", (), {"capacity_bytes": 1 << 20})()

    def drop_all(self) -> int:
        self.dropped += 1
        return 0


class _Log:
    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **_: self.events.append(event)


def _registration(masters: _Masters, log: _Log, **kwargs: Any) -> Any:
    from kvpool.store_node.registration import NodeRegistration

    return NodeRegistration(
        NodeConfig(masters=("127.0.0.1:1",)),
        _Store(),  # type: ignore[arg-type]
        masters,  # type: ignore[arg-type]
        data_address="tcp://127.0.0.1:2",
        admin_address="",
        log=log,
        **kwargs,
    )


def test_a_stale_unknown_that_gives_the_old_member_back_leaves_and_joins_again() -> None:
    async def scenario() -> tuple[int, _Masters, _Log]:
        masters, log = _Masters([1, 1, 2]), _Log()
        reg = _registration(masters, log)
        reg.heartbeat_interval_s = 0.01
        stop = asyncio.Event()
        assert await reg.register(stop)
        await asyncio.wait_for(reg._reregister(stop), 2.0)
        return reg.member_id, masters, log

    member_id, masters, log = asyncio.run(scenario())
    # The index still listed member 1 (and the blocks it just dropped): it left, then joined
    # again as a new member.
    assert masters.calls == ["RegisterNode", "RegisterNode", "LeaveNode", "RegisterNode"]
    assert member_id == 2
    assert log.events.count("node_rejoin_stale") == 1
    assert log.events.count("node_reregistered") == 1


def test_a_node_refused_as_drained_says_so_once_and_waits_to_be_stopped() -> None:
    from kvpool.store_node.registration import NodeRegistration

    async def scenario() -> tuple[NodeRegistration, _Masters, _Log, list[str]]:
        masters, log, notes = _Masters([1]), _Log(), []

        async def drained() -> None:
            notes.append("not ready")

        reg = _registration(masters, log, on_drained=drained)
        stop = asyncio.Event()
        assert await reg.register(stop)
        incarnation = reg.incarnation
        task = asyncio.create_task(reg._reregister(stop))  # its heartbeat found it unknown
        await asyncio.sleep(0.3)
        assert not task.done()  # waiting, not retrying
        stop.set()  # SIGTERM
        await asyncio.wait_for(task, 1.0)
        assert reg.incarnation == incarnation  # the same process: the same incarnation
        return reg, masters, log, notes

    reg, masters, log, notes = asyncio.run(scenario())
    assert reg.drained
    assert reg.member_id == 0
    assert masters.calls == ["RegisterNode", "RegisterNode"]  # one refused try, no loop
    assert log.events.count("node_drained_stopped_serving") == 1
    assert notes == ["not ready"]
