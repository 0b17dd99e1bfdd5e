"""Shared memory for same-host clients: the CPU arena's fd over an abstract unix socket.

The node listens on ``\\0kvpool-<pid>-<random>`` (advertised as ``shm://kvpool-…`` in HELLO).
Each connection first receives a preamble (magic, arena size, arena token) with the arena's
memfd (``SCM_RIGHTS``), then speaks frames: every op of the TCP data port, plus

* ``SHM_GET`` — per (key, write id): status, the block's arena offset and a lease id. The copy
  is leased exactly as a TCP GET leases it while sending: it cannot be evicted or reused until
  ``SHM_RELEASE`` names the lease, the connection closes, or the lease has been held for
  ``lease_timeout_s`` (the connection is then cut, which ends all its leases);
* ``SHM_RESERVE`` — per (key, write id, size, checksum): the arena offset the client writes the
  value to, reserved exactly as for a TCP PUT whose payload is arriving (invisible to reads,
  never evicted); ``SHM_COMMIT`` then verifies the checksum and stages the block, as at the end
  of a TCP PUT. A reservation never committed is aborted when the connection closes; a
  connection holding one uncommitted for ``frame_timeout_s`` is cut.

Blocks only on a slower tier (SSD, GPU) are answered DEFERRED: the client reads them with a
plain GET on the same socket (bytes inline).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import socket
from typing import TYPE_CHECKING

from kvpool.proto.wire import (
    COUNT,
    RESERVE_RECORD,
    SHM_RECORD,
    FrameError,
    Header,
    Op,
    Status,
    TierLevel,
    decode_ids,
    decode_key_table,
    table_size,
)
from kvpool.store_node.blocks import Block, Copy
from kvpool.store_node.data_server import _TIER_LIMITS, DataConnection, _decode_key
from kvpool.store_node.tiers.cpu import CpuTier
from kvpool.transports.auth import Gate
from kvpool.transports.directory import BEAT_S, DirectoryWriter, slots_for
from kvpool.transports.shm import PREAMBLE, SHM_MAGIC
from kvpool.transports.stream import StreamServer

if TYPE_CHECKING:
    from kvpool.store_node.block_store import BlockStore
    from kvpool.store_node.data_server import DataServer


def shm_supported(tier: CpuTier) -> bool:
    """The arena has an fd to share and this platform can pass it."""
    from kvpool.transports.shm import shm_supported as platform_ok

    return tier.fd is not None and platform_ok()


class Directory:
    """The node's half of the shared directory (:mod:`kvpool.transports.directory`): lists the
    committed blocks with a CPU copy as the tiers report them (:class:`TierManager`'s
    ``listing``), renews it, and folds the reads clients counted into the eviction policy."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.writer = DirectoryWriter(slots_for(store.tier.capacity_bytes))
        self._slot_of: dict[tuple[str, int], int] = {}
        self._at: dict[int, Block] = {}
        self.full = 0  # blocks not listed: their bucket was full
        self.writer.beat()
        store.tiers.listing = self
        for block in store.committed_blocks():
            cpu = block.copies.get(TierLevel.CPU)
            if cpu is not None and cpu.ready:
                self.add(cpu)

    def add(self, copy: Copy) -> None:
        block = copy.block
        if block.id in self._slot_of:
            return
        slot = self.writer.put(
            block.key.encode("utf-8"), copy.offset, block.size_bytes, block.checksum, block.write_id
        )
        if slot < 0:
            self.full += 1
            return
        self._slot_of[block.id] = slot
        self._at[slot] = block

    def remove(self, block: Block) -> None:
        slot = self._slot_of.pop(block.id, None)
        if slot is not None:
            del self._at[slot]
            self.writer.drop(slot)

    def tend(self) -> None:
        """Renew the directory; count the reads clients made through it."""
        self.writer.beat()
        for slot, reads in self.writer.take_reads():
            block = self._at.get(slot)
            if block is not None:
                self.store.mapped_reads(block, reads)

    def close(self) -> None:
        if self.store.tiers.listing is self:
            self.store.tiers.listing = None
        self.writer.close()


