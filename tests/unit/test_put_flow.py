"""The put flow (:func:`kvpool.client.ops.put_flow`) driven step by step: no socket, no
thread, no event loop. The test is the driver: it stages on the members it is told stage
(every target, or those ``acks`` names for a key), answers each commit as told (ok, stale
ring, or an error per chunk) and records every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvpool.client.commits import (
    AfterCommit,
    CommitAnswer,
    CommitBatcher,
    CommitJob,
    PutReceipt,
    judge_commit,
    superseded,
)
from kvpool.client.ops import (
    DELETE_WAIT_S,
    MAX_PUT_ATTEMPTS,
    Ask,
    Delete,
    EnsureMembers,
    Publish,
    PutStep,
    Stage,
    drive,
    put_flow,
)
from kvpool.client.placement import MemberInfo, Placement
from kvpool.client.plans import PutItem
from kvpool.errors import (
    InternalError,
    KVPoolError,
    NotLeaderError,
    StaleRingError,
    UnavailableError,
)
from kvpool.proto.v1 import master_pb2

DEADLINE = 10.0
TIMEOUT_S = 4.0
MEMBERS = [MemberInfo(i, f"node-{i}", f"tcp://127.0.0.1:{7000 + i}", 1 << 30) for i in (1, 2)]
OLD_WRITE = 1
"""The write id a "replaced" answer says the commit replaced (on every target)."""

Answer = str | KVPoolError
"""How the test answers one chunk's commit: "ok", "stale", "replaced" (ok, and the put
replaced an older write that is to be deleted), or the error the commit failed with."""


@dataclass
class World:
    placement: Placement = field(default_factory=Placement)
    acks: dict[str, list[int]] = field(default_factory=dict)  # key -> the members that stage it
    commits: list[list[Answer]] = field(default_factory=list)  # per Stage step, per chunk
    now: float = 0.0
    steps: list[object] = field(default_factory=list)
    receipts: dict[PutItem, PutReceipt] = field(default_factory=dict)
    write_ids: list[list[int]] = field(default_factory=list)  # per Stage step
    sent_nothing: bool = False  # the driver could send no frame: nothing committed
    drop_fails: bool = False  # every ReportEvictions fails

    def __post_init__(self) -> None:
        self.placement.update(MEMBERS, ring_version=1, now_s=0.0)

    def answered(
        self, chunk: list[PutItem], answer: CommitAnswer, receipts: dict[PutItem, PutReceipt]
    ) -> AfterCommit | None:
        """ClientCore.commit_answered in miniature: a stale ring fails every item of the
        chunk; otherwise the results are judged, and the blocks to publish (and the replaced
        writes to delete) are returned."""
        if answer.stale_ring:
            for it in chunk:
                it.error = StaleRingError("stale", ring_version=answer.ring_version)
            return None
        refs = judge_commit(chunk, answer, receipts)
        deletes, wait = superseded(chunk, answer.results, self.placement.member)
        return AfterCommit(refs, deletes, wait)

    def run(self, keys: list[str], *, max_commit_entries: int = 8192) -> list[PutItem]:
        items = [PutItem(k, k.encode(), memoryview(b"v")) for k in keys]
        flow = put_flow(
            self.placement,
            items,
            self.receipts,
            self.answered,
            replicas=2,
            timeout_s=TIMEOUT_S,
            deadline=DEADLINE,
            max_commit_entries=max_commit_entries,
            clock=lambda: self.now,
        )
        drive(flow, self.perform)
        return items

    def perform(self, step: PutStep) -> object:
        self.steps.append(step)
        if isinstance(step, Stage):
            self.write_ids.append([it.write_id for it in step.items])
            if self.sent_nothing:
                for it in step.items:
                    it.error = UnavailableError("unreachable")
                return None
            answers = self.commit(step)
            for it in step.items:  # the stage's answers come after the commit's
                if it.key in self.acks:
                    it.acked = list(self.acks[it.key])
                    if not it.acked:
                        it.error = UnavailableError(f"{it.key}: node full")
                else:
                    it.acked = [m.member_id for m in it.targets]
            return answers
        if isinstance(step, Ask) and self.drop_fails:
            raise NotLeaderError("no leader")
        return None

    def commit(self, step: Stage) -> list[CommitAnswer | KVPoolError]:
        told = self.commits.pop(0)
        chunks = step.commit.chunks
        assert len(told) == len(chunks)
        out: list[CommitAnswer | KVPoolError] = []
        for chunk, answer in zip(chunks, told, strict=True):
            if isinstance(answer, KVPoolError):
                out.append(answer)
                continue
            results = []
            for it in chunk:  # the commit names every target: it goes before the stage's acks
                named = [m.member_id for m in it.targets]
                result = master_pb2.PutResult(
                    status=master_pb2.PUT_STATUS_COMMITTED, version=1, replicas=named
                )
                if answer == "replaced":
                    result.superseded_write_id = OLD_WRITE
                    result.superseded_replicas.extend(named)
                results.append(result)
            stale = answer == "stale"
            out.append(CommitAnswer([] if stale else results, 7, stale, ring_version=2))
        return out

    def kinds(self) -> list[str]:
        return [type(s).__name__ for s in self.steps]

    def drops(self) -> list[tuple[int, list[str]]]:
        """(member id, keys) of each ReportEvictions asked."""
        out = []
        for s in self.steps:
            if isinstance(s, Ask):
                assert s.method == "ReportEvictions"
                assert s.leader_only
                out.append((s.request.member_id, [b.key for b in s.request.blocks]))
        return out


def test_one_attempt_stages_and_commits_at_once_then_publishes() -> None:
    w = World(commits=[["ok"]])
    items = w.run(["a", "b"])
    assert w.kinds() == ["EnsureMembers", "Stage", "Publish"]
    stage = w.steps[1]
    assert isinstance(stage, Stage)
    assert stage.deadline == DEADLINE - 0.25 * TIMEOUT_S  # time left for commit and publish
    assert stage.commit.ring_version == 1
    assert [[it.key for it in c] for c in stage.commit.chunks] == [["a", "b"]]
    publish = w.steps[2]
    assert isinstance(publish, Publish)
    assert not publish.wait  # nothing replaced: not waited for
    assert len(publish.refs) == 4  # two replicas each
    assert all(it.committed and it.write_id for it in items)
    assert {len(it.targets) for it in items} == {2}
    assert len(w.receipts) == 2
    assert w.drops() == []


def test_nothing_sent_commits_nothing_and_drops_nothing() -> None:
    w = World(sent_nothing=True)
    items = w.run(["a", "b"])
    assert w.kinds() == ["EnsureMembers", "Stage"]
    assert not any(it.committed for it in items)
    assert all(isinstance(it.error, UnavailableError) for it in items)


def test_a_block_no_replica_staged_fails_and_leaves_the_index_again() -> None:
    w = World(acks={"a": [], "b": []}, commits=[["ok"]])
    items = w.run(["a", "b"])
    assert w.kinds() == ["EnsureMembers", "Stage", "Ask", "Ask"]  # one per member, no Publish
    assert sorted(w.drops()) == [(1, ["a", "b"]), (2, ["a", "b"])]
    for it, step in ((it, s) for it in items for s in w.steps if isinstance(s, Ask)):
        assert it.write_id in [b.write_id for b in step.request.blocks]  # conditional drop
    assert not any(it.committed for it in items)
    assert all(isinstance(it.error, UnavailableError) for it in items)
    assert w.receipts == {}


def test_a_replica_that_did_not_stage_is_dropped_and_the_block_kept_on_the_other() -> None:
    w = World(acks={"a": [1]}, commits=[["ok"]])
    a, b = w.run(["a", "b"])
    assert w.drops() == [(2, ["a"])]
    assert a.committed
    assert a.error is None
    assert w.receipts[a].member_ids == (1,)  # the receipt names only the replica that holds it
    assert len(w.receipts[b].member_ids) == 2
    publish = w.steps[-1]
    assert isinstance(publish, Publish)
    assert sorted((r.key_bytes, r.member.member_id) for r in publish.refs) == [
        (b"a", 1),
        (b"b", 1),
        (b"b", 2),
    ]


def test_items_are_committed_in_chunks_and_only_the_unstaged_one_fails() -> None:
    w = World(acks={"k2": []}, commits=[["ok", "ok", "ok"]])
    items = w.run([f"k{i}" for i in range(6)], max_commit_entries=2)
    stage = w.steps[1]
    assert isinstance(stage, Stage)
    chunks = [[it.key for it in c] for c in stage.commit.chunks]
    assert chunks == [["k0", "k1"], ["k2", "k3"], ["k4", "k5"]]
    assert [it.key for it in items if not it.committed] == ["k2"]
    assert sorted(w.drops()) == [(1, ["k2"]), (2, ["k2"])]


def test_a_drop_that_fails_leaves_the_put_as_judged() -> None:
    w = World(acks={"a": []}, commits=[["ok"]], drop_fails=True)
    a, b = w.run(["a", "b"])
    assert w.kinds() == ["EnsureMembers", "Stage", "Ask", "Ask", "Publish"]
    assert not a.committed
    assert isinstance(a.error, UnavailableError)
    assert b.committed


def test_the_write_replaced_by_a_block_no_replica_staged_is_deleted() -> None:
    w = World(acks={"a": []}, commits=[["replaced"]], now=1.0)
    (a,) = w.run(["a"])
    assert not a.committed
    assert w.kinds() == ["EnsureMembers", "Stage", "Ask", "Ask", "Delete"]
    delete = w.steps[-1]
    assert isinstance(delete, Delete)
    assert sorted((r.write_id, r.member.member_id) for r in delete.refs) == [
        (OLD_WRITE, 1),
        (OLD_WRITE, 2),
    ]


def test_a_stale_ring_places_the_rest_again_with_new_write_ids() -> None:
    w = World(commits=[["ok", "stale"], ["ok"]])
    items = w.run(["a", "b", "c"], max_commit_entries=2)
    assert w.kinds() == [
        "EnsureMembers",
        "Stage",
        "Publish",  # the chunk that committed is published at once
        "EnsureMembers",
        "Stage",
        "Publish",
    ]
    second = w.steps[4]
    assert isinstance(second, Stage)
    assert [it.key for it in second.items] == ["c"]  # only what the stale ring refused
    assert w.write_ids[1][0] != w.write_ids[0][2]  # a write id is never reused
    assert all(it.committed for it in items)
    assert all(it.error is None for it in items)


def test_a_ring_stale_every_time_gives_up_after_max_attempts() -> None:
    w = World(commits=[["stale"]] * MAX_PUT_ATTEMPTS)
    items = w.run(["a"])
    assert w.kinds().count("Stage") == MAX_PUT_ATTEMPTS
    assert "Publish" not in w.kinds()
    assert isinstance(items[0].error, StaleRingError)
    assert not items[0].committed


def test_every_chunk_failing_fails_the_put_with_the_first_error() -> None:
    first, second = NotLeaderError("no leader"), NotLeaderError("still none")
    w = World(commits=[[first, second]])
    with pytest.raises(NotLeaderError) as raised:
        w.run(["a", "b"], max_commit_entries=1)
    assert raised.value is first


def test_every_chunk_and_the_stage_failing_keeps_the_stages_errors() -> None:
    w = World(acks={"a": [], "b": []}, commits=[[NotLeaderError("no leader")]])
    items = w.run(["a", "b"])
    assert w.kinds() == ["EnsureMembers", "Stage"]
    assert all(isinstance(it.error, UnavailableError) for it in items)


def test_a_failed_chunk_fails_its_items_only() -> None:
    error = NotLeaderError("no leader")
    w = World(commits=[[error, "ok"]])
    items = w.run(["a", "b"], max_commit_entries=1)
    assert w.kinds() == ["EnsureMembers", "Stage", "Publish"]
    a, b = items
    assert a.error is error
    assert not a.committed
    assert b.committed
    publish = w.steps[2]
    assert isinstance(publish, Publish)
    assert {r.key_bytes for r in publish.refs} == {b"b"}


def test_a_replacing_write_waits_for_its_publish_and_deletes_the_old_block() -> None:
    w = World(commits=[["replaced"]], now=9.9)
    w.run(["a"])
    assert w.kinds() == ["EnsureMembers", "Stage", "Publish", "Delete"]
    publish, delete = w.steps[2], w.steps[3]
    assert isinstance(publish, Publish)
    assert publish.wait
    assert isinstance(delete, Delete)
    assert {r.write_id for r in delete.refs} == {OLD_WRITE}
    assert delete.deadline == DEADLINE  # capped by the call's deadline


def test_the_delete_waits_at_most_delete_wait_s() -> None:
    w = World(commits=[["replaced"]], now=1.0)
    w.run(["a"])
    delete = w.steps[-1]
    assert isinstance(delete, Delete)
    assert delete.deadline == pytest.approx(1.0 + DELETE_WAIT_S)


def test_every_attempt_asks_for_members_first() -> None:
    w = World(commits=[["stale"], ["ok"]])
    w.run(["a"])
    assert [i for i, s in enumerate(w.steps) if isinstance(s, EnsureMembers)] == [0, 2]


def committed(n: int) -> list[master_pb2.PutResult]:
    return [
        master_pb2.PutResult(status=master_pb2.PUT_STATUS_COMMITTED, version=v, replicas=[1])
        for v in range(1, n + 1)
    ]


@pytest.mark.parametrize("answered", [2, 4], ids=["too few", "too many"])
def test_a_commit_answer_with_another_count_of_results_commits_no_put(answered: int) -> None:
    """Results are matched to puts by position: an answer that does not hold one per entry
    (a master's bug, or a garbled answer) would hand one key's result to another, so the whole
    request fails — a put may be lost, it is never acknowledged on another's result."""
    a = CommitJob(1, [master_pb2.PutEntry(key="a")], DEADLINE)
    b = CommitJob(1, [master_pb2.PutEntry(key=k) for k in ("b", "c")], DEADLINE)
    CommitBatcher.split([a, b], master_pb2.CommitPutsResponse(results=committed(answered)))
    for job in (a, b):
        assert job.answer is None
        assert isinstance(job.error, InternalError)

    items = [PutItem(k, k.encode(), memoryview(b"v")) for k in ("a", "b", "c")]
    for it in items:
        it.targets = [MEMBERS[0]]
    receipts: dict[PutItem, PutReceipt] = {}
    answer = CommitAnswer(committed(answered), revision=9, stale_ring=False, ring_version=1)
    with pytest.raises(InternalError):
        judge_commit(items, answer, receipts)
    assert receipts == {}
    assert not any(it.committed for it in items)
