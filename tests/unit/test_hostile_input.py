"""Hostile and broken input at a node's data port and a master's frame RPC port (issue 16):
memory bounded and returned at close without the garbage collector (finding 1), half-done
requests cut (finding 5), a refused PUT evicts nothing (5), versions from the index (4),
CopyBlocks checked before it allocates (2). Real loopback sockets, one process."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import weakref
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, TypeVar

import pytest

from kvpool import receipts
from kvpool.checksum import block_checksum
from kvpool.errors import (
    InternalError,
    MalformedRequestError,
    RequestTooLargeError,
    UnavailableError,
)
from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.v1 import common_pb2, master_pb2
from kvpool.proto.wire import (
    HEADER_SIZE,
    Header,
    MissReason,
    Op,
    Status,
    encode_key_table,
    unpack_header,
)
from kvpool.store_node import data_server
from kvpool.store_node.block_store import BlockState, BlockStore
from kvpool.store_node.cpu_tier import CpuTier
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.eviction import LruPolicy
from kvpool.store_node.publish_check import IndexVersions
from kvpool.store_node.replicate import IndexedBlock, check_refs
from kvpool.transports.limits import IngressLimits
from kvpool.transports.tcp import TcpConnection

MIB = 1 << 20
T = TypeVar("T")


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 60)

    return asyncio.run(bounded())


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The cyclic collector off: what is freed here is freed by reference counting alone."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextlib.asynccontextmanager
async def node(
    capacity: int = 64 * MIB,
    max_block: int = 16 * MIB,
    limits: IngressLimits | None = None,
    versions: Any = None,
) -> AsyncIterator[tuple[DataServer, int]]:
    tier = CpuTier(capacity)
    store = BlockStore(tier, LruPolicy(), max_block_size=max_block, clock=lambda: 0.0)
    server = DataServer(store, limits=limits)
    server.versions = versions
    try:
        port = await server.start("127.0.0.1", 0)
        yield server, port
    finally:
        await server.close()
        store.check_invariants()
        tier.close()


async def raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def answer(reader: asyncio.StreamReader) -> tuple[Header, bytes]:
    header = unpack_header(await reader.readexactly(HEADER_SIZE))
    await reader.readexactly(header.key_len)
    return header, await reader.readexactly(header.payload_len)


async def eventually(check: Any, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# --- finding 1: memory after close -------------------------------------------------------------


def test_closed_connections_are_freed_without_the_garbage_collector() -> None:
    async def scenario() -> None:
        async with node() as (server, port):
            refs: list[weakref.ref[Any]] = []
            with no_gc():
                for i in range(50):
                    _reader, writer = await raw(port)
                    if i % 2:  # an MGET table declared and never sent: memory is charged
                        writer.write(Header(op=Op.MGET, payload_len=4 << 20).pack())
                    else:  # half a header
                        writer.write(Header(op=Op.GET).pack()[:20])
                    await writer.drain()
                    await eventually(lambda: len(server.connections) == 1)
                    conn = next(iter(server.connections))
                    refs.append(weakref.ref(conn))
                    assert conn.stream is not None
                    refs.append(weakref.ref(conn.stream))
                    del conn
                    writer.close()
                    await eventually(lambda: not server.connections)
                for _ in range(5):
                    await asyncio.sleep(0)
                alive = [r for r in refs if r() is not None]
                assert not alive, f"{len(alive)} connection objects still alive after close"
            assert server.budget.used_bytes == 0
            assert server.budget.peak_bytes == 4 << 20

    run(scenario())


def test_an_idle_connection_costs_a_small_buffer() -> None:
    async def scenario() -> None:
        async with node() as (server, port):
            _, writer = await raw(port)
            await eventually(lambda: len(server.connections) == 1)
            conn = next(iter(server.connections))
            assert conn.stream is not None
            assert conn.stream.reader.scratch_bytes <= 4096
            writer.close()

    run(scenario())


def test_key_tables_beyond_the_request_budget_are_refused_not_allocated() -> None:
    limits = IngressLimits(request_memory_bytes=6 * MIB, frame_timeout_s=30.0)

    async def scenario() -> None:
        async with node(limits=limits) as (server, port):
            first_r, first_w = await raw(port)
            first_w.write(Header(op=Op.MGET, request_id=1, payload_len=4 << 20).pack())
            await eventually(lambda: server.budget.used_bytes == 4 << 20)
            second_r, second_w = await raw(port)
            table = encode_key_table([(b"k", 1, 0, 0)])
            big = table + b"\0" * ((3 << 20) - len(table))  # a 3 MiB table: over the budget
            second_w.write(Header(op=Op.MGET, request_id=2, payload_len=len(big)).pack() + big)
            header, body = await answer(second_r)
            assert header.status == Status.NO_SPACE
            assert b"memory left for requests" in body
            assert server.budget.used_bytes == 4 << 20  # the refused one was never charged
            first_w.close()
            await eventually(lambda: server.budget.used_bytes == 0)
            second_w.close()
            del first_r

    run(scenario())


# --- finding 5: reservations ------------------------------------------------------------------


async def hold_put(port: int, key: bytes, size: int) -> tuple[Any, Any]:
    """A PUT header declaring ``size`` bytes and none of them."""
    reader, writer = await raw(port)
    writer.write(Header(op=Op.PUT, write_id=7, payload_len=size, key_len=len(key)).pack() + key)
    await writer.drain()
    return reader, writer


def test_silent_puts_are_cut_and_a_refused_put_evicts_nothing() -> None:
    limits = IngressLimits(frame_timeout_s=1.0)

    async def scenario() -> None:
        async with node(capacity=256 * MIB, max_block=64 * MIB, limits=limits) as (server, port):
            store = server.store
            conn = await TcpConnection.open("127.0.0.1", port, timeout_s=5)
            for i in range(40):  # committed blocks that a careless PUT could evict
                data = bytes([i]) * MIB
                put = await conn.request(
                    Op.PUT, f"c{i}".encode(), write_id=1, checksum=block_checksum(data),
                    payload=data, timeout_s=5,
                )  # fmt: skip
                assert put.status == Status.OK
                assert store.publish(f"c{i}", 1, 1).status == Status.OK
            held = [await hold_put(port, f"big{i}".encode(), 64 * MIB) for i in range(3)]
            await asyncio.sleep(0.2)
            # put_memory_fraction (1/2): two 64 MiB reservations; the third was refused.
            assert store.receiving_bytes == 128 * MIB
            assert store.stats().evictions == 0
            data = b"x" * (60 * MIB)
            refused = await conn.request(
                Op.PUT, b"fourth", write_id=1, checksum=block_checksum(data), payload=data,
                timeout_s=10,
            )  # fmt: skip
            assert refused.status == Status.NO_SPACE
            assert store.stats().evictions == 0
            assert all(store.state_of(f"c{i}", 1) is BlockState.COMMITTED for i in range(40))
            # The silent ones are cut after frame_timeout_s: their memory comes back.
            loop = asyncio.get_running_loop()
            started = loop.time()
            await eventually(lambda: store.receiving_bytes == 0, timeout_s=5)
            assert loop.time() - started < 3.0
            assert server.stalled_cut >= 2
            for _, writer in held:
                writer.close()
            conn.close()

    run(scenario())


# --- finding 4: versions from the index ------------------------------------------------------


class FakeIndex:
    """The masters as a node's IndexVersions sees them: key -> (write id, version)."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[int, int]] = {}
        self.calls = 0
        self.down = False
        self.cut = False
        """No answer until the deadline (the node cut from the masters), then none."""

    async def call(
        self, method: str, request: Any, *, deadline: float, leader_only: bool = False
    ) -> Any:
        assert method == "Lookup"
        assert leader_only
        self.calls += 1
        if self.cut:
            await asyncio.sleep(max(0.0, deadline - asyncio.get_running_loop().time()))
        if self.down or self.cut:
            raise UnavailableError("no master")
        response = master_pb2.LookupResponse()
        for key in request.keys:
            if key in self.entries:
                write_id, version = self.entries[key]
                response.entries.append(
                    common_pb2.BlockEntry(key=key, found=True, write_id=write_id, version=version)
                )
            else:
                response.entries.append(common_pb2.BlockEntry(key=key, found=False))
        return response


