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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvpool.client import api, ops
from kvpool.client import state as state_module
from kvpool.client.blocking_plane import BlockingDataPlane
from kvpool.client.commits import CommitAnswer, SyncCommitter, put_entries
from kvpool.client.links import conn_arena
from kvpool.client.placement import MemberInfo
from kvpool.client.plans import PutItem
from kvpool.client.state import ClientState, Job, WarmUp
from kvpool.client.values import BytesLike
from kvpool.config import ClientConfig
from kvpool.errors import KVPoolError
from kvpool.mastercall import SyncMasterClient
from kvpool.proto.v1 import master_pb2
from kvpool.proto.wire import Op

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def blocking(
    build: Callable[Concatenate[ClientState, P], Job[R]],
) -> Callable[Concatenate[SyncPath, P], R]:
    """The method that carries out ``build``'s job in the caller's thread (an operation of
    :mod:`kvpool.client.api`, with its signature and document)."""

    def operation(self: SyncPath, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.carry(build(self, *args, **kwargs))

    return api.described(operation, build)


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

    # --- the API (client/api.py) -----------------------------------------------------------

    warm_up = blocking(api.warm_up)
    put = blocking(api.put)
    put_receipt = blocking(api.put_receipt)
    batch_put = blocking(api.batch_put)
    batch_put_receipts = blocking(api.batch_put_receipts)
    get = blocking(api.get)
    get_into = blocking(api.get_into)
    batch_get = blocking(api.batch_get)
    batch_get_into = blocking(api.batch_get_into)
    exists = blocking(api.exists)
    batch_exists = blocking(api.batch_exists)
    sizes = blocking(api.sizes)
    locate = blocking(api.locate)
    prefix_match = blocking(api.prefix_match)
    pin = blocking(api.pin)
    unpin = blocking(api.unpin)
    remove = blocking(api.remove)
    batch_remove = blocking(api.batch_remove)
    remove_prefix = blocking(api.remove_prefix)

    def batch_get_alloc(
        self,
        keys: Sequence[str],
        alloc: Callable[[int], T],
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> list[T | None]:
        """:func:`kvpool.client.api.batch_get_alloc` (written out here: a generic operation
        keeps its type only as a method of its own)."""
        return self.carry(api.batch_get_alloc(self, keys, alloc, strict=strict, max_tier=max_tier))

    def get_or_compute(self, key: str, compute: Callable[[], BytesLike]) -> bytes:
        """The cached bytes; on a miss ``compute()``'s value, stored best effort (never raises
        because the store failed). ``compute`` runs in the calling thread; its exceptions
        propagate."""
        data = self.get(key, strict=False)
        if data is not None:
            return data
        return self.carry(self.computed_job(key, compute()))

    def warmed(self, warm: WarmUp) -> WarmUp:
        self._data.lend_this_threads()
        self._masters.lend_this_threads()
        return warm

    # --- carrying out ---------------------------------------------------------------------

    def carry(self, job: Job[R]) -> R:
        """Carry ``job`` out in this thread under its deadline and failure policy: its
        answer."""
        if job.idle():
            return job.finish(self, None)
        with job.attempt(self) as attempt:
            deadline = self.call_deadline(time.monotonic(), job.timeout_s)
            flow = job.flow(self, deadline, time.monotonic)
            attempt.value = ops.drive(flow, partial(self._perform, deadline))
        return job.finish(self, attempt.value)

    def _perform(self, deadline: float, step: ops.Step) -> Any:
        """Carry out one step of a flow (:mod:`~kvpool.client.ops`) in this thread."""
        if isinstance(step, ops.Read):
            live = partial(self.member, live=step.live)
            self._data.read(step.items, live, deadline)
        elif isinstance(step, ops.Lookup):
            with self.looking_up(step.keys):
                request = self.lookup_request(step.keys)
                answer = self._masters.call("Lookup", request, deadline=deadline)
            self.lookup_answered(step.keys, answer)
            return answer
        elif isinstance(step, ops.Stage):
            commit, outcomes = step.commit, []

            def sent() -> None:  # the node takes the bytes while the masters commit
                outcomes.extend(self._commit_chunks(commit.chunks, commit.ring_version, deadline))

            return outcomes if self._data.stage(step.items, step.deadline, sent) else None
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
