"""The client's data plane on an event loop: block frames to and from store nodes.

Reads go as :func:`kvpool.client.rounds.read_flow` says, round by round, hedges included: this
plane carries its steps out with a task per node (one pooled connection each, its frames sent at
once: one MGET, one SHM_GET or pipelined GETs, see :mod:`kvpool.client.plans`, where every answer
is judged) and :func:`asyncio.wait`. A first read that is dropped is cancelled; a hedge's clone
finishes in the background, into its own buffer. Writes go as :func:`kvpool.client.rounds.
stage_flow` says (PUT frames or shared-memory reservations to every target replica at once);
PUBLISH follows the commit (not waited for), DELETE a remove (best effort).

Connections come from a pool per node address; the first one to a node asks HELLO and, where the
node is on this host and the ``transport`` setting allows, the pool hands out connections to the
node's shared memory instead (:mod:`kvpool.client.links`).

A payload read into a caller's buffer is never written after the read returns: a request that
times out while receiving closes its connection, and so does a read that is cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

from kvpool import tracing
from kvpool.client import links, rounds
from kvpool.client.hedge import HedgePolicy
from kvpool.client.links import Links
from kvpool.client.ops import drive_async
from kvpool.client.placement import MemberInfo
from kvpool.client.plans import (
    BlockRef,
    NodeStage,
    PutItem,
    ReadItem,
    new_write_ids,
    node_error,
    ref_rounds,
    refs_by_node,
)
from kvpool.errors import (
    KVPoolError,
    UnavailableError,
)
from kvpool.proto.wire import Op
from kvpool.transports import open_connection
from kvpool.transports.blocking import time_left
from kvpool.transports.shm import Arena
from kvpool.transports.tcp import ConnectionPool, FrameConnection, Response

__all__ = [
    "BlockRef",
    "DataPlane",
    "PutItem",
    "ReadItem",
    "_node_error",
    "new_write_ids",
]


def _node_error(address: str, op: str, response: Response) -> KVPoolError:
    """The typed error for a node's error response (kept for callers of the old helper)."""
    return node_error(address, op, response.status, response.message())