def test_a_publish_with_a_forged_version_poisons_nothing() -> None:
    index = FakeIndex()

    async def scenario() -> None:
        versions = IndexVersions(index, timeout_s=2.0)
        async with node(versions=versions) as (server, port):
            conn = await TcpConnection.open("127.0.0.1", port, timeout_s=5)

            async def put(write_id: int, data: bytes) -> None:
                r = await conn.request(
                    Op.PUT, b"k", write_id=write_id, checksum=block_checksum(data),
                    payload=data, timeout_s=5,
                )  # fmt: skip
                assert r.status == Status.OK

            # The attacker stages its own write and publishes it with version 2^64-1.
            await put(666, b"evil")
            forged = await conn.request(
                Op.PUBLISH, b"k", write_id=666, version=2**64 - 1, timeout_s=5
            )
            assert (forged.status, forged.header.flags) == (Status.MISS, MissReason.WRONG_VERSION)
            assert server.store.state_of("k", 666) is BlockState.STAGED  # nothing changed
            # An honest write the index committed at version 12 (the frame's version ignored).
            await put(1, b"good")
            index.entries["k"] = (1, 12)
            ok = await conn.request(Op.PUBLISH, b"k", write_id=1, version=3, timeout_s=5)
            assert ok.status == Status.OK
            assert ok.header.version == 12
            block = server.store.block("k", 1)
            assert block is not None
            assert block.state is BlockState.COMMITTED
            assert block.version == 12
            sink = bytearray(4)
            got = await conn.request(Op.GET, b"k", write_id=1, sink=memoryview(sink), timeout_s=5)
            assert (got.status, bytes(sink)) == (Status.OK, b"good")
            # A write the index has already replaced (it names write 1 at 12 >= the 5 claimed):
            # dropped at once, so a reader holding a stale entry misses instead of reading it.
            await put(3, b"gone")
            stale = await conn.request(Op.PUBLISH, b"k", write_id=3, version=5, timeout_s=5)
            assert (stale.status, stale.header.flags) == (Status.MISS, MissReason.WRONG_VERSION)
            assert server.store.state_of("k", 3) is None
            # A later write while the masters are unreachable: left staged (readable by its
            # write id), and the older one leaves at once: a stale reader misses, never reads
            # the replaced value after the put was acknowledged.
            await put(2, b"next")
            index.down = True
            unknown = await conn.request(Op.PUBLISH, b"k", write_id=2, version=13, timeout_s=5)
            assert (unknown.status, unknown.header.flags) == (Status.MISS, MissReason.STAGED)
            assert server.store.state_of("k", 2) is BlockState.STAGED
            assert server.store.state_of("k", 1) is None
            block = server.store.block("k", 2)
            assert block is not None
            assert block.version == 0  # no version from a frame
            conn.close()
        await versions.close()

    run(scenario())


