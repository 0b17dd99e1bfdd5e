"""The synchronous client's data plane: block frames to store nodes in the calling thread.

One :class:`~kvpool.transports.blocking.BlockingConnection` per thread and node (TCP, or the
node's shared memory where it offers it); an ended thread's are kept for the next thread, up to
``connections_per_node`` idle per node (:mod:`kvpool.transports.threads`). The same per-node
plans and judging as the event-loop data plane (:mod:`kvpool.client.blocks`,
:mod:`kvpool.client.plans`). Kernel socket timeouts bound each read and write; a connection that
timed out is closed, so no late byte can land in a caller's buffer after the call returned
(nothing reads that socket again).

Reads go as :func:`kvpool.client.rounds.read_flow` says, round by round, hedges included: this
plane sends each node's frames on this thread's connection and waits for the answers with
``select``/``poll``; a read that is dropped has its connection closed (no answer of it is read,
so none lands in a caller's buffer). Opening a connection blocks the thread, so with another
replica to go to it may take only the hedge delay (``SendReads.connect_by``).
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from opentelemetry.trace import SpanKind

from kvpool import tracing
from kvpool.client import links, rounds
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
from kvpool.transports.calls import Call
from kvpool.transports.threads import ThreadConnections

ANSWERED_GRACE_S = 0.05
"""After a put's commit, how long the nodes' answers to its stage are still waited for even
past the stage's deadline: the nodes answered while the masters committed (an election can
make that long), and the answers are in the socket."""


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
        counters = core.counters
        self._rules = rounds.PlaneRules(
            time.monotonic,
            core.hedge_policy,
            probing=probing or rounds.never_held,
            sendable=sendable,
            on_failed=on_node_failed,
            on_answered=on_node_answered or rounds.ignore,
            on_slow=on_node_slow,
            on_hedge=counters.hedged,
            on_retry=counters.replica_retries,
            content=core.direct_keys,
        )
        self._token = core.security.token
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
    ) -> None:
        """Read every item from its replicas, in rounds: :func:`~kvpool.client.rounds.
        read_flow`, carried out in this thread."""
        flow = rounds.read_flow(items, members, deadline, self._rules)
        underway: list[rounds.NodeReads] = []
        try:
            for step in flow:
                if isinstance(step, rounds.SendReads):
                    step.sent = self._send_round(step)
                    underway += step.sent
                elif isinstance(step, rounds.AwaitReads):
                    step.done = self._await(step.reads, step.until, step.first)
                else:
                    self._drop(step.reads)
        finally:  # a read left with answers owed (an error): its connection goes
            if underway:
                self._drop([r for r in underway if r.io is not None])

    def _send_round(self, step: rounds.SendReads) -> list[rounds.NodeReads]:
        """Send each node its reads; with ``step.wait``, finish them too (and list none)."""
        # One span per node when a round reads from several (one node: the node's span is
        # the caller's child directly).
        per_node = tracing.STATE.enabled and len(step.groups) > 1 and tracing.recording()
        trace = tracing.frame_trace() if tracing.STATE.enabled and not per_node else b""
        sent: list[rounds.NodeReads] = []
        waiting: list[tuple[BlockingConnection, NodeRead, MemberInfo, Any]] = []
        for address, (group, member) in step.groups.items():
            span = None
            if per_node:
                span = tracing.tracer().start_span(
                    "kvpool.client.read",
                    kind=SpanKind.CLIENT,
                    attributes={"kvpool.node": address, "kvpool.keys": len(group)},
                )
                trace = tracing.frame_trace(span)
            started = self._send_reads(address, group, member, step, trace)
            if started is None:
                _end(span, group)
            elif step.wait:  # no NodeReads to make: a one-step round
                waiting.append((*started, member, span))
            else:
                io = (*started, span)
                sent.append(
                    rounds.NodeReads(address, group, member, step.deadline, step.clones, io)
                )
        for conn, plan, member, span in waiting:
            self._finish_reads(conn, plan, member, step.deadline)
            _end(span, plan.items)
        return sent

    def _await(
        self, reads: list[rounds.NodeReads], until: float, first: bool
    ) -> list[rounds.NodeReads]:
        """Finish each of ``reads`` whose answer begins before ``until`` (see
        :class:`~kvpool.client.rounds.AwaitReads`)."""
        if len(reads) == 1:  # the common round: one node; its answer is on the way
            conn = reads[0].io[0]
            if self._poll_s and conn.busy_poll(self._poll_s) and conn.answer_waiting():
                self._finish(reads[0])
                return reads
            while (left := until - time.monotonic()) > 0:
                if select.select([conn.socket], (), (), left)[0] and conn.answer_waiting():
                    self._finish(reads[0])
                    return reads
            return []
        poller = select.poll()
        by_fd = {r.io[0].socket.fileno(): r for r in reads}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        done: list[rounds.NodeReads] = []
        while by_fd and not (first and done) and (left := until - time.monotonic()) > 0:
            for fd, _mask in poller.poll(max(1, int(left * 1000 + 0.999))):
                r = by_fd[fd]
                if r.io[0].answer_waiting():  # not only a posted answer (a PUBLISH's)
                    poller.unregister(fd)
                    del by_fd[fd]
                    self._finish(r)
                    done.append(r)
        return done

    def _finish(self, reads: rounds.NodeReads) -> None:
        conn, plan, span = reads.io
        reads.io = None
        self._finish_reads(conn, plan, reads.member, reads.deadline)
        _end(span, plan.items)

    def _drop(self, reads: list[rounds.NodeReads]) -> None:
        """Close the connections of reads whose answers will not be read: kept with answers
        owed, on a later call the owed answer arriving would look like that call's (the
        socket readable) and block it unhedged; and a shared-memory connection's leases end
        with it."""
        for r in reads:
            conn, plan, span = r.io
            r.io = None
            self.discard(plan.address, conn)
            _end(span, plan.items)

    def _send_reads(
        self,
        address: str,
        group: list[ReadItem],
        member: MemberInfo,
        step: rounds.SendReads,
        trace: bytes,
    ) -> tuple[BlockingConnection, NodeRead] | None:
        """Send a node its reads of ``step``'s round: the connection and plan, or None (the
        reads failed, or were all read through the node's shared directory)."""
        deadline, connect_by = step.deadline, step.connect_by
        held = self._rules.probing(member.member_id)  # a probe: rounds.PROBE_WAIT_S at most
        if held:
            deadline = min(deadline, time.monotonic() + rounds.PROBE_WAIT_S)
            if connect_by is not None:
                connect_by = min(connect_by, deadline)
        try:
            conn = self.connection(address, deadline if connect_by is None else connect_by)
        except KVPoolError as e:
            cut_short = connect_by is not None
            rounds.unreached_node(group, e, member.member_id, self._rules, cut_short=cut_short)
            return None
        plan = links.node_read(address, group, conn, self._rules.content)
        if not plan.calls:  # all read through the node's shared directory
            return None
        plan.sent_at = time.monotonic()
        try:
            conn.send(plan.calls, deadline, trace=trace)
        except KVPoolError as e:
            self._failed(address, conn, plan, member, e)
            return None
        return conn, plan

    def _finish_reads(
        self, conn: BlockingConnection, plan: NodeRead, member: MemberInfo, deadline: float
    ) -> None:
        held = self._rules.probing(member.member_id)
        if held:
            deadline = min(deadline, plan.sent_at + rounds.PROBE_WAIT_S)
        try:
            conn.receive(plan.calls, deadline, poll_s=self._poll_s)
        except KVPoolError as e:
            self._failed(plan.address, conn, plan, member, e)
            return
        release = rounds.node_read_answered(plan, member.member_id, self._rules)
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
        waited_s = time.monotonic() - plan.sent_at
        rounds.node_read_failed(plan, error, member.member_id, waited_s, self._rules)

    # --- writes ---------------------------------------------------------------------------

    def stage(self, items: list[PutItem], deadline: float, sent: Callable[[], None]) -> bool:
        """PUT every item to each of its targets: :func:`~kvpool.client.rounds.stage_flow`,
        carried out in this thread (every node's frames sent before any answer is read), and
        the commit ``sent()`` started as :class:`~kvpool.client.rounds.CommitStart` says,
        before the answers are read. Whether it was (False: nothing staged)."""
        start = rounds.CommitStart(sent)
        for step in rounds.stage_flow(items, deadline, self._rules):
            if isinstance(step, rounds.SendPuts):
                self._send_puts(step.puts, start)
            else:
                self._commit_puts(step.puts, start)
        return start.finish(items)

    def _send_puts(self, puts: list[rounds.NodePuts], start: rounds.CommitStart) -> None:
        sending: list[tuple[rounds.NodePuts, BlockingConnection, NodeStage, float]] = []
        for put in puts:
            started = time.monotonic()
            try:
                conn = self.connection(put.address, put.deadline)
            except KVPoolError as e:
                put.error = e
                continue
            put.io, put.plan = conn, NodeStage(put.address, put.group, links.conn_arena(conn))
            try:
                for calls in put.plan.chunks():  # each group's frames made as the last one goes
                    conn.send(calls, put.deadline)
            except KVPoolError as e:
                self.discard(put.address, conn)
                put.error = e
                continue
            sending.append((put, conn, put.plan, started))
        late = 0.0
        if any(not plan.reserves for _, _, plan, _ in sending):
            late = self._while_unread(((p.address, c) for p, c, _, _ in sending), start.sent)
        for put, conn, plan, started in sending:
            try:
                conn.receive(plan.calls, max(put.deadline, late))
            except KVPoolError as e:
                self.discard(put.address, conn)
                put.error, put.waited_s = e, time.monotonic() - started

    def _commit_puts(self, puts: list[rounds.NodePuts], start: rounds.CommitStart) -> None:
        """The shared-memory commits: every node's sent, then the index commit started, then
        the answers."""
        sending: list[tuple[rounds.NodePuts, BlockingConnection, Call]] = []
        for put in puts:
            assert put.plan is not None
            commit = put.plan.commit
            assert commit is not None
            try:
                put.io.send([commit], put.deadline)
            except KVPoolError as e:
                self.discard(put.address, put.io)
                commit.error = e
                continue
            sending.append((put, put.io, commit))
        late = 0.0
        if sending:
            late = self._while_unread(((p.address, c) for p, c, _ in sending), start.sent)
        for put, conn, commit in sending:
            try:
                conn.receive([commit], max(put.deadline, late))
            except KVPoolError as e:
                self.discard(put.address, conn)
                commit.error = e

    def _while_unread(
        self, waiting: Iterable[tuple[str, BlockingConnection]], work: Callable[[], None]
    ) -> float:
        """Do ``work`` while the nodes' answers wait (``waiting``: address, connection); if it
        raises, those connections are closed (their answers will never be read) and the error
        goes on. Returns until when the answers are still read once it is done
        (:data:`ANSWERED_GRACE_S`): a commit that outlasted the stage's deadline (an election)
        must not fail a block its node took."""
        try:
            work()
        except BaseException:
            for address, conn in waiting:
                self.discard(address, conn)
            raise
        return time.monotonic() + ANSWERED_GRACE_S

    def send_refs(
        self, op: Op, refs: list[BlockRef], deadline: float, *, wait: bool = True
    ) -> None:
        """PUBLISH or DELETE (failures are ignored). ``wait=False``: the answers are not waited
        for — read and dropped on the way to a later answer on the same connection. A PUBLISH
        waited for is waited for until the node has *handled* it (:func:`ref_rounds`), not
        until the node's check with the index answers it. A DELETE skips the nodes held back
        (:func:`~kvpool.client.rounds.deliverable`): it is best effort, and a stopped node
        would make the caller wait for it."""
        groups = refs_by_node(rounds.deliverable(op, refs, self._rules.probing))
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


def _end(span: Any, items: list[ReadItem]) -> None:
    """End a node's span of a round (None: the round had none), saying how its reads went."""
    if span is not None:
        span.set_attributes(read_attributes(items))
        span.end()


def _hello(conn: BlockingConnection, timeout_s: float) -> links.NodeOffer:
    call = links.hello_call()
    try:
        conn.exchange([call], time.monotonic() + timeout_s)
    except KVPoolError:
        conn.close()
        raise
    return links.read_hello(call, conn.sockname, conn.peername)
