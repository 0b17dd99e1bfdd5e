"""What both data planes decide around their I/O, once — no I/O.

The event-loop data plane (:mod:`kvpool.client.blocks`) and the synchronous client's
(:mod:`kvpool.client.blocking_plane`) read in rounds: a round sends every key still unread to the
node of its next replica (:func:`next_round`), with the time left shared out over the rounds the
keys may yet take (:func:`rounds_left`); after it, the keys still unread that have a replica left
go again (:func:`still_unread`). They put every block to each of its targets at once
(:func:`put_groups`). What a key counts as when it cannot be sent — no replica, no time, a node
that could not be reached — is decided here too; the planes open, send, wait and judge (with
:mod:`kvpool.client.plans`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvpool.client.placement import MemberInfo
from kvpool.client.plans import BlockRef, PutItem, ReadItem, transport_failure
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