def test_a_publish_with_the_leaders_receipt_is_settled_without_asking_and_no_other_is() -> None:
    """A PUBLISH carrying the commit's receipt (kvpool.receipts) is published with its version
    and asks the index nothing; a receipt that does not check for the frame's (key, write id,
    version) — forged, or for another version — is no proof: the index is asked as before."""
    index = FakeIndex()
    key = receipts.derive_key("the-group's-raft-secret")

    async def scenario() -> None:
        versions = IndexVersions(index, timeout_s=2.0)
        versions.learn_key(key)
        async with node(versions=versions) as (server, port):
            conn = await TcpConnection.open("127.0.0.1", port, timeout_s=5)

            async def put(name: bytes, write_id: int, data: bytes) -> None:
                r = await conn.request(
                    Op.PUT, name, write_id=write_id, checksum=block_checksum(data),
                    payload=data, timeout_s=5,
                )  # fmt: skip
                assert r.status == Status.OK

            async def publish(name: bytes, write_id: int, version: int, receipt: int) -> Any:
                return await conn.request(
                    Op.PUBLISH, name, write_id=write_id, version=version, checksum=receipt,
                    timeout_s=5,
                )  # fmt: skip

            await put(b"k", 1, b"good")
            ok = await publish(b"k", 1, 12, receipts.sign(key, b"k", 1, 12))
            assert (ok.status, ok.header.version) == (Status.OK, 12)
            block = server.store.block("k", 1)
            assert block is not None
            assert block.state is BlockState.COMMITTED
            assert block.version == 12
            assert index.calls == 0
            assert server.store.counters.receipt_publishes == 1
            # A forged tag on a forged version: asked, refused (the index names write 1).
            index.entries["k"] = (1, 12)
            await put(b"k", 666, b"evil")
            forged = await publish(b"k", 666, 2**64 - 1, 0x1234_5678_9ABC_DEF0)
            assert (forged.status, forged.header.flags) == (Status.MISS, MissReason.WRONG_VERSION)
            assert index.calls == 1
            # A genuine receipt for version 13 on a frame claiming 50: no proof of 50, asked.
            await put(b"j", 4, b"four")
            index.entries["j"] = (4, 13)
            claimed = await publish(b"j", 4, 50, receipts.sign(key, b"j", 4, 13))
            assert (claimed.status, claimed.header.version) == (Status.OK, 13)
            assert index.calls == 2
            # Another staged write of the key claims a newer version: the receipt does not say
            # which is current, the index does (it names write 9 at 21: write 8 is dropped).
            await put(b"m", 8, b"older")
            await put(b"m", 9, b"newer")
            index.down = True  # write 9's check fails: it stays staged with its claim
            newer = await publish(b"m", 9, 21, 0)
            assert (newer.status, newer.header.flags) == (Status.MISS, MissReason.STAGED)
            index.down = False
            index.entries["m"] = (9, 21)
            older = await publish(b"m", 8, 20, receipts.sign(key, b"m", 8, 20))
            assert (older.status, older.header.flags) == (Status.MISS, MissReason.WRONG_VERSION)
            assert server.store.state_of("m", 8) is None
            assert server.store.counters.receipt_publishes == 1
            conn.close()
        await versions.close()

    run(scenario())


