"""What both data planes decide around their I/O, once — no I/O.

The event-loop data plane (:mod:`kvpool.client.blocks`) and the synchronous client's
(:mod:`kvpool.client.blocking_plane`) read as :func:`read_flow` says, in rounds: a round sends
every key still unread to the node of its next replica (:func:`next_round`), with the time left
shared out over the rounds the keys may yet take (:func:`rounds_left`), and may hedge
(:func:`hedged_round`); after it, the keys still unread that have a replica left go again
(:func:`still_unread`). The planes carry out its steps (:class:`SendReads`,
:class:`AwaitReads`, :class:`DropReads`) and do nothing else between them. They put every
block to each of its targets at once (:func:`put_groups`). What a key counts as when it cannot
be sent — no replica, no time, a node that could not be reached — is decided here too; the
planes open, send, wait and judge (with :mod:`kvpool.client.plans`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.client.hedge import Hedge, HedgePolicy, fail_unanswered, round_bytes
from kvpool.client.placement import MemberInfo
from kvpool.client.plans import (
    BlockRef,
    NodeRead,
    NodeStage,
    PutItem,
    ReadItem,
    transport_failure,
)
from kvpool.errors import DeadlineExceededError, KVPoolError, UnavailableError
from kvpool.proto.wire import Op
from kvpool.transports.calls import Call

ReadGroups = dict[str, tuple[list[ReadItem], MemberInfo]]
"""A round's reads by node address: the node's keys and its member."""
PutGroups = dict[str, list[tuple[PutItem, MemberInfo]]]
"""A put's sends by node address: each block and the target member it goes to there."""


# --- reads ----------------------------------------------------------------------------------------


def read_queue(items: list[ReadItem]) -> list[ReadItem]:
    """The items to read: those not read yet that have a replica. An item whose index entry
    names no live replica fails as node_down."""
    if len(items) == 1 and items[0].replicas and not items[0].ok:
        return items  # a one-key get: no list to build
    queue = [it for it in items if not it.ok and it.replicas]
    if len(queue) < len(items):
        for it in items:
            if not it.replicas:
                it.fail(
                    "node_down",
                    UnavailableError(f"block {it.key!r}: the index names no live replica"),
                )
    return queue


def out_of_time(queue: list[ReadItem]) -> None:
    """The call's deadline passed with ``queue`` still unread: each fails as a timeout."""
    for it in queue:
        it.fail("timeout", DeadlineExceededError(f"get {it.key!r}: out of time"))


def rounds_left(items: list[ReadItem]) -> int:
    """The most replicas any of ``items`` has still to try: the rounds the read may yet take
    (each round gets its share of the time left). A read by content (write id 0) counts one
    round more: the Lookup and read it falls back to when it misses, so that a paused node
    leaves it time for them."""
    if len(items) == 1:  # a one-key get: no max()
        return _rounds_of(items[0])
    return max(map(_rounds_of, items))


def _rounds_of(it: ReadItem) -> int:
    """One item's part of :func:`rounds_left`."""
    return len(it.replicas) - it.next + (not it.entry.write_id)


def next_round(
    queue: list[ReadItem],
    members: Callable[[int], MemberInfo | None],
    sendable: Callable[[int], bool] | None = None,
) -> ReadGroups:
    """The next replica of every queued item, grouped by node address. Items whose next member
    is unknown fail as node_down, and so do those whose member is held back (``sendable``:
    asked once per member and round, see :meth:`~kvpool.client.placement.Placement.sendable`)."""
    groups: ReadGroups = {}
    held: dict[int, bool] = {}
    for it in queue:
        member_id = it.replicas[it.next]
        it.next += 1
        member = members(member_id)
        if member is None:
            it.fail(
                "node_down",
                UnavailableError(f"block {it.key!r}: member {member_id} is not live"),
            )
            continue
        if sendable is not None:
            go = held.get(member_id)
            if go is None:
                go = held[member_id] = sendable(member_id)
            if not go:
                it.fail(
                    "node_down",
                    UnavailableError(
                        f"block {it.key!r}: node {member.node_id} failed a request moments "
                        "ago; not asked again until its retry time"
                    ),
                )
                continue
        group = groups.get(member.data_address)
        if group is None:
            groups[member.data_address] = ([it], member)
        else:
            group[0].append(it)
    return groups


