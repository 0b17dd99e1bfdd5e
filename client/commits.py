"""Committing puts to the index: requests, receipts, and client-side group commit.

Group commit: puts of one client that want to commit while a CommitPuts of this client is in
flight wait and then go together, in one request, instead of one request each behind each
other (the masters group the requests of many clients into Raft entries the same way). A job
of at least half a request's entries goes at once, on its own. A request
holds entries placed on one ring version only and at most ``max_entries`` of them (a larger job
goes alone); it has a fresh request id, kept by the retries of one call (exactly-once).

:class:`CommitBatcher` is the pure part; :class:`AsyncCommitter` runs it on an event loop and
:class:`SyncCommitter` across engine threads (the first thread to arrive sends, the others wait;
when a request returns, one waiting thread sends the next).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvpool.client.placement import MemberInfo
from kvpool.client.plans import BlockRef, PutItem
from kvpool.errors import DeadlineExceededError, InternalError, UnavailableError
from kvpool.proto.v1 import common_pb2, master_pb2

REQUEST_ID_BYTES = 16


@dataclass(frozen=True, slots=True)
class PutReceipt:
    """What the index answered for one committed put: the block's version, its identity on the
    nodes, the index revision after the commit, and where its replicas are."""

    key: str
    version: int
    write_id: int
    revision: int
    replicas: tuple[str, ...]
    """Node ids of the replicas the index kept, in the index's order."""
    member_ids: tuple[int, ...]
    """The same replicas as member ids (one per node incarnation; a restarted node gets a new
    one), in the same order."""


@dataclass(slots=True)
class CommitAnswer:
    """One job's share of a CommitPuts response."""

    results: list[master_pb2.PutResult]
    revision: int
    stale_ring: bool
    ring_version: int


@dataclass(slots=True, eq=False)
class CommitJob:
    ring_version: int
    entries: list[master_pb2.PutEntry]
    deadline: float
    answer: CommitAnswer | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # sync: this waiting thread sends the next request


def put_entries(items: list[PutItem]) -> list[master_pb2.PutEntry]:
    """The index entries of ``items``, each naming every target as a replica: a put commits
    while its bytes are on their way (:func:`~kvpool.client.ops.put_flow`), and a target that
    did not stage them is taken out of the index again after (:func:`unstaged`)."""
    return [
        master_pb2.PutEntry(
            key=it.key,
            write_id=it.write_id,
            size_bytes=it.payload.nbytes,
            checksum=it.checksum,
            replicas=[m.member_id for m in it.targets],
        )
        for it in items
    ]


@dataclass(slots=True)
class Unstaged:
    """A commit's answer less what the stage did not land (:func:`unstaged`)."""

    chunk: list[PutItem]
    """The items committed with at least one replica that staged them (and those the index
    did not commit, with their results)."""
    answer: CommitAnswer
    """Their results; a result's replicas only those that staged the block."""
    drops: list[tuple[int, str, int]]
    """(member id, key, write id): replicas the index names that never staged the block, to
    be dropped from it again (``ReportEvictions``, conditional on the write id)."""
    deletes: list[BlockRef]
    """The writes replaced by an item no replica staged, on the members that held them: the
    index no longer names them, so they are deleted as a committed put's would be."""


def unstaged(
    chunk: list[PutItem], answer: CommitAnswer, member: Callable[[int], MemberInfo | None]
) -> Unstaged:
    """Split a commit's answer by what the stage landed (``item.acked``). The commit named
    every target before their answers came; a replica that did not stage the block is dropped
    from the index again, and an item that no kept replica staged fails, with the stage's
    error. A read in between finds the entry and misses on that replica: never a wrong
    block."""
    if answer.stale_ring or len(answer.results) != len(chunk):
        return Unstaged(chunk, answer, [], [])  # nothing committed, or judge_commit refuses
    items: list[PutItem] = []
    results: list[master_pb2.PutResult] = []
    drops: list[tuple[int, str, int]] = []
    deletes: list[BlockRef] = []
    for it, result in zip(chunk, answer.results, strict=True):
        named = list(result.replicas)
        landed = [m for m in named if m in it.acked]
        if result.status != master_pb2.PUT_STATUS_COMMITTED or landed == named:
            items.append(it)
            results.append(result)
            continue
        drops.extend((m, it.key, it.write_id) for m in named if m not in landed)
        if landed:
            kept = master_pb2.PutResult()
            kept.CopyFrom(result)
            del kept.replicas[:]
            kept.replicas.extend(landed)
            items.append(it)
            results.append(kept)
            continue
        if it.error is None:
            it.error = UnavailableError(f"put {it.key!r}: no replica staged it")
        deletes += replaced_refs(it, result, member)
    kept_answer = CommitAnswer(results, answer.revision, answer.stale_ring, answer.ring_version)
    return Unstaged(items, kept_answer, drops, deletes)


