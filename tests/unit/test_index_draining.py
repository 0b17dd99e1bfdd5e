"""The replicated draining mark (issue 6): ``SetDraining`` in the index, what it refuses, and
snapshots written before it existed."""

from __future__ import annotations

import pickle

import pytest

from kvpool.proto.v1 import common_pb2, master_pb2
from kvpool.raft_master.commands import (
    PUT_COMMITTED,
    PUT_NO_LIVE_REPLICA,
    ChangeReplicas,
    ChangeReplicasResult,
    MarkMemberDown,
    MarkMemberDownResult,
    ReplicaChange,
    SetDraining,
    SetDrainingResult,
)
from kvpool.raft_master.index import BlockIndex, IndexSnapshot
from kvpool.raft_master.members import DRAINED, member_tuple

from .test_index import put, register, rid


def set_draining(index: BlockIndex, member_id: int, draining: bool = True) -> SetDrainingResult:
    result = index.apply(SetDraining(rid(), member_id, draining))
    assert isinstance(result, SetDrainingResult)
    index.check_invariants()
    return result


def test_set_draining_bumps_the_ring_and_revision_only_when_it_changes_something() -> None:
    index = BlockIndex()
    m = register(index, "n1")
    ring, revision = index.ring_version, index.revision

    assert set_draining(index, m) == SetDrainingResult(True, True, ring + 1)
    assert (index.ring_version, index.revision) == (ring + 1, revision + 1)
    rec = index.member(m)
    assert rec is not None
    assert rec.live
    assert rec.draining
    assert index.draining_members() == [m]

    assert set_draining(index, m) == SetDrainingResult(True, False, ring + 1)  # already so
    assert (index.ring_version, index.revision) == (ring + 1, revision + 1)

    assert set_draining(index, m, False) == SetDrainingResult(True, True, ring + 2)
    assert index.draining_members() == []
    assert set_draining(index, 99) == SetDrainingResult(False, False, ring + 2)  # unknown
    assert (index.ring_version, index.revision) == (ring + 2, revision + 2)


def test_a_repeated_set_draining_request_returns_its_stored_result() -> None:
    index = BlockIndex()
    m = register(index, "n1")
    command = SetDraining(rid(), m, True)
    first = index.apply(command)
    set_draining(index, m, False)
    assert index.apply(command) == first  # a retry: no second effect
    assert index.draining_members() == []


def test_a_draining_member_stays_readable_but_takes_no_new_replica() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    put(index, "old", 1, (a,))
    set_draining(index, a)

    view = index.lookup(["old"])[0]
    assert view is not None
    assert view.replicas == (a,)
    assert index.prefix_match(["old"]) == 1
    assert [m.member_id for m in index.live_members()] == [a, b]

    both = put(index, "new", 2, (a, b)).outcomes[0]
    assert (both.status, both.replicas) == (PUT_COMMITTED, (b,))  # its replica dropped
    only = put(index, "only", 3, (a,)).outcomes[0]
    assert only.status == PUT_NO_LIVE_REPLICA
    assert index.lookup(["only"]) == [None]
    assert index.member_keys(a, 10) == ["old"]
    index.check_invariants()


def test_a_put_placed_on_the_ring_before_the_mark_is_refused_as_stale() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    placed_on = index.ring_version
    set_draining(index, a)
    result = put(index, "k", 1, (a,), ring=placed_on)
    assert result.stale_ring
    assert result.ring_version == index.ring_version
    assert index.lookup(["k"]) == [None]
    assert put(index, "k", 2, (b,)).outcomes[0].status == PUT_COMMITTED  # re-placed


def test_replica_moves_never_add_a_draining_member_but_may_take_one_away() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    put(index, "k", 7, (b,))
    put(index, "j", 8, (a,))
    set_draining(index, a)
    result = index.apply(
        ChangeReplicas(rid(), (ReplicaChange("k", 7, add_member=a), ReplicaChange("j", 8, b, a)))
    )
    assert isinstance(result, ChangeReplicasResult)
    assert result.applied == (False, True)
    k, j = index.lookup(["k", "j"])
    assert k is not None
    assert k.replicas == (b,)
    assert j is not None
    assert j.replicas == (b,)
    assert not index.holds_keys(a)
    index.check_invariants()


def test_a_drained_member_is_declared_left_only_once_it_holds_nothing() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    put(index, "k", 7, (a,))
    set_draining(index, a)
    refused = index.apply(MarkMemberDown(rid(), a, DRAINED))
    assert refused == MarkMemberDownResult(False, index.ring_version)
    assert index.lookup(["k"])[0] is not None  # nothing lost

    index.apply(ChangeReplicas(rid(), (ReplicaChange("k", 7, b, a),)))
    done = index.apply(MarkMemberDown(rid(), a, DRAINED))
    assert isinstance(done, MarkMemberDownResult)
    assert done.changed
    assert index.member(a) is None  # down and holding nothing: forgotten
    assert index.draining_members() == []
    index.check_invariants()


def test_a_member_declared_dead_while_draining_is_no_longer_draining() -> None:
    index = BlockIndex()
    a = register(index, "a")
    put(index, "k", 7, (a,))
    set_draining(index, a)
    index.apply(MarkMemberDown(rid(), a, "heartbeat_timeout"))
    rec = index.member(a)
    assert rec is not None
    assert not rec.live
    assert not rec.draining
    assert set_draining(index, a).found is False
    index.check_invariants()