def test_a_publish_checked_while_no_master_answers_is_settled_once_one_does() -> None:
    """Every master restarting right after a put: the PUBLISH's index check fails, the block
    stays staged (answered MISS STAGED at once) and is asked about again in the background, so
    that it is readable as soon as the masters are back, not only when the staged reaper's ttl
    has passed."""
    index = FakeIndex()

    async def scenario() -> None:
        versions = IndexVersions(index, timeout_s=0.5)
        async with node(versions=versions) as (server, port):
            conn = await TcpConnection.open("127.0.0.1", port, timeout_s=5)
            data = b"precious"
            r = await conn.request(
                Op.PUT, b"k", write_id=7, checksum=block_checksum(data), payload=data,
                timeout_s=5,
            )  # fmt: skip
            assert r.status == Status.OK
            other = b"other"
            r = await conn.request(
                Op.PUT, b"j", write_id=8, checksum=block_checksum(other), payload=other,
                timeout_s=5,
            )  # fmt: skip
            assert r.status == Status.OK
            index.down = True
            for _ in range(2):  # a repeated PUBLISH waits once
                published = await conn.request(Op.PUBLISH, b"k", write_id=7, version=3, timeout_s=5)
                assert (published.status, published.header.flags) == (
                    Status.MISS,
                    MissReason.STAGED,
                )
            assert server.store.state_of("k", 7) is BlockState.STAGED
            assert server.settling == {("k", 7)}
            # Bounded: beyond MAX_SETTLING writes waiting, the staged reaper is left to it.
            saved, data_server.MAX_SETTLING = data_server.MAX_SETTLING, 1
            try:
                refused = await conn.request(Op.PUBLISH, b"j", write_id=8, version=4, timeout_s=5)
                assert refused.status == Status.MISS
                assert server.settling == {("k", 7)}
            finally:
                data_server.MAX_SETTLING = saved
            index.entries["k"] = (7, 3)
            index.down = False
            deadline = asyncio.get_running_loop().time() + 5
            while server.store.state_of("k", 7) is not BlockState.COMMITTED:
                assert asyncio.get_running_loop().time() < deadline, "never settled"
                await asyncio.sleep(0.05)
            conn.close()
        await versions.close()

    run(scenario())


