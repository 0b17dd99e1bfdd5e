"""Hot-prefix replicas, pins and repair: the index commands (ChangeReplicas, SetPins), the hot
detector and the replica planner, all pure."""

from __future__ import annotations

import itertools
import pickle

import pytest

from kvpool.proto.ring import HashRing, RingMember
from kvpool.raft_master.commands import (
    PIN_ABSENT,
    PIN_OK,
    PIN_QUOTA_EXCEEDED,
    ChangeReplicas,
    ChangeReplicasResult,
    CommitPuts,
    CommitPutsResult,
    MarkMemberDown,
    PutItem,
    RegisterMember,
    RegisterMemberResult,
    RemoveKeys,
    ReplicaChange,
    SetDraining,
    SetPins,
    SetPinsResult,
    decode,
    decode_result,
    encode,
    encode_result,
)
from kvpool.raft_master.hot import HotDetector
from kvpool.raft_master.index import BlockIndex
from kvpool.raft_master.replica_plan import (
    BlockReplicas,
    TokenBucket,
    choose_targets,
    plan_block,
    plan_cooling,
)

_ids = itertools.count(1)


def rid() -> bytes:
    return next(_ids).to_bytes(16, "big")


def register(index: BlockIndex, node: str, zone: str = "") -> int:
    result = index.apply(RegisterMember(rid(), node, 1, f"tcp://{node}:1", "", 100, zone))
    assert isinstance(result, RegisterMemberResult)
    return result.member_id


def put(
    index: BlockIndex, key: str, write_id: int, replicas: tuple[int, ...], size: int = 4
) -> None:
    result = index.apply(
        CommitPuts(rid(), index.ring_version, (PutItem(key, write_id, size, 77, replicas),))
    )
    assert isinstance(result, CommitPutsResult)


def change(index: BlockIndex, *changes: ReplicaChange) -> tuple[bool, ...]:
    result = index.apply(ChangeReplicas(rid(), changes))
    assert isinstance(result, ChangeReplicasResult)
    index.check_invariants()
    return result.applied


def live_replicas(index: BlockIndex, key: str) -> tuple[int, ...]:
    view = index.lookup([key])[0]
    return () if view is None else view.replicas


# --- ChangeReplicas --------------------------------------------------------------------------


def test_a_copy_is_added_only_for_the_exact_write() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    put(index, "k", 11, (a,))
    assert change(index, ReplicaChange("k", 99, add_member=b)) == (False,)
    assert live_replicas(index, "k") == (a,)
    assert change(index, ReplicaChange("k", 11, add_member=b)) == (True,)
    assert live_replicas(index, "k") == (a, b)
    assert change(index, ReplicaChange("k", 11, add_member=b)) == (False,)  # already there


def test_a_replica_on_a_dead_member_is_replaced_and_the_last_live_one_never_removed() -> None:
    index = BlockIndex()
    a, b, c = register(index, "a"), register(index, "b"), register(index, "c")
    put(index, "k", 11, (a, b))
    index.apply(MarkMemberDown(rid(), b, "test"))
    assert change(index, ReplicaChange("k", 11, add_member=c, remove_member=b)) == (True,)
    assert live_replicas(index, "k") == (a, c)
    assert change(index, ReplicaChange("k", 11, remove_member=c)) == (True,)
    assert change(index, ReplicaChange("k", 11, remove_member=a)) == (False,)
    assert live_replicas(index, "k") == (a,)
    # a dead member is never added
    assert change(index, ReplicaChange("k", 11, add_member=b)) == (False,)


def test_change_replicas_round_trips_and_dedupes() -> None:
    cmd = ChangeReplicas(rid(), (ReplicaChange("k", 5, 2, 3), ReplicaChange("j", 6, 4, 0)))
    assert decode(encode(cmd)) == cmd
    res = ChangeReplicasResult((True, False, True), 9)
    assert decode_result(encode_result(res)) == res
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    put(index, "k", 5, (a,))
    again = ChangeReplicas(rid(), (ReplicaChange("k", 5, add_member=b),))
    first = index.apply(again)
    index.apply(ChangeReplicas(rid(), (ReplicaChange("k", 5, remove_member=b),)))
    assert index.apply(again) == first  # a retried request id applies once
    assert live_replicas(index, "k") == (a,)


