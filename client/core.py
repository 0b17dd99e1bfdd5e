"""The event-loop driver: every client operation as a coroutine (:class:`~kvpool.client.aio.
AsyncClient`, and the store node's own calls).

:class:`ClientCore` is a :class:`~kvpool.client.state.ClientState` — the operations, the read
and put flows of :mod:`kvpool.client.ops`, the placement, the lookup cache and the failure
policy, written once there — carried out by awaiting: calls to the masters through
:class:`~kvpool.mastercall.MasterClient` and frames to the nodes over pooled connections
(:class:`~kvpool.client.blocks.DataPlane`). All of its methods must run on one event loop.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvpool.client import api, ops
from kvpool.client import state as state_module
from kvpool.client.blocks import DataPlane, PutItem
from kvpool.client.commits import AsyncCommitter, CommitAnswer, PutReceipt, put_entries
from kvpool.client.placement import MemberInfo
from kvpool.client.state import ClientState, Job, WarmUp
from kvpool.client.values import BytesLike
from kvpool.config import ClientConfig
from kvpool.errors import KVPoolError
from kvpool.mastercall import MasterClient
from kvpool.proto.v1 import master_pb2
from kvpool.proto.wire import Op
from kvpool.transports.tcp import ConnectionPool

__all__ = ["ClientCore", "PutReceipt"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

DEADLINE_SLACK_S = 0.05
"""A call's guard fires this long after its deadline, should any step overrun it."""