def test_a_publish_check_that_fails_unexpectedly_answers_its_waiters_and_checks_on() -> None:
    """Any failure of the index check (not only a KVPoolError) is the waiting PUBLISHes'
    answer: none is left waiting for good, and the next check runs as usual."""
    index = FakeIndex()
    real = index.call

    async def broken(
        method: str, request: Any, *, deadline: float, leader_only: bool = False
    ) -> Any:
        raise ValueError("a malformed answer")

    async def scenario() -> None:
        versions = IndexVersions(index, timeout_s=2.0)
        try:
            index.call = broken  # type: ignore[method-assign]
            with pytest.raises(InternalError, match="malformed"):
                await asyncio.wait_for(versions.version_of("k", 1), 5)
            index.call = real  # type: ignore[method-assign]
            index.entries["k"] = (1, 3)
            verdict = await asyncio.wait_for(versions.version_of("k", 1), 5)
            assert verdict.version == 3
        finally:
            await versions.close()

    run(scenario())


def test_a_failed_sweep_for_stalled_peers_does_not_end_the_sweeps() -> None:
    """The node's guard that cuts stalled peers (and ends their leases) logs a sweep that
    fails and sweeps again: were it to end, a stalled peer would keep its memory for good."""

    async def scenario() -> None:
        tier = CpuTier(8 * MIB)
        store = BlockStore(tier, LruPolicy(), max_block_size=MIB, clock=lambda: 0.0)
        server = DataServer(store, lease_timeout_s=0.2)
        sweeps: list[float] = []
        real = server.cut_stalled

        def cut_stalled() -> int:
            sweeps.append(asyncio.get_running_loop().time())
            if len(sweeps) == 1:
                raise RuntimeError("a sweep that fails")
            return real()

        server.cut_stalled = cut_stalled  # type: ignore[method-assign]
        try:
            await server.start("127.0.0.1", 0)
            await eventually(lambda: len(sweeps) >= 3)
        finally:
            await server.close()
            tier.close()

    run(scenario())


def test_a_failed_check_does_not_end_the_masters_monitor() -> None:
    """The master's monitor (role changes, readiness, the Raft thread's liveness) logs a check
    that fails and checks again: were it to end, a dead Raft thread would go unnoticed."""
    from kvpool.raft_master import server
    from kvpool.raft_master.replication import StuckFollowerWatch

    class Replicator:
        asked = 0
        alive = True

        def tick_alive(self) -> bool:
            return self.alive

        def is_leader(self) -> bool:
            self.asked += 1
            if self.asked == 1:
                raise RuntimeError("a check that fails")
            return True

        def term(self) -> int:
            return 3

        def is_ready(self) -> bool:
            return True

        def status(self) -> Any:
            return type("Status", (), {"role": "follower"})()

    events: list[str] = []

    class Log:
        def __getattr__(self, level: str) -> Any:
            return lambda event, **fields: events.append(event)

    async def scenario() -> None:
        master = server.MasterProcess.__new__(server.MasterProcess)
        replicator = Replicator()
        stops: list[int] = []
        master.replicator = replicator  # type: ignore[assignment]
        master.log = Log()
        master._handle = None
        master.stuck_watch = StuckFollowerWatch(5.0)
        master.request_stop = stops.append  # type: ignore[method-assign,assignment]
        task = asyncio.get_running_loop().create_task(master._monitor())
        await eventually(lambda: "became_leader" in events)
        assert events[0] == "monitor_check_failed"
        replicator.alive = False  # the Raft thread died: still seen, after the failed check
        await asyncio.wait_for(task, 5)
        assert events[-1] == "raft_thread_died"
        assert stops == [server.EXIT_RAFT_DIED]

    run(scenario())