# --- SetPins ----------------------------------------------------------------------------------


def test_pins_have_a_quota_and_survive_overwrite_and_snapshot() -> None:
    index = BlockIndex()
    a = register(index, "a")
    put(index, "p", 1, (a,), size=100)
    put(index, "q", 2, (a,), size=100)
    res = index.apply(SetPins(rid(), ("p", "q", "nope"), 2, 300))
    assert isinstance(res, SetPinsResult)
    assert res.statuses == (PIN_OK, PIN_QUOTA_EXCEEDED, PIN_ABSENT)
    assert res.pinned_bytes == 200
    assert index.pins() == {"p": 2}
    view = index.lookup(["p"])[0]
    assert view is not None
    assert view.pinned
    put(index, "p", 3, (a,), size=100)  # overwrite keeps the pin
    view = index.lookup(["p"])[0]
    assert view is not None
    assert view.pinned
    assert view.write_id == 3
    twin = BlockIndex.import_state(pickle.loads(pickle.dumps(index.export_state())))
    assert twin.canonical_state() == index.canonical_state()
    assert twin.pins() == {"p": 2}
    res = index.apply(SetPins(rid(), ("p",), 0, 300))  # unpin
    assert isinstance(res, SetPinsResult)
    assert res.pinned_bytes == 0
    view = index.lookup(["p"])[0]
    assert view is not None
    assert not view.pinned
    index.apply(SetPins(rid(), ("q",), 1, 0))
    index.apply(RemoveKeys(rid(), ("q",)))
    assert index.pins() == {}
    index.check_invariants()
    cmd = SetPins(rid(), ("x", "y"), 3, 1 << 30)
    assert decode(encode(cmd)) == cmd
    stored = SetPinsResult((PIN_OK, PIN_ABSENT), 5, 6)
    assert decode_result(encode_result(stored)) == stored


# --- the hot detector -------------------------------------------------------------------------


def test_a_key_read_fast_becomes_hot_with_its_ancestors_and_cools_down() -> None:
    det = HotDetector(hot_reads_per_s=50, half_life_s=1.0)
    t = 0.0
    for _ in range(200):  # 100 reads/s of the chain p0 → p1 → p2, p2 alone 100/s more
        t += 0.01
        det.record(["p0", "p1", "p2"], t)
        det.record(["p2"], t)
        if int(t * 100) % 50 == 0:
            det.record(["cold"], t)
    hot, cooled = det.update(t)
    assert hot[:3] == ["p0", "p1", "p2"]
    assert "cold" not in hot
    assert cooled == []
    assert det.rate("p2", t) > det.rate("p0", t) > 50
    # silence: rates halve every second; after 3 s everything is below 50 * 0.5
    hot, cooled = det.update(t + 3.0)
    assert hot == []
    assert set(cooled) == {"p0", "p1", "p2"}


def test_hysteresis_keeps_a_key_hot_just_below_the_threshold() -> None:
    det = HotDetector(hot_reads_per_s=10, half_life_s=1.0, cool_ratio=0.5)
    t = 0.0
    for _ in range(300):
        t += 0.05  # 20 reads/s
        det.record(["k"], t)
    assert det.update(t)[0] == ["k"]
    for _ in range(300):
        t += 1 / 7  # 7 reads/s: below 10, above 5
        det.record(["k"], t)
    assert det.update(t)[0] == ["k"]
    fresh = HotDetector(hot_reads_per_s=10, half_life_s=1.0)
    for i in range(300):
        fresh.record(["k"], i / 7)
    assert fresh.update(300 / 7)[0] == []


def test_tracked_keys_are_bounded() -> None:
    det = HotDetector(hot_reads_per_s=1, max_keys=100)
    for i in range(1000):
        det.record([f"k{i}"], i * 0.001)
    assert len(det) == 100
    assert det.prune(1e6) == 100


# --- the planner ------------------------------------------------------------------------------


def ring(*members: tuple[int, str]) -> HashRing:
    return HashRing([RingMember(m, f"node-{m}", 1 << 30, zone) for m, zone in members])