def drop_requests(drops: list[tuple[int, str, int]]) -> list[master_pb2.ReportEvictionsRequest]:
    """One ``ReportEvictions`` per member for :attr:`Unstaged.drops` (the index drops a replica
    only while the key still names that write id)."""
    by_member: dict[int, list[master_pb2.EvictedBlock]] = {}
    for member_id, key, write_id in drops:
        by_member.setdefault(member_id, []).append(
            master_pb2.EvictedBlock(key=key, write_id=write_id)
        )
    return [
        master_pb2.ReportEvictionsRequest(
            request_id=os.urandom(REQUEST_ID_BYTES), member_id=member_id, blocks=blocks
        )
        for member_id, blocks in by_member.items()
    ]


def committed_entry(it: PutItem, result: master_pb2.PutResult) -> common_pb2.BlockEntry:
    """The index entry a committed put created (for the lookup cache)."""
    return common_pb2.BlockEntry(
        key=it.key,
        found=True,
        version=result.version,
        write_id=it.write_id,
        size_bytes=it.payload.nbytes,
        checksum=it.checksum,
        replicas=list(result.replicas),
    )


def judge_commit(
    staged: list[PutItem], answer: CommitAnswer, receipts: dict[PutItem, PutReceipt]
) -> list[BlockRef]:
    """Mark each staged item by its result and write the receipt of each committed one; the
    (block, replica) pairs to publish."""
    if len(answer.results) != len(staged):
        raise InternalError(
            f"CommitPuts answered {len(answer.results)} results for {len(staged)} entries"
        )
    refs: list[BlockRef] = []
    for it, result in zip(staged, answer.results, strict=True):
        if result.status == master_pb2.PUT_STATUS_COMMITTED:
            it.committed = True
            kept = set(result.replicas)
            node_of = {m.member_id: m.node_id for m in it.targets}
            member_ids = tuple(int(m) for m in result.replicas)
            receipts[it] = PutReceipt(
                key=it.key,
                version=int(result.version),
                write_id=it.write_id,
                revision=int(answer.revision),
                replicas=tuple(node_of.get(m, "") for m in member_ids),
                member_ids=member_ids,
            )
            refs.extend(
                BlockRef(it.key_bytes, it.write_id, result.version, m, result.receipt)
                for m in it.targets
                if m.member_id in kept
            )
        elif result.status == master_pb2.PUT_STATUS_NO_LIVE_REPLICA:
            it.error = UnavailableError(
                f"put {it.key!r}: the index knows every replica's node as down"
            )
        else:
            it.error = InternalError(f"put {it.key!r}: commit status {result.status}")
    return refs


@dataclass(slots=True)
class AfterCommit:
    """What a put does once its commit is answered, before it returns: ``publish`` the new
    blocks (posted, not waited for, unless ``wait_publish``) and ``delete`` the blocks of the
    writes the commit replaced on members the new write is not on."""

    publish: list[BlockRef] = field(default_factory=list)
    delete: list[BlockRef] = field(default_factory=list)
    wait_publish: bool = False

    def extend(self, other: AfterCommit) -> None:
        self.publish.extend(other.publish)
        self.delete.extend(other.delete)
        self.wait_publish = self.wait_publish or other.wait_publish


def superseded(
    staged: list[PutItem],
    results: list[master_pb2.PutResult],
    member: Callable[[int], MemberInfo | None],
) -> tuple[list[BlockRef], bool]:
    """The replaced writes' blocks to DELETE (on every member the index had them on), and
    whether a replaced write sits on a member the new one is published to — where the PUBLISH
    replaces it too, so the put waits until that node has handled it (``plans.ref_rounds``)
    — not for its answer, which waits for the index. The DELETE goes there as well: the
    PUBLISH may find nothing to publish (a remove of the key deleted the new write first) and
    the exact (key, replaced write id) is never wanted again. Once the put returns no node
    serves the replaced write to a reader holding a stale cached entry (unless the node was
    unreachable)."""
    deletes: list[BlockRef] = []
    wait = False
    for it, result in zip(staged, results, strict=True):
        if not (it.committed and result.superseded_write_id):
            continue
        deletes += replaced_refs(it, result, member)
        wait = wait or not set(result.replicas).isdisjoint(result.superseded_replicas)
    return deletes, wait


