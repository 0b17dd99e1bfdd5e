"""The master's read port: index reads answered by a thread per connection, no event loop.

An engine asks the index on the request path (SGLang's ``batch_exists``, LMCache's
``contains``, a first read's Lookup): each answer is on its time to first token. Over the frame
RPC port (:mod:`kvpool.raft_master.rpc_port`) a read passes through the master's event loop —
``epoll_wait``, the loop's callbacks, the frame stream's buffers — ~70 µs of a 1-key request's
CPU on the 2-core test machine; a thread blocked in ``recv`` on the connection wakes with the
request and answers it itself (measured in a 3-master cluster, a raw client, alternating: 1-key
``PrefixMatch`` p50 170 → 134 µs, 128 keys 208 → 170 µs).

The port serves the reads only — ``Lookup``, ``PrefixMatch``, ``GetMembers`` — with the same
frames, checks and typed errors as the RPC port: the index is read under its apply lock
(:meth:`~kvpool.raft_master.service.MasterService.read_now`); a read that has to wait (no read
lease yet, an index behind the caller) runs the async method on the event loop and this thread
waits for it. Writes stay on the RPC port, whose event loop batches them into Raft. A master
offers the port (``read_address`` in GetMembers) exactly when it offers its RPC port.

Connections are admitted on the event loop (:class:`~kvpool.transports.auth.Gate`: the cluster
token, ``max_connections`` counting both ports' connections), then handed to their thread. The
limits are the RPC port's: a request above ``max_request_size`` is answered REQUEST_TOO_LARGE and
its connection closed; a request whose buffer would pass the ``request_memory`` budget is
answered UNAVAILABLE (retryable) and its connection closed; a frame not complete within
``frame_timeout_s`` closes its connection, as does an answer not taken within
:data:`~kvpool.raft_master.rpc_port.BLOCKED_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import struct
import threading
import time
from typing import Any

from google.protobuf.message import DecodeError

from kvpool.errors import (
    InternalError,
    KVPoolError,
    MalformedRequestError,
    RequestTooLargeError,
    UnavailableError,
)
from kvpool.mastercall import READ_METHODS
from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.wire import (
    HEADER_SIZE,
    MAX_ERROR_MESSAGE_BYTES,
    PREFIX_SIZE,
    FrameError,
    Header,
    Op,
    Status,
    check_prefix,
    split_trace,
    unpack_header,
    version_mismatch_message,
)
from kvpool.raft_master.rpc_port import (
    BLOCKED_TIMEOUT_S,
    METHODS,
    Budget,
    FramePort,
    caller_budget,
    error_body,
    observe,
)
from kvpool.transports.limits import (
    overloaded_message,
    too_large_message,
)
from kvpool.transports.stream import tune_socket

READ_THREADS = 512
"""Connections (each a thread) the port serves at once unless told (``read_threads``)."""
IDLE_BUFFER_BYTES = 4 << 10
"""Each connection's own buffer to begin with: a header and its key fit (an idle connection
costs its thread and this)."""
BUFFER_BYTES = 64 << 10
"""What the own buffer grows to for a payload that does not fit; a frame larger still is read
into a buffer charged to the ``request_memory`` budget."""
WAIT_LIMIT_S = 30.0
"""The longest a read port thread waits for a read the event loop answers (when its caller
gave no time): the loop's own waits end within seconds."""
_HELLO = json.dumps({"features": []}).encode()
"""No trace contexts here: a traced read goes to the RPC port (clients ask HELLO when tracing)."""


