"""The ``tcp://`` transport: pipelined frames over asyncio, payloads received in place.

Client side, :class:`TcpConnection` (a :class:`FrameConnection` over a
:class:`~kvpool.transports.stream.FrameStream`) sends requests with a fresh request id each and
matches responses by id; many requests are in flight on one connection. A request's payload is
sent from the caller's memory with the header in one vectored write; a GET's payload lands
straight in the caller's buffer (see :mod:`kvpool.transports.frames`). A request that times out
while its payload is being received closes the connection, so a late response can never write
into a buffer the caller has taken back.

The store node serves on :class:`~kvpool.transports.stream.StreamServer`.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvpool.buffers import Parts
from kvpool.checksum import block_hasher
from kvpool.errors import (
    DeadlineExceededError,
    ProtocolVersionError,
    TransportError,
    UnauthenticatedError,
)
from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.wire import (
    MAX_ERROR_MESSAGE_BYTES,
    FrameError,
    Header,
    Op,
    Status,
    version_mismatch_message,
)
from kvpool.transports.auth import authenticate, blocking_connection
from kvpool.transports.blocking import (
    BlockingConnection,
    connect_tcp_blocking,
    connecting,
    time_left,
)
from kvpool.transports.calls import (
    Call,
    hash_landed,
    may_allocate,
    parse_records,
    refused_answer,
    table_head_size,
    table_rest,
)
from kvpool.transports.frames import Scatter
from kvpool.transports.stream import FrameStream
from kvpool.transports.stream import tune_socket as stream_tune_socket

SOCKET_BUFFER_BYTES = 4 * 2**20


@dataclass(slots=True)
class Response:
    header: Header
    key: bytes
    payload: memoryview | Parts | None  # the sink given with the request, or an error message
    digest: int | None = None  # the payload's checksum, taken as it landed (a large sink's)

    @property
    def status(self) -> int:
        return self.header.status

    def message(self) -> str:
        if self.payload is None or self.header.status in (Status.OK, Status.MISS):
            return ""
        return bytes(self.payload).decode("utf-8", "replace")


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Response]
    sink: memoryview | Parts | None
    alloc: bool = False  # allocate a buffer for a payload of any size on arrival
    started: bool = False  # its response frame is being received
    table: Call | None = None  # a table call: its response is scattered (Scatter) when it can be
    scattered: bool = False
    expect: int = -1  # alloc: the payload's size the index named (-1: any up to the cap)
    hashed: _Hashed | None = None  # a large sink received in pieces, each hashed once full


HASH_PIECE_BYTES = 256 * 1024
"""A one-call answer into a caller's buffer of at least twice this is received in pieces of
this size, each hashed as soon as it is full (while the node sends the next), not the whole
block after its last byte (the blocking connection hashes between receives the same way)."""


class _Hashed:
    """The caller's buffer as a :class:`Scatter` of pieces, hashed in order as they fill."""

    __slots__ = ("_hasher", "fed", "pieces")

    def __init__(self, sink: memoryview) -> None:
        self.pieces = [
            sink[i : i + HASH_PIECE_BYTES] for i in range(0, len(sink), HASH_PIECE_BYTES)
        ]
        self._hasher = block_hasher()
        self.fed = 0

    def scatter(self) -> Scatter:
        def rest(_left: int) -> list[memoryview]:
            self._feed(0)  # the first piece is full once the rest is asked for
            return self.pieces[1:]

        return Scatter(self.pieces[0], rest, lambda i: self._feed(i + 1))

    def _feed(self, index: int) -> None:
        piece = self.pieces[index]
        self._hasher.update(piece)
        self.fed += len(piece)

    def digest(self, size: int) -> int | None:
        """The checksum of the ``size`` bytes, when every one was hashed."""
        return int(self._hasher.intdigest()) if self.fed == size else None


def tune_socket(sock: socket.socket | None) -> None:
    if sock is not None:
        stream_tune_socket(sock)