def awaiting(
    build: Callable[Concatenate[ClientState, P], Job[R]],
) -> Callable[Concatenate[ClientCore, P], Coroutine[Any, Any, R]]:
    """The coroutine method that carries out ``build``'s job on the event loop (an operation
    of :mod:`kvpool.client.api`, with its signature and document)."""

    async def operation(self: ClientCore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await self.carry(build(self, *args, **kwargs))

    return api.described(operation, build)


class ClientCore(ClientState):
    """A client's state driven by awaiting on one event loop (see the module doc)."""

    def __init__(
        self,
        config: ClientConfig,
        *,
        strict: bool = False,
        logger: Any = None,
        masters: MasterClient | None = None,
        pool: ConnectionPool | None = None,
    ) -> None:
        routing = masters.routing if masters is not None else None
        super().__init__(config, strict=strict, logger=logger, routing=routing)
        self._masters = masters or MasterClient(
            config.masters,
            attempt_timeout_s=self.attempt_timeout_s,
            routing=self.routing,
            security=self.security,
        )
        self._data = DataPlane(
            pool,
            self._node_failed,
            links=self.links,
            pool_size=config.connections_per_node,
            connect_timeout_s=self.attempt_timeout_s,
            token=self.security.token,
            hedge=self.hedge_policy,
            on_node_slow=self._node_slow,
            on_hedge=self._stats.hedged,
            on_retry=self._stats.replica_retries,
            sendable=self._sendable,
            probing=self._placement.held.__contains__,
            on_node_answered=self._placement.node_answered,
            content=self.direct_keys,
        )
        self._committer = AsyncCommitter(self._commit_rpc, lambda: state_module.MAX_COMMIT_ENTRIES)
        self._members_lock = asyncio.Lock()
        self._shut = False
        if config.busy_poll_us:  # spinning would hold the caller's event loop
            self._log.warning(
                "client_setting_ignored",
                setting="busy_poll_us",
                reason="an AsyncClient awaits answers on its event loop; only Client spins",
            )

    async def close(self) -> None:
        """Close connections and channels; idempotent. Later calls raise UnavailableError."""
        if self._shut:
            return
        self._shut = True
        self.mark_closed()
        await self.metrics.close()
        await self._data.close()
        await self._masters.close()

    async def start_metrics(self) -> str:
        """Serve this client's /metrics when ``metrics_port`` asks for it (``async with`` does
        this); its address ("" when off). Idempotent."""
        if self.metrics.address:
            return self.metrics.address
        return await self.metrics.start(self.config.metrics_host, self.config.metrics_port)

    @property
    def metrics_address(self) -> str:
        """``host:port`` of this client's /metrics ("" when off or not started yet)."""
        return self.metrics.address

    # --- the API (client/api.py) -----------------------------------------------------------

    warm_up = awaiting(api.warm_up)
    put = awaiting(api.put)
    put_receipt = awaiting(api.put_receipt)
    batch_put = awaiting(api.batch_put)
    batch_put_receipts = awaiting(api.batch_put_receipts)
    get = awaiting(api.get)
    get_into = awaiting(api.get_into)
    batch_get = awaiting(api.batch_get)
    batch_get_into = awaiting(api.batch_get_into)
    exists = awaiting(api.exists)
    batch_exists = awaiting(api.batch_exists)
    sizes = awaiting(api.sizes)
    locate = awaiting(api.locate)
    prefix_match = awaiting(api.prefix_match)
    pin = awaiting(api.pin)
    unpin = awaiting(api.unpin)
    remove = awaiting(api.remove)
    batch_remove = awaiting(api.batch_remove)
    remove_prefix = awaiting(api.remove_prefix)

    async def batch_get_alloc(
        self,
        keys: Sequence[str],
        alloc: Callable[[int], T],
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> list[T | None]:
        """:func:`kvpool.client.api.batch_get_alloc` (written out here: a generic operation
        keeps its type only as a method of its own)."""
        return await self.carry(
            api.batch_get_alloc(self, keys, alloc, strict=strict, max_tier=max_tier)
        )

    async def get_or_compute(
        self, key: str, compute: Callable[[], Awaitable[BytesLike] | BytesLike]
    ) -> bytes:
        """The cached bytes, or ``compute()``'s (awaited if a coroutine), stored best effort.
        Exceptions of ``compute`` propagate; a failing store never raises. The get and the put
        each have their own deadline; the time ``compute`` takes is its own."""
        data = await self.get(key, strict=False)
        if data is not None:
            return data
        value = compute()
        if inspect.isawaitable(value):
            value = await value
        return await self.carry(self.computed_job(key, value))

    # --- carrying out ---------------------------------------------------------------------

    async def carry(self, job: Job[R]) -> R:
        """Carry ``job`` out on the event loop under its deadline and failure policy (as
        :meth:`SyncPath.carry <kvpool.client.fastpath.SyncPath.carry>`), where a guard also
        cancels what still runs DEADLINE_SLACK_S after the deadline: its answer."""
        if job.idle():
            return job.finish(self, None)
        loop = asyncio.get_running_loop()
        with job.attempt(self) as attempt:
            deadline = self.call_deadline(loop.time(), job.timeout_s)
            async with asyncio.timeout_at(deadline + DEADLINE_SLACK_S):
                flow = job.flow(self, deadline, loop.time)
                attempt.value = await ops.drive_async(flow, partial(self._perform, deadline))
        return job.finish(self, attempt.value)

    async def _perform(self, deadline: float, step: ops.Step) -> Any:
        """Carry out one step of a flow (:mod:`~kvpool.client.ops`) on the event loop (a
        commit's chunks at once)."""
        if isinstance(step, ops.Read):
            live = partial(self.member, live=step.live)
            await self._data.read(step.items, live, deadline)
        elif isinstance(step, ops.Lookup):
            with self.looking_up(step.keys):
                request = self.lookup_request(step.keys)
                answer = await self._masters.call("Lookup", request, deadline=deadline)
            self.lookup_answered(step.keys, answer)
            return answer
        elif isinstance(step, ops.Stage):
            commit = step.commit
            committing: list[asyncio.Future[list[CommitAnswer | KVPoolError]]] = []

            def sent() -> None:  # the node takes the bytes while the masters commit
                work = self._commit_chunks(commit.chunks, commit.ring_version, deadline)
                committing.append(asyncio.ensure_future(work))

            try:
                staged = await self._data.stage(step.items, step.deadline, sent)
            except BaseException:
                for task in committing:
                    task.add_done_callback(_retrieved)  # it ends on its own, unawaited
                raise
            return await committing[0] if staged else None
        elif isinstance(step, ops.Publish):
            await self._data.send_refs(Op.PUBLISH, step.refs, deadline, wait=step.wait)
        elif isinstance(step, ops.Delete):
            await self._data.send_refs(Op.DELETE, step.refs, step.deadline)
        elif isinstance(step, ops.Ask):
            leader_only = step.leader_only
            return await self._masters.call(
                step.method, step.request, deadline=deadline, leader_only=leader_only
            )
        elif isinstance(step, ops.EnsureMembers):
            if self._placement.needs_refresh():
                flow = self.members_flow(step.patient, deadline, asyncio.get_running_loop().time)
                async with self._members_lock if step.patient else nullcontext():
                    await ops.drive_async(flow, partial(self._perform, deadline))
        elif isinstance(step, ops.Pause):
            await asyncio.sleep(step.seconds)
        else:
            return await self._connect(step.members, deadline)
        return None

    async def _connect(self, members: list[MemberInfo], deadline: float) -> dict[str, str]:
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(
            *(
                self._data.connect(m.data_address, max(0.001, deadline - loop.time()))
                for m in members
            ),
            return_exceptions=True,
        )
        opened: dict[str, str] = {}
        for member, result in zip(members, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, KVPoolError):
                    raise result
                opened[member.node_id] = WarmUp.why(result)
                continue
            opened[member.node_id] = ""
            if result is not None:  # a shared memory's page tables, filled before the first calls
                await loop.run_in_executor(None, result.wait_prefaulted, deadline - loop.time())
        return opened

    async def _commit_chunks(
        self, chunks: list[list[PutItem]], ring_version: int, deadline: float
    ) -> list[CommitAnswer | KVPoolError]:
        """Commit every chunk at once (each grouped with this client's other puts committing
        meanwhile): one outcome per chunk. An error that is not a KVPoolError is raised (the
        first chunk's error when every chunk failed)."""
        outcomes = await asyncio.gather(
            *(self._committer.commit(ring_version, put_entries(c), deadline) for c in chunks),
            return_exceptions=True,
        )
        answers: list[CommitAnswer | KVPoolError] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, KVPoolError):
                failures = [o for o in outcomes if isinstance(o, BaseException)]
                raise failures[0] if len(failures) == len(outcomes) else outcome
            answers.append(outcome)
        return answers

    async def _commit_rpc(
        self, request: master_pb2.CommitPutsRequest, deadline: float
    ) -> master_pb2.CommitPutsResponse:
        response: master_pb2.CommitPutsResponse = await self._masters.call(
            "CommitPuts", request, deadline=deadline, leader_only=True
        )
        return response

    def _node_failed(self, member_id: int) -> None:
        self._placement.node_failed(member_id, asyncio.get_running_loop().time())

    def _sendable(self, member_id: int) -> bool:
        placement = self._placement
        return member_id not in placement.held or placement.sendable(
            member_id, asyncio.get_running_loop().time()
        )

    def _node_slow(self, member_id: int) -> None:
        self._placement.node_slow(member_id, asyncio.get_running_loop().time())


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Take a finished task's outcome, so that its error is not reported as never retrieved."""
    if not task.cancelled():
        task.exception()
