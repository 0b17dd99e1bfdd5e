"""Frames over a blocking socket, in the calling thread: the synchronous client's fast path.

Handing a call to an event-loop thread and back costs two thread wake-ups (64 µs measured on the
2-core test machine, more than a whole 4 KiB GET over loopback takes: 22 µs). A
:class:`BlockingConnection` does the I/O in the caller's thread instead: a request's header, key
and payload leave in one ``sendmsg`` straight from the caller's memory, and a response's payload
is received straight into the caller's buffer (``recv_into``), so each byte is copied once, by
the kernel. An MGET response is scattered: its table first, then each hit's bytes into that key's
own buffer.

Requests may be pipelined: :meth:`BlockingConnection.send` writes several, :meth:`receive` reads
responses (matched by request id, in any order) until those it was given are answered.
*Posted* requests (PUBLISH, DELETE after a put or remove) are not waited for: their responses are
read and dropped on the way to later ones. One thread at a time per connection (the client keeps
one per thread and node). A connection that timed out or lost step is ``broken``: close it.

Deadlines are kernel receive/send timeouts (``SO_RCVTIMEO``/``SO_SNDTIMEO``), checked against the
call's deadline before each frame and between the reads of one, so no extra ``poll`` per read.
The option is set again only when it would let a read run more than :data:`LATE_S` past the
deadline or end it over a quarter early; one that ends early is retried for what is left.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from kvpool.buffers import Parts
from kvpool.checksum import block_hasher
from kvpool.errors import (
    DeadlineExceededError,
    KVPoolError,
    ProtocolVersionError,
    TransportError,
    UnauthenticatedError,
)
from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.wire import (
    COUNT,
    HEADER_SIZE,
    MAGIC,
    MAX_ERROR_MESSAGE_BYTES,
    FrameError,
    Header,
    Status,
    unpack_header,
    version_mismatch_message,
)
from kvpool.transports.calls import (
    MAX_ALLOC_BYTES,
    Call,
    OwnHit,
    hash_landed,
    may_allocate,
    refused_answer,
    table_head_size,
    table_rest,
)

T = TypeVar("T")

OWN_HIT_BYTES = 64 * 1024
"""An MGET hit with no caller buffer at least this large is received into a ``bytes`` object of
its own (:class:`~kvpool.transports.calls.OwnHit`: one recv each, no shared buffer and no copy
after); smaller ones share one buffer, received with few calls, and are copied out."""
DROP_BYTES = 256 * 1024
_TIMEVAL = struct.Struct("@ll")
LATE_S = 0.01
"""How far past a call's deadline a kernel time-out may be left to run (rather than set again:
two ``setsockopt`` calls)."""


def _add_frame(views: list[bytes | bytearray | memoryview], call: Call, header: Header) -> None:
    """A call's frame as views to write: header and key, then its payload from where it is (a
    block in pieces: each piece)."""
    views.append(header.pack() + call.key)
    payload = call.payload
    if isinstance(payload, Parts):
        views.extend(payload.views)
    elif len(payload):
        views.append(payload)


class BlockingConnection:
    """A connected stream socket speaking frames; see the module doc."""

    def __init__(self, sock: socket.socket, address: str, *, timeout_s: float = 2.0) -> None:
        sock.settimeout(None)  # blocking; time limits are kernel socket options
        self._sock = sock
        self.address = address
        self._ids = itertools.count(1)
        self._header = bytearray(HEADER_SIZE)
        self._header_view = memoryview(self._header)
        self._drop: memoryview | None = None  # made by the first skip (up to DROP_BYTES)
        self._posted: set[int] = set()
        self._poller: select.poll | None = None
        self._timeout_s = 0.0
        self._set_timeout(timeout_s)
        self.broken = False
        self.closed = False
        self.features: frozenset[str] = frozenset()
        """What the node offers on this connection (``mget``, ``shm``), once asked (HELLO)."""
        self.peername = ""
        self.sockname = ""
        with contextlib.suppress(OSError):
            self.peername = _format(sock.getpeername())
            self.sockname = _format(sock.getsockname())

    @property
    def socket(self) -> socket.socket:
        return self._sock

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self._sock.close()

    # --- time limits ----------------------------------------------------------------------

    def _set_timeout(self, timeout_s: float) -> None:
        if 0.75 * timeout_s <= self._timeout_s <= timeout_s + LATE_S:
            return  # ends at most LATE_S late; one that ends early is retried (_retry_in_time)
        self._arm(timeout_s)

    def _arm(self, timeout_s: float) -> None:
        """Set the kernel time-outs of both directions to ``timeout_s`` (at least 1 ms)."""
        timeout_s = max(0.001, timeout_s)
        sec = int(timeout_s)
        raw = _TIMEVAL.pack(sec, int((timeout_s - sec) * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, raw)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, raw)
        self._timeout_s = timeout_s

    def _check(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self.broken = True
            raise DeadlineExceededError(f"{self.address}: out of time")
        self._set_timeout(remaining)

    def _retry_in_time(self, error: OSError, deadline: float) -> bool:
        """Whether a read or write that failed with ``error`` is to be tried again: a kernel
        time-out set a little shorter than what was left of the deadline (time is left), the
        option then set to exactly that."""
        if not isinstance(error, BlockingIOError | TimeoutError):
            return False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._arm(remaining)
        return True

    def _broken_by(self, error: OSError | None, doing: str) -> KVPoolError:
        """The typed error for a ``send`` or ``receive`` that failed with ``error`` (None: the
        node closed the stream); the connection is ``broken`` from now on. A kernel time-out
        (``SO_RCVTIMEO``/``SO_SNDTIMEO``) is the call's deadline passing."""
        self.broken = True
        if error is None:
            return TransportError(f"{self.address}: connection closed by the node")
        if isinstance(error, BlockingIOError | TimeoutError):
            late = "send timed out" if doing == "send" else "no answer in time"
            return DeadlineExceededError(f"{self.address}: {late}")
        return TransportError(f"{self.address}: {doing} failed: {error}")

    # --- sending --------------------------------------------------------------------------

    def send(
        self, calls: Sequence[Call], deadline: float, *, posted: bool = False, trace: bytes = b""
    ) -> None:
        """Write every call's frame (one vectored write for all of them when they fit), with
        the trace context ``trace`` when the peer offered ``trace``."""
        self._check(deadline)
        views: list[bytes | bytearray | memoryview] = []
        if trace and "trace" not in self.features:
            trace = b""
        for call in calls:
            rid = next(self._ids)
            call.request_id = rid
            _add_frame(views, call, call.request_header(trace))
            if posted:
                self._posted.add(rid)
        self._sendall(views, deadline)

    def notify(self, calls: Sequence[Call], deadline: float) -> None:
        """Write frames no response comes back for (``SHM_RELEASE``)."""
        views: list[bytes | bytearray | memoryview] = []
        for call in calls:
            call.request_id = next(self._ids)
            _add_frame(views, call, call.request_header())
        self._sendall(views, deadline)

    def _sendall(self, views: list[bytes | bytearray | memoryview], deadline: float) -> None:
        sock = self._sock
        while views:
            batch = views[:512]
            total = sum(len(v) if not isinstance(v, memoryview) else v.nbytes for v in batch)
            try:
                sent = sock.sendmsg(batch)
            except OSError as e:
                if self._retry_in_time(e, deadline):
                    continue
                raise self._broken_by(e, "send") from None
            if sent == total:
                views = views[512:]
                continue
            rest: list[bytes | bytearray | memoryview] = []
            for v in batch:
                view = memoryview(v).cast("B") if not isinstance(v, memoryview) else v
                if sent >= view.nbytes:
                    sent -= view.nbytes
                    continue
                rest.append(view[sent:] if sent else view)
                sent = 0
            views = rest + views[512:]
            self._check(deadline)

    # --- receiving ------------------------------------------------------------------------

    def receive(self, calls: Sequence[Call], deadline: float, *, poll_s: float = 0.0) -> None:
        """Read responses until every call in ``calls`` has one (others — posted requests —
        are dropped). A call whose response could not be taken gets ``error``; a broken stream
        raises TransportError or DeadlineExceededError (the connection is then ``broken``).
        ``poll_s``: first :meth:`busy_poll` that long."""
        if poll_s > 0:
            self.busy_poll(poll_s)
        waiting = {c.request_id: c for c in calls}
        while waiting:
            header = self._read_header(deadline)
            call = waiting.pop(header.request_id, None)
            if call is None:
                self._posted.discard(header.request_id)
                self._skip(header.key_len + header.payload_len, deadline)
                continue
            if header.key_len:
                self._skip(header.key_len, deadline)
            call.header = header
            self._take_payload(call, header, deadline)

    def answer_waiting(self) -> bool:
        """Without blocking: whether an answer other than a posted one has begun to arrive.
        Posted answers already here are read and dropped on the way (the socket being
        readable does not mean a call's answer is there: hedged reads must not mistake one).
        True also when the stream is broken or unreadable (a receive will say how)."""
        sock, view = self._sock, self._header_view
        while True:
            try:
                n = sock.recv_into(view, HEADER_SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                return True
            if n < HEADER_SIZE:
                return True  # part of an answer, or the end of the stream
            try:
                header = unpack_header(view)
            except FrameError:
                return True
            if header.request_id not in self._posted or header.key_len + header.payload_len:
                return True
            self._posted.discard(header.request_id)
            sock.recv_into(view, HEADER_SIZE, socket.MSG_DONTWAIT)  # all here (peeked)

    def busy_poll(self, seconds: float) -> bool:
        """Spin, without sleeping, until the socket is readable or ``seconds`` have passed:
        whether it is. An answer that arrives meanwhile is taken without the scheduler waking
        this thread (on a VM whose idle vCPUs halt, that wake-up is most of a short round
        trip); the price is this thread's CPU for as long as it spins."""
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self._sock, select.POLLIN)
        end = time.perf_counter() + seconds
        while not poller.poll(0):
            if time.perf_counter() >= end:
                return False
        return True

    def exchange(
        self, calls: Sequence[Call], deadline: float, *, trace: bytes = b"", poll_s: float = 0.0
    ) -> None:
        self.send(calls, deadline, trace=trace)
        self.receive(calls, deadline, poll_s=poll_s)

    def drain(self, deadline: float) -> None:
        """Read the responses of every posted request."""
        while self._posted:
            header = self._read_header(deadline)
            self._posted.discard(header.request_id)
            self._skip(header.key_len + header.payload_len, deadline)

    def _read_header(self, deadline: float) -> Header:
        view = self._header_view
        self._check(deadline)  # a frame read before this one (a posted answer) took time
        self._recv_into(view, deadline)
        if bytes(view[:4]) != MAGIC:
            self.broken = True
            raise TransportError(f"{self.address}: not a kvpool data-plane peer (bad magic)")
        try:
            header = unpack_header(view)
        except FrameError as e:
            self.broken = True
            raise TransportError(f"{self.address}: bad frame from node: {e}") from None
        if header.status == Status.UNAUTHORIZED:  # the node closes the connection next
            self.broken = True
            size = min(header.payload_len, MAX_ERROR_MESSAGE_BYTES)
            message = b""
            with contextlib.suppress(KVPoolError):
                message = bytes(self._recv_new(size, deadline)) if size else b""
            raise UnauthenticatedError(
                f"{self.address}: {message.decode('utf-8', 'replace') or 'refused'}"
            )
        if header.status == Status.VERSION_MISMATCH or header.protocol_version != PROTOCOL_VERSION:
            self.broken = True
            raise ProtocolVersionError(
                f"{self.address}: "
                + version_mismatch_message(PROTOCOL_VERSION, header.protocol_version)
            )
        return header

    def _take_payload(self, call: Call, header: Header, deadline: float) -> None:
        size = header.payload_len
        if call.table is None:
            call.digests = None  # set below only for bytes hashed as they landed, in this answer
        if size == 0:
            return
        status = header.status
        if status not in (Status.OK, Status.MISS):
            if size <= MAX_ERROR_MESSAGE_BYTES:
                call.data = self._recv_new(size, deadline)
            else:
                self._skip(size, deadline)
            return
        if call.table is not None:
            self._take_table(call, header, deadline)
            return
        sink = call.sink
        if sink is not None and sink.nbytes == size:
            if isinstance(sink, Parts):
                self._recv_scatter(sink.views, deadline)
            else:  # a block (a GET's): hashed as it lands, between receives (call.digests)
                hasher = block_hasher()
                self._recv_into(sink, deadline, hasher)
                call.digests = [int(hasher.intdigest())]
            call.data = sink
        elif sink is None and may_allocate(call.expect, size):
            call.data = self._recv_bytes(size, deadline)
        else:
            self._skip(size, deadline)
            call.error = TransportError(refused_answer(self.address, size, sink, call.expect))

    def _take_table(self, call: Call, header: Header, deadline: float) -> None:
        """A table response: count and records (one read), then (MGET) every hit's bytes,
        scattered by ``recvmsg_into`` into the views :func:`hit_views` names, each
        :class:`OwnHit` between them received into ``bytes`` of its own."""
        size = header.payload_len
        head_size = table_head_size(call)
        try:
            if head_size is None:  # the count says how many
                if size < COUNT.size:
                    raise FrameError("response table shorter than its count")
                head = self._recv_new(COUNT.size, deadline)
                (count,) = COUNT.unpack_from(head)
                assert call.table is not None
                rest = min(size - COUNT.size, call.table.size * count)
                if rest > MAX_ALLOC_BYTES:
                    raise FrameError(f"a response table of {count} records")
                head = memoryview(bytes(head) + bytes(self._recv_new(rest, deadline)))
            elif head_size > size:
                raise FrameError("response table shorter than asked")
            else:
                head = self._recv_new(head_size, deadline)
            views = table_rest(call, head, size - head.nbytes, OWN_HIT_BYTES)
        except FrameError as e:
            self.broken = True
            raise TransportError(f"{self.address}: {e}") from None
        # Each hit is hashed as its last byte lands (hash_landed), between receives.
        run: list[memoryview] = []
        run_ends: list[int] = []
        for view, end in zip(views, call.hit_ends, strict=True):
            if isinstance(view, OwnHit):
                self._recv_scatter(run, deadline, call, run_ends)
                run, run_ends = [], []
                view.datas[view.slot] = self._recv_bytes(view.size, deadline)
                hash_landed(call, view.slot)
            else:
                run.append(view)
                run_ends.append(end)
        self._recv_scatter(run, deadline, call, run_ends)

    def _recv_scatter(
        self,
        views: list[memoryview],
        deadline: float,
        call: Call | None = None,
        ends: list[int] | None = None,
    ) -> None:
        """Fill ``views`` in order from the stream, many per ``recvmsg_into``; with ``call``
        and ``ends`` (an MGET's, :func:`hit_views`), each hit is hashed once its last view is
        full (:func:`hash_landed`)."""
        sock = self._sock
        i, offset = 0, 0
        while i < len(views):
            batch = [views[i][offset:] if offset else views[i], *views[i + 1 : i + 256]]
            n = self._receive(sock.recvmsg_into, batch, deadline)[0]
            if n == 0:
                raise self._broken_by(None, "receive")
            while n:
                rest = views[i].nbytes - offset
                if n >= rest:
                    n -= rest
                    if ends is not None and call is not None and ends[i] >= 0:
                        hash_landed(call, ends[i])
                    i += 1
                    offset = 0
                else:
                    offset += n
                    n = 0
            if i < len(views):
                self._check(deadline)

    def _receive(self, recv: Callable[[Any], T], into: Any, deadline: float) -> T:
        """``recv(into)`` on the socket, tried again while a kernel time-out ends before the
        deadline (:meth:`_retry_in_time`); any other failure breaks the connection."""
        while True:
            try:
                return recv(into)
            except OSError as e:
                if not self._retry_in_time(e, deadline):
                    raise self._broken_by(e, "receive") from None

    def _recv_bytes(self, size: int, deadline: float) -> memoryview:
        """``size`` bytes as a view of a new ``bytes`` object the kernel copied them into: a
        caller that wants ``bytes`` takes that object (:func:`~kvpool.transports.calls.
        owned_bytes`), with no zero-filled buffer first and no second copy. (Two large buffers
        alive at once, the buffer and its copy, also made glibc give the heap back and fault it
        in again on every call: a 4 MiB ``get`` spent ~3 ms in page faults.) A read the kernel
        ends early (a signal, a kernel time-out within the deadline) is finished in a buffer."""
        sock = self._sock
        first = self._receive(lambda n: sock.recv(n, socket.MSG_WAITALL), size, deadline)
        if len(first) == size:
            return memoryview(first)
        if not first:
            raise self._broken_by(None, "receive")
        view = memoryview(bytearray(size))
        view[: len(first)] = first
        self._check(deadline)
        self._recv_into(view[len(first) :], deadline)
        return view

    def _recv_new(self, size: int, deadline: float) -> memoryview:
        view = memoryview(bytearray(size))
        self._recv_into(view, deadline)
        return view

    def _skip(self, size: int, deadline: float) -> None:
        drop = self._drop
        if drop is None or len(drop) < min(size, DROP_BYTES):  # as large as skips have been
            drop = self._drop = memoryview(bytearray(min(max(size, 4096), DROP_BYTES)))
        while size:
            n = min(size, len(drop))
            self._recv_into(drop[:n], deadline)
            size -= n

    def _recv_into(self, view: memoryview, deadline: float, hasher: Any = None) -> None:
        """Fill ``view`` from the socket; ``hasher`` (a :func:`~kvpool.checksum.block_hasher`)
        is fed each piece as it lands, while the node sends the next (still in the CPU's
        cache, and overlapped with the transfer instead of after it)."""
        sock = self._sock
        got = 0
        want = view.nbytes
        while got < want:
            n = self._receive(sock.recv_into, view[got:] if got else view, deadline)
            if n == 0:
                raise self._broken_by(None, "receive")
            if hasher is not None:
                hasher.update(view[got : got + n])
            got += n
            if got < want:
                self._check(deadline)


