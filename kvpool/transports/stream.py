"""Frames over a non-blocking stream socket, driven by the event loop: kvpool's own transport.

Why not asyncio's transports: in Python 3.11 a selector transport copies into a ``bytearray``
whatever one ``send()`` did not take (a second copy of each block a node sends from tier memory
and of each payload a client puts), writes a header and its payload with two syscalls, and says
"drained" only through write-buffer limits. A :class:`FrameStream` keeps a queue of memoryviews
and sends them with ``sendmsg`` — a header and its payload in one vectored syscall, never a copy
of what is still unsent — and runs each send's ``on_sent`` as soon as the kernel has taken its
last byte (a node ends a block's lease there). The answers to every frame parsed from one read are
sent together, in one ``sendmsg``.

Reads go through a :class:`~kvpool.transports.frames.FrameReader`: ``recv_into`` its scratch
buffer, or straight into a payload's destination.

Backpressure (servers): while the kernel refuses more bytes, the stream stops reading requests,
and :attr:`FrameStream.blocked_since` says since when — a node cuts a peer that stopped reading
(its leases end). Clients must not stop reading while their writes wait (both sides would wait
for ever), so they open streams with ``backpressure=False``.

Works over TCP, unix-domain sockets (the shared-memory control channel) and socket pairs
(``inproc``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from kvpool.logs import OncePer, get_logger
from kvpool.proto.wire import MAX_ERROR_MESSAGE_BYTES, Header, Status
from kvpool.transports.frames import SCRATCH_BYTES, FrameHandler, FrameReader

IOV_BATCH = 512
"""Most buffers handed to one sendmsg (Linux allows 1024)."""
SEND_BATCH_BYTES = 1 << 20
"""Most bytes handed to one sendmsg. Over loopback the sender's syscall does the receiver's
TCP work too; many megabytes in one call leave the reader idle meanwhile (measured with 16
pipelined 1 MiB GETs: 2.2 GB/s unbounded, 4.4-4.6 GB/s at 256 KiB-1 MiB per call)."""
READS_PER_WAKEUP = 16
"""Most recv_into calls per readable event before yielding to other connections."""
SOCKET_BUFFER_BYTES = 4 * 2**20

Buffer = bytes | bytearray | memoryview


class StreamHandler(FrameHandler, Protocol):
    def stream_closed(self, error: Exception | None) -> None:
        """The stream is closed (by either side); nothing more will be read or sent."""


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay on TCP; large buffers (best effort)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


def _address(sock: socket.socket, peer: bool) -> str:
    try:
        addr = sock.getpeername() if peer else sock.getsockname()
    except OSError:
        return "?"
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = str(addr[0])
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    if isinstance(addr, bytes):
        return addr.decode("utf-8", "replace")
    return str(addr) or "?"


class FrameStream:
    """One stream socket carrying frames both ways; see the module doc."""

    def __init__(
        self,
        sock: socket.socket,
        handler: StreamHandler,
        *,
        backpressure: bool,
        coalesce: bool = True,
        scratch_bytes: int = SCRATCH_BYTES,
        clock: Callable[[], float] = time.monotonic,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = loop or asyncio.get_running_loop()
        self._handler = handler
        self.reader = FrameReader(handler, scratch_bytes)
        self._backpressure = backpressure
        self._coalesce = coalesce
        self._clock = clock
        self._queue: deque[memoryview] = deque()
        self._callbacks: deque[tuple[int, Callable[[], None]]] = deque()
        self._queued_total = 0  # bytes ever queued
        self._sent_total = 0  # bytes the kernel has taken
        self._in_read = False
        self._flush_scheduled = False
        self._writer_armed = False
        self._reading = False
        self._paused_by_writes = False
        self._paused_by_user = False
        self._close_when_flushed = False
        self._closed = False
        self.blocked_since: float | None = None
        """When the kernel last refused bytes and has not taken them all since (None: not
        blocked)."""
        self.frame_since: float | None = None
        """Since when part of a request frame has arrived without the rest (None: between
        frames). A server cuts a peer that keeps a frame half-sent (its reservation ends)."""
        self.peername = _address(sock, peer=True)
        self.sockname = _address(sock, peer=False)
        self.family = sock.family
        self.closed = asyncio.Event()
        self._resume_reading()

    # --- state --------------------------------------------------------------------------------

    @property
    def is_closing(self) -> bool:
        return self._closed or self._close_when_flushed

    @property
    def socket(self) -> socket.socket:
        return self._sock

    # --- sending ------------------------------------------------------------------------------

    def send(
        self,
        header: Header | bytes,
        key: bytes = b"",
        payload: Buffer | Iterable[Buffer] = b"",
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        """Queue one frame: header, key, then the payload (one buffer or several, sent as they
        are). ``on_sent`` runs once the kernel has taken the frame's last byte, or when the
        stream closes first. Nothing is copied but the header and key."""
        if self._closed or self._close_when_flushed:
            if on_sent is not None:
                on_sent()
            return
        head = header.pack() if isinstance(header, Header) else header
        self._append(head + key if key else head)
        if isinstance(payload, bytes | bytearray | memoryview):
            if len(payload):
                self._append(payload)
        else:
            for part in payload:
                if len(part):
                    self._append(part)
        if on_sent is not None:
            if self._queued_total == self._sent_total:
                on_sent()
            else:
                self._callbacks.append((self._queued_total, on_sent))
        self._kick()

    def send_error(
        self, request: Header | None, status: Status, message: str, *, close: bool = False
    ) -> None:
        """An error response (the message is its payload); ``close``: close once it has left."""
        body = message.encode("utf-8")[:MAX_ERROR_MESSAGE_BYTES]
        self.send(
            Header(
                op=request.op if request else 0,
                status=status,
                request_id=request.request_id if request else 0,
                payload_len=len(body),
            ),
            b"",
            body,
        )
        if close:
            self.close()

    def _append(self, buf: Buffer) -> None:
        view = buf if isinstance(buf, memoryview) else memoryview(buf)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        self._queue.append(view)
        self._queued_total += view.nbytes

    def _kick(self) -> None:
        if self._in_read or self._writer_armed or self._flush_scheduled:
            return  # flushed at the end of the read, when writable, or soon
        if not self._coalesce:
            self._flush()
            return
        self._flush_scheduled = True
        self._loop.call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self._flush()

    def flush(self) -> None:
        """Send what is queued now (normally done at the end of a read or on the next turn of
        the loop)."""
        self._flush()

    def _flush(self) -> None:
        queue = self._queue
        while queue and not self._closed:
            views = []
            total = 0
            for view in queue:
                views.append(view)
                total += view.nbytes
                if total >= SEND_BATCH_BYTES or len(views) >= IOV_BATCH:
                    break
            try:
                sent = self._sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:
                self._fail(e)
                return
            if sent:
                self._consume(sent)
            if sent < total:
                if not self._closed:
                    self._blocked()
                return
        if not self._closed:
            self._drained()

    def _consume(self, sent: int) -> None:
        self._sent_total += sent
        queue = self._queue
        while sent:
            head = queue[0]
            if head.nbytes <= sent:
                sent -= head.nbytes
                queue.popleft()
            else:
                queue[0] = head[sent:]
                sent = 0
        callbacks = self._callbacks
        while callbacks and callbacks[0][0] <= self._sent_total:
            _, cb = callbacks.popleft()
            cb()

    def _blocked(self) -> None:
        if self.blocked_since is None:
            self.blocked_since = self._clock()
        if not self._writer_armed:
            self._loop.add_writer(self._fd, self._on_writable)
            self._writer_armed = True
        if self._backpressure and not self._paused_by_writes:
            self._paused_by_writes = True
            self._pause_reading()

    def _drained(self) -> None:
        self.blocked_since = None
        if self._writer_armed:
            self._loop.remove_writer(self._fd)
            self._writer_armed = False
        if self._close_when_flushed:
            self._finish_close(None)
            return
        if self._paused_by_writes:
            self._paused_by_writes = False
            if not self._paused_by_user:
                self._resume_reading()

    def _on_writable(self) -> None:
        self._flush()

    # --- reading ------------------------------------------------------------------------------

    def pause_reading(self) -> None:
        self._paused_by_user = True
        self._pause_reading()

    def resume_reading(self) -> None:
        self._paused_by_user = False
        if not self._paused_by_writes:
            self._resume_reading()

    def _pause_reading(self) -> None:
        if self._reading and not self._closed:
            self._loop.remove_reader(self._fd)
        self._reading = False

    def _resume_reading(self) -> None:
        if not self._reading and not self._closed and not self.reader.stopped:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _on_readable(self) -> None:
        reader = self.reader
        sock = self._sock
        self._in_read = True
        try:
            for _ in range(READS_PER_WAKEUP):
                buf = reader.get_buffer()
                try:
                    n = sock.recv_into(buf)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:
                    self._fail(e)
                    return
                if n == 0:
                    self._finish_close(None)
                    return
                reader.buffer_updated(n)
                if self._closed or reader.stopped or not self._reading or n < len(buf):
                    break
        finally:
            self._in_read = False
        if self._closed:
            return
        if reader.busy:
            if self.frame_since is None:
                self.frame_since = self._clock()
        else:
            self.frame_since = None
        if reader.stopped:
            self._pause_reading()
        if self._queue and not self._writer_armed:
            self._flush()
        elif self._close_when_flushed and not self._queue:
            self._finish_close(None)

    # --- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close once everything queued has been sent."""
        if self._closed:
            return
        self._close_when_flushed = True
        self._pause_reading()
        if not self._queue:
            self._finish_close(None)
        elif not self._writer_armed:
            self._kick()

    def abort(self) -> None:
        """Close now; what is still queued is dropped (its ``on_sent`` callbacks run)."""
        self._finish_close(None)

    def _fail(self, error: Exception) -> None:
        self._finish_close(error)

    def _finish_close(self, error: Exception | None) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False
        if self._writer_armed:
            self._loop.remove_writer(self._fd)
            self._writer_armed = False
        with contextlib.suppress(OSError):
            self._sock.close()
        self._queue.clear()
        self.blocked_since = None
        callbacks, self._callbacks = self._callbacks, deque()
        self._sent_total = self._queued_total
        self.frame_since = None
        try:
            for _, cb in callbacks:  # the bytes will never leave: let go of their memory
                cb()
        finally:
            self.closed.set()
            handler, self._handler = self._handler, _CLOSED
            try:
                handler.stream_closed(error)
            finally:
                # Break the handler <-> stream <-> reader cycle now: the connection's buffers
                # are freed by reference counting as soon as its owner lets go, without
                # waiting for a full garbage collection (which gctune may have frozen out).
                self.reader.release()