def test_a_node_restarted_mid_drain_keeps_draining_under_its_new_incarnation() -> None:
    index = BlockIndex()
    first = register(index, "a", incarnation=1)
    register(index, "b")
    set_draining(index, first)
    second = register(index, "a", incarnation=2)
    rec = index.member(second)
    assert second != first
    assert rec is not None
    assert rec.draining
    assert index.draining_members() == [second]
    index.check_invariants()


def test_snapshots_carry_the_mark_and_old_snapshots_load_as_not_draining() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    put(index, "k", 7, (a, b))
    set_draining(index, a)
    blob = pickle.dumps(IndexSnapshot(index.export_state()), protocol=2)
    restored = BlockIndex.import_state(pickle.loads(blob))
    assert restored.canonical_state() == index.canonical_state()
    assert restored.draining_members() == [a]

    # A member that is not draining keeps the 8-field layout of earlier releases …
    member_b = index.member(b)
    assert member_b is not None
    assert len(member_tuple(member_b)) == 8
    # … and a snapshot written before the mark existed (8-field members) still loads.
    old = {**index.export_state(), "members": [t[:8] for t in index.export_state()["members"]]}
    loaded = BlockIndex.import_state(old)
    assert loaded.draining_members() == []
    assert [m.member_id for m in loaded.live_members()] == [a, b]
    loaded.check_invariants()


# --- the client's placement ---------------------------------------------------------------------


def test_placement_puts_nothing_on_a_draining_member_but_still_resolves_it_for_reads() -> None:
    from kvpool.client.placement import MemberInfo, Placement
    from kvpool.errors import NoNodesError
    from kvpool.proto.v1 import common_pb2

    info = MemberInfo.from_proto(
        common_pb2.Member(member_id=1, node_id="a", data_address="tcp://a:1", draining=True)
    )
    assert info.draining
    draining = MemberInfo(1, "a", "tcp://a:1", 1 << 30, draining=True)
    others = [MemberInfo(2, "b", "tcp://b:1", 1 << 30), MemberInfo(3, "c", "tcp://c:1", 1 << 30)]
    placement = Placement()
    assert placement.update([draining, *others], 5, now_s=0.0)
    placed = {m.member_id for i in range(300) for m in placement.place(f"k{i}".encode(), 2)}
    assert placed == {2, 3}
    assert placement.member(1) == draining  # a lookup's replica on it is still read
    assert len(placement.members) == 3

    # The mark cleared (a newer ring): it takes puts again.
    placement.update([MemberInfo(1, "a", "tcp://a:1", 1 << 30), *others], 6, now_s=1.0)
    placed = {m.member_id for i in range(300) for m in placement.place(f"k{i}".encode(), 1)}
    assert placed == {1, 2, 3}

    alone = Placement()
    alone.update([draining], 7, now_s=0.0)
    with pytest.raises(NoNodesError, match="1 draining"):
        alone.place(b"k", 1)


# --- the leader's replica loop reads the mark from the index --------------------------------------


def test_a_new_leaders_replica_loop_carries_a_drain_on_and_declares_the_node_left() -> None:
    import asyncio

    from kvpool.config import MasterConfig
    from kvpool.raft_master.replica_loop import ReplicaLoop

    from .test_index import FakeReplicator

    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    put(index, "k", 7, (a,))
    set_draining(index, a)  # asked of the old leader, which then died
    replicator = FakeReplicator(index)
    cfg = MasterConfig(in_memory=True, raft_secret="x")
    loop = ReplicaLoop(cfg, replicator)  # type: ignore[arg-type]  # the new leader's, fresh

    plan = loop.plan(index)
    assert [(t.block.key, t.source, t.target, t.replaces) for t in plan.copies] == [("k", a, b, a)]
    assert plan.drained == []
    asyncio.run(loop.step())  # the copy cannot run here (no admin address): nothing changes
    assert index.draining_members() == [a]

    index.apply(ChangeReplicas(rid(), (ReplicaChange("k", 7, b, a),)))  # the copy, committed
    asyncio.run(loop.step())
    assert index.member(a) is None  # empty: declared left ("drained") and forgotten
    view = index.lookup(["k"])[0]
    assert view is not None
    assert view.replicas == (b,)


def test_kvpool_status_shows_a_draining_node() -> None:
    from kvpool.cli.status import render_status, status_document
    from kvpool.launcher.probe import MasterProbe

    status = master_pb2.ClusterStatusResponse(ring_version=4)
    status.master.role = "leader"
    for member_id, node, draining in ((1, "node-1", True), (2, "node-2", False)):
        status.nodes.add(
            member=common_pb2.Member(
                member_id=member_id, node_id=node, live=True, draining=draining
            )
        )
    doc = status_document([MasterProbe("127.0.0.1:1", status)])
    assert [n["state"] for n in doc["nodes"]] == ["draining", "live"]
    rows = render_status(doc).splitlines()
    assert "STATE" in next(r for r in rows if r.startswith("NODE"))
    assert "draining" in next(r for r in rows if r.startswith("node-1"))
    assert "draining" not in next(r for r in rows if r.startswith("node-2"))