def still_unread(queue: list[ReadItem], on_retry: Callable[[int], None] | None) -> list[ReadItem]:
    """After a round: the items of ``queue`` still unread that have a replica left, for the
    next round (``on_retry`` hears how many, when there are any)."""
    if len(queue) == 1 and queue[0].ok:
        return []  # a one-key get that was read: no list to build
    queue = [it for it in queue if not it.ok and it.next < len(it.replicas)]
    if queue and on_retry is not None:
        on_retry(len(queue))
    return queue


NO_ANSWER_S = 0.1
"""How long a node may leave a read or a put wholly unanswered before the client takes it for a
node that stopped, not a slow one, and holds it back (:meth:`~kvpool.client.placement.Placement.
sendable`): a node answers a read's header in well under a millisecond. A shorter wait says
nothing of the node (the call's time was nearly spent)."""


PROBE_WAIT_S = 0.25
"""The longest a request to a held-back node (its probe) waits for an answer: a node that is
back answers in a few milliseconds, and the call the probe belongs to, a miss or a failed put if
it does not, should not wait out its whole deadline on a node that is likely still stopped."""


def probe_deadline(
    deadline: float, now: float, member_id: int, probing: Callable[[int], bool] | None
) -> float:
    """``deadline``, or sooner for a probe (:data:`PROBE_WAIT_S` from ``now``)."""
    if probing is not None and probing(member_id):
        return min(deadline, now + PROBE_WAIT_S)
    return deadline


def deliverable(
    op: Op, refs: Iterable[BlockRef], held: Callable[[int], bool] | None
) -> Iterable[BlockRef]:
    """The refs a PUBLISH or DELETE goes to: all of them, but a DELETE leaves out the members
    ``held`` back — it is best effort (a block the index no longer names is never read through
    it, and the node reclaims it under pressure), and waiting on a stopped node would hold up
    the put or remove that sends it."""
    if op != Op.DELETE or held is None:
        return refs
    return [ref for ref in refs if not held(ref.member.member_id)]


def silent_node(error: KVPoolError, calls: Sequence[Call], waited_s: float) -> bool:
    """Whether a read or put that failed with ``error`` after ``waited_s`` says its node stopped
    answering: its deadline passed after at least :data:`NO_ANSWER_S` with not one answer
    begun. Any other failure but a deadline says so too (:func:`read_failed_node`)."""
    return (
        isinstance(error, DeadlineExceededError)
        and waited_s >= NO_ANSWER_S
        and all(call.header is None for call in calls)
    )


def read_failed_node(error: KVPoolError, calls: Sequence[Call], waited_s: float) -> bool:
    """Whether a node's reads that failed with ``error`` after ``waited_s`` count against the
    node (``node_failed``): any failure but a deadline, and a deadline of a silent node."""
    return not isinstance(error, DeadlineExceededError) or silent_node(error, calls, waited_s)


def unreached_reads(items: list[ReadItem], error: KVPoolError) -> None:
    """No connection to the node of ``items`` (``error``): each records it, as a timeout or
    node_down."""
    reason, failure = transport_failure(error)
    for it in items:
        it.fail(reason, failure)


def unreached_node(
    items: list[ReadItem],
    error: KVPoolError,
    member_id: int,
    rules: PlaneRules,
    *,
    cut_short: bool = False,
) -> None:
    """No connection to the node of ``items`` (``error``): each records why, and the node is
    reported failed — or slow, when the connect timed out only because the hedge delay cut it
    short (``cut_short``: another replica is there to go to)."""
    unreached_reads(items, error)
    if cut_short and isinstance(error, DeadlineExceededError):
        if rules.on_slow is not None:
            rules.on_slow(member_id)
    else:
        rules.on_failed(member_id)