def test_a_publish_of_a_write_deleted_first_still_retires_the_older_write() -> None:
    """An overwrite raced by a remove: the remove's DELETE of the new write reaches the node
    before the new write's PUBLISH. The PUBLISH finds nothing to publish, but the older write
    (which the index replaced before the remove) must leave all the same: a reader's cached
    entry naming it would otherwise read the replaced value after both calls returned."""
    index = FakeIndex()

    async def scenario() -> None:
        versions = IndexVersions(index, timeout_s=2.0)
        async with node(versions=versions) as (server, port):
            conn = await TcpConnection.open("127.0.0.1", port, timeout_s=5)
            for write_id, data in ((1, b"old"), (2, b"new")):
                r = await conn.request(
                    Op.PUT, b"k", write_id=write_id, checksum=block_checksum(data),
                    payload=data, timeout_s=5,
                )  # fmt: skip
                assert r.status == Status.OK
            index.entries["k"] = (1, 10)
            first = await conn.request(Op.PUBLISH, b"k", write_id=1, version=10, timeout_s=5)
            assert first.status == Status.OK
            # write 2 replaced write 1 at version 11, then a remove deleted write 2 here
            del index.entries["k"]
            gone = await conn.request(Op.DELETE, b"k", write_id=2, timeout_s=5)
            assert gone.status == Status.OK
            late = await conn.request(Op.PUBLISH, b"k", write_id=2, version=11, timeout_s=5)
            assert (late.status, late.header.flags) == (Status.MISS, MissReason.ABSENT)
            assert server.store.state_of("k", 1) is None  # the replaced value is not served
            sink = bytearray(3)
            got = await conn.request(Op.GET, b"k", write_id=1, sink=memoryview(sink), timeout_s=5)
            assert got.status == Status.MISS
            # A late PUBLISH claiming an older version than what is held retires nothing.
            r = await conn.request(
                Op.PUT, b"k", write_id=3, checksum=block_checksum(b"v3"), payload=b"v3",
                timeout_s=5,
            )  # fmt: skip
            assert r.status == Status.OK
            index.entries["k"] = (3, 20)
            ok = await conn.request(Op.PUBLISH, b"k", write_id=3, version=20, timeout_s=5)
            assert ok.status == Status.OK
            stale = await conn.request(Op.PUBLISH, b"k", write_id=9, version=15, timeout_s=5)
            assert stale.status == Status.MISS
            assert server.store.state_of("k", 3) is BlockState.COMMITTED
            conn.close()
        await versions.close()

    run(scenario())


# --- finding 2: CopyBlocks -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "error"),
    [
        (IndexedBlock("", 1, 1, 10, 0), MalformedRequestError),
        (IndexedBlock("k" * 1025, 1, 1, 10, 0), MalformedRequestError),
        (IndexedBlock("k", 0, 1, 10, 0), MalformedRequestError),
        (IndexedBlock("k", 1, 1, 2**40, 0), MalformedRequestError),
        (IndexedBlock("k", 1, 1, 2**64 - 1, 0), MalformedRequestError),
    ],
)
def test_copy_refs_are_checked_before_anything_is_allocated(
    ref: IndexedBlock, error: type[Exception]
) -> None:
    with pytest.raises(error):
        check_refs("tcp://127.0.0.1:1", [ref], max_block_size=64 * MIB)


def test_copy_requests_name_a_tcp_target_and_a_bounded_number_of_blocks() -> None:
    with pytest.raises(MalformedRequestError):
        check_refs("not-an-address", [], max_block_size=MIB)
    with pytest.raises(RequestTooLargeError):
        check_refs("tcp://h:1", [IndexedBlock("k", 1, 1, 1, 0)] * 5000, max_block_size=MIB)
    check_refs("tcp://h:1", [IndexedBlock("k", 1, 1, MIB, 0)], max_block_size=MIB)


# --- the RPC port ----------------------------------------------------------------------------


def test_a_socket_that_declares_a_huge_payload_gets_no_memory() -> None:
    """The master's frame RPC port: a 64 MiB declared request is refused before allocating."""
    from kvpool.raft_master.rpc_port import RpcPort

    class NoService:
        pass

    async def scenario() -> None:
        port = RpcPort(NoService(), limits=IngressLimits(frame_timeout_s=0.5))  # type: ignore[arg-type]
        bound = port.start("127.0.0.1", 0)
        try:
            reader, writer = await raw(bound)
            writer.write(
                Header(op=Op.RPC, request_id=1, payload_len=64 << 20, key_len=6).pack() + b"Lookup"
            )
            header, body = await answer(reader)
            assert header.status == Status.RPC_ERROR
            assert b"REQUEST_TOO_LARGE" in body
            assert await reader.read() == b""  # closed
            assert port.budget.peak_bytes == 0
            # Half a request within the limit: charged, then cut after frame_timeout_s.
            reader, writer = await raw(bound)
            writer.write(
                Header(op=Op.RPC, request_id=2, payload_len=1 << 20, key_len=6).pack() + b"Lookup"
            )
            await eventually(lambda: port.budget.used_bytes == 1 << 20)
            assert await asyncio.wait_for(reader.read(), 5) == b""
            assert port.budget.used_bytes == 0
            assert port.cut == 1
        finally:
            port.close()

    run(scenario())


