"""The master's frame RPC port: the clients' hot calls without gRPC's per-call cost.

A grpc.aio round trip costs ~300 µs on the 2-core test machine with an empty handler (~1 ms
under load), against ~25 µs for a data-plane frame over the same loopback. So a master also
serves ``Lookup``, ``CommitPuts``, ``GetMembers``, ``PrefixMatch`` and ``Remove`` as frames
(:data:`~kvpool.proto.wire.Op.RPC`: the key names the method, the payload is the same protobuf
request, ``version`` the caller's budget in microseconds). The handlers are the gRPC service's
own methods — same validation, leader guard, group commit, read-your-writes wait — and a raised
:class:`~kvpool.errors.KVPoolError` comes back with status RPC_ERROR as its code, message and
leader, so the caller rebuilds the same typed error.

A master offers the port (``rpc_address`` in GetMembers) only when clients dial it directly:
with ``advertise_address`` set (a proxy or NAT in front) it is not offered, so a proxied path,
and any fault injected on it, stays the only one.

Limits (:mod:`kvpool.transports.limits`): a request payload above ``max_request_size`` is
answered REQUEST_TOO_LARGE and its connection closed, before anything is allocated; the buffer of
an accepted one is charged to the process's ``request_memory`` budget until the request is
decoded (beyond the budget: UNAVAILABLE, retryable, the payload skipped); a frame not complete
within ``frame_timeout_s`` closes its connection; at most ``max_connections`` connections.
Undecodable and refused requests are logged once per peer and minute (``rpc_bad_request``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from typing import Any

from google.protobuf.message import DecodeError, Message

from kvpool import tracing
from kvpool.errors import (
    InternalError,
    KVPoolError,
    MalformedRequestError,
    NotLeaderError,
    RequestTooLargeError,
    UnavailableError,
)
from kvpool.logs import OncePer, get_logger
from kvpool.mastercall import READ_METHODS
from kvpool.metrics import RPC_SERVER_LATENCY
from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.v1 import master_pb2
from kvpool.proto.wire import FrameError, Header, Op, Status, version_mismatch_message
from kvpool.raft_master.service import MasterService
from kvpool.transports.auth import Gate
from kvpool.transports.eager import start_eagerly
from kvpool.transports.limits import (
    IngressLimits,
    MemoryBudget,
    overloaded_message,
    too_large_message,
)
from kvpool.transports.stream import FrameStream, StreamServer, listen_tcp, tune_socket

BLOCKED_TIMEOUT_S = 30.0
"""A caller that has not read its answers for this long is cut."""
METHODS: dict[str, type[Message]] = {
    "Lookup": master_pb2.LookupRequest,
    "CommitPuts": master_pb2.CommitPutsRequest,
    "GetMembers": master_pb2.GetMembersRequest,
    "PrefixMatch": master_pb2.PrefixMatchRequest,
    "Remove": master_pb2.RemoveRequest,
}
"""The calls served here (every other one: gRPC)."""
_LATENCY: dict[str, Any] = {}
"""Each served call's latency histogram (``labels()`` costs more than the observation)."""


def error_body(error: KVPoolError) -> bytes:
    """An RPC_ERROR answer's payload: the error's code and message, and the leader it names."""
    doc: dict[str, str] = {"code": error.code, "message": error.message}
    if isinstance(error, NotLeaderError) and error.leader:
        doc["leader"] = error.leader
    return json.dumps(doc).encode()


def observe(method: str, seconds: float) -> None:
    """A served call's latency (``kvpool_rpc_server_latency_seconds``, transport ``frame``)."""
    latency = _LATENCY.get(method)
    if latency is None:
        latency = _LATENCY[method] = RPC_SERVER_LATENCY.labels(method, "frame")
    latency.observe(seconds)


_HELLO = json.dumps({"features": ["trace"]}).encode()
"""What the port offers (a HELLO answer): frames may carry a trace context."""


