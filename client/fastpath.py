"""The blocking driver: every client operation in the caller's thread (the synchronous
:class:`~kvpool.client.sync.Client`).

:class:`SyncPath` is a :class:`~kvpool.client.state.ClientState` — the operations, the read and
put flows of :mod:`kvpool.client.ops`, the placement, the lookup cache and the failure policy,
written once there — carried out with blocking I/O: calls to the masters through
:class:`~kvpool.mastercall.SyncMasterClient` (their frame RPC port, else gRPC) and a
:class:`~kvpool.transports.blocking.BlockingConnection` per thread and node (TCP, or the node's
shared memory; :mod:`kvpool.client.blocking_plane`). No event loop and no thread of its own:
handing a call to another thread and back costs two wake-ups (64 µs measured here; a whole 4 KiB
GET over loopback takes 22 µs with a blocking socket).

Every call keeps the client's deadline: kernel socket timeouts bound each read and write, and a
connection that timed out is closed (no late byte can land in a caller's buffer after the call
returned, since nothing reads that socket again).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from typing import Any, TypeVar

from kvpool.client import ops
from kvpool.client import state as state_module
from kvpool.client.blocking_plane import BlockingDataPlane
from kvpool.client.commits import CommitAnswer, PutReceipt, SyncCommitter, put_entries
from kvpool.client.links import conn_arena
from kvpool.client.placement import MemberInfo
from kvpool.client.plans import BlockLocation, PutItem
from kvpool.client.state import Attempt, ClientState, Query, ReadCall, WarmUp
from kvpool.client.values import BytesLike, Into, PutItems, Value
from kvpool.config import ClientConfig
from kvpool.errors import KVPoolError
from kvpool.mastercall import SyncMasterClient
from kvpool.proto.v1 import master_pb2
from kvpool.proto.wire import Op

T = TypeVar("T")


class SyncPath(ClientState):
    """A client's state driven with blocking calls in the calling thread (see the module doc).
    Thread-safe: each thread has its own connection per node."""

    def __init__(self, config: ClientConfig, *, strict: bool = False, logger: Any = None) -> None:
        super().__init__(config, strict=strict, logger=logger)
        self._masters = SyncMasterClient(
            self.routing,
            attempt_timeout_s=self.attempt_timeout_s,
            security=self.security,
            busy_poll_s=config.busy_poll_us / 1e6,
        )
        placement = self._placement  # the callbacks hold the placement, not the client
        held = placement.held
        self._data = BlockingDataPlane(
            self,
            lambda mid: placement.node_failed(mid, time.monotonic()),
            connect_timeout_s=self.attempt_timeout_s,
            on_node_slow=lambda mid: placement.node_slow(mid, time.monotonic()),
            sendable=lambda mid: mid not in held or placement.sendable(mid, time.monotonic()),
            probing=held.__contains__,
            on_node_answered=placement.node_answered,
        )
        self._committer = SyncCommitter(self._commit_rpc, lambda: state_module.MAX_COMMIT_ENTRIES)
        self._members_lock = threading.Lock()

    def close(self) -> None:
        """Close connections. Idempotent; later calls raise UnavailableError."""
        self.mark_closed()
        self._data.close()
        self._masters.close()

    # --- the API --------------------------------------------------------------------------

    def warm_up(self, timeout_s: float | None = None, *, nodes: bool = True) -> WarmUp:
        """Open now what the first calls would otherwise pay for (tens of milliseconds on a
        fresh client): the masters' channel and RPC connection, the ring, and (``nodes``) a
        connection to every node — the node's shared memory mapped where it offers it; a
        client that only asks the index (a scheduler's prefix matches) wants ``nodes=False``.
        Another thread's first call takes these connections over. Never raises for the
        cluster's state (the answer says what could not be opened, within ``timeout_s``,
        default the client's); UnavailableError once the client is closed."""
        flow = partial(self.warm_up_flow, nodes)
        warm: WarmUp = self._carry(flow, self.warming_up(), timeout_s)
        self._data.lend_this_threads()
        self._masters.lend_this_threads()
        return warm

    def put(self, key: str, value: Value, *, strict: bool | None = None) -> bool:
        """Store ``value`` under ``key``: True once committed; False on failure (strict raises).

        ``value``: bytes, bytearray, C-contiguous memoryview or numpy array (sent as its raw
        bytes), or a list or tuple of them: one block, their bytes joined, each piece sent
        from where it is (no gathering copy). Do not modify it until put returns."""
        return self.put_receipt(key, value, strict=strict) is not None

    def put_receipt(
        self, key: str, value: Value, *, strict: bool | None = None
    ) -> PutReceipt | None:
        """As :meth:`put`, answering the commit's receipt (version, write id, index revision,
        replica node ids) instead of True; None on failure (strict raises as put does)."""
        item = self.put_item(key, value)
        (receipt,) = self._put_prepared([item], self._strict(strict), single=True)
        return receipt

    def batch_put(self, items: PutItems, *, strict: bool | None = None) -> list[bool]:
        """Store many blocks with one commit; one bool per item, in order."""
        return [r is not None for r in self.batch_put_receipts(items, strict=strict)]

    def batch_put_receipts(
        self, items: PutItems, *, strict: bool | None = None
    ) -> list[PutReceipt | None]:
        """As :meth:`batch_put`, with each committed item's receipt (None where it failed)."""
        prepared = self.put_items(items)
        if not prepared:
            return []
        return self._put_prepared(prepared, self._strict(strict), single=False)

    def get(
        self, key: str, *, strict: bool | None = None, max_tier: str | None = None
    ) -> bytes | None:
        """The bytes stored under ``key``, or None on a miss or any failure (strict raises
        BlockMissError, ChecksumMismatchError, DeadlineExceededError, UnavailableError…).
        ``max_tier`` ("gpu", "cpu", "ssd"): a block held only on a slower tier is a miss."""
        result: bytes | None = self._run(self.get_call(key, strict, max_tier))
        return result

    def get_into(
        self,
        key: str,
        buffer: Into,
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> int | None:
        """Read the block straight into ``buffer`` (writable, C-contiguous, large enough, else
        BufferTooSmallError / InvalidValueError), or into a list or tuple of such buffers,
        filled in order: its size in bytes, or None (the buffer's content is then undefined).
        The bytes are copied once, into ``buffer``."""
        result: int | None = self._run(self.get_into_call(key, buffer, strict, max_tier))
        return result

    def batch_get(
        self, keys: Sequence[str], *, strict: bool | None = None, max_tier: str | None = None
    ) -> list[bytes | None]:
        """Each key's bytes or None, in order (one lookup for the keys not cached, one MGET
        per node)."""
        result: list[bytes | None] = self._run(self.batch_get_call(keys, strict, max_tier))
        return result

    def batch_get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[Into],
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> list[int | None]:
        """Read each key into its own buffer (``buffers[i]`` for ``keys[i]``): each block's size
        or None. The bytes are copied once, into the buffers."""
        call = self.batch_get_into_call(keys, buffers, strict, max_tier)
        result: list[int | None] = self._run(call)
        return result

    def batch_get_alloc(
        self,
        keys: Sequence[str],
        alloc: Callable[[int], T],
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> list[T | None]:
        """Read each key into a buffer ``alloc(size)`` makes once the block's size is known
        (writable, at least ``size`` bytes): the buffers, None where a key missed. The bytes
        are copied once, into them; ``alloc`` runs in the calling thread."""
        result: list[T | None] = self._run(self.batch_get_alloc_call(keys, alloc, strict, max_tier))
        return result

    def get_or_compute(self, key: str, fn: Callable[[], BytesLike]) -> bytes:
        """The cached bytes; on a miss ``fn()``'s value, stored best effort (never raises
        because the store failed). ``fn`` runs in the calling thread; its exceptions
        propagate."""
        data = self.get(key, strict=False)
        if data is not None:
            return data
        value = fn()
        item = self.computed_item(key, value)
        self._put_prepared([item], strict=False, single=True)
        return value if type(value) is bytes else bytes(item.payload)

    def exists(self, key: str, *, strict: bool | None = None) -> bool:
        """Whether the index has ``key`` (False on failure unless the client is strict)."""
        return bool(self._ask(self.exists_query(key, strict)))

    def batch_exists(self, keys: Sequence[str], *, strict: bool | None = None) -> list[bool]:
        """Whether the index has each key, in one call to a master that sends no entries
        (cheaper than :meth:`sizes` for a long batch); all False on failure unless strict."""
        result: list[bool] = self._ask(self.batch_exists_query(keys, strict))
        return result

    def sizes(self, keys: Sequence[str], *, strict: bool | None = None) -> list[int | None]:
        """Each key's block size in bytes, or None where the index has no such key (one lookup;
        no bytes are read; None for all on failure unless strict)."""
        result: list[int | None] = self._ask(self.sizes_query(keys, strict))
        return result

    def locate(
        self, keys: Sequence[str], *, strict: bool | None = None
    ) -> list[BlockLocation | None]:
        """Where the index has each key's block — its size, version, checksum, the fastest tier
        a replica reported and the live nodes holding it — or None where it has no such key
        (one lookup; no bytes are read; None for all on failure unless strict)."""
        result: list[BlockLocation | None] = self._ask(self.locate_query(keys, strict))
        return result

    def prefix_match(
        self, keys: Sequence[str], *, strict: bool | None = None, fetch_entries: bool = True
    ) -> int:
        """How many leading keys of a chain are cached (0 on failure), in one call to a
        master, from the calling thread. ``fetch_entries`` (up to 1024 keys): the call brings
        the keys' index entries into the lookup cache, so that a get of the hits right after
        asks the index nothing; False asks for the count only, which is cheaper for this call
        and the master (a probe that reads may not follow, or a latency-bound hit query).
        Keys of kvpool's scheme (``kvpool.keys``) are read by content, asking the index nothing
        anyway: for them the count only is asked either way (``direct_reads="off"`` fetches)."""
        return int(self._ask(self.prefix_match_query(keys, strict, fetch_entries)))

    def pin(self, keys: Sequence[str], replicas: int = 1) -> list[bool]:
        """Pin keys at ``replicas`` copies: never evicted, kept at that count by the masters,
        replicated in the index (survives a master failover). True per key pinned, False when
        the index has no such key; raises PinQuotaExceededError above the masters' pin_quota,
        and other failures as typed errors."""
        result: list[bool] = self._ask(self.pin_query(keys, replicas))
        return result

    def unpin(self, keys: Sequence[str]) -> list[bool]:
        """End pins (True per key the index has)."""
        return self.pin(keys, 0)

    def remove(self, key: str, *, strict: bool | None = None) -> bool:
        """Remove ``key``; True if the index had it. Replicas are told to drop the bytes, best
        effort."""
        return bool(self._ask(self.remove_one_query(key, strict)))

    def batch_remove(self, keys: Sequence[str], *, strict: bool | None = None) -> list[bool]:
        """Remove many keys with one commit; True per key the index had (False for all on
        failure unless strict)."""
        result: list[bool] = self._ask(self.batch_remove_query(keys, strict))
        return result

    def remove_prefix(self, prefix: str, *, limit: int = 0) -> tuple[int, bool]:
        """Remove keys that start with ``prefix`` (``""``: every key in the cluster), at most
        ``limit`` (0: the masters' step, 4096) in one Raft commit: (keys removed, whether
        matching keys are left — call again). Replicas are told to drop the bytes, best effort.
        An admin call: failures raise, typed."""
        result: tuple[int, bool] = self._ask(self.remove_prefix_query(prefix, limit))
        return result

    # --- carrying out ---------------------------------------------------------------------

    def _carry(
        self,
        flow_of: Callable[[float, Callable[[], float]], Generator[ops.Step, Any, Any]],
        attempt: Attempt,
        timeout_s: float | None = None,
    ) -> Any:
        """Drive the flow ``flow_of(deadline, clock)`` in this thread under the call's deadline
        (``timeout_s``, else the client's) and failure policy (``attempt``, which types every
        failure): its answer, or the neutral one."""
        with attempt:
            deadline = self.call_deadline(time.monotonic(), timeout_s)
            flow = flow_of(deadline, time.monotonic)
            attempt.value = ops.drive(flow, partial(self._perform, deadline))
        return attempt.value

    def _perform(self, deadline: float, step: ops.Step) -> Any:
        """Carry out one step of a flow (:mod:`~kvpool.client.ops`) in this thread."""
        if isinstance(step, ops.Read):
            live = partial(self.member, live=step.live)
            self._data.read(step.items, live, deadline, on_retry=self._stats.replica_retries)
        elif isinstance(step, ops.Lookup):
            with self.looking_up(step.keys):
                request = self.lookup_request(step.keys)
                answer = self._masters.call("Lookup", request, deadline=deadline)
            self.lookup_answered(step.keys, answer)
            return answer
        elif isinstance(step, ops.Stage):
            self._data.stage(step.items, step.deadline)
        elif isinstance(step, ops.Commit):
            return self._commit_chunks(step.chunks, step.ring_version, deadline)
        elif isinstance(step, ops.Publish):
            self._data.send_refs(Op.PUBLISH, step.refs, deadline, wait=step.wait)
        elif isinstance(step, ops.Delete):
            self._data.send_refs(Op.DELETE, step.refs, step.deadline)
        elif isinstance(step, ops.Ask):
            leader_only = step.leader_only
            return self._masters.call(
                step.method, step.request, deadline=deadline, leader_only=leader_only
            )
        elif isinstance(step, ops.EnsureMembers):
            if self._placement.needs_refresh():
                flow = self.members_flow(step.patient, deadline, time.monotonic)
                with self._members_lock if step.patient else nullcontext():
                    ops.drive(flow, partial(self._perform, deadline))
        elif isinstance(step, ops.Pause):
            time.sleep(step.seconds)
        else:
            return self._connect(step.members, deadline)
        return None

    def _connect(self, members: list[MemberInfo], deadline: float) -> dict[str, str]:
        opened: dict[str, str] = {}
        arenas = []
        for member in members:
            try:
                arenas.append(conn_arena(self._data.connection(member.data_address, deadline)))
                opened[member.node_id] = ""
            except KVPoolError as e:
                opened[member.node_id] = WarmUp.why(e)
        for arena in arenas:  # a shared memory's page tables, filled before the first calls
            if arena is not None:
                arena.wait_prefaulted(deadline - time.monotonic())
        return opened

    def _ask(self, query: Query[Any] | Any) -> Any:
        """Carry out a :class:`Query` (and the ones its answers ask for) under one deadline;
        anything else is already the answer."""
        if not isinstance(query, Query):
            return query
        return self._carry(partial(self.ask_flow, query), self.asking(query))

    def _run(self, call: ReadCall) -> Any:
        """Carry out a :class:`ReadCall`: its answer from the items read (None: all failed)."""
        if not call.pairs:
            return self.answer(call, None)
        return self.answer(call, self._carry(partial(self.read_flow, call), self.reading(call)))

    def _put_prepared(
        self, items: list[PutItem], strict: bool, *, single: bool
    ) -> list[PutReceipt | None]:
        receipts: dict[PutItem, PutReceipt] = {}
        flow = partial(self.put_flow, items, receipts)
        done = self._carry(flow, self.putting(items, strict))
        return self.put_results(items, receipts, strict, done, single=single)

    def _commit_chunks(
        self, chunks: list[list[PutItem]], ring_version: int, deadline: float
    ) -> list[CommitAnswer | KVPoolError]:
        """Commit each chunk (a huge batch_put's chunks in parallel threads)."""

        def one(chunk: list[PutItem]) -> CommitAnswer | KVPoolError:
            try:
                return self._committer.commit(ring_version, put_entries(chunk), deadline)
            except KVPoolError as e:
                return e

        if len(chunks) == 1:
            return [one(chunks[0])]
        with ThreadPoolExecutor(max_workers=min(8, len(chunks))) as pool:
            return list(pool.map(one, chunks))

    def _commit_rpc(
        self, request: master_pb2.CommitPutsRequest, deadline: float
    ) -> master_pb2.CommitPutsResponse:
        response: master_pb2.CommitPutsResponse = self._masters.call(
            "CommitPuts", request, deadline=deadline, leader_only=True
        )
        return response