class _ClosedError(Exception):
    """The peer closed, the port closed the connection, or a frame timed out."""


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class ReadConnection:
    """One admitted connection, served by its own thread (:meth:`serve`)."""

    def __init__(self, port: ReadPort, sock: socket.socket) -> None:
        self._port = port
        self._sock = sock
        self.peer = "?"
        with contextlib.suppress(OSError):
            host, peer_port = sock.getpeername()[:2]
            self.peer = f"{host}:{peer_port}"
        self._buf = bytearray(IDLE_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the bytes read and not yet taken: _buf[_start:_end]
        self._between_frames = True
        self._frame_started: float | None = None  # when the frame being read began

    def abort(self) -> None:
        """End the connection from another thread: its ``recv`` returns, the thread ends."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def serve(self) -> None:
        sock = self._sock
        try:
            sock.setblocking(True)
            tune_socket(sock)
            # A frame begun must end within frame_timeout_s; an answer must leave within
            # BLOCKED_TIMEOUT_S. Kernel timeouts: recv and send stay one system call each.
            timeout = self._port.limits.frame_timeout_s
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(BLOCKED_TIMEOUT_S))
            while self._frame():
                pass
        except _ClosedError:
            pass
        except OSError:
            pass  # reset by the peer, or a send that timed out: the connection ends
        finally:
            with contextlib.suppress(OSError):
                sock.close()
            self._port.forget(self)

    # --- one frame ------------------------------------------------------------------------

    def _fill(self, view: memoryview, idle: bool) -> int:
        """One ``recv`` into ``view`` (its byte count). ``idle``: nothing of the next frame has
        come yet, so a timeout keeps waiting (an idle connection is not cut); a frame begun
        and not whole ``frame_timeout_s`` after its first byte cuts the connection, however its
        bytes trickle in."""
        limit = self._port.limits.frame_timeout_s
        while True:
            try:
                n = self._sock.recv_into(view)
            except (BlockingIOError, TimeoutError):
                n = -1
            except InterruptedError:
                continue
            if n == 0:
                raise _ClosedError
            now = time.monotonic()
            if idle:
                if n < 0:
                    continue
                self._frame_started = now
                return n
            if self._frame_started is None:
                self._frame_started = now  # a frame that began with bytes read before
            if now - self._frame_started > limit:
                self._port.slow_peer_cut(self.peer)
                raise _ClosedError
            if n > 0:
                return n

    def _ensure(self, size: int) -> None:
        """Have the stream's next ``size`` bytes (at most the buffer's size) in the buffer,
        read as they come — usually a whole frame, or several, per ``recv``."""
        buf = self._view
        while self._end - self._start < size:
            if len(buf) - self._start < size:  # move what is left of the buffer to its start
                left = self._end - self._start
                buf[:left] = buf[self._start : self._end]
                self._start, self._end = 0, left
            idle = self._end == self._start and self._between_frames
            self._end += self._fill(buf[self._end :], idle)
            self._between_frames = False

    def _grow(self) -> None:
        """The own buffer at its full size, with the bytes read and not yet taken."""
        left = self._end - self._start
        buf = bytearray(BUFFER_BYTES)
        buf[:left] = self._view[self._start : self._end]
        self._buf, self._view = buf, memoryview(buf)
        self._start, self._end = 0, left

    def _take(self, size: int) -> memoryview:
        """The next ``size`` bytes, taken (valid until the next :meth:`_ensure`)."""
        self._ensure(size)
        view = self._view[self._start : self._start + size]
        self._start += size
        return view

    def _frame(self) -> bool:
        """Read one frame and answer it; False when the connection must close."""
        self._between_frames = True
        self._frame_started = None
        self._ensure(PREFIX_SIZE)
        started = time.perf_counter()
        try:
            version = check_prefix(self._view[self._start : self._start + PREFIX_SIZE])
        except FrameError as e:
            return self._bad_frame(str(e))
        if version != PROTOCOL_VERSION:
            self._bad_request(None, b"", "version")
            self._send_error(
                None, Status.VERSION_MISMATCH, version_mismatch_message(PROTOCOL_VERSION, version)
            )
            return False
        try:
            header = unpack_header(self._take(HEADER_SIZE))
        except FrameError as e:
            return self._bad_frame(str(e))
        key = bytes(self._take(header.key_len)) if header.key_len else b""
        if header.ext:
            header, key = split_trace(header, key)
        size = header.payload_len
        port = self._port
        if size > port.limits.max_request_bytes:
            error: KVPoolError = RequestTooLargeError(
                too_large_message(size, port.limits.max_request_bytes)
            )
            self._bad_request(header, key, error.message)
            self._send(header, Status.RPC_ERROR, error_body(error))
            return False
        if size <= BUFFER_BYTES:
            if size > len(self._buf):
                self._grow()
            return self._answer(header, key, self._take(size), started)
        if not port.take(size):
            error = UnavailableError(overloaded_message(size, port.budget))
            self._bad_request(header, key, "request memory exhausted")
            self._send(header, Status.RPC_ERROR, error_body(error))
            return False
        try:
            payload = memoryview(bytearray(size))
            have = self._end - self._start
            payload[:have] = self._view[self._start : self._end]
            self._start = self._end = 0
            while have < size:
                have += self._fill(payload[have:], idle=False)
            return self._answer(header, key, payload, started)
        finally:
            port.give(size)

    def _answer(self, header: Header, key: bytes, payload: memoryview, started: float) -> bool:
        if header.op in (Op.PING, Op.AUTH):  # AUTH: no token here, or proved already (Gate)
            self._send(header, Status.OK, b"")
            return True
        if header.op == Op.HELLO:
            self._send(header, Status.OK, _HELLO)
            return True
        name = key.decode("ascii", "replace")
        if header.op != Op.RPC or name not in READ_METHODS:
            self._bad_request(header, key, "not served on this port")
            self._send_error(
                header, Status.BAD_REQUEST, f"op {header.op} {name!r}: not served on this port"
            )
            return True
        try:
            request = METHODS[name].FromString(bytes(payload))
        except DecodeError as e:
            self._bad_request(header, key, f"undecodable: {e}")
            refused = MalformedRequestError(f"{name}: undecodable request: {e}")
            self._send(header, Status.RPC_ERROR, error_body(refused))
            return True
        port = self._port
        assert port.loop is not None  # started
        try:
            response = port.service.read_now(name, request, port.loop.call_soon_threadsafe)
            if response is None:  # it has to wait: the async method waits, on the event loop
                budget_s = caller_budget(header)
                waiting = asyncio.run_coroutine_threadsafe(
                    getattr(port.service, name)(request, Budget(port.loop, budget_s)), port.loop
                )
                try:
                    response = waiting.result(WAIT_LIMIT_S if budget_s is None else budget_s)
                except concurrent.futures.TimeoutError:
                    waiting.cancel()
                    raise UnavailableError(f"{name}: no answer within its time") from None
        except KVPoolError as e:
            self._send(header, Status.RPC_ERROR, error_body(e))
        except Exception as e:  # the port keeps serving whatever a handler does
            port.log.exception("rpc_failed", method=name)
            error = InternalError(f"{type(e).__name__}: {e}")
            self._send(header, Status.RPC_ERROR, error_body(error))
        else:
            self._send(header, Status.OK, response.SerializeToString())
        observe(name, time.perf_counter() - started)
        return True

    # --- answers ----------------------------------------------------------------------------

    def _send(self, request: Header | None, status: int, body: bytes) -> None:
        """One answer frame (``request`` None: a frame that could not be read), all of it: a
        blocking send may take part of it when its time-out ends it (then OSError ends the
        connection, never half an answer followed by the next)."""
        head = Header(
            op=request.op if request is not None else 0,
            status=status,
            request_id=request.request_id if request is not None else 0,
            payload_len=len(body),
        ).pack()
        views = [memoryview(head), memoryview(body)] if body else [memoryview(head)]
        while views:
            sent = self._sock.sendmsg(views)
            while views and sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            if views:
                views[0] = views[0][sent:]

    def _send_error(self, request: Header | None, status: Status, message: str) -> None:
        """An error answer whose message is its payload, as the RPC port's ``send_error``."""
        with contextlib.suppress(OSError):
            self._send(request, status, message.encode("utf-8")[:MAX_ERROR_MESSAGE_BYTES])

    def _bad_frame(self, reason: str) -> bool:
        self._bad_request(None, b"", reason)
        self._send_error(None, Status.BAD_REQUEST, reason)
        return False

    def _bad_request(self, header: Header | None, key: bytes, reason: str) -> None:
        self._port.refused(self.peer, reason, header, key)


