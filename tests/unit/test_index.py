"""The block index state machine, and the pure deciders the leader runs beside it.

Focused tests per command, then a hypothesis state machine that checks after every step: the
state is consistent, versions strictly increase per key, no lookup names a replica on a down
member, a repeated request id changes nothing, and a twin index fed the encoded commands is
identical (determinism + encoding round trip + snapshot round trip).
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.raft_master.commands import (
    PUT_COMMITTED,
    PUT_NO_LIVE_REPLICA,
    Batch,
    BatchResult,
    CommitPuts,
    CommitPutsResult,
    DropReplicas,
    DropReplicasResult,
    MarkMemberDown,
    MarkMemberDownResult,
    PutItem,
    RegisterMaster,
    RegisterMember,
    RegisterMemberResult,
    RemoveKeys,
    RemoveKeysResult,
    SetDraining,
    SimpleCommand,
    encode,
)
from kvpool.raft_master.failure import FailureDetector, FailureLoop
from kvpool.raft_master.index import BlockIndex, IndexSnapshot, pack_record, unpack_record
from kvpool.raft_master.records import record_replicas, record_tier
from kvpool.raft_master.replication import StuckFollowerWatch

_ids = itertools.count(1)


def rid() -> bytes:
    return next(_ids).to_bytes(16, "big")


def register(index: BlockIndex, node: str, incarnation: int = 1) -> int:
    result = index.apply(RegisterMember(rid(), node, incarnation, f"tcp://{node}:1", "", 100, ""))
    assert isinstance(result, RegisterMemberResult)
    return result.member_id


def put(
    index: BlockIndex, key: str, write_id: int, replicas: tuple[int, ...], ring: int | None = None
) -> CommitPutsResult:
    ring_version = index.ring_version if ring is None else ring
    result = index.apply(
        CommitPuts(rid(), ring_version, (PutItem(key, write_id, 4, 77, replicas),))
    )
    assert isinstance(result, CommitPutsResult)
    return result


# --- focused tests ----------------------------------------------------------------------------


def test_record_packing_round_trips() -> None:
    record = pack_record(5, 2**64 - 1, 123, 456, (1, 2**32 - 1), pinned=True)
    assert unpack_record(record) == (5, 2**64 - 1, 123, 456, True, (1, 2**32 - 1))


@pytest.mark.parametrize("n", [0, 1, 2, 8, 9, 20])
@pytest.mark.parametrize("tier", [0, 3])
def test_records_of_any_replica_count_round_trip_with_their_tier(n: int, tier: int) -> None:
    replicas = tuple(range(7, 7 + n))
    record = pack_record(1, 2, 3, 4, replicas, tier=tier)
    assert unpack_record(record) == (1, 2, 3, 4, False, replicas)
    assert record_replicas(record) == replicas
    assert record_tier(record) == tier


def test_commit_then_lookup_returns_the_entry_with_a_version_from_the_revision() -> None:
    index = BlockIndex()
    m = register(index, "n1")
    result = put(index, "k", 9, (m,))
    assert result.outcomes[0].status == PUT_COMMITTED
    assert result.outcomes[0].version == index.revision == result.revision
    (view,) = index.lookup(["k"])
    assert view is not None
    assert (view.write_id, view.size_bytes, view.checksum, view.replicas) == (9, 4, 77, (m,))
    assert index.lookup(["absent"]) == [None]


def test_a_later_commit_of_a_key_wins_whole_with_a_higher_version() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    first = put(index, "k", 1, (a,)).outcomes[0].version
    second = put(index, "k", 2, (b,)).outcomes[0].version
    assert second > first
    (view,) = index.lookup(["k"])
    assert view is not None
    assert (view.write_id, view.replicas) == (2, (b,))
    assert index.member_keys(a, 10) == []  # the old replica no longer lists the key
    index.check_invariants()


def test_a_commit_names_the_write_it_replaced_and_where_it_was() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    fresh = put(index, "k", 1, (a, b)).outcomes[0]
    assert (fresh.superseded_write_id, fresh.superseded_replicas) == (0, ())
    over = put(index, "k", 2, (b,)).outcomes[0]
    assert (over.superseded_write_id, over.superseded_replicas) == (1, (a, b))
    again = put(index, "k", 2, (b,)).outcomes[0]  # the same write committed again
    assert (again.superseded_write_id, again.superseded_replicas) == (0, ())


def test_a_stale_ring_version_applies_nothing_and_reports_the_current_ring() -> None:
    index = BlockIndex()
    m = register(index, "n1")
    register(index, "n2")
    before = index.canonical_state()
    result = put(index, "k", 1, (m,), ring=1)
    assert result.stale_ring
    assert result.ring_version == 2
    assert result.outcomes == ()
    assert index.canonical_state() == before


def test_replicas_on_members_not_live_are_dropped_and_none_left_is_reported() -> None:
    index = BlockIndex()
    live, dead = register(index, "live"), register(index, "dead")
    index.apply(MarkMemberDown(rid(), dead, "heartbeat_timeout"))
    result = index.apply(
        CommitPuts(
            rid(),
            index.ring_version,
            (
                PutItem("mixed", 1, 1, 1, (dead, live, 999, live)),
                PutItem("none", 2, 1, 1, (dead, 999)),
            ),
        )
    )
    assert isinstance(result, CommitPutsResult)
    mixed, none = result.outcomes
    assert (mixed.status, mixed.replicas) == (PUT_COMMITTED, (live,))
    assert (none.status, none.version) == (PUT_NO_LIVE_REPLICA, 0)
    assert index.lookup(["none"]) == [None]
    index.check_invariants()


def test_present_and_prefix_match_find_what_lookup_finds_after_a_member_goes_down() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    keys = ["k0", "k1", "k2", "k3"]
    holders = [(a,), (a, b), (b,), (a,)]
    result = index.apply(
        CommitPuts(
            rid(),
            index.ring_version,
            tuple(
                PutItem(k, i + 1, 1, 1, h)
                for i, (k, h) in enumerate(zip(keys, holders, strict=True))
            ),
        )
    )
    assert isinstance(result, CommitPutsResult)
    asked = [*keys, "absent"]
    assert index.present(asked) == [True, True, True, True, False]
    index.apply(MarkMemberDown(rid(), b, "heartbeat_timeout"))
    found = [view is not None for view in index.lookup(asked)]
    assert found == [True, True, False, True, False]
    assert index.present(asked) == found
    assert index.prefix_match(asked) == 2
    (k1,) = index.lookup(["k1"])
    assert k1 is not None
    assert k1.replicas == (a,)


def test_remove_reports_what_it_removed() -> None:
    index = BlockIndex()
    m = register(index, "n1")
    put(index, "k", 5, (m,))
    revision = index.revision
    result = index.apply(RemoveKeys(rid(), ("k", "other")))
    assert isinstance(result, RemoveKeysResult)
    assert result.removed == (True, False)
    assert [(b.key, b.write_id, b.replicas) for b in result.blocks] == [("k", 5, (m,))]
    assert result.revision == revision + 1
    assert index.lookup(["k"]) == [None]
    index.check_invariants()


def test_drop_replicas_matches_the_write_id_and_deletes_an_entry_left_without_replicas() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    put(index, "k", 7, (a, b))
    wrong = index.apply(DropReplicas(rid(), a, (("k", 6),)))
    assert isinstance(wrong, DropReplicasResult)
    assert wrong.dropped == 0  # another write of the key: not this one
    index.apply(DropReplicas(rid(), a, (("k", 7),)))
    (view,) = index.lookup(["k"])
    assert view is not None
    assert view.replicas == (b,)
    any_write = index.apply(DropReplicas(rid(), b, (("k", 0),)))
    assert isinstance(any_write, DropReplicasResult)
    assert any_write.dropped == 1
    assert len(index) == 0
    index.check_invariants()


def test_a_down_member_disappears_from_lookups_at_once_and_is_forgotten_after_the_purge() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    put(index, "both", 1, (a, b))
    put(index, "only-a", 2, (a,))
    ring = index.ring_version
    down = index.apply(MarkMemberDown(rid(), a, "heartbeat_timeout"))
    assert isinstance(down, MarkMemberDownResult)
    assert down.changed
    assert down.ring_version == ring + 1
    both, only_a = index.lookup(["both", "only-a"])
    assert both is not None
    assert both.replicas == (b,)
    assert only_a is None
    assert index.prefix_match(["both", "only-a"]) == 1
    assert index.dead_members_with_keys() == [a]
    again = index.apply(MarkMemberDown(rid(), a, "heartbeat_timeout"))
    assert isinstance(again, MarkMemberDownResult)
    assert not again.changed
    keys = index.member_keys(a, 5000)
    index.apply(DropReplicas(rid(), a, tuple((k, 0) for k in keys)))
    assert index.member(a) is None  # purged, then forgotten
    assert index.dead_members_with_keys() == []
    assert len(index) == 1
    index.check_invariants()


def test_register_is_idempotent_per_incarnation_and_a_new_incarnation_replaces_the_old() -> None:
    index = BlockIndex()
    first = register(index, "n1", incarnation=10)
    ring = index.ring_version
    assert register(index, "n1", incarnation=10) == first
    assert index.ring_version == ring
    put(index, "k", 1, (first,))
    second = register(index, "n1", incarnation=11)
    assert second != first
    assert index.ring_version == ring + 1
    old = index.member(first)
    assert old is not None
    assert not old.live
    assert index.lookup(["k"]) == [None]  # blocks of the old incarnation are not served
    assert [m.member_id for m in index.live_members()] == [second]
    assert index.member_of_node("n1") == second
    index.check_invariants()


def test_a_repeated_request_id_returns_the_stored_result_and_changes_nothing() -> None:
    index = BlockIndex()
    m = register(index, "n1")
    command = CommitPuts(rid(), index.ring_version, (PutItem("k", 1, 1, 1, (m,)),))
    first = index.apply(command)
    state = index.canonical_state()
    again = index.apply(command)
    assert again == first
    assert index.canonical_state() == state


def test_the_dedupe_table_is_bounded_and_forgets_the_oldest_first() -> None:
    index = BlockIndex(dedupe_capacity=3)
    m = register(index, "n1")
    commands = [
        CommitPuts(rid(), index.ring_version, (PutItem(f"k{i}", 1, 1, 1, (m,)),)) for i in range(5)
    ]
    for c in commands:
        index.apply(c)
    assert index.status().dedupe_entries == 3
    revision = index.revision
    index.apply(commands[-1])  # remembered: no effect
    assert index.revision == revision
    index.apply(commands[0])  # forgotten: applies again (as a new write)
    assert index.revision == revision + 1


def test_the_dedupe_table_is_bounded_in_bytes_too() -> None:
    index = BlockIndex(dedupe_capacity=1000, dedupe_max_bytes=2000)
    m = register(index, "n1")
    for i in range(20):
        items = tuple(PutItem(f"k{i}/{j}", 1, 1, 1, (m,)) for j in range(10))
        index.apply(CommitPuts(rid(), index.ring_version, items))
    assert 1 <= index.status().dedupe_entries < 20


def test_batch_applies_each_sub_command_with_its_own_dedupe() -> None:
    index = BlockIndex()
    m = register(index, "n1")
    sub = CommitPuts(rid(), index.ring_version, (PutItem("k", 1, 1, 1, (m,)),))
    index.apply(sub)  # applied once on its own (a retried request)
    revision = index.revision
    result = index.apply(
        Batch(rid(), (sub, CommitPuts(rid(), index.ring_version, (PutItem("j", 2, 1, 1, (m,)),))))
    )
    assert isinstance(result, BatchResult)
    assert len(result.results) == 2
    assert index.revision == revision + 1  # only the new sub-command applied


def test_register_master_records_the_grpc_address_for_redirects() -> None:
    index = BlockIndex()
    index.apply(RegisterMaster(rid(), "10.0.0.1:7310", "10.0.0.1:7300"))
    revision = index.revision
    index.apply(RegisterMaster(rid(), "10.0.0.1:7310", "10.0.0.1:7300"))
    assert index.revision == revision  # unchanged address: no mutation
    assert index.master_grpc_address("10.0.0.1:7310") == "10.0.0.1:7300"


def test_a_snapshot_restores_an_identical_index() -> None:
    index = BlockIndex()
    a, b = register(index, "a"), register(index, "b")
    for i in range(50):
        put(index, f"k{i}", i + 1, (a, b) if i % 2 else (a,))
    index.apply(MarkMemberDown(rid(), b, "left"))
    index.apply(RegisterMaster(rid(), "r:1", "g:1"))
    blob = pickle.dumps(IndexSnapshot(index.export_state()), protocol=2)  # as PySyncObj does
    assert blob.count(b"latin1") == 1  # one payload, not a latin-1 rebuild per record
    restored = BlockIndex.import_state(pickle.loads(blob))
    assert restored.canonical_state() == index.canonical_state()
    restored.check_invariants()
    with pytest.raises(ValueError, match="format"):
        BlockIndex.import_state({**index.export_state(), "format": 99})


# --- property tests ---------------------------------------------------------------------------

KEYS = [f"k{i}" for i in range(6)]
NODES = ["n0", "n1", "n2"]


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = BlockIndex(dedupe_capacity=16)
        self.twin = BlockIndex(dedupe_capacity=16)  # fed the encoded bytes
        self.committed: dict[str, int] = {}  # key -> version of its last commit
        self.max_version = 0
        self.last: SimpleCommand | Batch | None = None
        self.incarnations = itertools.count(1)

    def run(self, command: SimpleCommand | Batch) -> object:
        result = self.index.apply(command)
        twin_result = self.twin.apply_encoded(encode(command))
        assert twin_result == result
        replay = command == self.last
        self.last = command
        subs = command.commands if isinstance(command, Batch) else (command,)
        results = result.results if isinstance(result, BatchResult) else (result,)
        for sub, r in zip(subs, results, strict=True):
            if isinstance(sub, CommitPuts) and isinstance(r, CommitPutsResult):
                self.record_commit(sub, r, replay)
        return result

    def record_commit(self, command: CommitPuts, result: CommitPutsResult, replay: bool) -> None:
        if result.stale_ring:
            return
        for item, outcome in zip(command.entries, result.outcomes, strict=True):
            if outcome.status != PUT_COMMITTED:
                continue
            if not replay:  # versions strictly increase, per key and globally
                assert outcome.version > self.committed.get(item.key, 0)
                assert outcome.version > self.max_version
            self.max_version = max(self.max_version, outcome.version)
            self.committed[item.key] = max(self.committed.get(item.key, 0), outcome.version)
        if not replay:
            assert result.revision >= self.max_version

    @rule(
        node=st.sampled_from(NODES),
        same=st.booleans(),
    )
    def register_member(self, node: str, same: bool) -> None:
        current = self.index.member_of_node(node)
        rec = self.index.member(current) if current else None
        incarnation = rec.incarnation if (same and rec) else next(self.incarnations)
        self.run(RegisterMember(rid(), node, incarnation, f"tcp://{node}", "", 10, ""))

    @rule(
        entries=st.lists(
            st.tuples(
                st.sampled_from(KEYS),
                st.integers(1, 5),
                st.lists(st.integers(1, 11), min_size=1, max_size=3),
            ),
            min_size=1,
            max_size=4,
        ),
        stale=st.booleans(),
    )
    def commit_puts(self, entries: list[tuple[str, int, list[int]]], stale: bool) -> None:
        ring = max(0, self.index.ring_version - 1) if stale else self.index.ring_version
        items = tuple(PutItem(k, w, 8, 1, tuple(r)) for k, w, r in entries)
        before = {k: v.version for k, v in zip(KEYS, self.index.lookup(KEYS), strict=True) if v}
        draining = set(self.index.draining_members())
        result = self.run(CommitPuts(rid(), ring, items))
        assert isinstance(result, CommitPutsResult)
        if not result.stale_ring:
            for item, outcome in zip(items, result.outcomes, strict=True):
                if outcome.status == PUT_COMMITTED:
                    assert outcome.version > before.get(item.key, 0)
                    assert not draining & set(outcome.replicas)  # never a new one there

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def remove_keys(self, keys: list[str]) -> None:
        self.run(RemoveKeys(rid(), tuple(keys)))

    @rule(
        member=st.integers(1, 11),
        blocks=st.lists(
            st.tuples(st.sampled_from(KEYS), st.sampled_from(["exact", "any", "other"])),
            max_size=3,
        ),
    )
    def drop_replicas(self, member: int, blocks: list[tuple[str, str]]) -> None:
        views = dict(zip(KEYS, self.index.lookup(KEYS), strict=True))
        named: list[tuple[str, int]] = []
        for key, which in blocks:
            view = views[key]
            write_id = view.write_id if view is not None else 1
            named.append((key, {"exact": write_id, "any": 0, "other": write_id + 100}[which]))
        self.run(DropReplicas(rid(), member, tuple(named)))

    @rule(member=st.integers(1, 11))
    def mark_member_down(self, member: int) -> None:
        self.run(MarkMemberDown(rid(), member, "heartbeat_timeout"))

    @rule(member=st.integers(1, 11), draining=st.booleans())
    def set_draining(self, member: int, draining: bool) -> None:
        self.run(SetDraining(rid(), member, draining))

    @rule()
    def purge_one_dead_member(self) -> None:
        dead = self.index.dead_members_with_keys()
        if dead:
            keys = self.index.member_keys(dead[0], 2)
            self.run(DropReplicas(rid(), dead[0], tuple((k, 0) for k in keys)))

    @rule(n=st.integers(2, 3))
    def batch(self, n: int) -> None:
        ring = self.index.ring_version
        subs: tuple[SimpleCommand, ...] = tuple(
            CommitPuts(rid(), ring, (PutItem(KEYS[i], i + 1, 1, 1, (1, 2, 3)),)) for i in range(n)
        )
        self.run(Batch(rid(), subs))

    @precondition(lambda self: self.last is not None)
    @rule()
    def replay_last(self) -> None:
        """A retried (or late-applied) command: no second effect."""
        assert self.last is not None
        state = self.index.canonical_state()
        self.run(self.last)
        assert self.index.canonical_state() == state

    @rule()
    def snapshot_round_trip(self) -> None:
        blob = pickle.dumps(IndexSnapshot(self.index.export_state()), protocol=2)
        restored = BlockIndex.import_state(pickle.loads(blob), dedupe_capacity=16)
        assert restored.canonical_state() == self.index.canonical_state()

    @invariant()
    def consistent(self) -> None:
        self.index.check_invariants()

    @invariant()
    def deterministic(self) -> None:
        assert self.twin.canonical_state() == self.index.canonical_state()

    @invariant()
    def no_lookup_names_a_down_member(self) -> None:
        live = {m.member_id for m in self.index.live_members()}
        for view in self.index.lookup(KEYS):
            if view is not None:
                assert view.replicas
                assert set(view.replicas) <= live
        matched = self.index.prefix_match(KEYS)
        assert all(v is not None for v in self.index.lookup(KEYS[:matched]))

    @invariant()
    def present_and_prefix_match_agree_with_lookup(self) -> None:
        # present() answers from the keys alone while no member is down: it must find exactly
        # what lookup finds, whatever the members did.
        found = [view is not None for view in self.index.lookup(KEYS)]
        assert self.index.present(KEYS) == found
        leading = next((i for i, hit in enumerate(found) if not hit), len(found))
        assert self.index.prefix_match(KEYS) == leading

    @invariant()
    def a_visible_entry_is_its_last_commit(self) -> None:
        for key, view in zip(KEYS, self.index.lookup(KEYS), strict=True):
            if view is not None:
                assert view.version == self.committed[key]
                assert view.version <= self.index.revision


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestIndexMachine = IndexMachine.TestCase


# --- leader-side pure deciders ----------------------------------------------------------------


def test_failure_detector_measures_silence_from_the_later_of_heartbeat_and_leadership() -> None:
    fd = FailureDetector(node_timeout_s=5.0)
    assert fd.expired(100.0) == []  # not leading: never decides
    fd.became_leader(10.0)
    fd.members([1, 2])
    fd.heartbeat(1, 12.0)
    assert fd.expired(14.9) == []
    assert fd.expired(15.0) == [2]  # never heard from: counted from the leadership start
    assert fd.expired(17.0) == [1, 2]
    fd.heartbeat(1, 16.5)
    assert fd.expired(17.0) == [2]


def test_a_new_leader_gives_every_node_a_full_timeout() -> None:
    fd = FailureDetector(node_timeout_s=5.0)
    fd.became_leader(0.0)
    fd.members([1])
    fd.heartbeat(1, 1.0)
    fd.lost_leadership()
    assert fd.expired(50.0) == []
    fd.became_leader(50.0)
    fd.members([1])
    assert fd.expired(54.0) == []
    assert fd.expired(55.0) == [1]


def test_members_first_seen_count_from_then_and_departed_members_are_forgotten() -> None:
    fd = FailureDetector(node_timeout_s=2.0)
    fd.became_leader(0.0)
    fd.members([1], now=0.0)
    fd.members([1, 2], now=10.0)  # member 2 registered through another path at t=10
    assert fd.expired(11.0) == [1]
    fd.members([2], now=11.0)  # member 1 left the live set
    assert fd.expired(11.5) == []
    assert fd.expired(12.0) == [2]
    fd.forget(2)
    assert fd.expired(100.0) == []
    assert fd.last_seen_age(2, 100.0) is None


def test_stuck_follower_is_reported_once_per_period_while_it_does_not_advance() -> None:
    watch = StuckFollowerWatch(stuck_after_s=5.0)
    assert watch.observe(0.0, 100, {"a": 100, "b": 40}) == []
    assert watch.observe(4.0, 120, {"a": 120, "b": 40}) == []
    assert watch.observe(5.0, 130, {"a": 125, "b": 40}) == ["b"]
    assert watch.observe(6.0, 130, {"a": 130, "b": 40}) == []  # re-armed
    assert watch.observe(10.0, 130, {"a": 130, "b": 40}) == ["b"]
    assert watch.observe(11.0, 130, {"a": 130, "b": 41}) == []  # it moved: not stuck
    assert watch.observe(15.9, 130, {"a": 130, "b": 41}) == []
    assert watch.observe(16.0, 130, {"a": 130, "b": 41}) == ["b"]


def test_a_follower_at_the_commit_index_is_never_stuck() -> None:
    watch = StuckFollowerWatch(stuck_after_s=1.0)
    for t in range(10):
        assert watch.observe(float(t), 50, {"a": 50}) == []


def test_last_seen_age_reports_real_heartbeats_only() -> None:
    fd = FailureDetector(node_timeout_s=5.0)
    fd.became_leader(0.0)
    fd.members([1], now=0.0)
    assert fd.last_seen_age(1, 3.0) is None  # counted from first sight, never heard
    fd.heartbeat(1, 2.0)
    assert fd.last_seen_age(1, 3.0) == 1.0


class FakeReplicator:
    """The slice of Replicator the failure loop uses, over a real index."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self.leader = True
        self.current_term = 1
        self.proposed: list[object] = []

    def is_leader(self) -> bool:
        return self.leader

    def leads(self) -> bool:
        return self.leader

    def is_ready(self) -> bool:
        return True

    def term(self) -> int:
        return self.current_term

    def read(self, fn: Any) -> Any:
        return fn(self.index)

    async def propose(self, command: Any, timeout_s: float) -> Any:
        self.proposed.append(command)
        return self.index.apply(command)