def _format(addr: object) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = str(addr[0])
        return f"[{host}]:{addr[1]}" if ":" in host else f"{host}:{addr[1]}"
    if isinstance(addr, bytes):
        return addr.decode("utf-8", "replace")
    return str(addr)


@contextlib.contextmanager
def connecting(address: str, sock: socket.socket | None = None) -> Iterator[None]:
    """Around opening a connection to ``address`` (blocking or awaited): an OSError becomes the
    typed error — a time-out DeadlineExceededError, anything else TransportError — and on any
    failure ``sock`` is closed."""
    try:
        yield
    except BaseException as e:
        if sock is not None:
            sock.close()
        if isinstance(e, TimeoutError):
            raise DeadlineExceededError(f"{address}: connect timed out") from None
        if isinstance(e, OSError):
            raise TransportError(f"{address}: connect failed: {e}") from None
        raise


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 1 ms: the steps of opening a
    connection (connect, AUTH, HELLO) share one deadline, and a step begun after it has passed
    times out at once with its own typed error."""
    return max(0.001, deadline - time.monotonic())


def connect_tcp_blocking(host: str, port: int, *, address: str, timeout_s: float) -> socket.socket:
    """A connected blocking TCP socket, tuned (typed errors on failure)."""
    from kvpool.transports.stream import tune_socket

    with connecting(address):
        sock = socket.create_connection((host, port), timeout=max(0.001, timeout_s))
    tune_socket(sock)
    return sock
