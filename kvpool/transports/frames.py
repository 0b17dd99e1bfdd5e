"""An incremental reader of data-plane frames for ``asyncio.BufferedProtocol``.

Small frames are parsed out of one scratch buffer (one ``recv_into`` can carry many pipelined
frames); a large payload is received straight into its destination (tier memory on a node, the
caller's buffer on a client): the reader hands that memory to ``recv_into`` directly, so the bytes
are copied once, by the kernel. Between frames, after a large payload and on a new connection, the
reader asks for one header's worth only, so that at most a key's length (1 KiB) of the next
payload is copied from scratch; a run of small frames switches back to full scratch reads.

The reader knows nothing about sockets; feed it with :meth:`get_buffer` / :meth:`buffer_updated`
(the BufferedProtocol calls) or with :meth:`feed` in tests.
"""

from __future__ import annotations

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


class FrameHandler(Protocol):
    def frame_sink(self, header: Header, key: bytes) -> memoryview | None:
        """Where the payload of this frame goes: a writable view of exactly ``payload_len``
        bytes, or None to discard it (``frame_received`` then gets ``None``)."""

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        """A whole frame arrived; ``payload`` is the sink given for it (now filled)."""

    def version_mismatch(self, theirs: int) -> None:
        """The peer speaks another protocol version. The reader stops; close the connection."""

    def bad_frame(self, error: FrameError) -> None:
        """The peer sent something that is not a frame. The reader stops; close the connection."""


class FrameReader:
    def __init__(self, handler: FrameHandler, scratch_bytes: int = SCRATCH_BYTES) -> None:
        self._handler = handler
        self._scratch = bytearray(scratch_bytes)
        self._view = memoryview(self._scratch)
        self._start = 0  # first unparsed byte in scratch
        self._end = 0  # end of received bytes in scratch
        # The frame whose payload is being received:
        self._header: Header | None = None
        self._key = b""
        self._sink: memoryview | None = None
        self._filled = 0
        self._direct = False  # payload remainder goes straight into the sink
        self._peek = True  # between frames, read only a header's worth (see get_buffer)
        self.stopped = False
        self.frames = 0

    @property
    def in_frame(self) -> bool:
        """True while a frame's payload is partly received (its sink is being written)."""
        return self._header is not None

    @property
    def current_request_id(self) -> int | None:
        return self._header.request_id if self._header is not None else None

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._direct:
            assert self._sink is not None
            return self._sink[self._filled :]
        if self._end == len(self._scratch):
            self._compact()
        if self._peek and self._start == self._end:
            # After a large payload (and on a new connection), read the next header alone: if
            # a large payload follows it, that goes straight into its destination instead of
            # through scratch. Small frames turn this off (one read then takes many of them).
            return self._view[self._end : self._end + PEEK_BYTES]
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
            return
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

    def _compact(self) -> None:
        remaining = self._end - self._start
        if self._start:
            self._scratch[:remaining] = self._scratch[self._start : self._end]
        self._start, self._end = 0, remaining

    def _stop_with(self, error: FrameError) -> None:
        self.stopped = True
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
                sink = self._handler.frame_sink(header, key)
                if sink is not None and len(sink) != header.payload_len:
                    self._stop_with(
                        FrameError(
                            f"sink of {len(sink)} bytes for a payload of {header.payload_len}"
                        )
                    )
                    return
                self._header, self._key, self._sink, self._filled = header, key, sink, 0
                avail = self._end - self._start
            header = self._header
            need = header.payload_len - self._filled
            take = min(need, avail)
            if take:
                if self._sink is not None:
                    self._sink[self._filled : self._filled + take] = self._view[
                        self._start : self._start + take
                    ]
                self._start += take
                self._filled += take
            if self._filled == header.payload_len:
                self._finish()
                continue
            # Scratch is drained and the payload is not complete.
            self._start = self._end = 0
            if self._sink is not None and header.payload_len - self._filled >= DIRECT_THRESHOLD:
                self._direct = True
            break
        if self._start == self._end:
            self._start = self._end = 0

    def _finish(self) -> None:
        header, key, sink = self._header, self._key, self._sink
        assert header is not None
        self._peek = header.payload_len >= DIRECT_THRESHOLD
        self._header, self._key, self._sink, self._filled = None, b"", None, 0
        self.frames += 1
        self._handler.frame_received(header, key, sink)