def replaced_refs(
    it: PutItem, result: master_pb2.PutResult, member: Callable[[int], MemberInfo | None]
) -> list[BlockRef]:
    """The blocks of the write ``it``'s commit replaced (none: it replaced none), on every
    live member the index had them on."""
    if not result.superseded_write_id:
        return []
    return [
        BlockRef(it.key_bytes, result.superseded_write_id, 0, m)
        for m in map(member, result.superseded_replicas)
        if m is not None
    ]


class CommitBatcher:
    """Jobs waiting to commit, taken a request's worth at a time."""

    def __init__(self, max_entries: Callable[[], int]) -> None:
        self._max_entries = max_entries
        self.queue: deque[CommitJob] = deque()
        self.requests = 0  # CommitPuts requests made
        self.jobs = 0  # commits they carried (puts and batch_puts)

    def alone(self) -> int:
        """Jobs at least this large are sent at once, in a request of their own (grouping
        could not make them any cheaper, and a batch_put's chunks then commit in parallel)."""
        return max(1, self._max_entries() // 2)

    def take(self) -> list[CommitJob]:
        """The jobs of the next request: the oldest job, and after it every waiting job on the
        same ring version while the entries fit."""
        if not self.queue:
            return []
        first = self.queue.popleft()
        jobs, total, limit = [first], len(first.entries), self._max_entries()
        rest: deque[CommitJob] = deque()
        while self.queue:
            job = self.queue.popleft()
            if job.ring_version == first.ring_version and total + len(job.entries) <= limit:
                jobs.append(job)
                total += len(job.entries)
            else:
                rest.append(job)
        self.queue = rest
        self.requests += 1
        self.jobs += len(jobs)
        return jobs

    @staticmethod
    def request(jobs: list[CommitJob]) -> master_pb2.CommitPutsRequest:
        entries = [e for job in jobs for e in job.entries]
        return master_pb2.CommitPutsRequest(
            request_id=os.urandom(REQUEST_ID_BYTES),
            ring_version=jobs[0].ring_version,
            entries=entries,
        )

    @staticmethod
    def split(jobs: list[CommitJob], response: master_pb2.CommitPutsResponse) -> None:
        """Give each job its share of ``response``."""
        results = list(response.results)
        if not response.stale_ring and len(results) != sum(len(j.entries) for j in jobs):
            error = InternalError(
                f"CommitPuts answered {len(results)} results for "
                f"{sum(len(j.entries) for j in jobs)} entries"
            )
            for job in jobs:
                job.error = error
            return
        pos = 0
        for job in jobs:
            n = len(job.entries)
            job.answer = CommitAnswer(
                results=results[pos : pos + n] if not response.stale_ring else [],
                revision=int(response.revision),
                stale_ring=bool(response.stale_ring),
                ring_version=int(response.ring_version),
            )
            pos += n


Call = Callable[[master_pb2.CommitPutsRequest, float], Awaitable[master_pb2.CommitPutsResponse]]
SyncCall = Callable[[master_pb2.CommitPutsRequest, float], master_pb2.CommitPutsResponse]


class _Committer:
    """What both committers are around their sending: a :class:`CommitBatcher`, and its
    counts."""

    def __init__(self, max_entries: Callable[[], int]) -> None:
        self._batcher = CommitBatcher(max_entries)

    @property
    def requests(self) -> int:
        """CommitPuts requests sent."""
        return self._batcher.requests

    @property
    def jobs(self) -> int:
        """Commits those requests carried."""
        return self._batcher.jobs


class AsyncCommitter(_Committer):
    """Group commit on one event loop."""

    def __init__(self, call: Call, max_entries: Callable[[], int]) -> None:
        super().__init__(max_entries)
        self._call = call
        self._futures: dict[int, asyncio.Future[None]] = {}
        self._pump: asyncio.Task[None] | None = None

    async def commit(
        self, ring_version: int, entries: list[master_pb2.PutEntry], deadline: float
    ) -> CommitAnswer:
        job = CommitJob(ring_version, entries, deadline)
        if len(entries) >= self._batcher.alone():  # a full request of its own: no waiting
            await self._send([job], wake=False)
            return _answer(job)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._futures[id(job)] = future
        self._batcher.queue.append(job)
        if self._pump is None:
            self._pump = loop.create_task(self._run())
        try:
            await future
        finally:
            self._futures.pop(id(job), None)
        if job.error is not None:
            raise job.error
        assert job.answer is not None
        return job.answer

    async def _run(self) -> None:
        try:
            while True:
                jobs = [j for j in self._batcher.take() if id(j) in self._futures]
                if not jobs:
                    if not self._batcher.queue:
                        return
                    continue
                await self._send(jobs)
        finally:
            self._pump = None

    async def _send(self, jobs: list[CommitJob], *, wake: bool = True) -> None:
        try:
            response = await self._call(CommitBatcher.request(jobs), max(j.deadline for j in jobs))
        except BaseException as e:  # every waiter learns; nothing is lost silently
            for job in jobs:
                job.error = e
            if isinstance(e, asyncio.CancelledError):
                if wake:
                    self._wake(jobs)
                raise
        else:
            CommitBatcher.split(jobs, response)
        if wake:
            self._wake(jobs)

    def _wake(self, jobs: list[CommitJob]) -> None:
        for job in jobs:
            future = self._futures.get(id(job))
            if future is not None and not future.done():
                future.set_result(None)


class SyncCommitter(_Committer):
    """Group commit across threads: the first thread to arrive sends; others wait and ride in
    the next request, sent by one of them."""

    def __init__(self, call: SyncCall, max_entries: Callable[[], int]) -> None:
        super().__init__(max_entries)
        self._call = call
        self._lock = threading.Lock()
        self._busy = False

    def commit(
        self, ring_version: int, entries: list[master_pb2.PutEntry], deadline: float
    ) -> CommitAnswer:
        job = CommitJob(ring_version, entries, deadline)
        if len(entries) >= self._batcher.alone():  # a full request of its own: no waiting
            self._send([job], deadline)
            return _answer(job)
        with self._lock:
            self._batcher.queue.append(job)
            lead = not self._busy
            self._busy = True
        if not lead:
            job.done.wait(max(0.0, deadline - time.monotonic()))
            with self._lock:
                if job.lead:  # the previous sender handed over to us
                    job.lead = False
                    job.done.clear()
                    lead = True
                elif not job.done.is_set():
                    if job in self._batcher.queue:
                        self._batcher.queue.remove(job)  # never sent
                    raise DeadlineExceededError("commit: not answered before the deadline")
            if not lead:
                return _answer(job)
        if deadline <= time.monotonic():
            with self._lock:
                if job in self._batcher.queue:
                    self._batcher.queue.remove(job)
                self._hand_over()
            raise DeadlineExceededError("commit: no time left to send")
        self._lead(deadline)
        return _answer(job)

    def _lead(self, deadline: float) -> None:
        """Send the next request (which holds this thread's job, the oldest) under this thread's
        ``deadline``, then hand over."""
        with self._lock:
            jobs = self._batcher.take()
        if jobs:
            self._send(jobs, deadline)
        with self._lock:
            self._hand_over()
        for job in jobs:
            job.done.set()

    def _send(self, jobs: list[CommitJob], deadline: float) -> None:
        """One request for ``jobs`` under the sending thread's ``deadline`` (a later one of a
        job riding along would hold the sender past its own); each job gets its share of the
        answer, or the error (every one of them: nothing is lost silently)."""
        try:
            response = self._call(CommitBatcher.request(jobs), deadline)
        except BaseException as e:
            for job in jobs:
                job.error = e
        else:
            CommitBatcher.split(jobs, response)

    def _hand_over(self) -> None:
        """(Lock held.) The oldest waiting thread sends next; none waiting: idle."""
        if self._batcher.queue:
            successor = self._batcher.queue[0]
            successor.lead = True
            successor.done.set()
        else:
            self._busy = False


def _answer(job: CommitJob) -> CommitAnswer:
    if job.error is not None:
        raise job.error
    if job.answer is None:
        raise InternalError("commit job finished without an answer")
    return job.answer
