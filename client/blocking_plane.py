"""The synchronous client's data plane: block frames to store nodes in the calling thread.

One :class:`~kvpool.transports.blocking.BlockingConnection` per thread and node (TCP, or the
node's shared memory where it offers it); an ended thread's are kept for the next thread, up to
``connections_per_node`` idle per node (:mod:`kvpool.transports.threads`). The same per-node
plans and judging as the event-loop data plane (:mod:`kvpool.client.blocks`,
:mod:`kvpool.client.plans`). Kernel socket timeouts bound each read and write; a connection that
timed out is closed, so no late byte can land in a caller's buffer after the call returned
(nothing reads that socket again).

Hedged reads (:mod:`kvpool.client.hedge`): after sending a round, the plane waits (``poll``) for
the nodes to start answering; the keys of nodes still silent after the hedge delay are also
sent to their next replica, into buffers of their own, and whichever node answers first is read
first; the connection of a read that lost is closed (no answer of it is read, so none lands in
a caller's buffer). Opening a connection blocks the thread, so with another replica to go to
it may take only the hedge delay.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from opentelemetry.trace import SpanKind

from kvpool import tracing
from kvpool.client import links, rounds
from kvpool.client.hedge import Hedge, HedgePolicy, fail_unanswered, round_bytes
from kvpool.client.ops import drive
from kvpool.client.placement import MemberInfo
from kvpool.client.plans import (
    BlockRef,
    NodeRead,
    NodeStage,
    PutItem,
    ReadItem,
    ref_rounds,
    refs_by_node,
)
from kvpool.client.spans import read_attributes
from kvpool.client.state import ClientState
from kvpool.errors import DeadlineExceededError, KVPoolError
from kvpool.proto.wire import Op
from kvpool.transports import open_blocking
from kvpool.transports.blocking import BlockingConnection, time_left
from kvpool.transports.threads import ThreadConnections


class BlockingDataPlane:
    """Frames to store nodes from the calling thread: one connection per thread and node."""

    def __init__(
        self,
        core: ClientState,
        on_node_failed: Callable[[int], None],
        *,
        connect_timeout_s: float,
        on_node_slow: Callable[[int], None] | None = None,
        sendable: Callable[[int], bool] | None = None,
        probing: Callable[[int], bool] | None = None,
        on_node_answered: Callable[[int], None] | None = None,
    ) -> None:
        self._links = core.links
        self._sendable = sendable
        self._probing: Callable[[int], bool] = probing or (lambda _mid: False)
        self._on_node_answered = on_node_answered or (lambda _mid: None)
        self._hedge: HedgePolicy = core.hedge_policy
        self._on_hedge = core.counters.hedged
        self._on_node_slow = on_node_slow or (lambda _mid: None)
        self._token = core.security.token
        self._on_node_failed = on_node_failed
        self._connect_timeout_s = connect_timeout_s
        self._poll_s = core.config.busy_poll_us / 1e6  # before a read's answer
        self._conns = ThreadConnections(core.config.connections_per_node)

    def close(self) -> None:
        self._conns.close()

    # --- connections ----------------------------------------------------------------------

    def connection(self, address: str, deadline: float) -> BlockingConnection:
        """This thread's connection to ``address`` (:class:`ThreadConnections`), opened if
        it has none."""
        conn = self._conns.get(address)
        if conn is None:
            timeout_s = min(deadline - time.monotonic(), self._connect_timeout_s)
            if timeout_s <= 0:
                raise DeadlineExceededError(f"{address}: no time left to connect")
            conn = self._open(address, timeout_s)
            self._conns.add(address, conn)
        return conn

    def discard(self, address: str, conn: BlockingConnection) -> None:
        self._conns.discard(address, conn)

    def lend_this_threads(self) -> None:
        """This thread's connections go to the next thread that needs one (a warm-up's)."""
        self._conns.lend_this_threads()

    def _open(self, address: str, timeout_s: float) -> BlockingConnection:
        """A connection to ``address``, made as :func:`~kvpool.client.links.open_flow` says, in
        ``timeout_s`` for all its steps."""
        dial = partial(self._dial, deadline=time.monotonic() + timeout_s)
        conn: BlockingConnection = drive(links.open_flow(self._links, address), dial)
        return conn

    def _dial(
        self, dial: links.Dial, deadline: float
    ) -> BlockingConnection | tuple[BlockingConnection, links.NodeOffer] | KVPoolError:
        try:
            conn = open_blocking(dial.address, time_left(deadline), self._token)
            return (conn, _hello(conn, time_left(deadline))) if dial.hello else conn
        except KVPoolError as e:
            return e

    # --- reads ----------------------------------------------------------------------------

    def read(
        self,
        items: list[ReadItem],
        members: Callable[[int], MemberInfo | None],
        deadline: float,
        on_retry: Callable[[int], None] | None = None,
    ) -> None:
        """Read every item from its replicas, in rounds (as the event-loop data plane)."""
        queue = rounds.read_queue(items)
        while queue:
            now = time.monotonic()
            if now >= deadline:
                rounds.out_of_time(queue)
                return
            round_deadline = now + (deadline - now) / rounds.rounds_left(queue)
            sent: list[_Sent] = []
            by_node = rounds.next_round(queue, members, self._sendable)
            hedging = self._hedge.worth_it(queue)
            # Opening a connection is not hedged (it blocks this thread): with another replica
            # to go to, it may take only the hedge delay.
            connect_by = min(round_deadline, now + self._hedge.delay_s(0)) if hedging else None
            # One span per node when a round reads from several (one node: the node's span
            # is the caller's child directly).
            per_node = tracing.STATE.enabled and len(by_node) > 1 and tracing.recording()
            trace = tracing.frame_trace() if tracing.STATE.enabled and not per_node else b""
            for address, (group, member) in by_node.items():
                span = None
                if per_node:
                    span = tracing.tracer().start_span(
                        "kvpool.client.read",
                        kind=SpanKind.CLIENT,
                        attributes={"kvpool.node": address, "kvpool.keys": len(group)},
                    )
                started = self._send_reads(
                    address,
                    group,
                    member,
                    round_deadline,
                    tracing.frame_trace(span) if span else trace,
                    connect_by=connect_by,
                )
                if started is not None:
                    sent.append((*started, span))
                elif span is not None:
                    span.set_attributes(read_attributes(group))
                    span.end()
            if sent and hedging:
                self._hedged_round(sent, members, round_deadline, deadline)
            else:
                for entry in sent:
                    self._finish_entry(entry, round_deadline)
            queue = rounds.still_unread(queue, on_retry)

    def _finish_entry(self, entry: _Sent, deadline: float) -> None:
        conn, plan, node, span = entry
        self._finish_reads(conn, plan, node, deadline)
        if span is not None:
            span.set_attributes(read_attributes(plan.items))
            span.end()

    def _hedged_round(
        self,
        sent: list[_Sent],
        members: Callable[[int], MemberInfo | None],
        round_deadline: float,
        deadline: float,
    ) -> None:
        """Finish a round's reads, hedging the keys of nodes still silent after the hedge
        delay (see the module doc)."""
        delay_s = self._hedge.delay_s(max(round_bytes(e[1].items) for e in sent))
        if len(sent) == 1:  # the common round: one node; its answer is on the way
            conn = sent[0][0]
            if self._poll_s and conn.busy_poll(self._poll_s) and conn.answer_waiting():
                self._finish_entry(sent[0], round_deadline)
                return
            hedge_at = min(time.monotonic() + delay_s, round_deadline)
            while (left := hedge_at - time.monotonic()) > 0:
                if select.select([conn.socket], (), (), left)[0] and conn.answer_waiting():
                    self._finish_entry(sent[0], round_deadline)
                    return
        poller = select.poll()
        waiting: dict[int, tuple[_Sent, float]] = {}
        for entry in sent:
            fd = entry[0].socket.fileno()
            waiting[fd] = (entry, round_deadline)
            poller.register(fd, select.POLLIN)
        done: set[int] = set()  # ids of the items and clones whose read is over

        def finish(fd: int) -> None:
            if not waiting[fd][0][0].answer_waiting():
                return  # only a posted answer (a PUBLISH's) was there: keep waiting
            entry, entry_deadline = waiting.pop(fd)
            poller.unregister(fd)
            self._finish_entry(entry, entry_deadline)
            done.update(id(it) for it in entry[1].items)

        _serve(poller, finish, min(time.monotonic() + delay_s, round_deadline), lambda: not waiting)
        if not waiting:
            return
        slow = [entry for entry, _ in waiting.values()]
        hedge = Hedge(it for e in slow for it in e[1].items)
        busy = {e[1].address for e in slow}  # asked already: a hedge there would wait too
        groups = rounds.next_round(hedge.clones, members, self._sendable)
        for address in busy & groups.keys():
            clones, _member = groups.pop(address)
            hedge.forget(clones)
        if len(hedge):
            self._on_hedge(len(hedge), 0)
            for e in slow:
                self._on_node_slow(e[2].member_id)
            now = time.monotonic()
            hedge_deadline = now + (deadline - now) / (rounds.rounds_left(hedge.clones) + 1)
            for address, (clones, member) in groups.items():
                started = self._send_reads(address, clones, member, hedge_deadline)
                if started is None:
                    done.update(id(c) for c in clones)
                    continue
                fd = started[0].socket.fileno()
                waiting[fd] = ((*started, None), hedge_deadline)
                poller.register(fd, select.POLLIN)
            limit = max(round_deadline, hedge_deadline)
            _serve(
                poller,
                finish,
                limit,
                lambda: (
                    not waiting
                    or hedge.resolved(lambda it: id(it) in done, lambda c: id(c) in done)
                ),
            )
        else:
            _serve(poller, finish, round_deadline, lambda: not waiting)
        abandoned = [entry for entry, _ in waiting.values()]
        for conn, plan, _node, span in abandoned:
            # Closed, not kept with answers owed: on a later call, the owed answer arriving
            # would look like that call's (the socket readable) and block it unhedged; and a
            # shared-memory connection's leases end with it.
            self.discard(plan.address, conn)
            if span is not None:
                span.set_attributes(read_attributes(plan.items))
                span.end()
        self._on_hedge(0, hedge.settle())
        firsts = {id(e[1]) for e in slow}
        for _conn, plan, _node, _span in abandoned:
            if id(plan) in firsts:
                fail_unanswered(plan.items, plan.address)

    def _send_reads(
        self,
        address: str,
        group: list[ReadItem],
        member: MemberInfo,
        deadline: float,
        trace: bytes = b"",
        *,
        connect_by: float | None = None,
    ) -> tuple[BlockingConnection, NodeRead, MemberInfo] | None:
        held = self._probing(member.member_id)  # a probe: rounds.PROBE_WAIT_S at most
        if held:
            deadline = min(deadline, time.monotonic() + rounds.PROBE_WAIT_S)
            if connect_by is not None:
                connect_by = min(connect_by, deadline)
        try:
            conn = self.connection(address, deadline if connect_by is None else connect_by)
        except KVPoolError as e:
            rounds.unreached_reads(group, e)
            if isinstance(e, DeadlineExceededError) and connect_by is not None:
                self._on_node_slow(member.member_id)
            else:
                self._on_node_failed(member.member_id)
            return None
        plan = links.node_read(address, group, conn)
        if not plan.calls:  # all read through the node's shared directory
            return None
        plan.sent_at = time.monotonic()
        try:
            conn.send(plan.calls, deadline, trace=trace)
        except KVPoolError as e:
            self._failed(address, conn, plan, member, e)
            return None
        return conn, plan, member

    def _finish_reads(
        self, conn: BlockingConnection, plan: NodeRead, member: MemberInfo, deadline: float
    ) -> None:
        held = self._probing(member.member_id)
        if held:
            deadline = min(deadline, plan.sent_at + rounds.PROBE_WAIT_S)
        try:
            conn.receive(plan.calls, deadline, poll_s=self._poll_s)
        except KVPoolError as e:
            self._failed(plan.address, conn, plan, member, e)
            return
        if held:
            self._on_node_answered(member.member_id)
        plan.judge()
        release = plan.release_call()
        try:
            if release is not None:
                conn.notify([release], deadline)
            if plan.followups:
                conn.exchange(plan.followups, deadline)
        except KVPoolError as e:
            self.discard(plan.address, conn)
            for call in plan.followups:
                call.error = e
        if plan.followups:
            plan.judge_followups()

    def _failed(
        self,
        address: str,
        conn: BlockingConnection,
        plan: NodeRead,
        member: MemberInfo,
        error: KVPoolError,
    ) -> None:
        self.discard(address, conn)
        plan.fail_all(error)
        waited_s = time.monotonic() - plan.sent_at
        if rounds.read_failed_node(error, plan.calls, waited_s):
            self._on_node_failed(member.member_id)

    # --- writes ---------------------------------------------------------------------------

    def stage(self, items: list[PutItem], deadline: float) -> None:
        """PUT every item to each of its targets (all nodes at once)."""
        sent: list[tuple[BlockingConnection, NodeStage, float, float]] = []
        for address, group in rounds.put_groups(items, deadline - time.monotonic()).items():
            member_id = group[0][1].member_id
            started = time.monotonic()
            by = rounds.probe_deadline(deadline, started, member_id, self._probing)
            try:
                conn = self.connection(address, by)
            except KVPoolError as e:
                rounds.unreached_puts(group, e)
                self._on_node_failed(member_id)
                continue
            plan = NodeStage(address, group, links.conn_arena(conn))
            try:
                for calls in plan.chunks():
                    conn.send(calls, by)
            except KVPoolError as e:
                self.discard(address, conn)
                plan.fail_all(e, self._on_node_failed)
                continue
            sent.append((conn, plan, by, started))
        for conn, plan, by, started in sent:
            try:
                conn.receive(plan.calls, by)
            except KVPoolError as e:
                self.discard(plan.address, conn)
                plan.fail_all(e, self._on_node_failed)
                if rounds.silent_node(e, plan.calls, time.monotonic() - started):
                    self._on_node_failed(plan.group[0][1].member_id)
                continue
            if self._probing(plan.group[0][1].member_id):
                self._on_node_answered(plan.group[0][1].member_id)
            plan.judge()
            if plan.commit is not None:
                try:
                    conn.exchange([plan.commit], by)
                except KVPoolError as e:
                    self.discard(plan.address, conn)
                    plan.commit.error = e
                plan.judge_commit()

    def send_refs(
        self, op: Op, refs: list[BlockRef], deadline: float, *, wait: bool = True
    ) -> None:
        """PUBLISH or DELETE (failures are ignored). ``wait=False``: the answers are not waited
        for — read and dropped on the way to a later answer on the same connection. A PUBLISH
        waited for is waited for until the node has *handled* it (:func:`ref_rounds`), not
        until the node's check with the index answers it. A DELETE skips the nodes held back
        (:func:`~kvpool.client.rounds.deliverable`): it is best effort, and a stopped node
        would make the caller wait for it."""
        groups = refs_by_node(rounds.deliverable(op, refs, self._probing))
        sent = []
        for address, group in groups.items():
            posted, awaited = ref_rounds(op, group, wait)
            try:
                conn = self.connection(address, deadline)
                if posted:
                    conn.send(posted, deadline, posted=True)
                if awaited:
                    conn.send(awaited, deadline)
            except KVPoolError:
                continue
            if awaited:
                sent.append((address, conn, awaited))
        for address, conn, calls in sent:
            try:
                conn.receive(calls, deadline)
            except KVPoolError:
                self.discard(address, conn)


_Sent = tuple[BlockingConnection, NodeRead, MemberInfo, Any]
"""A node's reads sent in a round: connection, plan, member, span (or None)."""


def _serve(
    poller: select.poll, finish: Callable[[int], None], limit: float, until: Callable[[], bool]
) -> None:
    """Finish each connection ``poller`` reports readable until ``until()`` holds or the
    monotonic clock reaches ``limit``."""
    while not until():
        left = limit - time.monotonic()
        if left <= 0:
            return
        events = poller.poll(max(1, int(left * 1000 + 0.999)))
        if not events:
            continue
        for fd, _mask in events:
            finish(fd)


def _hello(conn: BlockingConnection, timeout_s: float) -> links.NodeOffer:
    call = links.hello_call()
    try:
        conn.exchange([call], time.monotonic() + timeout_s)
    except KVPoolError:
        conn.close()
        raise
    return links.read_hello(call, conn.sockname, conn.peername)