class FrameConnection:
    """One client connection to a node over a stream (TCP, unix or an in-process socket pair),
    with many requests in flight, matched to their responses by request id."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._stream: FrameStream | None = None
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._closed_error: Exception | None = None
        self.closed = asyncio.Event()
        self.features: frozenset[str] = frozenset()
        """What the node offers on this connection (``mget``, ``shm``), once asked (HELLO)."""

    # --- opening and closing --------------------------------------------------------------

    def attach(self, sock: socket.socket) -> None:
        """Start speaking frames over ``sock`` (connected)."""
        tune_socket(sock)
        self._stream = FrameStream(sock, self, backpressure=False, coalesce=False)

    @property
    def stream(self) -> FrameStream | None:
        return self._stream

    @property
    def is_open(self) -> bool:
        return self._stream is not None and self._closed_error is None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()

    def abort(self, why: str) -> None:
        self._fail_all(TransportError(f"{self.address}: {why}"))
        if self._stream is not None:
            self._stream.abort()

    # --- requests ----------------------------------------------------------------------------

    async def request(
        self,
        op: Op,
        key: bytes,
        *,
        write_id: int = 0,
        version: int = 0,
        checksum: int = 0,
        flags: int = 0,
        payload: memoryview | bytes | Parts | None = None,
        sink: memoryview | Parts | None = None,
        alloc: bool = False,
        timeout_s: float,
    ) -> Response:
        """Send one request and wait for its response.

        ``payload`` is sent after the header, from the caller's memory (not copied; do not
        change it until this returns); ``sink`` receives a response payload of exactly its
        length (a response of another length fails with TransportError); ``alloc`` takes a
        response payload of any length into a fresh buffer. Errors: the typed TransportError,
        DeadlineExceededError, ProtocolVersionError.
        """
        stream = self._stream
        if self._closed_error is not None or stream is None:
            raise TransportError(f"{self.address}: connection closed")
        if timeout_s <= 0:
            raise DeadlineExceededError(f"{self.address}: no time left")
        request_id = next(self._ids)
        loop = asyncio.get_running_loop()
        pending = _Pending(loop.create_future(), sink, alloc)
        self._pending[request_id] = pending
        body = payload if payload is not None else b""
        header = Header(
            op=op,
            request_id=request_id,
            write_id=write_id,
            version=version,
            payload_len=len(body),
            checksum=checksum,
            key_len=len(key),
            flags=flags,
        )
        try:
            async with asyncio.timeout(timeout_s):
                stream.send(header, key, body)
                return await pending.future
        except TimeoutError:
            # A peer that did not answer in time is not trusted to be in step with us (a silent
            # partition, a request header garbled on the way, an overload): close the
            # connection, failing what else is pending on it; the pool opens a fresh one.
            self._pending.pop(request_id, None)
            self.abort(f"{op.name} timed out after {timeout_s:.3f}s; connection closed")
            raise DeadlineExceededError(
                f"{self.address}: {op.name} timed out after {timeout_s:.3f}s"
            ) from None
        except asyncio.CancelledError:
            self._abandon(request_id, "request cancelled while receiving; connection closed")
            raise
        finally:
            self._pending.pop(request_id, None)

    async def exchange(
        self, calls: Sequence[Call], timeout_s: float, *, trace: bytes = b""
    ) -> None:
        """Send every call's frame, then wait for all their responses (as
        :meth:`BlockingConnection.exchange <kvpool.transports.blocking.BlockingConnection>`
        does in a thread): ``call.header``/``data``/``records`` are filled, a call whose
        response could not be taken gets ``call.error``. A failure of the whole connection
        raises the typed error. ``trace``: the caller's trace context, sent when the peer
        offered ``trace``."""
        stream = self._stream
        if self._closed_error is not None or stream is None:
            raise TransportError(f"{self.address}: connection closed")
        if timeout_s <= 0:
            raise DeadlineExceededError(f"{self.address}: no time left")
        if trace and "trace" not in self.features:
            trace = b""
        loop = asyncio.get_running_loop()
        waits: list[tuple[Call, int, _Pending]] = []
        for call in calls:
            request_id = next(self._ids)
            call.request_id = request_id
            table = call.table is not None
            pending = _Pending(
                loop.create_future(),
                None if table else call.sink,
                alloc=table or call.sink is None,
                table=call if table else None,
                expect=call.expect,
            )
            self._pending[request_id] = pending
            waits.append((call, request_id, pending))
            stream.send(call.request_header(trace), call.key, call.payload)
        try:
            async with asyncio.timeout(timeout_s):
                for call, _, pending in waits:
                    try:
                        response = await pending.future
                    except ProtocolVersionError:
                        raise
                    except TransportError as e:
                        if not self.is_open:
                            raise
                        call.error = e  # this response only (a payload that did not fit)
                        continue
                    call.header = response.header
                    call.data = response.payload
                    if call.table is None:  # a one-call answer: hashed as it landed, or not
                        call.digests = None if response.digest is None else [response.digest]
                    if (
                        call.table is not None
                        and response.status == Status.OK
                        and not pending.scattered
                    ):
                        try:
                            body = response.payload
                            assert not isinstance(body, Parts)  # a table call has no sink
                            parse_records(call, body or memoryview(b""))
                        except FrameError as e:
                            call.error = TransportError(f"{self.address}: {e}")
        except TimeoutError:
            self.abort(f"no answer within {timeout_s:.3f}s; connection closed")
            raise DeadlineExceededError(
                f"{self.address}: no answer within {timeout_s:.3f}s"
            ) from None
        except asyncio.CancelledError:
            for _, request_id, _ in waits:
                self._abandon(request_id, "request cancelled while receiving; connection closed")
            raise
        finally:
            for _, request_id, pending in waits:
                self._pending.pop(request_id, None)
                future = pending.future
                if future.done() and not future.cancelled():
                    future.exception()  # a call not awaited because an earlier one raised:
                    # its error is this one's, not "Future exception was never retrieved"

    def notify(self, calls: Sequence[Call]) -> None:
        """Send frames no response is awaited for (``SHM_RELEASE``; PUBLISH/DELETE whose
        answers are dropped on arrival)."""
        stream = self._stream
        if self._closed_error is not None or stream is None:
            return
        for call in calls:
            request_id = next(self._ids)
            call.request_id = request_id
            stream.send(call.request_header(), call.key, call.payload)

    def _abandon(self, request_id: int, why: str) -> None:
        """The caller gives up on a request. If its response payload is being written into the
        caller's buffer right now, cut the connection so no late byte lands there after the
        caller has taken the buffer back."""
        current = self._pending.pop(request_id, None)
        if current is not None and current.started:
            self.abort(why)

    # --- StreamHandler ------------------------------------------------------------------------

    def stream_closed(self, error: Exception | None) -> None:
        self._fail_all(
            TransportError(f"{self.address}: connection lost" + (f": {error}" if error else ""))
        )
        self.closed.set()

    def frame_sink(self, header: Header, key: bytes) -> memoryview | Scatter | None:
        pending = self._pending.get(header.request_id)
        if header.status not in (Status.OK, Status.MISS):
            if header.payload_len > MAX_ERROR_MESSAGE_BYTES:
                return None
            return memoryview(bytearray(header.payload_len))
        if pending is None or pending.future.done() or header.payload_len == 0:
            return None
        if pending.table is not None:
            scatter = self._scatter(pending, pending.table, header.payload_len)
            if scatter is not None:
                return scatter
        if pending.alloc and may_allocate(pending.expect, header.payload_len):
            pending.started = True
            return memoryview(bytearray(header.payload_len))
        sink = pending.sink
        if sink is None or len(sink) != header.payload_len:
            if sink is None and header.payload_len <= MAX_ERROR_MESSAGE_BYTES:
                return memoryview(bytearray(header.payload_len))
            return None
        pending.started = True
        if isinstance(sink, Parts):  # the caller's pieces, filled in turn (frame_received: all)
            rest = sink.views[1:]
            return Scatter(sink.views[0], lambda _left: rest)
        if pending.table is None and len(sink) >= 2 * HASH_PIECE_BYTES:
            pending.hashed = _Hashed(sink)
            return pending.hashed.scatter()
        return sink

    @staticmethod
    def _scatter(pending: _Pending, call: Call, size: int) -> Scatter | None:
        """A table response read straight into where its parts go: the count and records into
        a fresh buffer, then each MGET hit's bytes into its caller's buffer (not a fresh one
        for the whole payload, then copied out: a 32 MiB batch took 1.5 ms more per call);
        None when the request cannot say how long the table is (then it comes whole)."""
        head_size = table_head_size(call)
        if head_size is None or head_size > size:
            return None
        head = memoryview(bytearray(head_size))
        pending.started = pending.scattered = True

        def landed(view: int) -> None:  # each MGET hit hashed once its last byte is in
            slot = call.hit_ends[view]
            if slot >= 0:
                hash_landed(call, slot)

        return Scatter(head, lambda left: table_rest(call, head, left), landed)

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        pending = self._pending.get(header.request_id)
        if pending is None or pending.future.done():
            return
        pending.started = False
        if (
            header.status == Status.OK
            and header.payload_len
            and (pending.sink is not None or pending.alloc)
            and payload is None
        ):
            pending.future.set_exception(
                TransportError(
                    refused_answer(self.address, header.payload_len, pending.sink, pending.expect)
                )
            )
            return
        if header.status == Status.UNAUTHORIZED:  # the node closes the connection next
            error = UnauthenticatedError(
                f"{self.address}: {Response(header, key, payload).message() or 'refused'}"
            )
            self._fail_all(error)
            return
        if header.status == Status.VERSION_MISMATCH:
            pending.future.set_exception(
                ProtocolVersionError(
                    Response(header, key, payload).message()
                    or version_mismatch_message(PROTOCOL_VERSION, header.protocol_version)
                )
            )
            return
        answer: memoryview | Parts | None = payload
        digest = None
        parts = pending.sink
        if isinstance(parts, Parts) and parts.views and payload is parts.views[0]:
            answer = parts  # the Scatter over its pieces was filled: the whole is the answer
        hashed = pending.hashed
        if hashed is not None and payload is hashed.pieces[0]:
            answer = parts  # the caller's buffer, filled (and hashed) piece by piece
            digest = hashed.digest(header.payload_len)
        pending.future.set_result(Response(header, key, answer, digest))

    def version_mismatch(self, theirs: int) -> None:
        self._fail_all(
            ProtocolVersionError(
                f"{self.address}: {version_mismatch_message(PROTOCOL_VERSION, theirs)}"
            )
        )
        if self._stream is not None:
            self._stream.abort()

    def bad_frame(self, error: FrameError) -> None:
        self.abort(f"bad frame from node: {error}")

    def _fail_all(self, error: Exception) -> None:
        if self._closed_error is None:
            self._closed_error = error
        for pending in list(self._pending.values()):
            if not pending.future.done():
                pending.future.set_exception(error)
        self._pending.clear()


class TcpConnection(FrameConnection):
    """A :class:`FrameConnection` to a node's ``tcp://`` data port."""

    @classmethod
    async def open(
        cls, host: str, port: int, *, timeout_s: float, token: bytes = b""
    ) -> TcpConnection:
        address = f"tcp://{host}:{port}"
        conn = cls(address)
        deadline = time.monotonic() + timeout_s
        sock = await connect_tcp(host, port, address=address, timeout_s=timeout_s)
        try:
            await authenticate(sock, token, address, time_left(deadline))
        except BaseException:
            sock.close()
            raise
        conn.attach(sock)
        return conn