def test_targets_are_distinct_nodes_in_distinct_zones_first() -> None:
    r = ring((1, "z1"), (2, "z1"), (3, "z2"), (4, "z2"), (5, "z3"))
    for i in range(200):
        key = f"key-{i}"
        picked = choose_targets(r, key, holders=[1], count=2)
        assert len(picked) == 2
        assert 1 not in picked
        assert len(set(picked)) == 2
        zones = {r.members[m].zone for m in [1, *picked]}
        assert zones == {"z1", "z2", "z3"}, (key, picked)
    # more replicas than zones: fill up with same-zone members
    assert sorted(choose_targets(r, "k", holders=[], count=5)) == [1, 2, 3, 4, 5]


def test_a_join_moves_few_targets() -> None:
    before = ring(*[(m, "") for m in range(1, 9)])
    after = ring(*[(m, "") for m in range(1, 10)])
    moved = 0
    total = 2000
    for i in range(total):
        key = f"key-{i}"
        if choose_targets(before, key, [], 1) != choose_targets(after, key, [], 1):
            moved += 1
    assert moved < total * 0.25  # ideal 1/9 ≈ 11 %; a full reshuffle would be ~89 %


def block(key: str, *listed: int) -> BlockReplicas:
    return BlockReplicas(key, 7, 3, 100, 55, listed)


def test_repair_replaces_the_dead_replica_from_a_survivor() -> None:
    r = ring((1, ""), (2, ""), (4, ""))  # member 3 is dead: not on the ring
    copies, releases = plan_block(block("k", 1, 3), r, target=2)
    assert releases == []
    assert len(copies) == 1
    (c,) = copies
    assert (c.source, c.replaces, c.reason) == (1, 3, "repair")
    assert c.target in (2, 4)
    # no survivor: nothing to copy from
    assert plan_block(block("k", 3), r, target=2) == ([], [])
    # enough live holders: nothing to do
    assert plan_block(block("k", 1, 2), r, target=2) == ([], [])


def test_drain_copies_off_the_draining_member_or_releases_it() -> None:
    r = ring((1, ""), (2, ""), (3, ""))
    copies, releases = plan_block(block("k", 1), r, target=1, draining={1})
    assert releases == []
    assert len(copies) == 1
    assert (copies[0].source, copies[0].replaces, copies[0].reason) == (1, 1, "drain")
    assert copies[0].target in (2, 3)
    copies, releases = plan_block(block("k", 1, 2), r, target=2, draining={1})
    assert [(c.source, c.replaces) for c in copies] == [(2, 1)]
    copies, releases = plan_block(block("k", 1, 2, 3), r, target=2, draining={1})
    assert copies == []
    assert [x.member for x in releases] == [1]


def test_hot_target_is_capped_by_live_members_and_cooling_releases_added_ones() -> None:
    r = ring((1, ""), (2, ""), (3, ""))
    copies, _ = plan_block(block("k", 1), r, target=8, reason="hot")
    assert sorted(c.target for c in copies) == [2, 3]
    assert all(c.replaces == 0 and c.reason == "hot" for c in copies)
    rel = plan_cooling(block("k", 1, 2, 3), live={1, 2, 3}, added=[2, 3], keep=1)
    assert [x.member for x in rel] == [3, 2]
    rel = plan_cooling(block("k", 1, 2, 3), live={1, 2, 3}, added=[2, 3], keep=2)
    assert [x.member for x in rel] == [3]


def test_token_bucket_limits_the_rate() -> None:
    bucket = TokenBucket(rate_per_s=10, burst=5, now=0.0)
    assert sum(bucket.take(1, 0.0) for _ in range(20)) == 5
    assert sum(bucket.take(1, 1.0) for _ in range(20)) == 5  # refilled to the burst only
    assert sum(bucket.take(1, 1.25) for _ in range(20)) == 2
    assert TokenBucket(0, 0).take(1e9, 0.0)  # 0 = unlimited
    big = TokenBucket(rate_per_s=10, burst=5, now=0.0)
    assert big.take(50, 0.0)
    assert not big.take(1, 1.0)


@pytest.mark.parametrize("bad", [0, -1])
def test_detector_refuses_nonsense(bad: float) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        HotDetector(hot_reads_per_s=bad)


# --- the chaos checker of replica counts ------------------------------------------------------


