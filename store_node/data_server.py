"""The store node's data plane: ``tcp://`` frames in, block bytes straight into tier memory.

Each connection is a :class:`~kvpool.transports.tcp.FrameServerProtocol`. A PUT is decided when
its header arrives, before any payload byte is read: the block store reserves tier memory and the
frame reader receives the payload straight into it (``recv_into``). A GET answers with a view of
the tier, leased until the transport has let go of the bytes. Requests on one connection are
answered in order; many may be in flight (pipelining).

Refusals: a PUT without room, above ``max_block_size`` or otherwise refused has its payload read
and discarded (the connection stays usable); a payload above :data:`MAX_DISCARD_BYTES` is not
worth skipping — the answer is sent and the connection closed. Garbage (bad magic) and another
protocol version are answered and the connection closed by the base protocol; both are counted
as bad frames. Nothing a peer sends can lose a stored block or stop the server.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from kvpool.logs import get_logger
from kvpool.proto.wire import FrameError, Header, Op, Status
from kvpool.store_node.block_store import Block, BlockStore, PutVerdict
from kvpool.transports.tcp import FrameServerProtocol, start_frame_server

MAX_DISCARD_BYTES = 1 << 30
"""A refused payload larger than this is not read and skipped: the connection is closed."""

_PUT_ERRORS = {
    Status.CHECKSUM_MISMATCH: "payload does not match the checksum in its header",
    Status.INTERNAL: "the block was dropped while its payload was being received",
}


class DataConnection(FrameServerProtocol):
    """One client connection to the data port."""

    def __init__(self, server: DataServer) -> None:
        super().__init__()
        self._server = server
        self._store = server.store
        self._log = server.log
        self.peer = "?"
        self._receiving: Block | None = None  # the PUT whose payload is arriving
        self._refusal: tuple[Status, str] | None = None  # decided for the current frame
        self._closing = False

    # --- connection lifecycle ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = f"{peer[0]}:{peer[1]}"
        self._server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        if self._receiving is not None:
            self._store.abort_put(self._receiving)
            self._receiving = None
        super().connection_lost(exc)  # runs pending on_sent callbacks: leases end

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # --- FrameHandler ----------------------------------------------------------------------------

    def frame_sink(self, header: Header, key: bytes) -> memoryview | None:
        self._refusal = None
        if self._closing:
            return None
        if header.op == Op.PUT:
            try:
                verdict = self._decide_put(header, key)
            except Exception as e:  # the server keeps serving whatever happens
                self._log.exception("put_failed", peer=self.peer)
                verdict = PutVerdict(Status.INTERNAL, message=f"{type(e).__name__}: {e}")
            if verdict.block is not None:
                self._receiving = verdict.block
                return self._store.view(verdict.block)
            self._refusal = (verdict.status, verdict.message)
        elif header.payload_len:
            self._refusal = (Status.BAD_REQUEST, f"op {header.op} takes no payload")
        if self._refusal is not None and header.payload_len > MAX_DISCARD_BYTES:
            status, message = self._refusal
            self._closing = True
            self.send_error(
                header,
                status,
                f"{message}; a payload of {header.payload_len} bytes is not worth skipping: "
                "closing the connection",
                close=True,
            )
        return None

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        if self._closing:
            return
        try:
            self._dispatch(header, key)
        except Exception as e:
            self._log.exception("frame_failed", peer=self.peer, op=header.op)
            if self._receiving is not None:
                self._store.abort_put(self._receiving)
                self._receiving = None
            self.send_error(header, Status.INTERNAL, f"{type(e).__name__}: {e}")

    def bad_frame(self, error: FrameError) -> None:
        self._store.counters.bad_frames += 1
        self._log.warning("bad_frame", peer=self.peer, error=str(error))
        super().bad_frame(error)

    def version_mismatch(self, theirs: int) -> None:
        self._store.counters.bad_frames += 1
        self._log.warning("peer_version_mismatch", peer=self.peer, peer_version=theirs)
        super().version_mismatch(theirs)

    # --- requests --------------------------------------------------------------------------------

    def _decide_put(self, header: Header, key: bytes) -> PutVerdict:
        name = _decode_key(key)
        if name is None:
            return PutVerdict(Status.BAD_REQUEST, message="key is empty or not UTF-8")
        return self._store.reserve(name, header.write_id, header.payload_len, header.checksum)

    def _dispatch(self, header: Header, key: bytes) -> None:
        op = header.op
        if op == Op.PUT:
            block, self._receiving = self._receiving, None
            if block is not None:
                status = self._store.finish_put(block)
                self._answer(header, status, _PUT_ERRORS.get(status, ""))
            else:
                status, message = self._refusal or (Status.INTERNAL, "PUT lost its verdict")
                self._answer(header, status, message)
            return
        if self._refusal is not None:
            self._answer(header, *self._refusal)
            return
        if op == Op.PING:
            self._answer(header, Status.OK)
            return
        if op not in (Op.GET, Op.PUBLISH, Op.DELETE):
            self._answer(header, Status.BAD_REQUEST, f"unknown op {op}")
            return
        name = _decode_key(key)
        if name is None:
            self._answer(header, Status.BAD_REQUEST, "key is empty or not UTF-8")
            return
        if op == Op.DELETE:
            found = self._store.delete(name, header.write_id)
            self._answer(header, Status.OK if found else Status.MISS)
            return
        if header.write_id == 0:
            self._answer(header, Status.BAD_REQUEST, "write id 0 names no block")
            return
        if op == Op.PUBLISH:
            result = self._store.publish(name, header.write_id, header.version)
            self._answer(header, result.status, flags=result.reason)
            return
        result = self._store.get(name, header.write_id)
        if result.block is None:
            self._answer(header, result.status, flags=result.reason)
            return
        self._send_block(header, result.block)

    def _send_block(self, request: Header, block: Block) -> None:
        try:
            self.send(
                Header(
                    op=Op.GET,
                    status=Status.OK,
                    request_id=request.request_id,
                    write_id=block.write_id,
                    version=block.version,
                    payload_len=block.size_bytes,
                    checksum=block.checksum,
                ),
                b"",
                self._store.view(block),
                on_sent=partial(self._store.release, block),
            )
        except Exception:
            self._store.release(block)  # send() registers on_sent only after both writes
            raise

    def _answer(self, request: Header, status: Status, message: str = "", flags: int = 0) -> None:
        if status not in (Status.OK, Status.MISS):
            self.send_error(request, status, message)
            return
        self.send(
            Header(
                op=request.op,
                status=status,
                request_id=request.request_id,
                write_id=request.write_id,
                version=request.version if request.op == Op.PUBLISH else 0,
                flags=int(flags),
            )
        )


def _decode_key(key: bytes) -> str | None:
    if not key:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return None


class DataServer:
    """The data-plane listener of one node over one :class:`BlockStore`."""

    def __init__(self, store: BlockStore, *, log: Any = None) -> None:
        self.store = store
        self.log = log if log is not None else get_logger("kvpool.node.data")
        self.connections: set[DataConnection] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 = any free port); returns the bound port. OSError when
        the address cannot be bound."""
        self._server, self.port = await start_frame_server(host, port, self._new_connection)
        return self.port

    def _new_connection(self) -> DataConnection:
        return DataConnection(self)

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Stop accepting, cut every connection (in-flight PUTs are aborted, leases end)."""
        self.stop_accepting()
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        for _ in range(3):  # let the connection_lost callbacks run
            if not self.connections:
                break
            await asyncio.sleep(0)
