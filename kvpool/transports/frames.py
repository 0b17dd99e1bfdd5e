"""An incremental reader of data-plane frames for ``asyncio.BufferedProtocol``.

Small frames are parsed out of one scratch buffer (one ``recv_into`` can carry many pipelined
frames); a large payload is received straight into its destination (tier memory on a node, the
caller's buffer on a client): the reader hands that memory to ``recv_into`` directly, so the bytes
are copied once, by the kernel. Between frames, after a large payload and on a new connection, the
reader asks for one header's worth only, so that at most a key's length (1 KiB) of the next
payload is copied from scratch; a run of small frames switches back to full scratch reads.

The reader knows nothing about sockets; feed it with :meth:`get_buffer` / :meth:`buffer_updated`
(the BufferedProtocol calls) or with :meth:`feed` in tests.

Memory: the scratch buffer starts at :data:`INITIAL_SCRATCH_BYTES` (a header and the longest
key) and grows, four times at a step, up to ``scratch_bytes`` only while reads keep filling it
(pipelined small frames), so an idle or one-request connection costs 4 KiB, not 256 KiB.
:meth:`release` drops the buffers and the handler when the connection closes, so nothing waits
for the cyclic garbage collector (which a node may have frozen, :mod:`kvpool.gctune`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.wire import (
    HEADER_SIZE,
    MAX_KEY_BYTES,
    PREFIX_SIZE,
    TRACE_CONTEXT_SIZE,
    FrameError,
    Header,
    check_prefix,
    split_trace,
    unpack_header,
)

SCRATCH_BYTES = 256 * 1024
DIRECT_THRESHOLD = 64 * 1024
"""Payload remainders at least this large are received straight into their destination."""
PEEK_BYTES = HEADER_SIZE + TRACE_CONTEXT_SIZE + MAX_KEY_BYTES
"""What is read between frames after a large payload: a header and the longest key."""
INITIAL_SCRATCH_BYTES = 4096
"""A new connection's scratch buffer (at least PEEK_BYTES); it grows with pipelining."""


class FrameHandler(Protocol):
    def frame_sink(self, header: Header, key: bytes) -> memoryview | Scatter | None:
        """Where the payload of this frame goes: a writable view of exactly ``payload_len``
        bytes, a :class:`Scatter` (``frame_received`` then gets its ``first``), or None to
        discard it (``frame_received`` then gets ``None``)."""

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        """A whole frame arrived; ``payload`` is the sink given for it (now filled)."""

    def version_mismatch(self, theirs: int) -> None:
        """The peer speaks another protocol version. The reader stops; close the connection."""

    def bad_frame(self, error: FrameError) -> None:
        """The peer sent something that is not a frame. The reader stops; close the connection."""


class Scatter:
    """A payload received in pieces, for a handler that learns where its rest goes from its
    first bytes (a table response, whose records say where each hit's bytes go): ``first`` is
    filled, then ``rest(left)`` names the views that take the ``left`` bytes after it, in order,
    each filled straight from the socket. ``rest`` raises FrameError when they cannot take
    exactly ``left`` bytes; it is asked once, even when nothing follows ``first``. ``landed``,
    when given, is told the index (in ``rest``'s list) of each view once it is full: when the
    next is asked for, or the payload is complete."""

    __slots__ = ("_landed", "_next", "_rest", "_views", "first")

    def __init__(
        self,
        first: memoryview,
        rest: Callable[[int], list[memoryview]],
        landed: Callable[[int], None] | None = None,
    ) -> None:
        self.first = first
        self._rest = rest
        self._landed = landed
        self._views: list[tuple[int, memoryview]] | None = None
        self._next = 0

    def _pieces(self, left: int) -> list[tuple[int, memoryview]]:
        if self._views is None:
            self._views = [(i, v) for i, v in enumerate(self._rest(left)) if v.nbytes]
        return self._views

    def _filled(self) -> None:
        """The view before the next one is full (none before the first)."""
        if self._landed is not None and self._next:
            assert self._views is not None
            self._landed(self._views[self._next - 1][0])

    def advance(self, left: int) -> memoryview:
        """The next view to fill, once those before it are full; ``left``: bytes to come."""
        views = self._pieces(left)
        if self._next == len(views):
            raise FrameError(f"{left} bytes more than the response's table says")
        self._filled()
        view = views[self._next][1]
        self._next += 1
        return view

    def complete(self) -> None:
        """The whole payload arrived: FrameError when it was shorter than the table says."""
        if self._next != len(self._pieces(0)):
            raise FrameError("a response shorter than its table says")
        self._filled()