class ReadPort(FramePort):
    """The read port; :meth:`close` stops and cuts every caller. Its limits are its own
    (``request_memory``), as the RPC port's are, but for its connections: at most
    ``max_connections`` (``read_threads``; :data:`READ_THREADS` unless told), each served by a
    thread."""

    LOGGER = "kvpool.raft_master.read"
    NAME = "read"
    LIMIT_NAME = "read_threads"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("max_connections", READ_THREADS)
        super().__init__(*args, **kwargs)
        self._budget_lock = threading.Lock()  # the budget is shared by the threads
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._closed = False

    def start(self, host: str, port: int) -> int:
        self.loop = asyncio.get_running_loop()
        return super().start(host, port)

    def _adopt(self, sock: socket.socket) -> None:
        conn = ReadConnection(self, sock)
        with self._lock:
            if self._closed:
                sock.close()
                return
            self.connections.add(conn)
        threading.Thread(target=conn.serve, name="kvpool-read", daemon=True).start()

    def forget(self, conn: ReadConnection) -> None:
        with self._lock:
            self.connections.discard(conn)

    def take(self, size: int) -> bool:
        with self._budget_lock:
            return self.budget.take(size)

    def give(self, size: int) -> None:
        with self._budget_lock:
            self.budget.give(size)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self.connections)
        self._stop_listening()
        for conn in conns:
            conn.abort()