def test_the_rpc_port_refuses_another_protocol_version_and_counts_it() -> None:
    """A caller speaking another protocol version is told so, cut, and counted as a bad request
    (as the read port counts it)."""
    from kvpool.raft_master.rpc_port import RpcPort

    async def scenario() -> None:
        port = RpcPort(object())  # type: ignore[arg-type]
        bound = port.start("127.0.0.1", 0)
        try:
            reader, writer = await raw(bound)
            writer.write(Header(op=Op.PING, protocol_version=PROTOCOL_VERSION + 1).pack())
            header, _ = await answer(reader)
            assert header.status == Status.VERSION_MISMATCH
            assert await reader.read() == b""
            assert port.bad_requests == 1
        finally:
            port.close()

    run(scenario())


def test_a_failed_sweep_for_slow_callers_does_not_end_the_rpc_ports_sweeps() -> None:
    """The master's RPC port cuts callers that stall mid-frame; a sweep that fails is logged
    and the next one comes, so a later stalled caller is still cut."""
    from kvpool.raft_master.rpc_port import RpcPort

    async def scenario() -> None:
        port = RpcPort(object(), limits=IngressLimits(frame_timeout_s=0.4))  # type: ignore[arg-type]
        sweeps: list[float] = []
        real = port.cut_slow

        def cut_slow(now: float) -> int:
            sweeps.append(now)
            if len(sweeps) == 1:
                raise RuntimeError("a sweep that fails")
            return real(now)

        port.cut_slow = cut_slow  # type: ignore[method-assign]
        bound = port.start("127.0.0.1", 0)
        try:
            reader, writer = await raw(bound)
            writer.write(Header(op=Op.RPC, request_id=2, payload_len=4096, key_len=6).pack())
            assert await asyncio.wait_for(reader.read(), 5) == b""  # cut by a later sweep
            assert port.cut == 1
            assert len(sweeps) >= 2
        finally:
            port.close()

    run(scenario())


def test_a_grpc_server_holds_at_most_max_connections() -> None:
    """Masters' and nodes' gRPC ports: one connection beyond ``max_connections`` is closed at
    once (silent connections would otherwise each cost the server memory, without bound); once
    they close, a client is served again."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvpool.grpcutil import start_server

    async def scenario() -> None:
        handle = await start_server("127.0.0.1:0", [], max_connections=4)
        try:

            def flood() -> list[socket.socket]:
                return [socket.create_connection(("127.0.0.1", handle.port)) for _ in range(10)]

            socks = await asyncio.to_thread(flood)

            def closed() -> int:
                count = 0
                for s in socks:
                    s.setblocking(False)
                    try:
                        count += s.recv(64) == b""
                    except BlockingIOError:
                        pass
                    except OSError:
                        count += 1
                return count

            await eventually(lambda: closed() >= 6)
            for s in socks:
                s.close()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                # The server may see the closes after the channel's first connection (then shut
                # at once, as over the limit): the channel tries again, and the call waits.
                request = health_pb2.HealthCheckRequest()
                reply = await health.Check(request, timeout=10, wait_for_ready=True)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await handle.stop(0)

    run(scenario())


def test_many_silent_connections_beyond_the_limit_are_closed_at_once() -> None:
    async def scenario() -> None:
        async with node(limits=IngressLimits(max_connections=8)) as (server, port):
            socks = []
            for _ in range(20):
                s = socket.create_connection(("127.0.0.1", port))
                s.setblocking(False)
                socks.append(s)
            await eventually(lambda: server.gate.over_limit == 12)
            assert len(server.connections) == 8
            for s in socks:
                s.close()

    run(scenario())


def test_same_process_tells_an_exited_process_from_a_running_one() -> None:
    import subprocess
    import sys

    from kvpool.launcher.procfs import process_start_ticks, same_process

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ticks = process_start_ticks(child.pid)
        assert same_process(child.pid, ticks)
        assert not same_process(child.pid, (ticks or 0) + 1)  # a reused pid: another process
        child.kill()
        deadline = 50
        while same_process(child.pid, ticks) and deadline:
            deadline -= 1
            import time

            time.sleep(0.05)
        assert not same_process(child.pid, ticks)  # a zombie counts as exited
    finally:
        child.kill()
        child.wait()