class FrameReader:
    def __init__(self, handler: FrameHandler, scratch_bytes: int = SCRATCH_BYTES) -> None:
        self._handler: FrameHandler | None = handler
        self._max_scratch = max(scratch_bytes, PEEK_BYTES)
        self._scratch = bytearray(min(INITIAL_SCRATCH_BYTES, self._max_scratch))
        self._view = memoryview(self._scratch)
        self._start = 0  # first unparsed byte in scratch
        self._end = 0  # end of received bytes in scratch
        # The frame whose payload is being received:
        self._header: Header | None = None
        self._key = b""
        self._sink: memoryview | None = None  # where the payload (a Scatter: this piece) goes
        self._filled = 0  # payload bytes received
        self._scatter: Scatter | None = None
        self._piece_at = 0  # the payload offset of the sink's first byte (a Scatter's piece)
        self._direct = False  # payload remainder goes straight into the sink
        self._peek = True  # between frames, read only a header's worth (see get_buffer)
        self._offered = 0  # bytes of scratch the last get_buffer offered
        self._want_grow = False
        self.stopped = False
        self.frames = 0

    @property
    def busy(self) -> bool:
        """True while part of a frame (header, key or payload) has arrived and the rest has
        not: the peer owes bytes."""
        return self._header is not None or self._end > self._start

    @property
    def scratch_bytes(self) -> int:
        """The scratch buffer's size now."""
        return len(self._scratch)

    def release(self) -> None:
        """The connection is closed: drop the buffers, the frame in progress and the handler
        (breaking the handler ↔ reader cycle). The reader reads nothing more."""
        self.stopped = True
        self._handler = None
        self._header, self._key, self._sink, self._filled = None, b"", None, 0
        self._scatter = None
        self._direct = False
        self._scratch = bytearray()
        self._view = memoryview(self._scratch)
        self._start = self._end = 0

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._direct:
            assert self._sink is not None
            return self._sink[self._filled - self._piece_at :]
        if self._want_grow:
            self._grow()  # the last read filled what it was offered: more is waiting
        elif self._end == len(self._scratch):
            self._compact()
        if self._peek and self._start == self._end and self._header is None:
            # After a large payload (and on a new connection), read the next header alone: if
            # a large payload follows it, that goes straight into its destination instead of
            # through scratch. Small frames turn this off (one read then takes many of them).
            # Only between frames: the rest of a payload is never read a header's size at a
            # time.
            self._offered = 0
            return self._view[self._end : self._end + PEEK_BYTES]
        self._offered = len(self._scratch) - self._end
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.stopped:
            return
        if self._direct:
            assert self._header is not None
            self._filled += nbytes
            if self._filled == self._header.payload_len:
                self._direct = False
                self._finish()
                self._parse()
            elif self._scatter is not None and self._piece_full():
                self._next_piece()
            return
        if (
            nbytes == self._offered
            and nbytes * 2 >= len(self._scratch)
            and len(self._scratch) < self._max_scratch
        ):
            self._want_grow = True
        self._end += nbytes
        self._parse()

    def feed(self, data: bytes) -> None:
        """Push bytes through the reader as the transport would (tests, non-socket use)."""
        view = memoryview(data)
        while view and not self.stopped:
            buf = self.get_buffer()
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            self.buffer_updated(n)

    # --- internals -------------------------------------------------------------------------

    def _grow(self) -> None:
        self._want_grow = False
        size = min(self._max_scratch, len(self._scratch) * 4)
        grown = bytearray(size)
        remaining = self._end - self._start
        grown[:remaining] = self._scratch[self._start : self._end]
        self._start, self._end = 0, remaining
        self._scratch = grown
        self._view = memoryview(grown)

    def _compact(self) -> None:
        remaining = self._end - self._start
        if self._start:
            self._scratch[:remaining] = self._scratch[self._start : self._end]
        self._start, self._end = 0, remaining

    def _stop_with(self, error: FrameError) -> None:
        self.stopped = True
        if self._handler is not None:
            self._handler.bad_frame(error)

    def _parse(self) -> None:
        while not self.stopped:
            avail = self._end - self._start
            if self._header is None:
                if avail < PREFIX_SIZE:
                    break
                try:
                    version = check_prefix(self._view[self._start : self._start + PREFIX_SIZE])
                except FrameError as e:
                    self._stop_with(e)
                    return
                if version != PROTOCOL_VERSION:
                    self.stopped = True
                    if self._handler is not None:
                        self._handler.version_mismatch(version)
                    return
                if avail < HEADER_SIZE:
                    break
                try:
                    header = unpack_header(self._view[self._start : self._start + HEADER_SIZE])
                except FrameError as e:
                    self._stop_with(e)
                    return
                if avail < HEADER_SIZE + header.key_len:
                    break
                key_start = self._start + HEADER_SIZE
                key = bytes(self._scratch[key_start : key_start + header.key_len])
                self._start = key_start + header.key_len
                if header.ext:
                    header, key = split_trace(header, key)
                handler = self._handler
                if handler is None:
                    return
                sink = handler.frame_sink(header, key)
                if self._handler is None:  # the handler closed the connection (release)
                    return
                scatter = None
                if isinstance(sink, Scatter):
                    scatter, sink = sink, sink.first
                    if len(sink) > header.payload_len:
                        self._stop_with(
                            FrameError(f"{len(sink)} bytes asked of a {header.payload_len} payload")
                        )
                        return
                elif sink is not None and len(sink) != header.payload_len:
                    self._stop_with(
                        FrameError(
                            f"sink of {len(sink)} bytes for a payload of {header.payload_len}"
                        )
                    )
                    return
                self._header, self._key, self._sink, self._filled = header, key, sink, 0
                self._scatter, self._piece_at = scatter, 0
                avail = self._end - self._start
            header = self._header
            need = header.payload_len - self._filled
            if self._scatter is not None and need:
                if self._piece_full() and not self._next_piece():
                    return
                assert self._sink is not None
                need = min(need, self._piece_at + len(self._sink) - self._filled)
            take = min(need, avail)
            if take:
                if self._sink is not None:
                    at = self._filled - self._piece_at
                    self._sink[at : at + take] = self._view[self._start : self._start + take]
                self._start += take
                self._filled += take
            if self._filled == header.payload_len:
                self._finish()
                continue
            if self._start < self._end:
                continue  # a Scatter's piece is full: the next one takes the rest
            # Scratch is drained and the payload is not complete. A large payload's rest goes
            # straight into its destination, however little of it the header's read left.
            self._start = self._end = 0
            if self._scatter is not None and self._piece_full() and not self._next_piece():
                return
            if self._sink is not None and header.payload_len >= DIRECT_THRESHOLD:
                self._direct = True
            break
        if self._start == self._end:
            self._start = self._end = 0

    def _piece_full(self) -> bool:
        assert self._sink is not None
        return self._filled == self._piece_at + len(self._sink)

    def _next_piece(self) -> bool:
        """The Scatter's next piece becomes the sink; False (the reader stopped) on a bad one."""
        assert self._scatter is not None
        assert self._header is not None
        try:
            self._sink = self._scatter.advance(self._header.payload_len - self._filled)
        except FrameError as e:
            self._stop_with(e)
            return False
        self._piece_at = self._filled
        return True

    def _finish(self) -> None:
        header, key, sink = self._header, self._key, self._sink
        assert header is not None
        if self._scatter is not None:
            try:
                if not self._piece_full():
                    raise FrameError("a response shorter than its table says")
                self._scatter.complete()
            except FrameError as e:
                self._stop_with(e)
                return
            sink = self._scatter.first
        self._peek = header.payload_len >= DIRECT_THRESHOLD
        self._header, self._key, self._sink, self._filled = None, b"", None, 0
        self._scatter = None
        self.frames += 1
        if self._handler is not None:
            self._handler.frame_received(header, key, sink)