def _span_attributes(request: Any, response: Any) -> dict[str, Any]:
    """Key counts of a served call (and found entries of a Lookup)."""
    attrs: dict[str, Any] = {}
    keys = getattr(request, "keys", None)
    if keys is not None:
        attrs["kvpool.keys"] = len(keys)
    if isinstance(response, master_pb2.LookupResponse):
        attrs["kvpool.found"] = sum(1 for e in response.entries if e.found)
    return attrs


MAX_BUDGET_S = 600.0
"""The most time a caller may give one call (a frame's ``version``, in µs); more is taken as
this. A u64 of µs is ~585,000 years: past what a thread can be told to wait."""


def caller_budget(header: Header) -> float | None:
    """The time the caller gave its call (None: it gave none), at most :data:`MAX_BUDGET_S`."""
    return min(header.version / 1e6, MAX_BUDGET_S) if header.version else None


class Budget:
    """What the service methods ask of a gRPC context: the time the caller gave."""

    def __init__(self, loop: asyncio.AbstractEventLoop, budget_s: float | None) -> None:
        self._deadline = loop.time() + budget_s if budget_s is not None else None
        self._loop = loop

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - self._loop.time())


class RpcConnection:
    """One client connection to the RPC port; calls run concurrently, answered by id."""

    def __init__(self, port: RpcPort) -> None:
        self._port = port
        self.stream: FrameStream | None = None
        self.peer = "?"
        self._tasks: set[asyncio.Task[None]] = set()
        self._charged = 0  # request memory held by the frame being received
        self._refusal: KVPoolError | None = None  # decided for the frame being received

    def attach(self, sock: socket.socket) -> None:
        tune_socket(sock)
        self.stream = FrameStream(sock, self, backpressure=True)
        self.peer = self.stream.peername
        self._port.connections.add(self)

    def abort(self) -> None:
        if self.stream is not None:
            self.stream.abort()

    # --- StreamHandler ----------------------------------------------------------------------

    def frame_sink(self, header: Header, key: bytes) -> memoryview | None:
        self._refusal = None
        if header.op != Op.RPC or not header.payload_len:
            return None
        port = self._port
        size = header.payload_len
        if size > port.limits.max_request_bytes:
            error = RequestTooLargeError(too_large_message(size, port.limits.max_request_bytes))
            self._bad_request(header, key, error.message)
            self._error(header, error)
            if self.stream is not None:
                self.stream.close()  # not worth reading: the answer goes, then we close
            return None
        if not port.budget.take(size):
            self._refusal = UnavailableError(overloaded_message(size, port.budget))
            self._bad_request(header, key, "request memory exhausted")
            return None
        self._charged = size
        return memoryview(bytearray(size))

    def _uncharge(self) -> None:
        if self._charged:
            self._port.budget.give(self._charged)
            self._charged = 0

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        try:
            self._handle(header, key, payload)
        finally:
            self._uncharge()

    def _handle(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        stream = self.stream
        if stream is None or stream.is_closing:
            return
        if self._refusal is not None:
            self._error(header, self._refusal)
            return
        if header.op in (Op.PING, Op.AUTH):  # AUTH: no token here, or proved already (Gate)
            stream.send(Header(op=header.op, request_id=header.request_id))
            return
        if header.op == Op.HELLO:
            stream.send(
                Header(
                    op=Op.HELLO,
                    status=Status.OK,
                    request_id=header.request_id,
                    payload_len=len(_HELLO),
                ),
                b"",
                _HELLO,
            )
            return
        name = key.decode("ascii", "replace")
        request_type = METHODS.get(name) if header.op == Op.RPC else None
        if request_type is None or (payload is None and header.payload_len):
            self._bad_request(header, key, "not served on this port")
            stream.send_error(
                header, Status.BAD_REQUEST, f"op {header.op} {name!r}: not served on this port"
            )
            return
        try:
            request = request_type.FromString(bytes(payload) if payload is not None else b"")
        except DecodeError as e:
            self._bad_request(header, key, f"undecodable: {e}")
            self._error(header, MalformedRequestError(f"{name}: undecodable request: {e}"))
            return
        finally:
            self._uncharge()  # decoded: the payload's buffer is no longer needed
        # A read the index can answer as it is goes now (a traced one: as every other call).
        traced = header.trace and tracing.STATE.enabled
        if name in READ_METHODS and not traced and self._read_now(header, name, request):
            return
        budget_s = caller_budget(header)
        # Most handlers answer without waiting: run them now, a task only for those that wait.
        task = start_eagerly(
            asyncio.get_running_loop(), self._call(header, name, request, budget_s)
        )
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _read_now(self, header: Header, name: str, request: Any) -> bool:
        """Answer a read the index can answer as it is, with no coroutine or task (most
        reads): True when answered (or refused); False when it has to wait — no read lease
        yet, or an index behind the caller — which the async method does."""
        started = time.perf_counter()
        try:
            response = self._port.service.read_now(name, request)
        except KVPoolError as e:
            self._error(header, e)
        except Exception as e:  # the port keeps serving whatever a handler does
            self._port.log.exception("rpc_failed", method=name)
            self._error(header, InternalError(f"{type(e).__name__}: {e}"))
        else:
            if response is None:
                return False
            self._reply(header, response)
        observe(name, time.perf_counter() - started)
        return True

    async def _call(self, header: Header, name: str, request: Any, budget_s: float | None) -> None:
        started = time.perf_counter()
        try:
            if header.trace and tracing.STATE.enabled and tracing.sampled(header.trace):
                with tracing.server_span(
                    f"kvpool.v1.Master/{name}",
                    tracing.remote_context(header.trace),
                    {"rpc.method": name, "kvpool.transport": "frame"},
                ) as span:
                    await self._answer(header, name, request, budget_s, span)
            else:
                await self._answer(header, name, request, budget_s, None)
        finally:
            observe(name, time.perf_counter() - started)

    async def _answer(
        self, header: Header, name: str, request: Any, budget_s: float | None, span: Any
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            response = await getattr(self._port.service, name)(request, Budget(loop, budget_s))
            if span is not None:
                span.set_attributes(_span_attributes(request, response))
        except KVPoolError as e:
            if span is not None:
                span.set_attribute("kvpool.error", e.code)
            self._error(header, e)
            return
        except Exception as e:  # the port keeps serving whatever a handler does
            self._port.log.exception("rpc_failed", method=name)
            self._error(header, InternalError(f"{type(e).__name__}: {e}"))
            return
        self._reply(header, response)

    def _reply(self, header: Header, response: Message) -> None:
        body = response.SerializeToString()
        if self.stream is not None:
            self.stream.send(
                Header(
                    op=Op.RPC,
                    status=Status.OK,
                    request_id=header.request_id,
                    payload_len=len(body),
                ),
                b"",
                body,
            )

    def _error(self, header: Header, error: KVPoolError) -> None:
        body = error_body(error)
        if self.stream is not None:
            self.stream.send(
                Header(
                    op=Op.RPC,
                    status=Status.RPC_ERROR,
                    request_id=header.request_id,
                    payload_len=len(body),
                ),
                b"",
                body,
            )

    def _bad_request(self, header: Header, key: bytes, reason: str) -> None:
        self._port.refused(self.peer, reason, header, key)

    def version_mismatch(self, theirs: int) -> None:
        self._port.refused(self.peer, "version")
        if self.stream is not None:
            self.stream.send_error(
                None,
                Status.VERSION_MISMATCH,
                version_mismatch_message(PROTOCOL_VERSION, theirs),
                close=True,
            )

    def bad_frame(self, error: FrameError) -> None:
        self._port.refused(self.peer, str(error))
        if self.stream is not None:
            self.stream.send_error(None, Status.BAD_REQUEST, str(error), close=True)

    def stream_closed(self, error: Exception | None) -> None:
        self._port.connections.discard(self)
        self._uncharge()
        for task in list(self._tasks):
            task.cancel()
        self.stream = None  # nothing points back at the stream: freed by reference counting


class FramePort:
    """What a master's frame ports share: the service, the log, the ingress limits and request
    memory budget, the token gate (with ``max_connections``) and the listening socket.
    :meth:`start` binds (on the event loop); subclasses adopt each admitted socket."""

    LOGGER = "kvpool.raft_master.rpc"
    NAME = "rpc"  # the port, in its log lines
    LIMIT_NAME = "max_connections"  # the setting that bounds its connections (limits')

    def __init__(
        self,
        service: MasterService,
        log: Any = None,
        token: bytes = b"",
        limits: IngressLimits | None = None,
        *,
        max_connections: int = 0,
    ) -> None:
        """``max_connections``: the port's own bound on connections, over ``limits``' (0:
        theirs)."""
        self.service = service
        self.log = log if log is not None else get_logger(self.LOGGER)
        self.once = OncePer(self.log)
        self.limits = limits if limits is not None else IngressLimits()
        if max_connections:
            self.limits = dataclasses.replace(self.limits, max_connections=max_connections)
        self.budget = MemoryBudget(self.limits.request_memory_bytes)
        self.connections: set[Any] = set()
        self.gate = Gate(
            token,
            self._adopt,
            log=self.log,
            max_connections=self.limits.max_connections,
            live=lambda: len(self.connections),
            limit_name=self.LIMIT_NAME,
        )
        self._server: StreamServer | None = None
        self.port = 0
        self.bad_requests = 0
        self.cut = 0

    def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); OSError when it cannot."""
        self._server = StreamServer(listen_tcp(host, port), self.gate, log=self.log)
        self.port = self._server.port
        return self.port

    def _adopt(self, sock: socket.socket) -> None:
        raise NotImplementedError

    def refused(
        self, peer: str, reason: str, header: Header | None = None, key: bytes = b""
    ) -> None:
        """A request refused or a frame unread: counted, and logged once per peer and minute
        (``rpc_bad_request``)."""
        self.bad_requests += 1
        self.once.warning(
            "rpc_bad_request",
            peer.rsplit(":", 1)[0],
            peer=peer,
            op=header.op if header is not None else None,
            method=key[:64].decode("ascii", "replace"),
            reason=reason,
            port=self.NAME,
        )

    def slow_peer_cut(self, peer: str) -> None:
        """A connection cut for a frame or an answer that took too long: counted and logged."""
        self.cut += 1
        self.once.warning("slow_peer_cut", peer.rsplit(":", 1)[0], peer=peer, port=self.NAME)

    def _stop_listening(self) -> None:
        self.gate.close()
        if self._server is not None:
            self._server.close()
            self._server = None


class RpcPort(FramePort):
    """The frame RPC port; :meth:`close` stops and cuts every caller."""

    _guard: asyncio.Task[None] | None = None  # cuts slow callers (cut_slow), once started

    def start(self, host: str, port: int) -> int:
        bound = super().start(host, port)
        self._guard = asyncio.get_running_loop().create_task(self._cut_slow())
        return bound

    def _adopt(self, sock: socket.socket) -> None:
        RpcConnection(self).attach(sock)

    def cut_slow(self, now: float) -> int:
        """Close connections with a frame half-sent for ``frame_timeout_s`` or answers unread
        for :data:`BLOCKED_TIMEOUT_S`."""
        cut = 0
        for conn in list(self.connections):
            stream = conn.stream
            if stream is None:
                continue
            started, blocked = stream.frame_since, stream.blocked_since
            if (started is not None and now - started > self.limits.frame_timeout_s) or (
                blocked is not None and now - blocked > BLOCKED_TIMEOUT_S
            ):
                self.slow_peer_cut(conn.peer)
                conn.abort()
                cut += 1
        return cut

    async def _cut_slow(self) -> None:
        period_s = max(0.05, min(1.0, self.limits.frame_timeout_s / 4))
        while True:
            await asyncio.sleep(period_s)
            try:
                self.cut_slow(time.monotonic())
            except Exception as e:  # a sweep that fails must not end the sweeps: a slow
                # caller would then hold its connection and buffers for good
                self.once.warning("slow_peer_guard_failed", self.NAME, error=repr(e))

    def close(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
            self._guard = None
        self._stop_listening()
        for conn in list(self.connections):
            conn.abort()
