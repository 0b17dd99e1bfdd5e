"""The store node's data plane: ``tcp://`` frames in, block bytes straight into tier memory.

Each connection is a :class:`~kvpool.transports.stream.FrameStream`. A PUT is decided when its
header arrives, before any payload byte is read: the block store reserves tier memory and the
frame reader receives the payload straight into it (``recv_into``). A GET of a block in CPU
memory answers with a view of the tier — queued as it is, sent with ``sendmsg``, never copied —
leased until the kernel has taken its last byte; a block only on the SSD (or GPU) is first read
by the tier worker into a bounce buffer — checked against its checksum — while later requests
go on being answered: responses carry the request's id, so they may come back out of order. A
GET's flags may name the slowest tier the caller accepts (a block only on a slower one is a MISS
SLOW_TIER); a hit's flags name the tier that served it. Many requests may be in flight on one
connection (pipelining); the answers to every frame of one read leave in one ``sendmsg``.

An MGET asks for many blocks in one frame: the answer is one table and the bytes of every block
held in CPU memory, sent from where they lie in one vectored write (a block only on a slower
tier is marked DEFERRED: the client reads it with a single GET). HELLO tells a client what this
node offers (MGET; same-host shared memory, see :mod:`kvpool.store_node.shm_server`).

No reader can hold a lease for ever: a connection whose sent bytes have not left after
``lease_timeout_s`` (a peer that stopped reading) is cut, which ends its leases. No writer can
hold a reservation for ever either: a connection with a frame half-received (a PUT whose payload
stops coming) for ``frame_timeout_s`` is cut, which frees the PUT's memory. Key tables (MGET,
shared memory) are charged to the process's ``request_memory`` budget while they are read
(beyond it: NO_SPACE, retryable); at most ``max_connections`` connections per port
(:mod:`kvpool.transports.limits`). Bad frames are logged once per peer and minute.

Refusals: a PUT without room, above ``max_block_size`` or otherwise refused has its payload read
and discarded (the connection stays usable); a payload above :data:`MAX_DISCARD_BYTES` is not
worth skipping — the answer is sent and the connection closed. Garbage (bad magic) and another
protocol version are answered and the connection closed; both are counted as bad frames.
Nothing a peer sends can lose a stored block or stop the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from functools import partial
from time import perf_counter
from typing import Any

from opentelemetry.trace import SpanKind

from kvpool import tracing
from kvpool.errors import KVPoolError
from kvpool.logs import OncePer, get_logger
from kvpool.metrics import TRANSFER_LATENCY
from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.wire import (
    COUNT,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_TABLE_BYTES,
    MGET_RECORD,
    FrameError,
    Header,
    MissReason,
    Op,
    Status,
    TierLevel,
    decode_key_table,
    table_size,
    version_mismatch_message,
)
from kvpool.store_node.block_store import (
    Block,
    BlockState,
    BlockStore,
    PutVerdict,
    ReadOutcome,
    ReadResult,
)
from kvpool.store_node.blocks import Copy
from kvpool.store_node.node_metrics import (
    GET_CPU_LATENCY,
    GET_MISS_LATENCY,
    MGET_LATENCY,
    TIER_LABELS,
    get_attributes,
)
from kvpool.store_node.publish_check import IndexVersions
from kvpool.store_node.tier_worker import TierWorker, WorkerStoppedError
from kvpool.transports import host_id
from kvpool.transports.auth import Gate
from kvpool.transports.inproc import register_inproc, unregister_inproc
from kvpool.transports.limits import IngressLimits, MemoryBudget, overloaded_message
from kvpool.transports.stream import Buffer, FrameStream, StreamServer, listen_tcp, tune_socket

LEASE_TIMEOUT_S = 30.0
SETTLE_FIRST_S = 0.2
SETTLE_MAX_DELAY_S = 2.0
SETTLE_PATIENCE_S = 30.0
"""A PUBLISH whose index check failed (no master answered: all restarting, say) is checked again
in the background, first after SETTLE_FIRST_S, the pause doubling up to SETTLE_MAX_DELAY_S, for
SETTLE_PATIENCE_S at most (the staged reaper settles what is left): the block is readable again
soon after the masters are, not only when the reaper's ``staged_ttl_s`` has passed."""
MAX_SETTLING = 4096
"""Writes asked about again in the background at once, per server (each holds a waiting task);
beyond it, and for a write already waiting, the staged reaper settles them."""
"""A connection whose responses have not left for this long is cut (its leases end)."""
_TIER_LIMITS = {int(level) for level in TierLevel}