def node_read_failed(
    plan: NodeRead, error: KVPoolError, member_id: int, waited_s: float, rules: PlaneRules
) -> None:
    """A node's reads failed with ``error`` after ``waited_s``: each key records it, and the
    node is reported failed unless it was merely slow (:func:`read_failed_node`)."""
    plan.fail_all(error)
    if read_failed_node(error, plan.calls, waited_s):
        rules.on_failed(member_id)


def node_read_answered(plan: NodeRead, member_id: int, rules: PlaneRules) -> Call | None:
    """A node answered its reads: it is held back no longer, and its answers are judged.
    Returns the call that ends the answers' shared-memory leases, if any, to send (posted)."""
    rules.on_answered(member_id)
    plan.judge()
    return plan.release_call()


# --- puts -----------------------------------------------------------------------------------------


def put_groups(items: list[PutItem], time_left_s: float) -> PutGroups:
    """Every item's targets grouped by node address; none when no time is left (each item
    then fails as out of time before sending)."""
    if time_left_s <= 0:
        for it in items:
            it.error = DeadlineExceededError(f"put {it.key!r}: out of time before sending")
        return {}
    groups: PutGroups = {}
    for it in items:
        for member in it.targets:
            groups.setdefault(member.data_address, []).append((it, member))
    return groups


def unreached_puts(group: list[tuple[PutItem, MemberInfo]], error: KVPoolError) -> None:
    """No connection to the node of ``group`` (``error``): each block records it there — the
    deadline's error as it is, any other as UnavailableError."""
    late = error if isinstance(error, DeadlineExceededError) else None
    for it, _ in group:
        it.error = late or UnavailableError(error.message)


# --- a read, round by round: the flow both data planes carry out ---------------------------------


@dataclass(eq=False, slots=True)
class NodeReads:
    """One node's reads of a round, as a data plane sent them: the node, its keys (clones of
    a hedge's keys when ``clones``), the deadline they were sent with, and the plane's own
    handle on them (``io``: its connection and plan, or its task; None once over)."""

    address: str
    items: list[ReadItem]
    member: MemberInfo
    deadline: float
    clones: bool = False
    io: Any = None


@dataclass(slots=True)
class SendReads:
    """Send each node of ``groups`` its keys' reads, by ``deadline`` (opening a connection by
    ``connect_by`` when given: a blocking plane cannot hedge a connect), and list the
    :class:`NodeReads` underway in ``sent``. A node that could not be reached, or whose keys
    were all read through its shared directory, is not listed: its items say what happened.
    With ``wait``, finish every read first (and list none): a round that will not hedge."""

    groups: ReadGroups
    deadline: float
    connect_by: float | None = None
    clones: bool = False
    wait: bool = False
    sent: list[NodeReads] = field(default_factory=list)


@dataclass(slots=True)
class AwaitReads:
    """Finish each of ``reads`` whose answer arrives before ``until`` (its items judged) and
    list those in ``done`` — as soon as one is, when ``first``, else all of them or as many as
    ``until`` allowed."""

    reads: list[NodeReads]
    until: float
    first: bool = False
    done: list[NodeReads] = field(default_factory=list)


@dataclass(slots=True)
class DropReads:
    """Stop ``reads``: none of their answers is taken, so none lands in a caller's buffer
    later (a clone's own buffer may still be written)."""

    reads: list[NodeReads]


RoundStep = SendReads | AwaitReads | DropReads
RoundFlow = Generator[RoundStep, None, None]
"""A read's steps; a data plane carries out each (``for step in flow``) and writes its answer
on the step (``sent``, ``done``) before taking the next: nothing is sent into the flow, so a
one-round read costs a loop over a generator, not a driver."""


def ignore(_member_id: int) -> None:
    """Hear of a member and do nothing (a :class:`PlaneRules` callback left unset)."""


def never_held(_member_id: int) -> bool:
    """No member is held back (:attr:`PlaneRules.probing` left unset)."""
    return False