class DataPlane:
    """Frames to store nodes over pooled connections; ``on_node_failed`` hears of every member
    that could not be reached (placement may be out of date)."""

    def __init__(
        self,
        pool: ConnectionPool | None = None,
        on_node_failed: Callable[[int], None] | None = None,
        *,
        links: Links | None = None,
        pool_size: int = 2,
        connect_timeout_s: float = 1.0,
        token: bytes = b"",
        hedge: HedgePolicy | None = None,
        on_node_slow: Callable[[int], None] | None = None,
        on_hedge: Callable[[int, int], None] | None = None,
        on_retry: Callable[[int], None] | None = None,
        sendable: Callable[[int], bool] | None = None,
        probing: Callable[[int], bool] | None = None,
        on_node_answered: Callable[[int], None] | None = None,
        content: Callable[[str], bool] | None = None,
    ) -> None:
        self._links = links or Links("auto")
        self._rules: rounds.PlaneRules | None = None  # made with the loop's clock, at first use
        self._rules_on = partial(
            rounds.PlaneRules,
            hedge=hedge or HedgePolicy(enabled=False),
            probing=probing or rounds.never_held,
            sendable=sendable,
            on_failed=on_node_failed or rounds.ignore,
            on_answered=on_node_answered or rounds.ignore,
            on_slow=on_node_slow,
            on_hedge=on_hedge,
            on_retry=on_retry,
            content=content,
        )
        self._background: set[asyncio.Task[None]] = set()
        self._token = token
        self._pool = pool or ConnectionPool(
            size=pool_size, connect_timeout_s=connect_timeout_s, opener=self._open
        )

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self._pool.close()

    # --- connections ----------------------------------------------------------------------

    async def _open(self, address: str, timeout_s: float) -> FrameConnection:
        """A connection to ``address``, made as :func:`~kvpool.client.links.open_flow` says, in
        ``timeout_s`` for all its steps."""
        dial = partial(self._dial, deadline=time.monotonic() + timeout_s)
        conn: FrameConnection = await drive_async(links.open_flow(self._links, address), dial)
        return conn

    async def _dial(
        self, dial: links.Dial, deadline: float
    ) -> FrameConnection | tuple[FrameConnection, links.NodeOffer] | KVPoolError:
        try:
            conn = await open_connection(dial.address, time_left(deadline), self._token)
            return (conn, await _hello(conn, time_left(deadline))) if dial.hello else conn
        except KVPoolError as e:
            return e

    async def connect(self, address: str, timeout_s: float) -> Arena | None:
        """Open the pool's connections to ``address`` now (a warm-up's); the node's shared
        memory when they use it."""
        return links.conn_arena(await self._pool.fill(address, timeout_s=timeout_s))

    # --- reads ----------------------------------------------------------------------------

    async def read(
        self,
        items: list[ReadItem],
        members: Callable[[int], MemberInfo | None],
        deadline: float,
    ) -> None:
        """Read every item from its replicas, in rounds: :func:`~kvpool.client.rounds.
        read_flow`, carried out on the event loop."""
        loop = asyncio.get_running_loop()
        flow = rounds.read_flow(items, members, deadline, self._rules_now())
        underway: list[rounds.NodeReads] = []
        try:
            for step in flow:
                if isinstance(step, rounds.SendReads):
                    timeout_s = step.deadline - loop.time()
                    groups = step.groups.items()
                    if step.wait:
                        await _all([self._read_group(a, g, m, timeout_s) for a, (g, m) in groups])
                    else:
                        step.sent = [
                            rounds.NodeReads(a, g, m, step.deadline, step.clones)
                            for a, (g, m) in groups
                        ]
                        for r in step.sent:
                            read = self._read_group(r.address, r.items, r.member, timeout_s)
                            r.io = asyncio.ensure_future(read)
                        underway += step.sent
                elif isinstance(step, rounds.AwaitReads):
                    step.done = await self._await(step)
                else:
                    await self._drop(step.reads)
        finally:  # cancelled, or an error: no first read goes on into a caller's buffer
            late = [r for r in underway if not r.io.done()]
            if late:
                await self._drop(late)

    def _rules_now(self) -> rounds.PlaneRules:
        """This plane's rules, with the running event loop's clock."""
        rules = self._rules
        if rules is None:
            rules = self._rules = self._rules_on(asyncio.get_running_loop().time)
        return rules

    async def _await(self, step: rounds.AwaitReads) -> list[rounds.NodeReads]:
        by_task = {r.io: r for r in step.reads}
        when = asyncio.FIRST_COMPLETED if step.first else asyncio.ALL_COMPLETED
        left = max(0.0, step.until - asyncio.get_running_loop().time())
        done, _ = await asyncio.wait(by_task, timeout=left, return_when=when)
        for task in done:
            task.result()  # an unexpected error is raised here, as gather would
        return [by_task[task] for task in done]

    async def _drop(self, reads: list[rounds.NodeReads]) -> None:
        """Stop first reads: a read cancelled while receiving into a caller's buffer cuts its
        connection, so no byte of it lands there later. A hedge's clones write only into their
        own buffers: they finish in the background."""
        late = [r.io for r in reads if not r.clones]
        for task in late:
            task.cancel()
        if late:
            await asyncio.gather(*late, return_exceptions=True)
        for r in reads:
            if r.clones and not r.io.done():
                self._background.add(r.io)
                r.io.add_done_callback(self._background.discard)

    async def _read_group(
        self, address: str, items: list[ReadItem], member: MemberInfo, timeout_s: float
    ) -> None:
        loop = asyncio.get_running_loop()
        rules, member_id = self._rules_now(), member.member_id
        now = loop.time()
        deadline = rounds.probe_deadline(now + timeout_s, now, member_id, rules.probing)
        try:
            conn = await self._pool.get(address, timeout_s=deadline - now)
        except KVPoolError as e:
            rounds.unreached_node(items, e, member_id, rules)
            return
        plan = links.node_read(address, items, conn, rules.content)
        if not plan.calls:  # all read through the node's shared directory
            return
        plan.sent_at = loop.time()
        try:
            await conn.exchange(plan.calls, deadline - loop.time(), trace=tracing.frame_trace())
        except KVPoolError as e:
            rounds.node_read_failed(plan, e, member_id, loop.time() - plan.sent_at, rules)
            return
        release = rounds.node_read_answered(plan, member_id, rules)
        if release is not None:
            conn.notify([release])
        if plan.followups:
            try:
                await conn.exchange(plan.followups, deadline - loop.time())
            except KVPoolError as e:
                for call in plan.followups:
                    call.error = e
            plan.judge_followups()

    # --- writes -------------------------------------------------------------------------------

    async def stage(self, items: list[PutItem], deadline: float, sent: Callable[[], None]) -> bool:
        """PUT every item to each of its targets: :func:`~kvpool.client.rounds.stage_flow`,
        carried out on the event loop (every node at once), and the commit ``sent()`` started
        as :class:`~kvpool.client.rounds.CommitStart` says — what it starts runs once the
        frames are written and their answers awaited. Whether it was (False: nothing
        staged)."""
        start = rounds.CommitStart(sent)
        for step in rounds.stage_flow(items, deadline, self._rules_now()):
            if isinstance(step, rounds.SendPuts):
                await _all([self._send_puts(put, start) for put in step.puts])
            else:
                await _all([self._commit(put, start) for put in step.puts])
        return start.finish(items)

    async def _send_puts(self, put: rounds.NodePuts, start: rounds.CommitStart) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            conn = await self._pool.get(put.address, timeout_s=put.deadline - started)
        except KVPoolError as e:
            put.error = e
            return
        put.io, put.plan = conn, NodeStage(put.address, put.group, links.conn_arena(conn))
        calls = put.plan.all_calls()
        if not put.plan.reserves:
            start.sent()  # what it starts runs once this exchange has written the frames
        try:
            await conn.exchange(calls, put.deadline - loop.time())
        except KVPoolError as e:
            put.error, put.waited_s = e, loop.time() - started

    async def _commit(self, put: rounds.NodePuts, start: rounds.CommitStart) -> None:
        assert put.plan is not None
        assert put.plan.commit is not None
        start.sent()  # the copies are made: the node has every byte once this commit is written
        try:
            await put.io.exchange(
                [put.plan.commit], put.deadline - asyncio.get_running_loop().time()
            )
        except KVPoolError as e:
            put.plan.commit.error = e

    async def send_refs(
        self, op: Op, refs: list[BlockRef], deadline: float, *, wait: bool = True
    ) -> None:
        """PUBLISH or DELETE, every node at once, as :meth:`BlockingDataPlane.send_refs
        <kvpool.client.blocking_plane.BlockingDataPlane.send_refs>` says (what is waited for,
        which nodes a DELETE skips; failures are ignored)."""
        loop = asyncio.get_running_loop()
        timeout_s = deadline - loop.time()
        if timeout_s <= 0:
            return
        groups = refs_by_node(rounds.deliverable(op, refs, self._rules_now().probing))

        async def send(address: str, group: list[BlockRef]) -> None:
            posted, awaited = ref_rounds(op, group, wait)
            try:
                conn = await self._pool.get(address, timeout_s=timeout_s)
                conn.notify(posted)  # the awaited frames follow them on this connection
                if awaited:
                    await conn.exchange(awaited, deadline - loop.time())
            except KVPoolError:
                return

        await _all([send(address, group) for address, group in groups.items()])


async def _all(works: list[Coroutine[Any, Any, None]]) -> None:
    """Await ``works`` at once (one as it is: a task costs more than the await)."""
    if len(works) == 1:
        await works[0]
    elif works:
        await asyncio.gather(*works)


async def _hello(conn: FrameConnection, timeout_s: float) -> links.NodeOffer:
    call = links.hello_call()
    try:
        await conn.exchange([call], timeout_s)
    except KVPoolError:
        conn.close()
        raise
    stream = conn.stream
    if stream is None:
        raise UnavailableError(f"{conn.address}: connection closed")
    return links.read_hello(call, stream.sockname, stream.peername)
