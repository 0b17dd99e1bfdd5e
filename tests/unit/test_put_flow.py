"""The put flow (:func:`kvpool.client.ops.put_flow`) driven step by step: no socket, no
thread, no event loop. The test is the driver: it stages on the members it is told are up,
answers each commit as told (ok, stale ring, or an error per chunk) and records every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvpool.client.commits import AfterCommit, CommitAnswer, PutReceipt
from kvpool.client.ops import (
    DELETE_WAIT_S,
    MAX_PUT_ATTEMPTS,
    Commit,
    Delete,
    EnsureMembers,
    Publish,
    PutStep,
    Stage,
    drive,
    put_flow,
)
from kvpool.client.placement import MemberInfo, Placement
from kvpool.client.plans import BlockRef, PutItem
from kvpool.errors import KVPoolError, NotLeaderError, StaleRingError

DEADLINE = 10.0
TIMEOUT_S = 4.0
MEMBERS = [MemberInfo(i, f"node-{i}", f"tcp://127.0.0.1:{7000 + i}", 1 << 30) for i in (1, 2)]

Answer = str | KVPoolError
"""How the test answers one chunk's commit: "ok", "stale", "replaced" (ok, and the put
replaced an older write that is to be deleted), or the error the commit failed with."""


@dataclass
class World:
    placement: Placement = field(default_factory=Placement)
    unacked: set[str] = field(default_factory=set)  # keys no replica acks
    commits: list[list[Answer]] = field(default_factory=list)  # per Commit step, per chunk
    now: float = 0.0
    steps: list[object] = field(default_factory=list)
    receipts: dict[PutItem, PutReceipt] = field(default_factory=dict)
    write_ids: list[list[int]] = field(default_factory=list)  # per Stage step
    replacing: set[int] = field(default_factory=set)  # id() of the chunks answered "replaced"

    def __post_init__(self) -> None:
        self.placement.update(MEMBERS, ring_version=1, now_s=0.0)

    def answered(
        self, chunk: list[PutItem], answer: CommitAnswer, receipts: dict[PutItem, PutReceipt]
    ) -> AfterCommit | None:
        """ClientCore.commit_answered in miniature: a stale ring fails every item of the
        chunk; otherwise every item is committed, and the blocks to publish (and, for a
        replacing write, to delete) are returned."""
        if answer.stale_ring:
            for it in chunk:
                it.error = StaleRingError("stale", ring_version=answer.ring_version)
            return None
        after = AfterCommit()
        for it in chunk:
            it.committed = True
            receipts[it] = PutReceipt(it.key, 1, it.write_id, answer.revision, (), ())
            after.publish += [BlockRef(it.key_bytes, it.write_id, 1, m) for m in it.targets]
            if id(chunk) in self.replacing:
                after.delete.append(BlockRef(it.key_bytes, 1, 0, it.targets[0]))
                after.wait_publish = True
        return after

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

    def perform(self, step: PutStep) -> list[CommitAnswer | KVPoolError] | None:
        self.steps.append(step)
        if isinstance(step, Stage):
            self.write_ids.append([it.write_id for it in step.items])
            for it in step.items:
                if it.key not in self.unacked:
                    it.acked = [m.member_id for m in it.targets]
        elif isinstance(step, Commit):
            return self.commit(step)
        return None

    def commit(self, step: Commit) -> list[CommitAnswer | KVPoolError]:
        told = self.commits.pop(0)
        assert len(told) == len(step.chunks)
        out: list[CommitAnswer | KVPoolError] = []
        for chunk, answer in zip(step.chunks, told, strict=True):
            if isinstance(answer, KVPoolError):
                out.append(answer)
                continue
            if answer == "replaced":
                self.replacing.add(id(chunk))
            out.append(CommitAnswer([], revision=7, stale_ring=answer == "stale", ring_version=2))
        return out

    def kinds(self) -> list[str]:
        return [type(s).__name__ for s in self.steps]


def test_one_attempt_stages_commits_and_publishes() -> None:
    w = World(commits=[["ok"]])
    items = w.run(["a", "b"])
    assert w.kinds() == ["EnsureMembers", "Stage", "Commit", "Publish"]
    stage = w.steps[1]
    assert isinstance(stage, Stage)
    assert stage.deadline == DEADLINE - 0.25 * TIMEOUT_S  # time left for commit and publish
    commit = w.steps[2]
    assert isinstance(commit, Commit)
    assert commit.ring_version == 1
    publish = w.steps[3]
    assert isinstance(publish, Publish)
    assert not publish.wait  # nothing replaced: not waited for
    assert len(publish.refs) == 4  # two replicas each
    assert all(it.committed and it.write_id for it in items)
    assert {len(it.targets) for it in items} == {2}
    assert len(w.receipts) == 2


def test_nothing_staged_commits_nothing() -> None:
    w = World(unacked={"a", "b"})
    items = w.run(["a", "b"])
    assert w.kinds() == ["EnsureMembers", "Stage"]
    assert not any(it.committed for it in items)


def test_only_staged_items_are_committed_in_chunks() -> None:
    w = World(unacked={"k2"}, commits=[["ok", "ok", "ok"]])
    items = w.run([f"k{i}" for i in range(6)], max_commit_entries=2)
    commit = w.steps[2]
    assert isinstance(commit, Commit)
    assert [[it.key for it in c] for c in commit.chunks] == [["k0", "k1"], ["k3", "k4"], ["k5"]]
    assert [it.key for it in items if not it.committed] == ["k2"]


def test_a_stale_ring_places_the_rest_again_with_new_write_ids() -> None:
    w = World(commits=[["ok", "stale"], ["ok"]])
    items = w.run(["a", "b", "c"], max_commit_entries=2)
    assert w.kinds() == [
        "EnsureMembers",
        "Stage",
        "Commit",
        "Publish",  # the chunk that committed is published at once
        "EnsureMembers",
        "Stage",
        "Commit",
        "Publish",
    ]
    second = w.steps[5]
    assert isinstance(second, Stage)
    assert [it.key for it in second.items] == ["c"]  # only what the stale ring refused
    assert w.write_ids[1][0] != w.write_ids[0][2]  # a write id is never reused
    assert all(it.committed for it in items)
    assert all(it.error is None for it in items)


def test_a_ring_stale_every_time_gives_up_after_max_attempts() -> None:
    w = World(commits=[["stale"]] * MAX_PUT_ATTEMPTS)
    items = w.run(["a"])
    assert w.kinds().count("Commit") == MAX_PUT_ATTEMPTS
    assert "Publish" not in w.kinds()
    assert isinstance(items[0].error, StaleRingError)
    assert not items[0].committed


def test_every_chunk_failing_fails_the_put_with_the_first_error() -> None:
    first, second = NotLeaderError("no leader"), NotLeaderError("still none")
    w = World(commits=[[first, second]])
    with pytest.raises(NotLeaderError) as raised:
        w.run(["a", "b"], max_commit_entries=1)
    assert raised.value is first


def test_a_failed_chunk_fails_its_items_only() -> None:
    error = NotLeaderError("no leader")
    w = World(commits=[[error, "ok"]])
    items = w.run(["a", "b"], max_commit_entries=1)
    assert w.kinds() == ["EnsureMembers", "Stage", "Commit", "Publish"]
    a, b = items
    assert a.error is error
    assert not a.committed
    assert b.committed
    publish = w.steps[3]
    assert isinstance(publish, Publish)
    assert {r.key_bytes for r in publish.refs} == {b"b"}


def test_a_replacing_write_waits_for_its_publish_and_deletes_the_old_block() -> None:
    w = World(commits=[["replaced"]], now=9.9)
    w.run(["a"])
    assert w.kinds() == ["EnsureMembers", "Stage", "Commit", "Publish", "Delete"]
    publish, delete = w.steps[3], w.steps[4]
    assert isinstance(publish, Publish)
    assert publish.wait
    assert isinstance(delete, Delete)
    assert [r.write_id for r in delete.refs] == [1]
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
    assert [i for i, s in enumerate(w.steps) if isinstance(s, EnsureMembers)] == [0, 3]