@dataclass(frozen=True, slots=True)
class PlaneRules:
    """What a data plane's reads and puts go by: its clock, its hedge policy, which members
    are held back (``probing``: asked once, briefly, :data:`PROBE_WAIT_S`) and which of them
    may be asked now (``sendable``); and who hears of a node that failed (``on_failed``),
    answered (``on_answered``) or was silent past the hedge delay (``on_slow``), of hedges
    (``on_hedge``: keys hedged, then keys the hedge served) and of keys that go again to
    another replica after a round (``on_retry``). ``content``: which keys name their content
    (the client's ``direct_reads``), whose cached entries a node's shared directory may serve
    (:func:`~kvpool.client.plans.read_listed`)."""

    clock: Callable[[], float]
    hedge: HedgePolicy
    probing: Callable[[int], bool] = never_held
    sendable: Callable[[int], bool] | None = None
    on_failed: Callable[[int], None] = ignore
    on_answered: Callable[[int], None] = ignore
    on_slow: Callable[[int], None] | None = None
    on_hedge: Callable[[int, int], None] | None = None
    on_retry: Callable[[int], None] | None = None
    content: Callable[[str], bool] | None = None


def read_flow(
    items: list[ReadItem],
    members: Callable[[int], MemberInfo | None],
    deadline: float,
    rules: PlaneRules,
) -> RoundFlow:
    """Read every item from its replicas, in rounds, until read, out of replicas or out of
    time: the items record each outcome. A round that may hedge
    (:meth:`HedgePolicy.worth_it`) goes as :func:`hedged_round` says; any other is sent and
    finished in one step."""
    clock, sendable = rules.clock, rules.sendable
    queue = read_queue(items)
    while queue:
        now = clock()
        if now >= deadline:
            out_of_time(queue)
            return
        round_deadline = now + (deadline - now) / rounds_left(queue)
        groups = next_round(queue, members, sendable)
        if groups and rules.hedge.worth_it(queue):
            yield from hedged_round(groups, members, round_deadline, deadline, rules)
        elif groups:
            yield SendReads(groups, round_deadline, wait=True)
        queue = still_unread(queue, rules.on_retry)


def hedged_round(
    groups: ReadGroups,
    members: Callable[[int], MemberInfo | None],
    round_deadline: float,
    deadline: float,
    rules: PlaneRules,
) -> RoundFlow:
    """One round of reads that may hedge. Wait the hedge delay (:meth:`HedgePolicy.delay_s`
    of the round's bytes) for the nodes to answer; the keys of the nodes still silent then are
    also read from their next replica, by clones into buffers of their own (:class:`Hedge`),
    but not from a node of this round that is silent too. Wait until each hedged key is read
    or both its reads are over; stop the reads still running (a first read's keys then fail as
    unanswered there) and fold the clones back (:meth:`Hedge.settle`)."""
    clock, hedge, on_hedge, on_slow = rules.clock, rules.hedge, rules.on_hedge, rules.on_slow
    now = clock()
    send = SendReads(groups, round_deadline, connect_by=min(round_deadline, now + hedge.delay_s(0)))
    yield send
    firsts = send.sent
    if not firsts:
        return
    delay_s = hedge.delay_s(max(round_bytes(r.items) for r in firsts))
    wait = AwaitReads(firsts, min(clock() + delay_s, round_deadline))
    yield wait
    if len(wait.done) == len(firsts):  # every node answered within the hedge delay
        return
    over = {id(r) for r in wait.done}
    slow = [r for r in firsts if id(r) not in over]
    second = Hedge(it for r in slow for it in r.items)
    clone_groups = next_round(second.clones, members, rules.sendable)
    for address in {r.address for r in slow} & clone_groups.keys():  # it would wait too
        second.forget(clone_groups.pop(address)[0])
    limit = round_deadline
    waiting = slow
    if len(second):
        if on_hedge is not None:
            on_hedge(len(second), 0)
        if on_slow is not None:
            for r in slow:
                on_slow(r.member.member_id)
        now = clock()
        hedge_deadline = now + (deadline - now) / (rounds_left(second.clones) + 1)
        send = SendReads(clone_groups, hedge_deadline, clones=True)
        yield send
        waiting = slow + send.sent
        limit = max(round_deadline, hedge_deadline)
    reader = {id(it): r for r in waiting for it in r.items}

    def read_over(it: ReadItem) -> bool:  # a clone never sent counts as over
        r = reader.get(id(it))
        return r is None or id(r) in over

    while waiting and not (len(second) and second.resolved(read_over, read_over)):
        if clock() >= limit:
            break
        wait = AwaitReads(waiting, limit, first=bool(len(second)))
        yield wait
        over.update(id(r) for r in wait.done)
        waiting = [r for r in waiting if id(r) not in over]
    if waiting:
        yield DropReads(waiting)
    won = second.settle()
    if len(second) and on_hedge is not None:
        on_hedge(0, won)
    for r in waiting:
        if not r.clones:
            fail_unanswered(r.items, r.address, hedged=bool(len(second)))


