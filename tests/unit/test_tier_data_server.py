"""The data server over a tiered store: SSD reads over TCP, tier limits, refusals, stalled
readers."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TypeVar

from kvpool.checksum import block_checksum
from kvpool.client.blocks import _node_error
from kvpool.errors import NoSpaceError
from kvpool.proto.wire import Header, MissReason, Op, Status, TierLevel
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.eviction import S3FifoPolicy
from kvpool.store_node.tier_worker import TierWorker
from kvpool.store_node.tiers.cpu import CpuTier
from kvpool.store_node.tiers.ssd import SsdTier
from kvpool.transports.tcp import TcpConnection

KIB = 1024
MIB = 1 << 20
TIMEOUT_S = 10.0
T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def node(
    path: Path | None,
    *,
    cpu: int = 1 * MIB,
    ssd: int = 8 * MIB,
    lease_timeout_s: float = 30.0,
) -> AsyncIterator[tuple[DataServer, TcpConnection]]:
    tier = CpuTier(cpu)
    ssd_tier = SsdTier(path, ssd, 256 * KIB) if path is not None else None
    store = BlockStore(
        tier,
        S3FifoPolicy(),
        max_block_size=256 * KIB,
        clock=time.monotonic,
        ssd=ssd_tier,
        write_batch_bytes=256 * KIB,
    )
    worker = TierWorker(store)
    worker.start()
    server = DataServer(store, worker=worker, lease_timeout_s=lease_timeout_s)
    port = await server.start("127.0.0.1", 0)
    conn = await TcpConnection.open("127.0.0.1", port, timeout_s=TIMEOUT_S)
    try:
        yield server, conn
    finally:
        conn.close()
        await server.close()
        await worker.stop()
        store.check_invariants()
        tier.close()
        if ssd_tier is not None:
            ssd_tier.close()


def data_for(key: str, size: int) -> bytes:
    return random.Random(key).randbytes(size)


async def put(conn: TcpConnection, key: str, size: int, *, publish: bool = True) -> Status:
    data = data_for(key, size)
    r = await conn.request(
        Op.PUT, key.encode(), write_id=1, checksum=block_checksum(data), payload=data,
        timeout_s=TIMEOUT_S,
    )  # fmt: skip
    if r.status != Status.OK or not publish:
        return Status(r.status)
    r = await conn.request(Op.PUBLISH, key.encode(), write_id=1, version=1, timeout_s=TIMEOUT_S)
    return Status(r.status)


async def get(
    conn: TcpConnection, key: str, size: int, limit: TierLevel = TierLevel.ANY
) -> tuple[int, int, bytes]:
    sink = bytearray(size)
    r = await conn.request(
        Op.GET, key.encode(), write_id=1, flags=int(limit), sink=memoryview(sink),
        timeout_s=TIMEOUT_S,
    )  # fmt: skip
    return r.status, r.header.flags, bytes(sink)


def test_blocks_on_the_ssd_are_served_over_tcp_byte_exact_with_their_tier(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with node(tmp_path / "ssd") as (server, conn):
            keys = [f"k{i}" for i in range(48)]  # 3 MiB through a 1 MiB CPU tier
            for key in keys:
                for _ in range(500):
                    status = await put(conn, key, 64 * KIB)
                    if status != Status.NO_SPACE:
                        break
                    await asyncio.sleep(0.01)  # demotions on their way: retry
                assert status == Status.OK
            assert server.worker is not None
            await server.worker.idle()
            # Pipelined GETs of CPU and SSD blocks at once: every answer exact, by request id.
            results = await asyncio.gather(*(get(conn, k, 64 * KIB) for k in keys))
            served = {TierLevel.CPU: 0, TierLevel.SSD: 0}
            for key, (code, flags, data) in zip(keys, results, strict=True):
                assert code == Status.OK, key
                assert data == data_for(key, 64 * KIB), key
                served[TierLevel(flags)] += 1
            assert served[TierLevel.SSD] >= 24
            slow = [k for k, (_, f, _) in zip(keys, results, strict=True) if f == TierLevel.SSD]
            answer, flags, _ = await get(conn, slow[-1], 64 * KIB, TierLevel.CPU)
            if answer == Status.MISS:  # unless its first read promoted it meanwhile
                assert flags == MissReason.SLOW_TIER
            bad = await conn.request(Op.GET, b"k0", write_id=1, flags=9, timeout_s=TIMEOUT_S)
            assert bad.status == Status.BAD_REQUEST  # an unknown tier limit

    run(scenario())


def test_a_full_node_refuses_puts_with_a_clear_retryable_error_and_keeps_serving() -> None:
    async def scenario() -> None:
        async with node(None, cpu=1 * MIB) as (server, conn):
            for i in range(16):  # staged, never published: nothing can be evicted
                status = await put(conn, f"s{i}", 60 * KIB, publish=False)
                if status != Status.OK:
                    break
            data = data_for("more", 200 * KIB)
            r = await conn.request(
                Op.PUT, b"more", write_id=1, checksum=block_checksum(data), payload=data,
                timeout_s=TIMEOUT_S,
            )  # fmt: skip
            assert r.status == Status.NO_SPACE
            assert "no room" in r.message()
            error = _node_error(conn.address, "PUT", r)
            assert isinstance(error, NoSpaceError)
            assert error.retryable
            ping = await conn.request(Op.PING, b"", timeout_s=TIMEOUT_S)
            assert ping.status == Status.OK  # the same connection goes on
            assert server.store.stats().staged >= 15

    run(scenario())


def test_a_reader_that_stops_reading_is_cut_and_its_leases_end() -> None:
    async def scenario() -> None:
        async with node(None, cpu=16 * MIB, lease_timeout_s=0.3) as (server, conn):
            assert await put(conn, "big", 256 * KIB) == Status.OK
            raw = socket.socket()
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            raw.connect(("127.0.0.1", server.port))
            raw.setblocking(False)
            request = Header(op=Op.GET, request_id=1, write_id=1, key_len=3).pack() + b"big"
            loop = asyncio.get_running_loop()
            for _ in range(64):  # 16 MiB of answers it never reads
                await loop.sock_sendall(raw, request)
            block = server.store.block("big", 1)
            assert block is not None
            cpu_copy = block.copies[TierLevel.CPU]
            await asyncio.sleep(0.1)
            assert cpu_copy.leases > 0  # held while the bytes wait to leave
            for _ in range(100):
                if not cpu_copy.leases:
                    break
                await asyncio.sleep(0.05)
            assert cpu_copy.leases == 0, "a stalled reader kept its lease"
            assert server.stalled_cut >= 1
            raw.close()
            # Nothing holds the block now: it can be evicted like any other.
            server.store.tiers.evict(TierLevel.CPU, 16 * MIB)
            assert server.store.block("big", 1) is None

    run(scenario())


def test_mget_reads_serve_memory_and_defer_other_tiers(tmp_path: Path) -> None:
    # BlockStore.get_in_memory, the per-key step of MGET and SHM_GET: a CPU copy is leased and
    # sent from where it lies; a block whose fastest acceptable copy is on the SSD is DEFERRED
    # (the client reads it with a single GET); misses keep their reasons.
    async def scenario() -> None:
        async with node(tmp_path / "ssd") as (server, conn):
            keys = [f"m{i}" for i in range(48)]
            for key in keys:
                for _ in range(500):
                    status = await put(conn, key, 64 * KIB)
                    if status != Status.NO_SPACE:
                        break
                    await asyncio.sleep(0.01)
                assert status == Status.OK
            assert server.worker is not None
            await server.worker.idle()
            store = server.store
            answers = {k: store.get_in_memory(k, 1) for k in keys}
            in_memory = [k for k, (s, _f, c) in answers.items() if s == Status.OK]
            deferred = [k for k, (s, _f, c) in answers.items() if s == Status.DEFERRED]
            assert in_memory
            assert deferred
            assert len(in_memory) + len(deferred) == len(keys)
            for key in in_memory:
                status, flags, copy = answers[key]
                assert flags == TierLevel.CPU
                assert copy is not None
                assert copy.leases == 1
                assert bytes(store.view_copy(copy)) == data_for(key, 64 * KIB)
                store.release(copy)
                # A caller that accepts only the GPU tier (none here): a miss, not a CPU copy.
                assert store.get_in_memory(key, 1, TierLevel.GPU) == (
                    Status.MISS, MissReason.SLOW_TIER, None,
                )  # fmt: skip
            assert store.get_in_memory(deferred[0], 1, TierLevel.CPU) == (
                Status.MISS, MissReason.SLOW_TIER, None,
            )  # fmt: skip
            assert store.get_in_memory("absent", 1) == (Status.MISS, MissReason.ABSENT, None)
            assert store.get_in_memory(keys[0], 2) == (
                Status.MISS, MissReason.WRONG_VERSION, None,
            )  # fmt: skip

    run(scenario())
