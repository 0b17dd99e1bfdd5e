"""The master's read port (raft_master/read_port.py) on a fake replicator: index reads answered
by a thread per connection, as the RPC port answers them; everything else refused; the RPC
port's limits (request size, request memory, half-sent frames, the cluster token)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.v1 import master_pb2
from kvpool.proto.wire import HEADER_SIZE, Header, Op, Status, unpack_header
from kvpool.raft_master.read_port import ReadPort
from kvpool.transports.auth import auth_frame
from kvpool.transports.limits import IngressLimits
from tests.unit.test_service_lookup import _stored, service

T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(bounded())


def frame(method: str, request: Any, request_id: int = 1, version: int = 2_000_000) -> bytes:
    payload: bytes = request.SerializeToString()
    name = method.encode()
    return (
        Header(
            op=Op.RPC,
            request_id=request_id,
            version=version,
            payload_len=len(payload),
            key_len=len(name),
        ).pack()
        + name
        + payload
    )


async def answer(reader: asyncio.StreamReader) -> tuple[Header, bytes]:
    header = unpack_header(await reader.readexactly(HEADER_SIZE))
    await reader.readexactly(header.key_len)
    return header, await reader.readexactly(header.payload_len)


@contextlib.asynccontextmanager
async def serving(port: ReadPort) -> AsyncIterator[tuple[ReadPort, int]]:
    """``port`` listening on 127.0.0.1 (the port and its number); closed after."""
    bound = port.start("127.0.0.1", 0)
    try:
        yield port, bound
    finally:
        port.close()


async def eventually(check: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_reads_are_answered_as_the_rpc_port_answers_them_and_writes_are_refused() -> None:
    svc, hooks = service()
    _stored(svc, ["a", "c"])

    async def scenario() -> None:
        async with serving(ReadPort(svc)) as (_, bound):
            reader, writer = await asyncio.open_connection("127.0.0.1", bound)
            # several requests in one write: each answered, in order, on the same connection
            prefix = master_pb2.PrefixMatchRequest(keys=["a", "b", "c"], each=True)
            lookup = master_pb2.LookupRequest(keys=["a", "b"])
            writer.write(frame("PrefixMatch", prefix, 1) + frame("Lookup", lookup, 2))
            header, body = await answer(reader)
            assert (header.status, header.request_id) == (Status.OK, 1)
            assert master_pb2.PrefixMatchResponse.FromString(body) == await svc.PrefixMatch(
                prefix, None
            )
            header, body = await answer(reader)
            assert (header.status, header.request_id) == (Status.OK, 2)
            got = master_pb2.LookupResponse.FromString(body)
            assert [(e.key, e.found) for e in got.entries] == [("a", True), ("b", False)]
            await eventually(lambda: hooks.chains == [["a", "b"]])  # noted on the event loop
            # a write is not served here: refused, and the connection goes on
            commit = master_pb2.CommitPutsRequest(request_id=b"r" * 16)
            writer.write(frame("CommitPuts", commit, 3))
            header, body = await answer(reader)
            assert (header.status, header.request_id) == (Status.BAD_REQUEST, 3)
            assert b"not served on this port" in body
            # an invalid read: the typed error, as over the RPC port
            writer.write(frame("Lookup", master_pb2.LookupRequest(keys=["a", ""]), 4))
            header, body = await answer(reader)
            assert header.status == Status.RPC_ERROR
            assert json.loads(body)["code"] == "INVALID_KEY"
            writer.write(Header(op=Op.PING, request_id=5).pack())
            header, _ = await answer(reader)
            assert (header.op, header.status, header.request_id) == (Op.PING, Status.OK, 5)
            writer.close()

    run(scenario())


def test_a_read_that_has_to_wait_is_answered_by_the_event_loop() -> None:
    svc, _ = service()
    index = _stored(svc, ["a"])

    async def scenario() -> None:
        async with serving(ReadPort(svc)) as (port, bound):
            reader, writer = await asyncio.open_connection("127.0.0.1", bound)
            ahead = master_pb2.LookupRequest(keys=["a"], min_revision=index.revision + 1)
            began = time.monotonic()
            writer.write(frame("Lookup", ahead))
            header, body = await answer(reader)
            assert header.status == Status.RPC_ERROR
            assert json.loads(body)["code"] == "NOT_CAUGHT_UP"
            assert time.monotonic() - began >= 0.9  # it waited for the revision, then said so
            # A caller giving more time than a thread can wait for (the fuzz suite's find):
            # taken as MAX_BUDGET_S, the same answer, no internal error.
            writer.write(frame("Lookup", ahead, request_id=2, version=2**64 - 1))
            header, body = await answer(reader)
            assert (header.status, header.request_id) == (Status.RPC_ERROR, 2)
            assert json.loads(body)["code"] == "NOT_CAUGHT_UP"
            follower, _ = service(leading=False)
            port.service = follower
            writer.write(frame("PrefixMatch", master_pb2.PrefixMatchRequest(keys=["a"])))
            header, body = await answer(reader)
            assert json.loads(body)["code"] == "NOT_LEADER"
            writer.close()

    run(scenario())


def test_the_rpc_ports_limits_hold_here() -> None:
    svc, _ = service()
    limits = IngressLimits(frame_timeout_s=0.5, max_request_bytes=1 << 20)

    async def scenario() -> None:
        async with serving(ReadPort(svc, limits=limits)) as (port, bound):
            # above max_request_size: refused before anything is allocated, then closed
            reader, writer = await asyncio.open_connection("127.0.0.1", bound)
            writer.write(
                Header(op=Op.RPC, request_id=1, payload_len=64 << 20, key_len=6).pack() + b"Lookup"
            )
            header, body = await answer(reader)
            assert header.status == Status.RPC_ERROR
            assert b"REQUEST_TOO_LARGE" in body
            assert await reader.read() == b""
            assert port.budget.peak_bytes == 0
            # half a request within the limit: charged, then cut after frame_timeout_s
            reader, writer = await asyncio.open_connection("127.0.0.1", bound)
            writer.write(
                Header(op=Op.RPC, request_id=2, payload_len=512 << 10, key_len=6).pack() + b"Lookup"
            )
            await eventually(lambda: port.budget.used_bytes == 512 << 10)
            assert await asyncio.wait_for(reader.read(), 5) == b""
            await eventually(lambda: port.budget.used_bytes == 0)
            assert port.cut == 1
            # not a frame: told so, then closed
            reader, writer = await asyncio.open_connection("127.0.0.1", bound)
            writer.write(b"GET / HTTP/1.1\r\n\r\n" + bytes(64))
            header, body = await answer(reader)
            assert header.status == Status.BAD_REQUEST
            assert await reader.read() == b""
            # another protocol version: VERSION_MISMATCH, then closed
            reader, writer = await asyncio.open_connection("127.0.0.1", bound)
            other = Header(op=Op.PING, protocol_version=PROTOCOL_VERSION + 1).pack()
            writer.write(other)
            header, _ = await answer(reader)
            assert header.status == Status.VERSION_MISMATCH
            assert await reader.read() == b""
            # an idle connection is not cut: it is answered after the frame timeout
            reader, writer = await asyncio.open_connection("127.0.0.1", bound)
            await asyncio.sleep(1.2)
            writer.write(Header(op=Op.PING, request_id=7).pack())
            header, _ = await answer(reader)
            assert header.request_id == 7
            assert port.cut == 1
            assert port.bad_requests == 3
            writer.close()

    run(scenario())


def test_a_frame_trickled_in_is_cut_at_its_frame_timeout() -> None:
    svc, _ = service()

    async def scenario() -> None:
        limits = IngressLimits(frame_timeout_s=0.5)
        async with serving(ReadPort(svc, limits=limits)) as (port, bound):
            reader, writer = await asyncio.open_connection("127.0.0.1", bound)
            request = frame("PrefixMatch", master_pb2.PrefixMatchRequest(keys=["a"] * 50))
            began = time.monotonic()
            for i in range(len(request)):  # a byte every 50 ms: each recv well within 0.5 s
                if reader.at_eof():
                    break
                writer.write(request[i : i + 1])
                await asyncio.sleep(0.05)
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert time.monotonic() - began < 2.0
            assert port.cut == 1

    run(scenario())


def test_the_cluster_token_is_asked_first_and_closing_the_port_ends_every_connection() -> None:
    svc, _ = service()

    async def scenario() -> None:
        async with serving(ReadPort(svc, token=b"secret-token")) as (port, bound):
            reader, writer = await asyncio.open_connection("127.0.0.1", bound)
            writer.write(frame("PrefixMatch", master_pb2.PrefixMatchRequest(keys=["a"])))
            header, _ = await answer(reader)
            assert header.status == Status.UNAUTHORIZED
            reader, writer = await asyncio.open_connection("127.0.0.1", bound)
            writer.write(auth_frame(b"secret-token"))
            header, _ = await answer(reader)
            assert header.status == Status.OK
            writer.write(frame("PrefixMatch", master_pb2.PrefixMatchRequest(keys=["a"])))
            header, body = await answer(reader)
            assert header.status == Status.OK
            assert master_pb2.PrefixMatchResponse.FromString(body).matched == 0
            await eventually(lambda: len(port.connections) == 1)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # its thread ended it
        await eventually(lambda: not port.connections)

    run(scenario())


def test_connections_beyond_read_threads_are_closed_at_once_and_idle_ones_cost_little() -> None:
    """Each connection is a thread: at most ``read_threads`` at once, one more closed at once
    (its client reads over the RPC port). An idle connection holds a 4 KiB buffer, grown to
    64 KiB only for a request that needs it."""
    from kvpool.raft_master import read_port

    svc, _ = service()
    _stored(svc, [f"key-{i:04d}" for i in range(3)])

    async def scenario() -> None:
        async with serving(ReadPort(svc, max_connections=3)) as (port, bound):
            held = [await asyncio.open_connection("127.0.0.1", bound) for _ in range(3)]
            await eventually(lambda: len(port.connections) == 3)
            assert all(len(c._buf) == read_port.IDLE_BUFFER_BYTES for c in port.connections)
            reader, _ = await asyncio.open_connection("127.0.0.1", bound)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # the fourth: closed
            assert port.gate.over_limit == 1
            # a request larger than the idle buffer is read whole and answered
            big = master_pb2.LookupRequest(keys=[f"key-{i:04d}" for i in range(1200)])
            assert 4 << 10 < big.ByteSize() < 64 << 10
            reader, writer = held[0]
            writer.write(frame("Lookup", big))
            header, body = await answer(reader)
            assert header.status == Status.OK
            found = [e.key for e in master_pb2.LookupResponse.FromString(body).entries if e.found]
            assert found == ["key-0000", "key-0001", "key-0002"]
            assert port.budget.peak_bytes == 0  # the own buffer, not request memory
            # one closed: a new one is served
            held[1][1].close()
            await eventually(lambda: len(port.connections) == 2)
            reader, writer = await asyncio.open_connection("127.0.0.1", bound)
            writer.write(Header(op=Op.PING, request_id=9).pack())
            header, _ = await answer(reader)
            assert header.request_id == 9
            writer.close()
            for _, w in held:
                w.close()

    run(scenario())


def test_a_client_turned_away_by_a_full_read_port_reads_over_the_rpc_port() -> None:
    from kvpool.mastercall import MasterRouting, SyncMasterClient
    from kvpool.raft_master.rpc_port import RpcPort

    svc, _ = service()
    _stored(svc, ["a"])

    async def scenario() -> None:
        rpc_port = RpcPort(svc)
        rpc_bound = rpc_port.start("127.0.0.1", 0)
        try:
            async with serving(ReadPort(svc, max_connections=1)) as (port, bound):
                _, holder = await asyncio.open_connection("127.0.0.1", bound)  # its one thread
                await eventually(lambda: len(port.connections) == 1)
                routing = MasterRouting(["127.0.0.1:1"])  # a gRPC address never dialled
                routing.learn_rpc("127.0.0.1:1", f"127.0.0.1:{rpc_bound}", f"127.0.0.1:{bound}")
                client = SyncMasterClient(routing)

                def lookup() -> Any:
                    request = master_pb2.LookupRequest(keys=["a"])
                    return client.call("Lookup", request, deadline=time.monotonic() + 5)

                try:
                    got = await asyncio.to_thread(lookup)
                    assert [e.found for e in got.entries] == [True]
                    assert port.gate.over_limit == 1
                    assert routing.read_of("127.0.0.1:1") == ""  # it reads over the RPC port now
                    got = await asyncio.to_thread(lookup)
                    assert [e.found for e in got.entries] == [True]
                    assert port.gate.over_limit == 1
                finally:
                    client.close()
                    holder.close()
        finally:
            rpc_port.close()

    run(scenario())