# --- a put's stage: the flow both data planes carry out ------------------------------------------


@dataclass(eq=False, slots=True)
class NodePuts:
    """One node's share of a put: its blocks and their deadline (shorter for a probe), and
    what the data plane found: the plan it sent (``plan``, a :class:`NodeStage`; None when the
    node could not be reached), the error the exchange failed with, how long it waited for
    the answers, and the plane's own handle (``io``: the connection)."""

    address: str
    group: list[tuple[PutItem, MemberInfo]]
    deadline: float
    plan: NodeStage | None = None
    error: KVPoolError | None = None
    waited_s: float = 0.0
    io: Any = None


@dataclass(slots=True)
class SendPuts:
    """For each of ``puts``, every node at once: open a connection by its deadline, make its
    plan (:class:`NodeStage`, over the connection's shared memory when it has one), send every
    call and take the answers; record the plan, or the error and how long the answers were
    waited for."""

    puts: list[NodePuts]


@dataclass(slots=True)
class CommitPuts:
    """Send each of ``puts``' shared-memory commit (``plan.commit``) on its connection and take
    the answer; an exchange that failed records its error on the commit call."""

    puts: list[NodePuts]


StageStep = SendPuts | CommitPuts
StageFlow = Generator[StageStep, None, None]


class CommitStart:
    """When a stage starts its put's index commit (``start``, called once): as soon as a
    node has been handed every byte of its blocks — over TCP its PUT frames sent, over shared
    memory the copies made and the node's commit sent (:meth:`sent`) — or, at the end, when a
    replica acked only then (:meth:`finish`: a node's inline blocks beside a failed
    reservation). Never when nothing was staged."""

    __slots__ = ("_start", "started")

    def __init__(self, start: Callable[[], None]) -> None:
        self._start = start
        self.started = False

    def sent(self) -> None:
        if not self.started:
            self.started = True
            self._start()

    def finish(self, items: list[PutItem]) -> bool:
        """At the stage's end: start if a replica acked and it has not; whether it did."""
        if any(it.acked for it in items):
            self.sent()
        return self.started


def stage_flow(items: list[PutItem], deadline: float, rules: PlaneRules) -> StageFlow:
    """PUT every item to each of its targets, every node at once, by ``deadline``:
    ``item.acked`` lists the members that staged it, ``item.error`` the last failure. A node
    that could not be reached, or failed, is reported (``on_failed``), and so is one silent
    for :data:`NO_ANSWER_S` (:func:`silent_node`); one that answered is no longer held back
    (``on_answered``). Steps and answers as :data:`RoundFlow`'s."""
    clock, probing, on_failed = rules.clock, rules.probing, rules.on_failed
    groups = put_groups(items, deadline - clock())
    if not groups:
        return
    now = clock()
    puts = [
        NodePuts(address, group, probe_deadline(deadline, now, group[0][1].member_id, probing))
        for address, group in groups.items()
    ]
    yield SendPuts(puts)
    committing: list[NodePuts] = []
    for put in puts:
        member_id = put.group[0][1].member_id
        plan, error = put.plan, put.error
        if plan is None:
            assert error is not None
            unreached_puts(put.group, error)
            on_failed(member_id)
        elif error is not None:
            plan.fail_all(error, on_failed)
            if silent_node(error, plan.calls, put.waited_s):
                on_failed(member_id)
        else:
            rules.on_answered(member_id)
            plan.judge()
            if plan.commit is not None:
                committing.append(put)
    if committing:
        yield CommitPuts(committing)
        for put in committing:
            assert put.plan is not None
            put.plan.judge_commit()