async def connect_tcp(host: str, port: int, *, address: str, timeout_s: float) -> socket.socket:
    """A connected, non-blocking TCP socket (typed errors on failure)."""
    loop = asyncio.get_running_loop()
    with connecting(address):
        async with asyncio.timeout(timeout_s):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, kind, proto, _, sockaddr = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, sockaddr)
            except BaseException:
                sock.close()
                raise
    return sock


class ConnectionPool:
    """Up to ``size`` connections per node address, used round-robin; dead ones are replaced.
    Addresses of any registered scheme (see :mod:`kvpool.transports`)."""

    def __init__(
        self,
        size: int = 2,
        connect_timeout_s: float = 1.0,
        opener: Callable[[str, float], Awaitable[FrameConnection]] | None = None,
    ) -> None:
        self._size = size
        self._connect_timeout_s = connect_timeout_s
        self._opener = opener or open_tcp_address
        self._conns: dict[str, list[FrameConnection]] = {}
        self._next: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, address: str, *, timeout_s: float) -> FrameConnection:
        conns = self._conns.get(address)
        if conns is not None and len(conns) >= self._size and all(c.is_open for c in conns):
            i = self._next.get(address, 0)
            self._next[address] = i + 1
            return conns[i % len(conns)]
        conns = [c for c in self._conns.get(address, []) if c.is_open]
        self._conns[address] = conns
        if len(conns) < self._size:
            lock = self._locks.setdefault(address, asyncio.Lock())
            async with lock:
                conns = [c for c in self._conns.get(address, []) if c.is_open]
                if len(conns) < self._size:
                    conn = await self._opener(address, min(timeout_s, self._connect_timeout_s))
                    conns.append(conn)
                    self._conns[address] = conns
                    return conn
        i = self._next.get(address, 0)
        self._next[address] = i + 1
        return conns[i % len(conns)]

    async def fill(self, address: str, *, timeout_s: float) -> FrameConnection:
        """Open connections to ``address`` until the pool holds its size of them, within
        ``timeout_s`` (a warm-up's); one of them."""
        deadline = time.monotonic() + timeout_s
        conn = await self.get(address, timeout_s=timeout_s)
        for _ in range(self._size - 1):
            await self.get(address, timeout_s=time_left(deadline))
        return conn

    def discard(self, address: str) -> None:
        for conn in self._conns.pop(address, []):
            conn.abort("discarded")

    async def close(self) -> None:
        for conns in self._conns.values():
            for conn in conns:
                conn.close()
        self._conns.clear()


async def open_tcp_address(address: str, timeout_s: float, token: bytes = b"") -> FrameConnection:
    host, port = parse_tcp_address(address)
    return await TcpConnection.open(host, port, timeout_s=timeout_s, token=token)


def parse_tcp_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` → ``(host, port)``; raises TransportError."""
    if not address.startswith("tcp://"):
        raise TransportError(f"not a tcp:// address: {address!r}")
    rest = address[len("tcp://") :]
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise TransportError(f"not a tcp://host:port address: {address!r}")
    return host.strip("[]"), int(port)


class TcpTransport:
    """``tcp://host:port``."""

    scheme = "tcp"

    async def open(self, address: str, timeout_s: float, token: bytes = b"") -> FrameConnection:
        return await open_tcp_address(address, timeout_s, token)

    def open_blocking(
        self, address: str, timeout_s: float, token: bytes = b""
    ) -> BlockingConnection:
        host, port = parse_tcp_address(address)
        deadline = time.monotonic() + timeout_s
        sock = connect_tcp_blocking(host, port, address=address, timeout_s=timeout_s)
        return blocking_connection(sock, token, address, time_left(deadline))
