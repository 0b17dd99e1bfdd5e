"""Client operations written once, with no I/O: each says what it needs done and takes the
answers.

A read of many keys is :func:`read_flow`, a generator. It yields a request — :class:`Lookup`
(ask the index for these keys) or :class:`Read` (read these items from their replicas) — and is
sent the answer: the ``LookupResponse`` for a Lookup, nothing for a Read (the data plane has
filled the items in place). It returns one item per key. Two drivers run it: the synchronous
client's fast path (:mod:`kvpool.client.fastpath`) with blocking calls in the caller's thread,
and :class:`~kvpool.client.core.ClientCore` on the event loop, awaiting them. Everything the
read decides is here, once:

* keys the lookup cache holds are read through their cached entries; keys that name their
  content (``direct``: see :func:`direct_entry`) are read straight from the node the ring places
  them on, with no Lookup (the membership asked for first when the ring is missing or stale,
  :class:`EnsureMembers`); the others are looked up first, in one Lookup;
* a key the index lacks is None, and is not read;
* an item read through a cached entry or straight from its node that missed may be stale, or
  placed elsewhere: while time is left before the deadline, those keys leave the cache and are
  looked up once more and read once more;
* the cached entry of an item that still failed is dropped (only if it names the write id
  that failed).

A put of many blocks is :func:`put_flow`: per attempt it asks for a membership
(:class:`EnsureMembers`), places every pending block on the ring under a fresh write id,
sends the bytes to the replicas and, while the nodes take them, commits the entries in chunks
naming every target (:class:`Stage` with its :class:`Commit`, answered with one outcome per
chunk), so that the index's Raft round and the node's round trip overlap. A replica that then
did not stage its block is dropped from the index again (an :class:`Ask` of
``ReportEvictions``, conditional on the write id: a reader in between misses, never reads
wrong), and a block no replica staged fails. Then it PUBLISHes the new blocks
(:class:`Publish`) and DELETEs the replaced ones (:class:`Delete`). What the index refused as
placed on a stale ring is placed again on the refreshed ring, up to :data:`MAX_PUT_ATTEMPTS`
attempts; when every chunk's commit failed the put fails with the first chunk's error.

The client's other operations are flows of :class:`~kvpool.client.state.ClientState` made of
the same steps and three more — :class:`Ask` (call a master), :class:`Pause` and
:class:`Connect` —: a chain of index questions (``ask_flow``), a membership refresh
(``members_flow``, what :class:`EnsureMembers` runs) and a warm-up (``warm_up_flow``).

The clock is passed in (the driver's: ``time.monotonic`` or the event loop's ``time``), so a
test drives any flow step by step with no socket, no thread and no event loop. A driver hands a
flow to :func:`drive` (blocking) or :func:`drive_async` (awaited) with its one function that
performs any step (``_perform``); what a step raised is thrown into the flow at that step.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvpool.buffers import Parts
from kvpool.client.cache import LookupCache
from kvpool.client.commits import (
    AfterCommit,
    CommitAnswer,
    PutReceipt,
    drop_requests,
    unstaged,
)
from kvpool.client.placement import MemberInfo, Placement
from kvpool.client.plans import BlockRef, DirectEntry, Entry, PutItem, ReadItem, new_write_ids
from kvpool.errors import BlockMissError, KVPoolError, NoNodesError
from kvpool.proto.v1 import master_pb2
from kvpool.proto.wire import TierLevel

__all__ = [
    "COMMIT_SHARE",
    "DELETE_WAIT_S",
    "DIRECT_SIZE",
    "MAX_PUT_ATTEMPTS",
    "Ask",
    "Commit",
    "Connect",
    "Delete",
    "EnsureMembers",
    "Lookup",
    "Pause",
    "Publish",
    "PutFlow",
    "PutStep",
    "Read",
    "ReadFlow",
    "SinkFactory",
    "Stage",
    "Step",
    "direct_entry",
    "drive",
    "drive_async",
    "put_flow",
    "read_flow",
    "read_items",
]

S = TypeVar("S")
R = TypeVar("R")


def _resume(
    flow: Generator[S, Any, Any], answer: Any, failure: Exception | None
) -> tuple[bool, Any]:
    """(False, the flow's next step) given the last step's answer or failure (thrown in at the
    step), or (True, its return value) once it returns."""
    try:
        return False, flow.send(answer) if failure is None else flow.throw(failure)
    except StopIteration as done:
        return True, done.value


def drive(flow: Generator[S, Any, R], perform: Callable[[S], Any]) -> R:
    """Carry a flow out in this thread: each step it yields is ``perform``-ed and what that
    answers is sent back — or what it raised is thrown in, at the step (a flow that does not
    catch it ends with it); the flow's return value is the answer."""
    done, step = _resume(flow, None, None)
    while not done:
        try:
            answer = perform(step)
        except Exception as e:
            done, step = _resume(flow, None, e)
        else:
            done, step = _resume(flow, answer, None)
    return step  # type: ignore[no-any-return]


async def drive_async(flow: Generator[S, Any, R], perform: Callable[[S], Awaitable[Any]]) -> R:
    """:func:`drive` on an event loop: each step's ``perform`` is awaited."""
    done, step = _resume(flow, None, None)
    while not done:
        try:
            answer = await perform(step)
        except Exception as e:
            done, step = _resume(flow, None, e)
        else:
            done, step = _resume(flow, answer, None)
    return step  # type: ignore[no-any-return]


MAX_PUT_ATTEMPTS = 3
"""Whole-put attempts when the index answers stale_ring (each on a refreshed ring)."""
COMMIT_SHARE = 0.25
"""Share of ``timeout_s`` that sending a put's bytes leaves for the commit and publish."""
DELETE_WAIT_S = 0.25
"""Longest wait for best-effort DELETE frames after a put or a remove."""

SinkFactory = Callable[[int, str, int], tuple[memoryview | Parts | None, bool]]
"""Where the bytes of the i-th key go (None: into fresh bytes), given its index, key and size,
and whether that is the caller's buffer."""


@dataclass(slots=True)
class EnsureMembers:
    """Have a membership to place on (ask the masters when the placement needs a refresh);
    answer with nothing. ``patient``: a put asks again while the answer names no node (a
    read asks once, and a failure is no error: it reads through the index instead)."""

    patient: bool = True


@dataclass(slots=True)
class Lookup:
    """Ask the index for the entries of ``keys``; answer with the ``LookupResponse``."""

    keys: list[str]


@dataclass(slots=True)
class Read:
    """Read ``items`` from their replicas until read, out of replicas or out of time; ``live``
    names the members the last Lookup answered with (before the cached ones). Answer with
    nothing: the items carry the outcome. (Not frozen, as Lookup: one is built for every get,
    and a frozen dataclass takes twice as long to build.)"""

    items: list[ReadItem]
    live: dict[int, MemberInfo]


ReadStep = EnsureMembers | Lookup | Read
ReadFlow = Generator[ReadStep, master_pb2.LookupResponse | None, list[ReadItem | None]]


def read_flow(
    cache: LookupCache,
    placement: Placement,
    pairs: list[tuple[str, bytes]],
    sink_for: SinkFactory,
    *,
    limit: int,
    deadline: float,
    clock: Callable[[], float],
    direct: Callable[[str], bool] | None = None,
    on_direct: Callable[[int, int], None] | None = None,
    direct_replicas: int = 1,
) -> ReadFlow:
    """Read ``pairs`` (key, key bytes): one ReadItem per key the index holds, None for the
    others (see the module doc). ``direct``: which keys name their content (None: none);
    ``on_direct`` hears how many keys read by content hit and missed, after the first read;
    ``direct_replicas``: the ring's members tried for each (the writers' replica count)."""
    entries: list[Entry | None] = [cache.get(k) for k, _ in pairs]
    from_cache = [e is not None for e in entries]
    live: dict[int, MemberInfo] = {}
    todo = [i for i, e in enumerate(entries) if e is None]
    by_content: list[int] = []
    named = [i for i in todo if direct(pairs[i][0])] if todo and direct is not None else []
    if named:
        if placement.refresh_due(clock()):
            yield EnsureMembers(patient=False)
        if placement.has_ring and not placement.ring_is_empty():
            for i in named:
                key, key_bytes = pairs[i]
                stand_in = direct_entry(placement, key, key_bytes, direct_replicas)
                if stand_in is not None:
                    entries[i] = stand_in
                    from_cache[i] = True  # a guess, as a cached entry is: a miss looks it up
                    by_content.append(i)
            if by_content:
                todo = [i for i in todo if entries[i] is None]
    if todo:
        response = yield Lookup([pairs[i][0] for i in todo])
        assert response is not None
        live = members_of(response)
        for i, entry in zip(todo, response.entries, strict=True):
            entries[i] = entry
    items = read_items(placement, pairs, entries, from_cache, sink_for, limit=limit, now_s=clock())
    readable = [it for it in items if it is not None and it.replicas]
    if readable:
        yield Read(readable, live)
    if by_content and on_direct is not None:
        hits = sum(1 for i in by_content if (it := items[i]) is not None and it.ok)
        on_direct(hits, len(by_content) - hits)
    stale = [i for i, it in enumerate(items) if it is not None and not it.ok and it.from_cache]
    if stale and clock() < deadline:
        # A cached entry missed: it may be stale. Look those keys up again, once.
        for i in stale:
            cache.drop(pairs[i][0])
        sub = [pairs[i] for i in stale]
        response = yield Lookup([k for k, _ in sub])
        assert response is not None
        fresh = read_items(
            placement,
            sub,
            list(response.entries),
            [False] * len(sub),
            sink_for,
            limit=limit,
            now_s=clock(),
            indexes=stale,
        )
        for i, item in zip(stale, fresh, strict=True):
            items[i] = item
        readable = [it for it in fresh if it is not None and it.replicas]
        if readable:
            yield Read(readable, members_of(response))
    for it in items:
        if it is not None and not it.ok:
            cache.drop(it.key, it.entry.write_id)
    return items


DIRECT_SIZE = -1
"""The size a sink is asked for when a direct read does not know it yet: the caller's whole
buffer, or fresh bytes of the size the node answers."""


def direct_entry(
    placement: Placement, key: str, key_bytes: bytes, replicas: int = 1
) -> DirectEntry | None:
    """A stand-in index entry for a key that names its content: write id 0 (the node answers
    with the key's committed block, whichever write it is), on the ring's first ``replicas``
    members for the key (where a writer with that replica count put it), size and checksum
    unknown (taken from the node's answer, the bytes checked against that checksum); None when
    the ring names no node. Safe only for such keys: every committed write of one holds the
    same bytes, so any committed block of it is the right value (``docs/operations.md``,
    "Direct reads")."""
    try:
        return DirectEntry(key, placement.place_ids(key_bytes, replicas))
    except NoNodesError:  # the ring emptied since it was checked
        return None


def members_of(response: master_pb2.LookupResponse) -> dict[int, MemberInfo]:
    """The members a Lookup answered with, by member id."""
    return {m.member_id: MemberInfo.from_proto(m) for m in response.members}


def read_items(
    placement: Placement,
    pairs: list[tuple[str, bytes]],
    entries: Sequence[Entry | None],
    from_cache: Sequence[bool],
    sink_for: SinkFactory,
    *,
    limit: int,
    now_s: float,
    indexes: Sequence[int] | None = None,
) -> list[ReadItem | None]:
    """One ReadItem per found entry (None for keys the index lacks), its replicas in the order
    to try them; a block held only on a tier slower than ``limit`` is a ``slow_tier`` miss
    with no replica left to read. ``indexes``: the keys' places in the caller's batch."""
    items: list[ReadItem | None] = []
    append = items.append
    read_order = placement.read_order
    randrange = random.randrange
    slowest = TierLevel.SSD
    for n_item, ((key, key_bytes), entry, cached) in enumerate(
        zip(pairs, entries, from_cache, strict=True)
    ):
        if entry is None or not entry.found:
            append(None)
            continue
        index = indexes[n_item] if indexes is not None else n_item
        if entry.write_id:
            sink, caller_buffer = sink_for(index, key, entry.size_bytes)
        else:  # a direct read: the caller's whole buffer is the size expected (else any)
            sink, caller_buffer = sink_for(index, key, DIRECT_SIZE)
            entry.size_bytes = sink.nbytes if sink is not None else 0
        held = entry.replicas
        n = len(held)
        if n == 1:
            replicas = [held[0]]
        else:  # a read by content tries the ring's primary first (suspects last)
            replicas = read_order(held, now_s, randrange(n) if entry.write_id else 0)
        item = ReadItem(
            key,
            key_bytes,
            entry,
            sink=sink,
            caller_buffer=caller_buffer,
            replicas=replicas,
            max_tier=limit,
            from_cache=cached,
        )
        if limit and limit < entry.tier <= slowest:  # the index: on a slower tier
            item.replicas = []
            item.fail(
                "slow_tier",
                BlockMissError(
                    f"{key!r} is on the {TierLevel(entry.tier).name.lower()} tier, slower "
                    f"than max_tier {TierLevel(limit).name.lower()}",
                    reason="slow_tier",
                ),
            )
        append(item)
    return items


# --- puts -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Commit:
    """Commit each chunk's entries (every target named a replica: ``commits.put_entries``)
    placed on ring ``ring_version``."""

    chunks: list[list[PutItem]]
    ring_version: int


@dataclass(slots=True)
class Stage:
    """Send every item's bytes to its targets, staged, by ``deadline``, and :class:`Commit`
    ``commit`` while the nodes take them: once a node has been handed every byte of its
    blocks, before its answers are awaited. Answer with one commit outcome per chunk, in order
    — the CommitAnswer, or the KVPoolError that commit failed with — or None when nothing was
    staged (nothing was committed); the items record which replicas acked."""

    items: list[PutItem]
    deadline: float
    commit: Commit


@dataclass(slots=True)
class Publish:
    """PUBLISH ``refs``; wait for the answers only when ``wait``. Answer with nothing."""

    refs: list[BlockRef]
    wait: bool


@dataclass(slots=True)
class Delete:
    """DELETE ``refs``, best effort, until ``deadline``. Answer with nothing."""

    refs: list[BlockRef]
    deadline: float


# --- the other steps: a master's answer, a pause, connections ---------------------------------


@dataclass(slots=True)
class Ask:
    """Call a master's ``method`` with ``request`` (the leader only, when ``leader_only``);
    answer with its response. A failure is thrown into the flow, typed."""

    method: str
    request: Any
    leader_only: bool = False


@dataclass(slots=True)
class Pause:
    """Wait ``seconds``; answer with nothing."""

    seconds: float


@dataclass(slots=True)
class Connect:
    """Open a data connection to each of ``members`` (a same-host node's shared memory mapped
    and its page tables filled); answer with ``{node id: "" when open, else why not}``."""

    members: list[MemberInfo]


PutStep = EnsureMembers | Stage | Publish | Delete | Ask
Step = ReadStep | PutStep | Pause | Connect
"""Every step a flow may ask a driver for."""
CommitOutcomes = list[CommitAnswer | KVPoolError]
PutFlow = Generator[PutStep, CommitOutcomes | None, None]
CommitAnswered = Callable[
    [list[PutItem], CommitAnswer, dict[PutItem, PutReceipt]], AfterCommit | None
]
"""Learn from one chunk's commit answer (receipts, errors, floor, cache): the blocks to publish
and delete, or None when the index refused the ring (``ClientCore.commit_answered``)."""


def put_flow(
    placement: Placement,
    items: list[PutItem],
    receipts: dict[PutItem, PutReceipt],
    answered: CommitAnswered,
    *,
    replicas: int,
    timeout_s: float,
    deadline: float,
    max_commit_entries: int,
    clock: Callable[[], float],
) -> PutFlow:
    """Put ``items`` (see the module doc); each committed item's receipt lands in
    ``receipts``, each failed one keeps its error."""
    send_deadline = deadline - COMMIT_SHARE * timeout_s
    pending = items
    for _attempt in range(MAX_PUT_ATTEMPTS):
        yield EnsureMembers()
        ring_version = placement.ring_version or 0
        now = clock()
        for item, write_id in zip(pending, new_write_ids(len(pending)), strict=True):
            item.restart(write_id, placement.targets(item.key_bytes, replicas, now))
        size = max_commit_entries
        chunks = [pending[i : i + size] for i in range(0, len(pending), size)]
        outcomes = yield Stage(pending, send_deadline, Commit(chunks, ring_version))
        if outcomes is None:
            return  # nothing sent, nothing committed: the items hold the stage's errors
        failures = [o for o in outcomes if isinstance(o, KVPoolError)]
        if len(failures) == len(chunks):
            if not any(it.acked for it in pending):
                return  # the stage failed too: its errors say more than the commit's
            raise failures[0]  # the whole call failed (no leader, deadline, …)
        after = AfterCommit()
        drops: list[tuple[int, str, int]] = []
        stale = False
        for chunk, outcome in zip(chunks, outcomes, strict=True):
            if isinstance(outcome, KVPoolError):
                for it in chunk:
                    it.error = outcome
                continue
            split = unstaged(chunk, outcome, placement.member)
            drops += split.drops
            after.delete += split.deletes
            result = answered(split.chunk, split.answer, receipts)
            if result is None:
                stale = True
            else:
                after.extend(result)
        for request in drop_requests(drops):
            # The index names a replica that never staged the block: take it out again. Left
            # named (the master unreachable), that replica misses every read of it.
            with contextlib.suppress(KVPoolError):
                yield Ask("ReportEvictions", request, leader_only=True)
        if after.publish:
            # Not waited for (a node serves a staged block to a read naming its write id),
            # unless it replaces an older write there: then until that node has handled it
            # (plans.ref_rounds), not for its answer.
            yield Publish(after.publish, after.wait_publish)
        if after.delete:
            yield Delete(after.delete, min(deadline, clock() + DELETE_WAIT_S))
        if not stale:
            return
        pending = [it for it in pending if not it.committed]