MAX_DISCARD_BYTES = 1 << 30
"""A refused payload larger than this is not read and skipped: the connection is closed."""

_PUT_ERRORS = {
    Status.CHECKSUM_MISMATCH: "payload does not match the checksum in its header",
    Status.INTERNAL: "the block was dropped while its payload was being received",
}


class DataConnection:
    """One client connection to the data port (or to the shared-memory socket)."""

    def __init__(self, server: DataServer) -> None:
        self._server = server
        self._store = server.store
        self._log = server.log
        self.stream: FrameStream | None = None
        self.peer = "?"
        self._receiving: Block | None = None  # the PUT whose payload is arriving
        self._refusal: tuple[Status, str] | None = None  # decided for the current frame
        self._closing = False
        self._charged = 0  # request memory held by the table being received
        self._span: Any = None  # the current frame's span (traced requests only)

    # --- connection lifecycle ---------------------------------------------------------------

    def attach(self, sock: socket.socket) -> None:
        tune_socket(sock)
        self.stream = FrameStream(sock, self, backpressure=True, clock=self._server.clock)
        self.peer = self.stream.peername
        self._server.connections.add(self)

    @property
    def blocked_since(self) -> float | None:
        """Since when sent bytes have been waiting for this peer to read them (None: they
        are not)."""
        return self.stream.blocked_since if self.stream is not None else None

    @property
    def frame_since(self) -> float | None:
        """Since when a request frame has been half-received (None: none is)."""
        return self.stream.frame_since if self.stream is not None else None

    def stream_closed(self, error: Exception | None) -> None:
        self._server.connections.discard(self)
        if self._receiving is not None:
            self._store.abort_put(self._receiving)
            self._receiving = None
        self._uncharge()
        self.stream = None  # nothing points back at the stream: freed by reference counting

    def _uncharge(self) -> None:
        if self._charged:
            self._server.budget.give(self._charged)
            self._charged = 0

    def abort(self) -> None:
        if self.stream is not None:
            self.stream.abort()

    def send(
        self,
        header: Header,
        key: bytes = b"",
        payload: Buffer | Sequence[Buffer] = b"",
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        if self.stream is None:
            if on_sent is not None:
                on_sent()
            return
        self.stream.send(header, key, payload, on_sent)

    def send_error(
        self, request: Header | None, status: Status, message: str, *, close: bool = False
    ) -> None:
        if self.stream is not None:
            self.stream.send_error(request, status, message, close=close)

    # --- FrameHandler ----------------------------------------------------------------------------

    def frame_sink(self, header: Header, key: bytes) -> memoryview | None:
        self._refusal = None
        if self._closing:
            return None
        op = header.op
        if op == Op.PUT:
            try:
                verdict = self._decide_put(header, key)
            except Exception as e:  # the server keeps serving whatever happens
                self._server.once.warning(
                    "put_failed", self.peer_host, peer=self.peer, exc_info=True
                )
                verdict = PutVerdict(Status.INTERNAL, message=f"{type(e).__name__}: {e}")
            if verdict.block is not None:
                self._receiving = verdict.block
                return self._store.view(verdict.block)
            self._refusal = (verdict.status, verdict.message)
        elif op in TABLE_OPS:
            size = header.payload_len
            if size > MAX_TABLE_BYTES:
                self._refusal = (Status.TOO_LARGE, f"a table of {size} bytes")
            elif not self._server.budget.take(size):
                self._refusal = (Status.NO_SPACE, overloaded_message(size, self._server.budget))
            else:
                self._charged = size
                return memoryview(bytearray(size))
        elif op == Op.AUTH:
            pass  # the token is checked before a connection gets here (auth.Gate); dropped
        elif header.payload_len:
            self._refusal = (Status.BAD_REQUEST, f"op {op} takes no payload")
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
        if header.trace and tracing.STATE.enabled and tracing.sampled(header.trace):
            op = _OP_NAMES.get(header.op, str(header.op))
            span, token = tracing.enter_span(
                f"kvpool.node.{op}",
                kind=SpanKind.SERVER,
                parent=tracing.remote_context(header.trace),
                attributes={"kvpool.peer": self.peer},
            )
            self._span = span
            try:
                self._received(header, key, payload)
            finally:
                self._span = None
                tracing.exit_span(span, token)
            return
        self._received(header, key, payload)

    def _received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        try:
            if header.op in TABLE_OPS and self._refusal is None:
                self._dispatch_table(header, payload)
            else:
                self._dispatch(header, key)
        except Exception as e:
            self._server.once.warning(
                "frame_failed", self.peer_host, peer=self.peer, op=header.op, exc_info=True
            )
            if self._receiving is not None:
                self._store.abort_put(self._receiving)
                self._receiving = None
            self.send_error(header, Status.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            self._uncharge()

    @property
    def peer_host(self) -> str:
        return self.peer.rsplit(":", 1)[0]

    def bad_frame(self, error: FrameError) -> None:
        self._store.counters.bad_frames += 1
        self._server.once.warning("bad_frame", self.peer_host, peer=self.peer, error=str(error))
        self.send_error(None, Status.BAD_REQUEST, str(error), close=True)

    def version_mismatch(self, theirs: int) -> None:
        self._store.counters.bad_frames += 1
        self._server.once.warning(
            "peer_version_mismatch", self.peer_host, peer=self.peer, peer_version=theirs
        )
        self.send_error(
            None,
            Status.VERSION_MISMATCH,
            version_mismatch_message(PROTOCOL_VERSION, theirs),
            close=True,
        )

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
        if op in (Op.PING, Op.AUTH):  # AUTH: no token here, or proved when the connection opened
            self._answer(header, Status.OK)
            return
        if op == Op.HELLO:
            self._hello(header)
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
        if op == Op.PUBLISH:
            if header.write_id == 0:
                self._answer(header, Status.BAD_REQUEST, "write id 0 names no block")
                return
            self._publish(header, name, key)
            return
        # A GET of write id 0 reads the key's committed block (BlockStore.resolve).
        if header.flags not in _TIER_LIMITS:
            self._answer(header, Status.BAD_REQUEST, f"unknown tier limit {header.flags}")
            return
        started = perf_counter()
        result = self._store.get(name, header.write_id, TierLevel(header.flags))
        if self._span is not None:
            self._span.set_attributes(get_attributes(result))
        if result.copy is None:
            self._answer(header, result.status, flags=result.reason)
            GET_MISS_LATENCY.observe(perf_counter() - started)
            return
        if result.copy.level is TierLevel.CPU:
            self._send_block(header, result)  # sent from where it lies: no tier read
            GET_CPU_LATENCY.observe(perf_counter() - started)
            return
        worker = self._server.worker
        if worker is None:  # a store with slow tiers always runs with a worker
            self._store.finish_read(result, ReadOutcome.ABANDONED)
            self.send_error(header, Status.INTERNAL, "no tier worker to read the block")
            return
        task = asyncio.get_running_loop().create_task(self._send_slow(header, result, worker))
        self._server.reads.add(task)
        task.add_done_callback(self._server.reads.discard)

    def _publish(self, header: Header, name: str, key: bytes) -> None:
        """Staged → committed, with the version the index gives this write (see
        :mod:`kvpool.store_node.publish_check`); the frame's version only where the server
        has no index to ask (a standalone data server: benchmarks, data-plane tests)."""
        versions = self._server.versions
        store = self._store
        if versions is None:
            result = store.publish(name, header.write_id, header.version)
            self._answer(header, result.status, flags=result.reason, version=header.version)
            return
        block = store.block(name, header.write_id)
        if block is None or block.state is BlockState.RECEIVING:
            # The write is gone here (a remove of the key deleted it first, or its PUT never
            # came), but its claim still names a newer version than what is held: the older
            # write leaves all the same, else a reader's cached entry would read it after the
            # put was acknowledged (a remove racing an overwrite; chaos read_after_ack).
            store.retire_older(name, header.write_id, header.version)
            self._answer(header, Status.MISS, flags=MissReason.ABSENT)
            return
        if block.state is BlockState.COMMITTED:
            self._answer(header, Status.OK, version=block.version)  # an idempotent re-publish
            return
        store.retire_older(name, header.write_id, header.version)
        if (
            header.checksum  # a PUBLISH's checksum field carries the commit's receipt
            and not store.claimed_newer(name, header.write_id, header.version)
            and versions.proves(key, header.write_id, header.version, header.checksum)
        ):  # the index signed this version of this write: published with it, nothing asked
            result = store.publish(name, header.write_id, header.version)
            store.counters.receipt_publishes += result.status == Status.OK
            self._answer(header, result.status, flags=result.reason, version=header.version)
            return
        task = asyncio.get_running_loop().create_task(self._publish_checked(header, name))
        self._server.publishing.add(task)
        task.add_done_callback(self._server.publishing.discard)

    async def _publish_checked(self, header: Header, name: str) -> None:
        versions = self._server.versions
        assert versions is not None
        try:
            version, other = await versions.version_of(name, header.write_id)
        except KVPoolError:
            # Left staged (readable by its write id for a while): answered now, asked again
            # in the background until the index answers.
            self._answer(header, Status.MISS, flags=MissReason.STAGED)
            await self._settle_later(header, name)
            return
        status, reason, version = self._settle(header, name, version, other)
        self._answer(header, status, flags=reason, version=version)

    def _settle(
        self, header: Header, name: str, version: int | None, other: int
    ) -> tuple[Status, int, int]:
        """Publish the staged write with the index's ``version``, or refuse it: (status, miss
        reason, version) for the answer."""
        if version is None:  # the index holds another write of the key, or none
            replaced = other and other >= header.version
            if replaced:  # replaced, or never committed: no reader may get it any more
                self._store.reap(name, header.write_id, report=False)
            self._server.once.warning(
                "publish_refused",
                self.peer_host,
                peer=self.peer,
                reason="the index names another write" if other else "the index names none",
                claimed_version=header.version,
                dropped=bool(replaced),
            )
            return Status.MISS, MissReason.WRONG_VERSION, 0
        result = self._store.publish(name, header.write_id, version)
        return result.status, result.reason, version

    async def _settle_later(self, header: Header, name: str) -> None:
        """Ask the index again (see :data:`SETTLE_PATIENCE_S`) while the write is still staged
        here; nothing is answered (the PUBLISH was)."""
        server = self._server
        versions = server.versions
        assert versions is not None
        write = (name, header.write_id)
        if write in server.settling or len(server.settling) >= MAX_SETTLING:
            return  # already waiting, or too many: the staged reaper settles it
        server.settling.add(write)
        try:
            loop = asyncio.get_running_loop()
            until = loop.time() + SETTLE_PATIENCE_S
            delay = SETTLE_FIRST_S
            while loop.time() < until:
                await asyncio.sleep(delay)
                block = self._store.block(name, header.write_id)
                if block is None or block.state is not BlockState.STAGED:
                    return  # settled otherwise: the reaper, a DELETE, another PUBLISH
                try:
                    version, other = await versions.version_of(name, header.write_id)
                except KVPoolError:
                    delay = min(delay * 2, SETTLE_MAX_DELAY_S)
                    continue
                self._settle(header, name, version, other)
                return
        finally:
            server.settling.discard(write)

    def _dispatch_table(self, header: Header, payload: memoryview | None) -> None:
        """Multi-key ops: their payload is a table of keys (see :mod:`kvpool.proto.wire`)."""
        if header.op != Op.MGET:
            self._answer(header, Status.BAD_REQUEST, f"op {header.op} needs shared memory")
            return
        if header.flags not in _TIER_LIMITS:
            self._answer(header, Status.BAD_REQUEST, f"unknown tier limit {header.flags}")
            return
        try:
            records = decode_key_table(payload if payload is not None else b"")
        except FrameError as e:
            self._answer(header, Status.BAD_REQUEST, f"bad MGET table: {e}")
            return
        started = perf_counter()
        limit = TierLevel(header.flags)
        table = bytearray(table_size(MGET_RECORD, len(records)))
        COUNT.pack_into(table, 0, len(records))
        pack, pos = MGET_RECORD.pack_into, COUNT.size
        views: list[Buffer] = [table]
        leased: list[Copy] = []
        data_bytes = 0
        store = self._store
        get_in_memory, view = store.get_in_memory, store.tier.view
        for rec in records:
            name = _decode_key(rec.key)
            if name is None:
                pack(table, pos, Status.BAD_REQUEST, 0, rec.write_id, 0, 0)
            else:
                status, flags, copy = get_in_memory(name, rec.write_id, limit)
                if copy is None:
                    pack(table, pos, status, flags, rec.write_id, 0, 0)
                else:
                    block = copy.block
                    leased.append(copy)
                    views.append(view(copy.offset, block.size_bytes))
                    data_bytes += block.size_bytes
                    pack(
                        table,
                        pos,
                        Status.OK,
                        flags,
                        block.write_id,
                        block.size_bytes,
                        block.checksum,
                    )
            pos += MGET_RECORD.size
        response = Header(
            op=Op.MGET,
            status=Status.OK,
            request_id=header.request_id,
            payload_len=len(table) + data_bytes,
        )
        self.send(response, b"", views, on_sent=partial(_release_all, store, leased))
        MGET_LATENCY.observe(perf_counter() - started)
        if self._span is not None:
            self._span.set_attributes(
                {
                    "kvpool.keys": len(records),
                    "kvpool.hits": len(leased),
                    "kvpool.bytes": data_bytes,
                    "kvpool.tier": "cpu",
                }
            )

    def _hello(self, header: Header) -> None:
        stream = self.stream
        shm = self._server.shm_address
        info: dict[str, Any] = {
            "features": ["mget", "trace", "direct", *(["shm"] if shm else [])],
            "host": host_id(),
            "pid": os.getpid(),
            "local": stream.sockname if stream is not None else "",
            "peer": stream.peername if stream is not None else "",
        }
        if shm:
            info["shm"] = shm
        body = json.dumps(info, separators=(",", ":")).encode()[:MAX_ERROR_MESSAGE_BYTES]
        self.send(
            Header(
                op=Op.HELLO, status=Status.OK, request_id=header.request_id, payload_len=len(body)
            ),
            b"",
            body,
        )

    def _send_block(self, request: Header, result: ReadResult) -> None:
        block, copy = result.block, result.copy
        assert block is not None
        assert copy is not None
        try:
            self.send(
                self._hit_header(request, block, TierLevel.CPU),
                b"",
                self._store.view_copy(copy),
                on_sent=partial(self._store.release, copy),
            )
        except Exception:
            self._store.release(copy)  # send() registers on_sent only after queueing
            raise

    async def _send_slow(self, request: Header, result: ReadResult, worker: TierWorker) -> None:
        """Read a block off a slow tier, then answer; every lease and buffer is given back."""
        block, copy = result.block, result.copy
        assert block is not None
        assert copy is not None
        started = perf_counter()
        tier = TIER_LABELS.get(copy.level, "other")
        try:
            if request.trace and tracing.STATE.enabled and tracing.sampled(request.trace):
                with tracing.tracer().start_as_current_span(
                    "kvpool.tier.read",
                    attributes={"kvpool.tier": tier, "kvpool.bytes": block.size_bytes},
                ) as span:
                    buf, size = await worker.read(result)
                    if buf is None:
                        span.set_attribute("kvpool.miss_reason", "checksum_mismatch")
            else:
                buf, size = await worker.read(result)
        except WorkerStoppedError as e:
            self.send_error(request, Status.INTERNAL, str(e))
            return
        except Exception as e:
            self._log.exception("tier_read_failed", peer=self.peer)
            self.send_error(request, Status.INTERNAL, f"{type(e).__name__}: {e}")
            return
        if buf is None:
            self._answer(request, Status.MISS, flags=MissReason.CORRUPT)
            return
        try:
            self.send(
                self._hit_header(request, block, copy.level),
                b"",
                memoryview(buf)[:size],
                on_sent=partial(worker.release_buffer, buf),
            )
        except Exception:
            self._log.exception("send_failed", peer=self.peer)
        TRANSFER_LATENCY.labels("get", tier).observe(perf_counter() - started)

    @staticmethod
    def _hit_header(request: Header, block: Block, level: TierLevel) -> Header:
        return Header(
            op=Op.GET,
            status=Status.OK,
            request_id=request.request_id,
            write_id=block.write_id,
            version=block.version,
            payload_len=block.size_bytes,
            checksum=block.checksum,
            flags=int(level),
        )

    def _answer(
        self,
        request: Header,
        status: Status,
        message: str = "",
        flags: int = 0,
        version: int = 0,
    ) -> None:
        if status not in (Status.OK, Status.MISS):
            self.send_error(request, status, message)
            return
        self.send(
            Header(
                op=request.op,
                status=status,
                request_id=request.request_id,
                write_id=request.write_id,
                version=version,
                flags=int(flags),
            )
        )


TABLE_OPS = frozenset({Op.MGET, Op.SHM_GET, Op.SHM_RELEASE, Op.SHM_RESERVE, Op.SHM_COMMIT})
_OP_NAMES = {int(op): op.name.lower() for op in Op}


def _release_all(store: BlockStore, copies: list[Copy]) -> None:
    for copy in copies:
        store.release(copy)


def _decode_key(key: bytes) -> str | None:
    if not key:
        return None
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError:
        return None


class DataServer:
    """The data-plane listener of one node over one :class:`BlockStore` (and the
    :class:`TierWorker` that reads its slow tiers): ``tcp://``; ``shm://`` for same-host
    clients when ``shm`` (:mod:`kvpool.store_node.shm_server`); ``inproc://<inproc_name>`` for
    tests when a name is given."""

    def __init__(
        self,
        store: BlockStore,
        *,
        log: Any = None,
        worker: TierWorker | None = None,
        lease_timeout_s: float = LEASE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        shm: bool = False,
        shm_directory: bool = True,
        inproc_name: str = "",
        token: bytes = b"",
        limits: IngressLimits | None = None,
    ) -> None:
        self.store = store
        self.worker = worker
        self.log = log if log is not None else get_logger("kvpool.node.data")
        self.once = OncePer(self.log)
        """Bad frames and refusals: one line per peer host, event and minute."""
        self.limits = limits if limits is not None else IngressLimits()
        self.budget = MemoryBudget(self.limits.request_memory_bytes)
        self.lease_timeout_s = lease_timeout_s
        self.clock = clock
        self.connections: set[DataConnection] = set()
        self.reads: set[asyncio.Task[None]] = set()  # slow-tier reads in progress
        self.publishing: set[asyncio.Task[None]] = set()  # PUBLISHes asking the index
        self.settling: set[tuple[str, int]] = set()  # (key, write id) waiting to ask again
        self.versions: IndexVersions | None = None
        """Where PUBLISH versions come from: the index (a node sets it once it has its master
        client); None only for a standalone data server, which takes them from the frames."""
        self._server: StreamServer | None = None
        self._shm: Any = None  # the ShmListener, when serving shared memory
        self._want_shm = shm
        self.shm_directory = shm_directory
        """With ``shm``: list committed in-memory blocks in a directory clients read through."""
        self._inproc_name = inproc_name
        self._guard: asyncio.Task[None] | None = None
        self.port = 0
        self.stalled_cut = 0
        self.shm_address = ""
        """``shm://<name>`` once same-host clients can connect ("" when not offered)."""
        self.inproc_address = ""
        self.gate = Gate(
            token,
            self._adopt,
            log=self.log,
            max_connections=self.limits.max_connections,
            live=lambda: len(self.connections),
        )
        """Every accepted connection passes here: the connection limit, and the cluster token
        when there is one."""

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 = any free port); returns the bound port. OSError when
        the address cannot be bound."""
        self._server = StreamServer(listen_tcp(host, port), self.gate, log=self.log)
        self.port = self._server.port
        if self._want_shm:
            from kvpool.store_node.shm_server import ShmListener, shm_supported

            if shm_supported(self.store.tier):
                self._shm = ShmListener(self)
                self.shm_address = self._shm.start()
        if self._inproc_name:
            register_inproc(self._inproc_name, self.gate)
            self.inproc_address = f"inproc://{self._inproc_name}"
        self._guard = asyncio.get_running_loop().create_task(self._lease_guard())
        return self.port

    def _adopt(self, sock: socket.socket) -> None:
        DataConnection(self).attach(sock)

    def cut_stalled(self) -> int:
        """Cut connections whose responses have not left (or whose shared-memory leases have
        been held) for ``lease_timeout_s``: a peer that stopped reading must not keep blocks
        leased (so unevictable) for ever; and those with a request half-received (or a
        shared-memory reservation uncommitted) for ``frame_timeout_s``: a peer that stopped
        writing must not keep tier memory reserved."""
        now = self.clock()
        cut = 0
        frame_timeout_s = self.limits.frame_timeout_s
        for conn in list(self.connections):
            since = conn.blocked_since
            started = conn.frame_since
            if since is not None and now - since > self.lease_timeout_s:
                self.once.warning(
                    "stalled_reader_cut",
                    conn.peer_host,
                    peer=conn.peer,
                    stalled_s=round(now - since),
                )
            elif started is not None and now - started > frame_timeout_s:
                self.once.warning(
                    "slow_writer_cut", conn.peer_host, peer=conn.peer, after_s=frame_timeout_s
                )
            else:
                continue
            conn.abort()
            cut += 1
        self.stalled_cut += cut
        return cut

    async def _lease_guard(self) -> None:
        period_s = max(0.05, min(1.0, self.lease_timeout_s / 4, self.limits.frame_timeout_s / 4))
        while True:
            await asyncio.sleep(period_s)
            try:
                self.cut_stalled()
            except Exception as e:  # a sweep that fails must not end the sweeps: a stalled
                # peer would then keep its leases and buffers for good
                self.once.warning("lease_guard_failed", "guard", error=repr(e))

    def stop_accepting(self) -> None:
        self.gate.close()
        if self._server is not None:
            self._server.close()
        if self._shm is not None:
            self._shm.close()
        if self._inproc_name:
            unregister_inproc(self._inproc_name)

    async def close(self) -> None:
        """Stop accepting, cut every connection (in-flight PUTs are aborted, leases end)."""
        self.stop_accepting()
        if self._guard is not None:
            self._guard.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._guard
            self._guard = None
        for conn in list(self.connections):
            conn.abort()
        self._server = None
        for _ in range(3):  # let the close callbacks run
            if not self.connections:
                break
            await asyncio.sleep(0)
        if self.reads:  # slow-tier reads end on their own (their leases are given back)
            await asyncio.wait(list(self.reads), timeout=5.0)
        for task in list(self.publishing):
            task.cancel()
