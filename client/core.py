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
from collections.abc import Awaitable, Callable, Generator, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any, TypeVar

from kvpool.client import ops
from kvpool.client import state as state_module
from kvpool.client.blocks import DataPlane, PutItem
from kvpool.client.commits import AsyncCommitter, CommitAnswer, PutReceipt, put_entries
from kvpool.client.placement import MemberInfo
from kvpool.client.plans import BlockLocation
from kvpool.client.state import Attempt, ClientState, Query, ReadCall, WarmUp
from kvpool.client.values import BytesLike, Into, PutItems, Value
from kvpool.config import ClientConfig
from kvpool.errors import KVPoolError
from kvpool.mastercall import MasterClient
from kvpool.proto.v1 import master_pb2
from kvpool.transports.tcp import ConnectionPool

__all__ = ["ClientCore", "PutReceipt"]

T = TypeVar("T")

DEADLINE_SLACK_S = 0.05
"""A call's guard fires this long after its deadline, should any step overrun it."""


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
            sendable=self._sendable,
            probing=self._placement.held.__contains__,
            on_node_answered=self._placement.node_answered,
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

    # --- the API --------------------------------------------------------------------------

    async def warm_up(self, timeout_s: float | None = None, *, nodes: bool = True) -> WarmUp:
        """Open now what the first calls would otherwise pay for: as :meth:`Client.warm_up
        <kvpool.client.fastpath.SyncPath.warm_up>` (the masters' channel and RPC connection,
        the ring, and with ``nodes`` the pool's connections to every node); never raises for
        the cluster's state."""
        flow = partial(self.warm_up_flow, nodes)
        warm: WarmUp = await self._carry(flow, self.warming_up(), timeout_s)
        return warm

    async def put(self, key: str, value: Value, *, strict: bool | None = None) -> bool:
        """Store one block. True once committed to the index (and published)."""
        return await self.put_receipt(key, value, strict=strict) is not None

    async def put_receipt(
        self, key: str, value: Value, *, strict: bool | None = None
    ) -> PutReceipt | None:
        """Store one block, as :meth:`put`: its receipt once committed, None on failure
        (strict: the typed error, as put raises it)."""
        item = self.put_item(key, value)
        (receipt,) = await self._put_prepared([item], self._strict(strict), single=True)
        return receipt

    async def batch_put(self, items: PutItems, *, strict: bool | None = None) -> list[bool]:
        """Store many blocks with one CommitPuts; one bool per item, in order. With strict, a
        failure of the whole call raises; per-item failures stay False."""
        receipts = await self.batch_put_receipts(items, strict=strict)
        return [r is not None for r in receipts]

    async def batch_put_receipts(
        self, items: PutItems, *, strict: bool | None = None
    ) -> list[PutReceipt | None]:
        """As :meth:`batch_put`, with each committed item's receipt (None where it failed)."""
        prepared = self.put_items(items)
        if not prepared:
            return []
        return await self._put_prepared(prepared, self._strict(strict), single=False)

    async def get(
        self, key: str, *, strict: bool | None = None, max_tier: str | None = None
    ) -> bytes | None:
        """The block's bytes, or None on a miss or any failure (strict: the typed error).
        ``max_tier`` (gpu, cpu, ssd; default: the config's): a block held only on a slower
        tier is a miss — for an engine that recomputes faster than it reads the SSD."""
        result: bytes | None = await self._run(self.get_call(key, strict, max_tier))
        return result

    async def get_into(
        self,
        key: str,
        buffer: Into,
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> int | None:
        """Read the block into ``buffer``; the number of bytes, or None (then the buffer's
        content is undefined). BufferTooSmallError when the block does not fit."""
        result: int | None = await self._run(self.get_into_call(key, buffer, strict, max_tier))
        return result

    async def batch_get(
        self, keys: Sequence[str], *, strict: bool | None = None, max_tier: str | None = None
    ) -> list[bytes | None]:
        """Each key's bytes or None, in order: one Lookup (none for cached keys), one MGET per
        node. With strict, a failure of the whole call raises; per-key misses stay None."""
        result: list[bytes | None] = await self._run(self.batch_get_call(keys, strict, max_tier))
        return result

    async def batch_get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[Into],
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> list[int | None]:
        """Read each key into its buffer (one per key, in order): each block's size or None.
        BufferTooSmallError when a block does not fit its buffer."""
        call = self.batch_get_into_call(keys, buffers, strict, max_tier)
        result: list[int | None] = await self._run(call)
        return result

    async def batch_get_alloc(
        self,
        keys: Sequence[str],
        alloc: Callable[[int], T],
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> list[T | None]:
        """Read each key into a buffer ``alloc(size)`` makes once the block's size is known
        (as :meth:`kvpool.Client.batch_get_alloc`; ``alloc`` runs on the event loop)."""
        call = self.batch_get_alloc_call(keys, alloc, strict, max_tier)
        result: list[T | None] = await self._run(call)
        return result

    async def exists(self, key: str, *, strict: bool | None = None) -> bool:
        """Whether the index has the key (the bytes are not checked)."""
        return bool(await self._ask(self.exists_query(key, strict)))

    async def batch_exists(self, keys: Sequence[str], *, strict: bool | None = None) -> list[bool]:
        """Whether the index has each key, in one call to a master that sends no entries; all
        False on failure unless strict."""
        result: list[bool] = await self._ask(self.batch_exists_query(keys, strict))
        return result

    async def locate(
        self, keys: Sequence[str], *, strict: bool | None = None
    ) -> list[BlockLocation | None]:
        """Where the index has each key's block (as :meth:`kvpool.Client.locate`)."""
        result: list[BlockLocation | None] = await self._ask(self.locate_query(keys, strict))
        return result

    async def sizes(self, keys: Sequence[str], *, strict: bool | None = None) -> list[int | None]:
        """Each key's block size in bytes as the index has it, or None where it has no such key
        (or on failure, unless strict): one Lookup, no bytes read."""
        result: list[int | None] = await self._ask(self.sizes_query(keys, strict))
        return result

    async def remove(self, key: str, *, strict: bool | None = None) -> bool:
        """Remove the key from the index; True if it was there. Replicas are told to drop the
        bytes, best effort."""
        return bool(await self._ask(self.remove_one_query(key, strict)))

    async def pin(self, keys: Sequence[str], replicas: int = 1) -> list[bool]:
        """Pin keys at ``replicas`` copies (0: unpin): never evicted, kept at that count by the
        masters, recorded in the replicated index. Per key: True when pinned (unpinned), False
        when the index has no such key. Raises PinQuotaExceededError when the masters' pin
        quota would be exceeded (the keys that fit are pinned), and any other failure as its
        typed error: pinning is an explicit request, never a silent miss."""
        result: list[bool] = await self._ask(self.pin_query(keys, replicas))
        return result

    async def unpin(self, keys: Sequence[str]) -> list[bool]:
        """End pins (True per key the index has)."""
        return await self.pin(keys, 0)

    async def batch_remove(self, keys: Sequence[str], *, strict: bool | None = None) -> list[bool]:
        """Remove many keys with one commit; True per key the index had."""
        result: list[bool] = await self._ask(self.batch_remove_query(keys, strict))
        return result

    async def remove_prefix(self, prefix: str, *, limit: int = 0) -> tuple[int, bool]:
        """One step of removing the keys under ``prefix`` (as :meth:`kvpool.Client.
        remove_prefix`): (keys removed, whether matching keys are left). Failures raise."""
        result: tuple[int, bool] = await self._ask(self.remove_prefix_query(prefix, limit))
        return result

    async def prefix_match(
        self, keys: Sequence[str], *, strict: bool | None = None, fetch_entries: bool = True
    ) -> int:
        """How many leading keys of ``keys`` the index holds (0 on failure); ``fetch_entries``
        as :meth:`kvpool.Client.prefix_match`'s."""
        return int(await self._ask(self.prefix_match_query(keys, strict, fetch_entries)))

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
        return await self.store_computed(key, value)

    async def store_computed(self, key: str, value: BytesLike) -> bytes:
        """The second half of get_or_compute: count the fallback, put best effort, return the
        value as bytes. Bad keys and values raise; store failures do not."""
        item = self.computed_item(key, value)
        await self._put_prepared([item], strict=False, single=True)
        return value if type(value) is bytes else bytes(item.payload)

    # --- carrying out ---------------------------------------------------------------------

    async def _carry(
        self,
        flow_of: Callable[[float, Callable[[], float]], Generator[ops.Step, Any, Any]],
        attempt: Attempt,
        timeout_s: float | None = None,
    ) -> Any:
        """:meth:`SyncPath._carry <kvpool.client.fastpath.SyncPath._carry>` on the event loop,
        where a guard also cancels what still runs DEADLINE_SLACK_S after the deadline."""
        loop = asyncio.get_running_loop()
        with attempt:
            deadline = self.call_deadline(loop.time(), timeout_s)
            async with asyncio.timeout_at(deadline + DEADLINE_SLACK_S):
                perform = partial(self._perform, deadline)
                attempt.value = await ops.drive_async(flow_of(deadline, loop.time), perform)
        return attempt.value

    async def _perform(self, deadline: float, step: ops.Step) -> Any:
        """Carry out one step of a flow (:mod:`~kvpool.client.ops`) on the event loop (a
        commit's chunks at once)."""
        if isinstance(step, ops.Read):
            live = partial(self.member, live=step.live)
            await self._data.read(step.items, live, deadline, on_retry=self._stats.replica_retries)
        elif isinstance(step, ops.Lookup):
            with self.looking_up(step.keys):
                request = self.lookup_request(step.keys)
                answer = await self._masters.call("Lookup", request, deadline=deadline)
            self.lookup_answered(step.keys, answer)
            return answer
        elif isinstance(step, ops.Stage):
            await self._data.stage(step.items, step.deadline)
        elif isinstance(step, ops.Commit):
            return await self._commit_chunks(step.chunks, step.ring_version, deadline)
        elif isinstance(step, ops.Publish):
            await self._data.publish(step.refs, deadline, wait=step.wait)
        elif isinstance(step, ops.Delete):
            await self._data.delete(step.refs, step.deadline)
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

    async def _ask(self, query: Query[Any] | Any) -> Any:
        """Carry out a :class:`Query` (and the ones its answers ask for) under one deadline;
        anything else is already the answer."""
        if not isinstance(query, Query):
            return query
        return await self._carry(partial(self.ask_flow, query), self.asking(query))

    async def _run(self, call: ReadCall) -> Any:
        """Carry out a :class:`ReadCall`: its answer from the items read (None: all failed)."""
        if not call.pairs:
            return self.answer(call, None)
        items = await self._carry(partial(self.read_flow, call), self.reading(call))
        return self.answer(call, items)

    async def _put_prepared(
        self, items: list[PutItem], strict: bool, *, single: bool
    ) -> list[PutReceipt | None]:
        """The one put path: each item's receipt once committed, None where it failed."""
        receipts: dict[PutItem, PutReceipt] = {}
        flow = partial(self.put_flow, items, receipts)
        done = await self._carry(flow, self.putting(items, strict))
        return self.put_results(items, receipts, strict, done, single=single)

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