def test_the_replicas_checker_flags_keys_under_target() -> None:
    from kvpool.chaos.check_replicas import check
    from kvpool.chaos.final_state import FinalState, IndexEntry, NodeState
    from kvpool.chaos.history import CheckContext, History

    nodes = [NodeState(member_id=m, node_id=f"n{m}", incarnation=1) for m in (1, 2, 3)]
    final = FinalState(
        t=1.0,
        nodes=nodes,
        nodes_known=True,
        entries={
            "a": IndexEntry(1, 11, (1, 2)),
            "b": IndexEntry(2, 12, (3,)),
            "c": None,  # lost: check_lost's business
        },
    )
    history = History([])
    bad = check(history, CheckContext(final_state=final, replica_target=2))
    assert not bad.ok
    assert bad.counters["under_target"] == 1
    assert "'b'" in bad.details[0]
    good = check(history, CheckContext(final_state=final, replica_target=1))
    assert good.ok
    assert not good.skipped
    assert check(history, CheckContext(final_state=final)).skipped


# --- reads spread, same host first ------------------------------------------------------------


def test_reads_prefer_a_replica_on_this_host_and_otherwise_spread() -> None:
    from kvpool.client.placement import MemberInfo, Placement

    placement = Placement(is_local=lambda address: address == "tcp://here:1")
    members = [
        MemberInfo(1, "a", "tcp://far:1", 1 << 30),
        MemberInfo(2, "b", "tcp://here:1", 1 << 30),
        MemberInfo(3, "c", "tcp://far:3", 1 << 30),
    ]
    placement.update(members, 1, now_s=0.0)
    firsts = {placement.read_order([1, 2, 3], 0.0, start)[0] for start in range(3)}
    assert firsts == {2}
    # the local replica failed recently: it goes last; the others are spread by `start`
    placement.node_failed(2, now_s=0.0)
    orders = [placement.read_order([1, 2, 3], 0.5, start) for start in range(3)]
    assert all(order[-1] == 2 for order in orders)
    assert {order[0] for order in orders} == {1, 3}


# --- the replica loop's planning over a real index, and the purge hold ----------------------


def test_the_loop_plans_repair_pins_and_drain_and_holds_the_purge() -> None:
    import asyncio

    from kvpool.config import MasterConfig
    from kvpool.raft_master.failure import FailureDetector, FailureLoop
    from kvpool.raft_master.replica_loop import ReplicaLoop

    from .test_index import FakeReplicator

    index = BlockIndex()
    a, b, c, d = (register(index, n) for n in "abcd")
    put(index, "two", 1, (a, b))  # loses b: repair from a
    put(index, "one", 2, (b,))  # loses its only replica: nothing to copy from
    put(index, "pinned", 3, (c,))
    put(index, "drained", 4, (d,))
    index.apply(SetPins(rid(), ("pinned",), 2, 0))
    index.apply(MarkMemberDown(rid(), b, "test"))
    replicator = FakeReplicator(index)
    cfg = MasterConfig(in_memory=True, raft_secret="x")
    loop = ReplicaLoop(cfg, replicator)  # type: ignore[arg-type]
    index.apply(SetDraining(rid(), d, True))  # the replicated mark: no soft state
    plan = loop.plan(index)
    by_key = {t.block.key: t for t in plan.copies}
    assert set(by_key) == {"two", "pinned", "drained"}
    assert (by_key["two"].source, by_key["two"].replaces, by_key["two"].reason) == (a, b, "repair")
    assert by_key["two"].target == c  # a holds it, b is dead, d drains: takes no new copy
    assert (by_key["pinned"].source, by_key["pinned"].replaces) == (c, 0)
    assert (by_key["drained"].source, by_key["drained"].replaces) == (d, d)
    assert plan.repairing == {b}
    assert plan.pin == [(c, plan.pin[0][1])]
    assert plan.pin[0][1].key == "pinned"
    # While b's blocks await repair, the failure loop keeps b's entries (no purge).
    loop.repairing = plan.repairing
    now = [100.0]
    failure = FailureLoop(
        replicator,  # type: ignore[arg-type]
        FailureDetector(5.0),
        commit_timeout_s=1.0,
        clock=lambda: now[0],
        hold_purge=loop.hold_purge,
    )
    asyncio.run(failure.step())
    assert b in index.dead_members_with_keys()
    loop.repairing = set()
    asyncio.run(failure.step())
    assert b not in index.dead_members_with_keys()
