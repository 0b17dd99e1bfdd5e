"""A plain asyncio frame server for test fakes: :func:`start_frame_server` runs a server whose
protocol feeds a :class:`~kvpool.transports.frames.FrameReader` and hands whole frames to a
handler (the store node itself serves on :class:`~kvpool.transports.stream.StreamServer`). Its
write buffer limits are zero, so the protocol is told exactly when everything written has left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.wire import (
    MAX_ERROR_MESSAGE_BYTES,
    FrameError,
    Header,
    Status,
    version_mismatch_message,
)
from kvpool.transports.frames import FrameReader
from kvpool.transports.tcp import tune_socket


class FrameServerProtocol(asyncio.BufferedProtocol):
    """Base protocol of a frame server: subclass and implement the FrameHandler methods
    ``frame_sink`` and ``frame_received``; call :meth:`send` to answer."""

    def __init__(self) -> None:
        self.reader = FrameReader(self)
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self._on_drained: list[Callable[[], None]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        tune_socket(transport.get_extra_info("socket"))
        # Zero limits: pause_writing as soon as anything is buffered, resume_writing when the
        # buffer is empty again — so we know exactly when a payload has left.
        transport.set_write_buffer_limits(high=0, low=0)

    def connection_lost(self, exc: Exception | None) -> None:
        self._run_drained()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.reader.buffer_updated(nbytes)

    def eof_received(self) -> bool | None:
        return False

    def pause_writing(self) -> None:
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()  # backpressure: read no more until this has left

    def resume_writing(self) -> None:
        self.paused = False
        self._run_drained()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _run_drained(self) -> None:
        callbacks, self._on_drained = self._on_drained, []
        for cb in callbacks:
            cb()

    def frame_sink(self, header: Header, key: bytes) -> memoryview | None:
        raise NotImplementedError

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        raise NotImplementedError

    def send(
        self,
        header: Header,
        key: bytes = b"",
        payload: memoryview | bytes = b"",
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        """Write a response; ``on_sent`` runs once the transport no longer holds the payload."""
        if self.transport is None or self.transport.is_closing():
            if on_sent:
                on_sent()
            return
        self.transport.write(header.pack() + key)
        if len(payload):
            self.transport.write(payload)
        if on_sent is not None:
            if self.paused:
                self._on_drained.append(on_sent)
            else:
                on_sent()

    def send_error(
        self, request: Header | None, status: Status, message: str, *, close: bool = False
    ) -> None:
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
        if close and self.transport is not None:
            self.transport.close()

    def version_mismatch(self, theirs: int) -> None:
        self.send_error(
            None,
            Status.VERSION_MISMATCH,
            version_mismatch_message(PROTOCOL_VERSION, theirs),
            close=True,
        )

    def bad_frame(self, error: FrameError) -> None:
        self.send_error(None, Status.BAD_REQUEST, str(error), close=True)


async def start_frame_server(
    host: str, port: int, protocol_factory: Callable[[], FrameServerProtocol]
) -> tuple[asyncio.Server, int]:
    """Listen on ``host:port`` (0 = any free port); return the server and the bound port."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(protocol_factory, host, port, reuse_address=True)
    bound = server.sockets[0].getsockname()[1]
    return server, int(bound)