class ShmListener:
    """The abstract unix socket same-host clients connect to."""

    def __init__(self, server: DataServer) -> None:
        self.server = server
        self.name = f"kvpool-{os.getpid()}-{secrets.token_hex(8)}"
        self.token = secrets.token_bytes(16)
        self._server: StreamServer | None = None
        self._gate: Gate | None = None
        self.directory: Directory | None = None
        self._tending: asyncio.Task[None] | None = None

    def start(self) -> str:
        """Listen; returns the ``shm://`` address."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + self.name)
            listener.listen(256)
        except BaseException:
            listener.close()
            raise
        # The arena's fd goes only to a peer that proved the cluster token (when there is one).
        self._gate = Gate(
            self.server.gate.token,
            self._adopt,
            log=self.server.log,
            max_connections=self.server.limits.max_connections,
            live=lambda: len(self.server.connections),
        )
        self._server = StreamServer(listener, self._gate, log=self.server.log)
        if self.server.shm_directory:
            try:
                self.directory = Directory(self.server.store)
            except OSError as e:  # no memfd sealing, no memory: read through the node
                self.server.once.warning("shm_directory_unavailable", "shm", error=repr(e))
            else:
                self._tending = asyncio.get_running_loop().create_task(self._tend())
        return f"shm://{self.name}"

    async def _tend(self) -> None:
        directory = self.directory
        assert directory is not None
        while True:
            await asyncio.sleep(BEAT_S)
            try:
                directory.tend()
            except Exception as e:  # a beat missed must not end the beats: clients would
                # stop reading through the directory for good, a second after the last one
                self.server.once.warning("shm_directory_tend_failed", "shm", error=repr(e))

    def _adopt(self, sock: socket.socket) -> None:
        tier = self.server.store.tier
        fd = tier.fd
        if fd is None or tier.closed:
            sock.close()
            return
        sock.setblocking(True)
        sock.settimeout(1.0)  # a fresh socket: the preamble always fits in its buffer
        fds = [fd]
        if self.directory is not None:  # a client before the directory takes the first fd only
            fds += [self.directory.writer.fd, self.directory.writer.hits_fd]
        try:
            socket.send_fds(sock, [PREAMBLE.pack(SHM_MAGIC, tier.capacity_bytes, self.token)], fds)
        except OSError as e:  # the peer left already (a connect-and-close, a port scan)
            sock.close()
            self.server.once.warning("shm_peer_left", "shm", error=repr(e))
            return
        ShmConnection(self.server).attach(sock)

    def close(self) -> None:
        if self._gate is not None:
            self._gate.close()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._tending is not None:
            self._tending.cancel()
            self._tending = None
        if self.directory is not None:
            self.server.log.info(
                "shm_directory_closed",
                listed=self.directory.writer.listed,
                reads=self.server.store.counters.directory_reads,
                not_listed_bucket_full=self.directory.full,
            )
            with contextlib.suppress(OSError):
                self.directory.close()
            self.directory = None


class ShmConnection(DataConnection):
    """A client connection on the shared-memory socket: leases and reservations it holds."""

    def __init__(self, server: DataServer) -> None:
        super().__init__(server)
        self._ids = itertools.count(1)
        self._leases: dict[int, tuple[Copy, float]] = {}
        self._reserved: dict[int, tuple[Block, float]] = {}

    @property
    def blocked_since(self) -> float | None:
        since = [s for s in (super().blocked_since,) if s is not None]
        if self._leases:
            since.append(next(iter(self._leases.values()))[1])  # the oldest: dicts keep order
        return min(since) if since else None

    @property
    def frame_since(self) -> float | None:
        """A half-received frame, or the oldest reservation not yet committed: both are cut
        after ``frame_timeout_s`` (a reservation holds tier memory nobody can use)."""
        since = [s for s in (super().frame_since,) if s is not None]
        if self._reserved:
            since.append(next(iter(self._reserved.values()))[1])  # the oldest
        return min(since) if since else None

    def stream_closed(self, error: Exception | None) -> None:
        leases, self._leases = self._leases, {}
        for copy, _ in leases.values():
            self._store.release(copy)
        reserved, self._reserved = self._reserved, {}
        for block, _ in reserved.values():
            self._store.abort_put(block)
        super().stream_closed(error)

    def _dispatch_table(self, header: Header, payload: memoryview | None) -> None:
        op = header.op
        if op == Op.MGET:
            super()._dispatch_table(header, payload)
            return
        raw = payload if payload is not None else b""
        try:
            if op == Op.SHM_GET:
                self._shm_get(header, raw)
            elif op == Op.SHM_RELEASE:
                self._release(decode_ids(raw))
            elif op == Op.SHM_RESERVE:
                self._reserve(header, raw)
            elif op == Op.SHM_COMMIT:
                self._commit(header, decode_ids(raw))
            else:
                self._answer(header, Status.BAD_REQUEST, f"unknown op {op}")
        except FrameError as e:
            if op == Op.SHM_RELEASE:  # no answer is expected: the stream is out of step
                self.bad_frame(e)
            else:
                self._answer(header, Status.BAD_REQUEST, f"bad table: {e}")

    def _shm_get(self, header: Header, raw: memoryview | bytes) -> None:
        if header.flags not in _TIER_LIMITS:
            self._answer(header, Status.BAD_REQUEST, f"unknown tier limit {header.flags}")
            return
        records = decode_key_table(raw)
        limit = TierLevel(header.flags)
        table = bytearray(table_size(SHM_RECORD, len(records)))
        COUNT.pack_into(table, 0, len(records))
        pos = COUNT.size
        store, now = self._store, self._server.clock()
        for rec in records:
            name = _decode_key(rec.key)
            if name is None:  # write id 0: the key's committed block (BlockStore.resolve)
                SHM_RECORD.pack_into(table, pos, Status.BAD_REQUEST, 0, rec.write_id, 0, 0, 0, 0)
            else:
                status, flags, copy = store.get_in_memory(name, rec.write_id, limit)
                if copy is None:
                    SHM_RECORD.pack_into(table, pos, status, flags, rec.write_id, 0, 0, 0, 0)
                else:
                    block = copy.block
                    lease = next(self._ids)
                    self._leases[lease] = (copy, now)
                    SHM_RECORD.pack_into(
                        table,
                        pos,
                        Status.OK,
                        flags,
                        block.write_id,
                        block.size_bytes,
                        block.checksum,
                        copy.offset,
                        lease,
                    )
            pos += SHM_RECORD.size
        self._table_answer(header, table)

    def _release(self, leases: list[int]) -> None:
        for lease in leases:
            held = self._leases.pop(lease, None)
            if held is not None:
                self._store.release(held[0])

    def _reserve(self, header: Header, raw: memoryview | bytes) -> None:
        records = decode_key_table(raw)
        table = bytearray(table_size(RESERVE_RECORD, len(records)))
        COUNT.pack_into(table, 0, len(records))
        pos = COUNT.size
        now = self._server.clock()
        for rec in records:
            name = _decode_key(rec.key)
            if name is None:
                RESERVE_RECORD.pack_into(table, pos, Status.BAD_REQUEST, 0, 0, 0)
            else:
                verdict = self._store.reserve(name, rec.write_id, rec.size_bytes, rec.checksum)
                if verdict.block is not None:
                    reservation = next(self._ids)
                    self._reserved[reservation] = (verdict.block, now)
                    RESERVE_RECORD.pack_into(
                        table, pos, Status.OK, 0, verdict.block.offset, reservation
                    )
                else:  # OK without a block: this very write is already held
                    RESERVE_RECORD.pack_into(table, pos, verdict.status, 0, 0, 0)
            pos += RESERVE_RECORD.size
        self._table_answer(header, table)

    def _commit(self, header: Header, reservations: list[int]) -> None:
        table = bytearray(table_size(RESERVE_RECORD, len(reservations)))
        COUNT.pack_into(table, 0, len(reservations))
        pos = COUNT.size
        for reservation in reservations:
            held = self._reserved.pop(reservation, None)
            status = Status.BAD_REQUEST if held is None else self._store.finish_put(held[0])
            RESERVE_RECORD.pack_into(table, pos, status, 0, 0, reservation)
            pos += RESERVE_RECORD.size
        self._table_answer(header, table)

    def _table_answer(self, request: Header, table: bytearray) -> None:
        self.send(
            Header(
                op=request.op,
                status=Status.OK,
                request_id=request.request_id,
                payload_len=len(table),
            ),
            b"",
            table,
        )