class _ClosedHandler:
    """What a closed stream points at instead of its handler (nothing more is delivered)."""

    def stream_closed(self, error: Exception | None) -> None:
        return None

    def frame_sink(self, header: Header, key: bytes) -> memoryview | None:
        return None

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        return None

    def version_mismatch(self, theirs: int) -> None:
        return None

    def bad_frame(self, error: Exception) -> None:
        return None


_CLOSED: StreamHandler = _ClosedHandler()


# --- servers ------------------------------------------------------------------------------------


class StreamServer:
    """Accepts connections on a listening socket (TCP or unix) and wraps each in a FrameStream
    made by ``adopt``. ``close`` stops accepting (established streams stay)."""

    def __init__(
        self,
        listener: socket.socket,
        adopt: Callable[[socket.socket], object],
        loop: asyncio.AbstractEventLoop | None = None,
        log: Any = None,
    ) -> None:
        listener.setblocking(False)
        self._listener = listener
        self._adopt = adopt
        self._once = OncePer(log if log is not None else get_logger("kvpool.transports"))
        self.adopt_failures = 0
        self._loop = loop or asyncio.get_running_loop()
        self._closed = False
        self._loop.add_reader(listener.fileno(), self._on_accept)
        self.sockname = listener.getsockname()

    @property
    def port(self) -> int:
        return int(self.sockname[1]) if isinstance(self.sockname, tuple) else 0

    def _on_accept(self) -> None:
        for _ in range(64):
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # EMFILE and friends: try again on the next readable event
            try:
                self._adopt(sock)
            except Exception as e:  # a peer that left at once (shm: send_fds fails), a bug
                self.adopt_failures += 1
                with contextlib.suppress(OSError):
                    sock.close()
                self._once.warning("accept_failed", type(e).__name__, error=repr(e))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._listener.fileno())
        with contextlib.suppress(OSError):
            self._listener.close()


def listen_tcp(host: str, port: int, backlog: int = 512) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0 = any free port); OSError when it cannot."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock
