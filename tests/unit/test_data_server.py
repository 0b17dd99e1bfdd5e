"""The node's data server over real loopback sockets, driven by the tcp transport's client."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import pytest

from kvpool.checksum import block_checksum
from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.wire import HEADER_SIZE, Header, MissReason, Op, Status, unpack_header
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.cpu_tier import CpuTier
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.eviction import LruPolicy
from kvpool.transports.tcp import Response, TcpConnection

MIB = 1 << 20
TIMEOUT_S = 10.0
T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(bounded())


@contextlib.asynccontextmanager
async def node(
    capacity: int = 64 * MIB, max_block: int = 16 * MIB
) -> AsyncIterator[tuple[DataServer, int]]:
    tier = CpuTier(capacity)
    store = BlockStore(tier, LruPolicy(), max_block_size=max_block, clock=lambda: 0.0)
    server = DataServer(store)
    try:
        port = await server.start("127.0.0.1", 0)
        yield server, port
    finally:
        await server.close()
        store.check_invariants()
        tier.close()


@contextlib.asynccontextmanager
async def connect(port: int) -> AsyncIterator[TcpConnection]:
    conn = await TcpConnection.open("127.0.0.1", port, timeout_s=TIMEOUT_S)
    try:
        yield conn
    finally:
        conn.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(conn.closed.wait(), 5)


async def put(conn: TcpConnection, key: str, write_id: int, data: bytes) -> Response:
    return await conn.request(
        Op.PUT,
        key.encode(),
        write_id=write_id,
        checksum=block_checksum(data),
        payload=data,
        timeout_s=TIMEOUT_S,
    )


async def publish(conn: TcpConnection, key: str, write_id: int, version: int) -> Response:
    return await conn.request(
        Op.PUBLISH, key.encode(), write_id=write_id, version=version, timeout_s=TIMEOUT_S
    )


async def get(conn: TcpConnection, key: str, write_id: int, size: int) -> tuple[Response, bytes]:
    sink = bytearray(size)
    response = await conn.request(
        Op.GET, key.encode(), write_id=write_id, sink=memoryview(sink), timeout_s=TIMEOUT_S
    )
    return response, bytes(sink)


async def raw_response(reader: asyncio.StreamReader) -> tuple[Header, bytes]:
    header = unpack_header(await reader.readexactly(HEADER_SIZE))
    await reader.readexactly(header.key_len)
    return header, await reader.readexactly(header.payload_len)


@pytest.mark.parametrize("size", [0, 1, 4096, MIB, 4 * MIB])
def test_put_publish_get_round_trip_byte_for_byte(size: int) -> None:
    data = random.Random(size).randbytes(size)

    async def scenario() -> None:
        async with node() as (server, port), connect(port) as conn:
            assert (await put(conn, "block", 11, data)).status == Status.OK
            assert (await publish(conn, "block", 11, 5)).status == Status.OK
            response, got = await get(conn, "block", 11, size)
            assert response.status == Status.OK
            assert response.header.checksum == block_checksum(data)
            assert response.header.version == 5
            assert response.header.write_id == 11
            assert got == data
            assert server.store.stats().hits == 1

    run(scenario())


def test_reads_miss_with_the_reason_and_never_return_other_bytes() -> None:
    async def scenario() -> None:
        async with node() as (_, port), connect(port) as conn:
            assert (await put(conn, "k", 1, b"one")).status == Status.OK
            staged, got = await get(conn, "k", 1, 3)  # by its exact write id: served
            assert (staged.status, got) == (Status.OK, b"one")
            assert (await publish(conn, "k", 1, 1)).status == Status.OK
            wrong, got = await get(conn, "k", 2, 3)
            assert (wrong.status, wrong.header.flags) == (Status.MISS, MissReason.WRONG_VERSION)
            assert got == b"\0\0\0"
            absent, _ = await get(conn, "nope", 1, 3)
            assert (absent.status, absent.header.flags) == (Status.MISS, MissReason.ABSENT)
            ok, got = await get(conn, "k", 1, 3)
            assert (ok.status, got) == (Status.OK, b"one")

    run(scenario())


def test_a_put_with_a_bad_checksum_is_refused_and_nothing_is_kept() -> None:
    async def scenario() -> None:
        async with node() as (server, port), connect(port) as conn:
            data = b"x" * 100_000
            response = await conn.request(
                Op.PUT,
                b"k",
                write_id=1,
                checksum=block_checksum(data) ^ 1,
                payload=data,
                timeout_s=TIMEOUT_S,
            )
            assert response.status == Status.CHECKSUM_MISMATCH
            assert "checksum" in response.message()
            assert (await publish(conn, "k", 1, 1)).header.flags == MissReason.ABSENT
            assert server.store.tier.used_bytes == 0

    run(scenario())


def test_publish_ordering_over_the_wire() -> None:
    async def scenario() -> None:
        async with node() as (_, port), connect(port) as conn:
            assert (await put(conn, "k", 1, b"old")).status == Status.OK
            assert (await put(conn, "k", 2, b"new")).status == Status.OK
            assert (await publish(conn, "k", 2, 20)).status == Status.OK
            late = await publish(conn, "k", 1, 10)
            assert (late.status, late.header.flags) == (Status.MISS, MissReason.WRONG_VERSION)
            assert (await publish(conn, "k", 2, 20)).status == Status.OK  # idempotent
            response, got = await get(conn, "k", 2, 3)
            assert (response.status, got) == (Status.OK, b"new")

    run(scenario())


def test_write_id_0_reads_the_keys_committed_block_never_a_staged_one() -> None:
    async def scenario() -> None:
        async with node() as (_, port), connect(port) as conn:
            assert (await put(conn, "k", 5, b"value")).status == Status.OK
            staged, _ = await get(conn, "k", 0, 5)
            assert staged.status == Status.MISS, "a staged block's commit is unproven"
            assert (await publish(conn, "k", 5, 9)).status == Status.OK
            response, got = await get(conn, "k", 0, 5)
            assert (response.status, got) == (Status.OK, b"value")
            h = response.header
            assert (h.write_id, h.version, h.checksum) == (5, 9, block_checksum(b"value"))
            absent, _ = await get(conn, "other", 0, 5)
            assert (absent.status, absent.header.flags) == (Status.MISS, MissReason.ABSENT)
            # PUBLISH still names one write: 0 is refused.
            assert (await publish(conn, "k", 0, 10)).status == Status.BAD_REQUEST

    run(scenario())


def test_delete_frees_and_then_misses() -> None:
    async def scenario() -> None:
        async with node() as (server, port), connect(port) as conn:
            assert (await put(conn, "k", 1, b"abc")).status == Status.OK
            assert (await publish(conn, "k", 1, 1)).status == Status.OK
            assert (await conn.request(Op.DELETE, b"k", timeout_s=TIMEOUT_S)).status == Status.OK
            again = await conn.request(Op.DELETE, b"k", write_id=1, timeout_s=TIMEOUT_S)
            assert again.status == Status.MISS
            assert server.store.tier.used_bytes == 0

    run(scenario())


def test_refused_puts_keep_the_connection_usable() -> None:
    async def scenario() -> None:
        async with node(capacity=4 * MIB, max_block=2 * MIB) as (server, port):
            async with connect(port) as conn:
                too_large = await put(conn, "big", 1, b"z" * (2 * MIB + 1))
                assert too_large.status == Status.TOO_LARGE
                assert "limit" in too_large.message()
                zero = await put(conn, "k", 0, b"abc")
                assert zero.status == Status.BAD_REQUEST
                # Fill the tier with staged blocks (never evicted), then one more.
                for i in range(4):
                    assert (await put(conn, f"s{i}", 1, b"s" * (MIB - 64))).status == Status.OK
                full = await put(conn, "more", 1, b"m" * MIB)
                assert full.status == Status.NO_SPACE
                ping = await conn.request(Op.PING, b"", timeout_s=TIMEOUT_S)
                assert ping.status == Status.OK
                for i in range(4):
                    assert (await publish(conn, f"s{i}", 1, 1)).status == Status.OK
                    response, got = await get(conn, f"s{i}", 1, MIB - 64)
                    assert (response.status, got) == (Status.OK, b"s" * (MIB - 64))
            assert server.store.stats().puts == 4

    run(scenario())


def test_unknown_op_is_a_bad_request_and_the_connection_survives() -> None:
    async def scenario() -> None:
        async with node() as (server, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(Header(op=99, request_id=3).pack())
                header, message = await raw_response(reader)
                assert (header.status, header.request_id) == (Status.BAD_REQUEST, 3)
                assert b"unknown op" in message
                writer.write(Header(op=Op.PING, request_id=4).pack())
                header, _ = await raw_response(reader)
                assert (header.status, header.request_id) == (Status.OK, 4)
            finally:
                writer.close()
            assert server.store.stats().bad_frames == 0

    run(scenario())


def test_garbage_gets_bad_request_and_the_server_keeps_serving() -> None:
    async def scenario() -> None:
        async with node() as (server, port):
            async with connect(port) as conn:
                assert (await put(conn, "kept", 1, b"kept")).status == Status.OK
                assert (await publish(conn, "kept", 1, 1)).status == Status.OK
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(b"GET / HTTP/1.1\r\nHost: node\r\n\r\n" + b"\0" * 64)
                header, message = await raw_response(reader)
                assert header.status == Status.BAD_REQUEST
                assert b"bad magic" in message
                assert await reader.read() == b""  # closed by the server
            finally:
                writer.close()
            assert server.store.stats().bad_frames == 1
            async with connect(port) as conn:
                response, got = await get(conn, "kept", 1, 4)
                assert (response.status, got) == (Status.OK, b"kept")

    run(scenario())


def test_another_protocol_version_is_refused_naming_both() -> None:
    async def scenario() -> None:
        async with node() as (server, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                theirs = PROTOCOL_VERSION + 41
                writer.write(Header(op=Op.PING, request_id=1, protocol_version=theirs).pack())
                header, message = await raw_response(reader)
                assert header.status == Status.VERSION_MISMATCH
                text = message.decode()
                assert f"protocol {PROTOCOL_VERSION}" in text
                assert str(theirs) in text
                assert await reader.read() == b""
            finally:
                writer.close()
            assert server.store.stats().bad_frames == 1
            async with connect(port) as conn:
                assert (await conn.request(Op.PING, b"", timeout_s=TIMEOUT_S)).status == Status.OK

    run(scenario())


def test_many_pipelined_requests_on_one_connection() -> None:
    rng = random.Random(7)
    blocks = {
        f"k{i}": rng.randbytes(rng.choice([0, 10, 4096, 70_000, 300_000])) for i in range(200)
    }

    async def scenario() -> None:
        async with node() as (_, port), connect(port) as conn:
            puts = await asyncio.gather(*(put(conn, k, 1, v) for k, v in blocks.items()))
            assert {r.status for r in puts} == {Status.OK}
            pubs = await asyncio.gather(*(publish(conn, k, 1, 1) for k in blocks))
            assert {r.status for r in pubs} == {Status.OK}
            gets = await asyncio.gather(*(get(conn, k, 1, len(v)) for k, v in blocks.items()))
            for (response, got), (key, data) in zip(gets, blocks.items(), strict=True):
                assert response.status == Status.OK, key
                assert got == data, key

    run(scenario())


def test_a_put_cut_off_mid_payload_frees_its_reservation() -> None:
    async def scenario() -> None:
        async with node() as (server, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            data = b"p" * MIB
            header = Header(
                op=Op.PUT,
                request_id=1,
                write_id=1,
                payload_len=len(data),
                checksum=block_checksum(data),
                key_len=1,
            )
            writer.write(header.pack() + b"k" + data[: MIB // 2])
            await writer.drain()
            for _ in range(100):
                if server.store.tier.used_bytes:
                    break
                await asyncio.sleep(0.01)
            assert server.store.tier.used_bytes >= MIB  # reserved before the payload came
            writer.transport.abort()
            for _ in range(100):
                if not server.store.tier.used_bytes:
                    break
                await asyncio.sleep(0.01)
            assert server.store.tier.used_bytes == 0
            assert server.store.stats().blocks == 0
            del reader

    run(scenario())


def test_a_block_being_sent_stays_intact_until_the_reader_lets_go() -> None:
    size = 12 * MIB  # far more than the socket buffers hold

    async def scenario() -> None:
        async with node() as (server, port):
            data = random.Random(1).randbytes(size)
            async with connect(port) as conn:
                assert (await put(conn, "big", 1, data)).status == Status.OK
                assert (await publish(conn, "big", 1, 1)).status == Status.OK
            # A slow reader: asks for the block and reads nothing yet.
            slow = socket.create_connection(("127.0.0.1", port))
            try:
                slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
                request = Header(op=Op.GET, request_id=1, write_id=1, key_len=3)
                slow.sendall(request.pack() + b"big")
                await asyncio.sleep(0.2)
                async with connect(port) as conn:
                    deleted = await conn.request(Op.DELETE, b"big", timeout_s=TIMEOUT_S)
                    assert deleted.status == Status.OK
                    # The deleted block's memory is still held for the slow reader: new blocks
                    # land elsewhere.
                    assert server.store.stats().leased_bytes_lingering == size
                    filler = b"f" * (4 * MIB)
                    for i in range(6):
                        assert (await put(conn, f"f{i}", 1, filler)).status == Status.OK
                received = bytearray()
                slow.settimeout(10)
                while len(received) < HEADER_SIZE + size:
                    chunk = await asyncio.to_thread(slow.recv, 1 << 20)
                    assert chunk
                    received += chunk
                header = unpack_header(received[:HEADER_SIZE])
                assert header.status == Status.OK
                assert bytes(received[HEADER_SIZE:]) == data
            finally:
                slow.close()
            for _ in range(100):
                if not server.store.stats().leased_bytes_lingering:
                    break
                await asyncio.sleep(0.01)
            assert server.store.stats().leased_bytes_lingering == 0

    run(scenario())