def test_failure_loop_declares_silent_members_down_then_purges_them_in_chunks() -> None:
    index = BlockIndex()
    quiet, chatty = register(index, "quiet"), register(index, "chatty")
    for i in range(7):
        put(index, f"k{i}", 1, (quiet,))
    put(index, "shared", 1, (quiet, chatty))
    replicator = FakeReplicator(index)
    now = [0.0]
    detector = FailureDetector(node_timeout_s=5.0)
    loop = FailureLoop(replicator, detector, commit_timeout_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]

    async def run() -> None:
        await loop.step()
        for t in (2.0, 4.0, 6.0):
            now[0] = t
            detector.heartbeat(chatty, t)
            await loop.step()
        assert loop.declared_down == [quiet]
        assert index.member(quiet) is None  # purged in the same step, then forgotten
        (shared,) = index.lookup(["shared"])
        assert shared is not None
        assert shared.replicas == (chatty,)
        assert len(index) == 1

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kvpool.raft_master.failure.PURGE_CHUNK_KEYS", 3)
        asyncio.run(run())
    drops = [c for c in replicator.proposed if isinstance(c, DropReplicas)]
    assert [len(c.blocks) for c in drops] == [3, 3, 2]
    index.check_invariants()


def test_failure_loop_restarts_the_clock_when_leadership_changes_between_steps() -> None:
    index = BlockIndex()
    member = register(index, "n")
    replicator = FakeReplicator(index)
    now = [0.0]
    loop = FailureLoop(replicator, FailureDetector(5.0), commit_timeout_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]

    async def run() -> None:
        await loop.step()  # leader in term 1 at t=0; the node heartbeats another leader later
        replicator.current_term = 3  # lost and regained between two steps
        now[0] = 4.9
        await loop.step()
        now[0] = 9.0
        await loop.step()
        assert loop.declared_down == []  # 4.1 s into this leadership: not yet
        now[0] = 9.9
        await loop.step()
        assert loop.declared_down == [member]

    asyncio.run(run())
