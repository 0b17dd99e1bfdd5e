"""The data-plane transports against a real data server in this process: tcp, inproc and shm
(blocking and event-loop connections), MGET tables, shared-memory leases and reservations."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import mmap
import random
import signal
import socket
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest

from kvpool.checksum import block_checksum
from kvpool.errors import DeadlineExceededError, TransportError
from kvpool.proto.wire import (
    COUNT,
    HEADER_SIZE,
    KEY_RECORD,
    MGET_RECORD,
    RESERVE_RECORD,
    SHM_RECORD,
    FrameError,
    Header,
    KeyRecord,
    MissReason,
    Op,
    Status,
    TierLevel,
    decode_ids,
    decode_key_table,
    encode_ids,
    encode_key_table,
    unpack_header,
)
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.cpu_tier import CpuTier
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.eviction import LruPolicy
from kvpool.transports import host_id, open_blocking, open_connection, scheme_of, schemes
from kvpool.transports.blocking import OWN_HIT_BYTES, BlockingConnection
from kvpool.transports.calls import Call
from kvpool.transports.frames import DIRECT_THRESHOLD, PEEK_BYTES, FrameReader
from kvpool.transports.shm import ShmBlockingConnection, shm_supported

MIB = 1 << 20
T = TypeVar("T")
needs_shm = pytest.mark.skipif(not shm_supported(), reason="shared memory needs Linux")


class Node:
    """A data server on a private event-loop thread (as in a node process)."""

    def __init__(self, *, capacity: int = 32 * MIB, lease_timeout_s: float = 30.0) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tier = CpuTier(capacity)
        self.store = BlockStore(
            self.tier, LruPolicy(), max_block_size=8 * MIB, clock=time.monotonic
        )
        self.name = f"test-node-{random.getrandbits(32):08x}"
        self.server = DataServer(
            self.store, lease_timeout_s=lease_timeout_s, shm=True, inproc_name=self.name
        )
        self.port = self.run(self.server.start("127.0.0.1", 0))

    def run(self, coro: Awaitable[T]) -> T:
        async def bounded() -> T:
            return await asyncio.wait_for(coro, 30)

        return asyncio.run_coroutine_threadsafe(bounded(), self.loop).result(timeout=40)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the node's loop (the store is not thread-safe)."""

        async def on_loop() -> T:
            return fn()

        return self.run(on_loop())

    def address(self, scheme: str) -> str:
        if scheme == "tcp":
            return f"tcp://127.0.0.1:{self.port}"
        if scheme == "inproc":
            return self.server.inproc_address
        return self.server.shm_address

    def close(self) -> None:
        try:
            self.run(self.server.close())
            self.call(self.store.check_invariants)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()
            self.tier.close()


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node()
    try:
        yield n
    finally:
        n.close()


def deadline(s: float = 10.0) -> float:
    return time.monotonic() + s


def put(conn: BlockingConnection, key: str, data: bytes, write_id: int = 1) -> None:
    calls = [
        Call(Op.PUT, key.encode(), write_id=write_id, checksum=block_checksum(data), payload=data),
        Call(Op.PUBLISH, key.encode(), write_id=write_id, version=write_id),
    ]
    conn.exchange(calls, deadline())
    assert [c.status for c in calls] == [Status.OK, Status.OK]


# --- the wire tables -------------------------------------------------------------------------


def test_key_tables_round_trip_and_malformed_tables_are_refused() -> None:
    records = [KeyRecord(b"k" * n, n + 1, n * 7, n * 11) for n in (1, 5, 1024)]
    raw = encode_key_table(records)
    assert decode_key_table(raw) == records
    assert decode_ids(encode_ids([1, 2**64 - 1])) == [1, 2**64 - 1]
    for bad in (raw[:-1], raw + b"x", COUNT.pack(5) + raw[4:], b"\x01"):
        with pytest.raises(FrameError):
            decode_key_table(bad)
    too_long = COUNT.pack(1) + KEY_RECORD.pack(1, 0, 0, 1025) + b"k" * 1025
    with pytest.raises(FrameError):
        decode_key_table(too_long)
    with pytest.raises(FrameError):
        decode_ids(encode_ids([1])[:-1])


def test_the_registry_knows_its_schemes_and_refuses_others() -> None:
    assert {"tcp", "inproc"} <= set(schemes())
    assert ("shm" in schemes()) == shm_supported()
    assert scheme_of("tcp://127.0.0.1:1") == "tcp"
    for bad in ("127.0.0.1:1", "udp://x:1"):
        with pytest.raises(TransportError):
            scheme_of(bad)
    assert host_id() == host_id()
    assert host_id()


# --- every transport, blocking and on a loop ---------------------------------------------------

SCHEMES = ["tcp", "inproc", pytest.param("shm", marks=needs_shm)]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_put_get_and_mget_over_each_transport(node: Node, scheme: str) -> None:
    conn = open_blocking(node.address(scheme), 5.0)
    try:
        blocks = {f"b{i}": random.Random(i).randbytes(n) for i, n in enumerate([1, 4096, MIB])}
        for key, data in blocks.items():
            put(conn, key, data)
        sink = memoryview(bytearray(MIB))
        single = Call(Op.GET, b"b2", write_id=1, sink=sink)
        conn.exchange([single], deadline())
        assert single.status == Status.OK
        assert bytes(sink) == blocks["b2"]
        # One MGET: hits scattered into their buffers (or fresh ones), misses with reasons.
        keys = [*blocks, "absent"]
        sinks: list[memoryview | None] = [None, memoryview(bytearray(4096)), None, None]
        table = encode_key_table([(k.encode(), 1, 0, 0) for k in keys])
        mget = Call(Op.MGET, payload=table, table=MGET_RECORD, sinks=sinks)
        conn.exchange([mget], deadline())
        assert mget.status == Status.OK
        assert [r[0] for r in mget.records] == [Status.OK] * 3 + [Status.MISS]
        assert mget.records[3][1] == MissReason.ABSENT
        assert mget.sinks is not None
        got = [bytes(d) if d is not None else None for d in mget.sinks]
        assert got == [*blocks.values(), None]
        assert mget.sinks[1] is sinks[1]  # the caller's buffer, filled in place
        assert [r[4] for r in mget.records[:3]] == [block_checksum(v) for v in blocks.values()]
    finally:
        conn.close()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_blocking_mget_receives_each_large_hit_without_a_buffer_into_bytes_of_its_own(
    node: Node, scheme: str
) -> None:
    """Hits with no caller buffer from OWN_HIT_BYTES up land in a ``bytes`` object each (what
    ``batch_get`` returns, with no copy); smaller ones share one buffer; in any order with
    misses and hits that have buffers, every hit is its own bytes, and the batch allocates
    about what it returns (a shared buffer for all, then a copy of each, took twice that)."""
    sizes = {"big0": 2 * MIB, "small0": 100, "big1": MIB, "big2": OWN_HIT_BYTES, "small1": 7}
    blocks = {k: random.Random(k).randbytes(n) for k, n in sizes.items()}
    conn = open_blocking(node.address(scheme), 5.0)
    try:
        for key, data in blocks.items():
            put(conn, key, data)
        keys = ["big0", "small0", "big1", "absent", "big2", "small1"]
        given = memoryview(bytearray(MIB))
        sinks: list[memoryview | None] = [None, None, given, None, None, None]
        table = encode_key_table([(k.encode(), 1, 0, 0) for k in keys])
        mget = Call(Op.MGET, payload=table, table=MGET_RECORD, sinks=sinks)
        tracemalloc.start()
        try:
            conn.exchange([mget], deadline())
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert mget.sinks is not None
        got = [bytes(d) if d is not None else None for d in mget.sinks]
        assert got == [blocks.get(k) for k in keys]
        assert mget.sinks[2] is given
        owned = [isinstance(d, memoryview) and type(d.obj) is bytes for d in mget.sinks]
        assert owned == [True, False, False, False, True, False]
        assert peak < 2 * MIB + OWN_HIT_BYTES + MIB // 4
        ping = Call(Op.PING)
        conn.exchange([ping], deadline())  # the stream is in step after it
        assert ping.status == Status.OK
    finally:
        conn.close()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_event_loop_connections_exchange_the_same_frames(node: Node, scheme: str) -> None:
    data = random.Random(3).randbytes(3 * MIB)

    async def scenario() -> None:
        conn = await open_connection(node.address(scheme), 5.0)
        try:
            calls = [
                Call(Op.PUT, b"k", write_id=9, checksum=block_checksum(data), payload=data),
                Call(Op.PUBLISH, b"k", write_id=9, version=1),
            ]
            await conn.exchange(calls, 10.0)
            assert [c.status for c in calls] == [Status.OK, Status.OK]
            table = encode_key_table([(b"k", 9, 0, 0), (b"k", 8, 0, 0)])
            mget = Call(Op.MGET, payload=table, table=MGET_RECORD, sinks=[None, None])
            await conn.exchange([mget], 10.0)
            assert [r[0] for r in mget.records] == [Status.OK, Status.MISS]
            assert mget.sinks is not None
            assert mget.sinks[0] is not None
            assert bytes(mget.sinks[0]) == data
        finally:
            conn.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_event_loop_mget_reads_hits_straight_into_the_callers_buffers(
    node: Node, scheme: str
) -> None:
    """As the blocking MGET: a hit lands in its caller's buffer (the same object, filled in
    place), a hit without one in a fresh buffer, a hit whose buffer has another size is dropped,
    a miss says why; the connection stays usable."""
    sizes = [3, MIB, 2 * MIB, 0, 100]  # s3: an empty block, a hit of no bytes
    blocks = {f"s{i}": random.Random(10 + i).randbytes(n) for i, n in enumerate(sizes)}

    async def scenario() -> None:
        conn = await open_connection(node.address(scheme), 5.0)
        try:
            for key, data in blocks.items():
                calls = [
                    Call(
                        Op.PUT,
                        key.encode(),
                        write_id=1,
                        checksum=block_checksum(data),
                        payload=data,
                    ),
                    Call(Op.PUBLISH, key.encode(), write_id=1, version=1),
                ]
                await conn.exchange(calls, 10.0)
                assert [c.status for c in calls] == [Status.OK, Status.OK]
            keys = [*blocks, "absent"]
            sinks: list[memoryview | None] = [
                None,
                memoryview(bytearray(MIB)),
                memoryview(bytearray(2 * MIB)),
                None,
                memoryview(bytearray(5)),  # the wrong size: dropped, not written
                memoryview(bytearray(8)),
            ]
            table = encode_key_table([(k.encode(), 1, 0, 0) for k in keys])
            mget = Call(Op.MGET, payload=table, table=MGET_RECORD, sinks=sinks)
            tracemalloc.start()
            try:
                await conn.exchange([mget], 10.0)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            # Not a buffer for the whole 3 MiB answer, copied out of after: the hits' bytes
            # went into the callers' buffers as they arrived.
            assert peak < MIB // 4
            assert mget.error is None
            assert [r[0] for r in mget.records] == [Status.OK] * 5 + [Status.MISS]
            assert mget.records[5][1] == MissReason.ABSENT
            assert mget.sinks is not None
            got = [bytes(d) if d is not None else None for d in mget.sinks]
            assert got == [blocks["s0"], blocks["s1"], blocks["s2"], b"", None, None]
            assert mget.sinks[1] is sinks[1]  # the callers' buffers, filled in place
            assert mget.sinks[2] is sinks[2]
            assert bytes(sinks[4] or b"") == bytes(5)
            ping = Call(Op.PING)
            await conn.exchange([ping], 5.0)
            assert ping.status == Status.OK
        finally:
            conn.close()

    asyncio.run(scenario())


def test_hello_names_what_the_node_offers(node: Node) -> None:
    conn = open_blocking(node.address("tcp"), 5.0)
    try:
        hello = Call(Op.HELLO)
        conn.exchange([hello], deadline())
        assert hello.status == Status.OK
        info = json.loads(bytes(hello.data or b"{}"))
        assert "mget" in info["features"]
        assert info["host"] == host_id()
        # The node's view of the connection is ours, mirrored: no proxy between.
        assert (info["peer"], info["local"]) == (conn.sockname, conn.peername)
        if shm_supported():
            assert info["shm"] == node.server.shm_address
    finally:
        conn.close()


def test_a_silent_peer_costs_one_deadline_and_breaks_the_connection() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        conn = open_blocking(f"tcp://127.0.0.1:{listener.getsockname()[1]}", 1.0)
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            conn.exchange([Call(Op.PING)], time.monotonic() + 0.3)
        assert 0.25 < time.monotonic() - started < 1.0
        assert conn.broken
        conn.close()
    finally:
        listener.close()


@contextlib.contextmanager
def _one_peer(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A tcp address whose first connection is served by ``answer`` (in a thread)."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve() -> None:
        sock, _ = listener.accept()
        accepted.append(sock)
        answer(sock)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        thread.join(5)
        for sock in accepted:
            sock.close()
        listener.close()


def test_a_posted_answer_arriving_late_does_not_extend_the_deadline() -> None:
    """A receive that reads and drops a posted answer (a PUBLISH not waited for) on the way
    still ends at its deadline: the kernel time-out is set again for what is left before the
    next frame (it was armed in full for each, and a 1 s put took 2 s in the chaos suite)."""

    def answer(sock: socket.socket) -> None:
        posted = unpack_header(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        sock.recv(posted.key_len, socket.MSG_WAITALL)
        time.sleep(0.35)  # answers the posted request only, shortly before the deadline
        sock.sendall(Header(op=Op.PUBLISH, request_id=posted.request_id).pack())

    with _one_peer(answer) as address:
        conn = open_blocking(address, 1.0)
        started = time.monotonic()
        deadline = started + 0.4
        conn.send([Call(Op.PUBLISH, b"k", write_id=1)], deadline, posted=True)
        with pytest.raises(DeadlineExceededError):
            conn.exchange([Call(Op.PING)], deadline)
        assert time.monotonic() - started < 0.4 + 0.1
        conn.close()


def _answer_get_in_two_halves(payload: bytes, pause_s: float) -> Callable[[socket.socket], None]:
    def answer(sock: socket.socket) -> None:
        asked = unpack_header(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        sock.recv(asked.key_len, socket.MSG_WAITALL)
        header = Header(op=Op.GET, request_id=asked.request_id, payload_len=len(payload))
        half = len(payload) // 2
        sock.sendall(header.pack() + payload[:half])
        time.sleep(pause_s)
        sock.sendall(payload[half:])
        time.sleep(0.2)

    return answer


def test_a_payload_without_a_buffer_is_received_into_the_bytes_the_caller_gets() -> None:
    payload = random.randbytes(3 * MIB)
    with _one_peer(_answer_get_in_two_halves(payload, 0.05)) as address:
        conn = open_blocking(address, 2.0)
        get = Call(Op.GET, b"k", write_id=1)
        conn.exchange([get], time.monotonic() + 2.0)
        assert isinstance(get.data, memoryview)
        assert get.data == payload
        assert type(get.data.obj) is bytes  # no buffer first, no copy after
        conn.close()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals")
def test_a_payload_read_cut_short_by_a_signal_is_finished_whole() -> None:
    """A receive into new bytes that the kernel ends early (a signal arrives, or a kernel
    time-out within the deadline) keeps what came and reads the rest after it."""
    payload = random.randbytes(3 * MIB)
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        with _one_peer(_answer_get_in_two_halves(payload, 0.4)) as address:
            conn = open_blocking(address, 2.0)
            get = Call(Op.GET, b"k", write_id=1)
            signal.setitimer(signal.ITIMER_REAL, 0.15)  # while the second half is awaited
            conn.exchange([get], time.monotonic() + 5.0)
            assert isinstance(get.data, memoryview)
            assert get.data == payload
            assert type(get.data.obj) is bytearray  # the early end was taken
            assert not conn.broken
            conn.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_kernel_time_out_a_little_shorter_than_the_deadline_is_waited_out() -> None:
    """The socket's time-out is left as it is when it is near what the call has left; when it
    is shorter, an answer that comes after it but before the deadline is still taken."""

    def answer(sock: socket.socket) -> None:
        asked = unpack_header(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        time.sleep(0.26)  # after the socket's 0.25 s, before the call's 0.3 s
        sock.sendall(Header(op=Op.PING, request_id=asked.request_id).pack())

    with _one_peer(answer) as address:
        conn = open_blocking(address, 0.25)
        ping = Call(Op.PING)
        conn.exchange([ping], time.monotonic() + 0.3)
        assert ping.status == Status.OK
        assert not conn.broken
        conn.close()


@pytest.mark.parametrize(
    ("declared", "expects", "refusal"),
    [
        (2 << 30, None, "no buffer"),
        (8 * MIB, [4096], "hit of 8388608 bytes for a block of 4096"),
    ],
    ids=["gigabytes", "not-the-index-size"],
)
def test_an_mget_answer_declaring_too_much_breaks_the_blocking_connection(
    declared: int, expects: list[int] | None, refusal: str
) -> None:
    """A peer's MGET answer whose one hit (no buffer given for it) would take 2 GiB, or 8 MiB
    for a block the index says is 4 KiB: refused at its table, the connection broken, nothing
    of that size allocated."""

    def answer(sock: socket.socket) -> None:
        asked = unpack_header(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        sock.recv(asked.payload_len, socket.MSG_WAITALL)
        table = COUNT.pack(1) + MGET_RECORD.pack(Status.OK, 0, 1, declared, 0)
        header = Header(op=Op.MGET, request_id=asked.request_id, payload_len=len(table) + declared)
        sock.sendall(header.pack() + table + b"x" * 1000)
        time.sleep(0.5)

    with _one_peer(answer) as address:
        conn = open_blocking(address, 2.0)
        mget = Call(
            Op.MGET,
            payload=encode_key_table([(b"k", 1, 0, 0)]),
            table=MGET_RECORD,
            sinks=[None],
            expects=expects,
        )
        tracemalloc.start()
        try:
            with pytest.raises(TransportError, match=refusal):
                conn.exchange([mget], time.monotonic() + 2.0)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert conn.broken
        assert peak < 1 << 20
        conn.close()


def _answer_get_larger_then_ping(size: int) -> Callable[[socket.socket], None]:
    """A peer that answers a GET with ``size`` bytes and the PING after it as usual."""
    body = b"x" * size  # made before the test measures what the client allocates

    def answer(sock: socket.socket) -> None:
        get = unpack_header(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        sock.recv(get.key_len, socket.MSG_WAITALL)
        ping = unpack_header(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        header = Header(op=Op.GET, request_id=get.request_id, payload_len=size, write_id=1)
        sock.sendall(header.pack())
        sock.sendall(body)
        sock.sendall(Header(op=Op.PING, request_id=ping.request_id).pack())
        time.sleep(0.5)

    return answer


@pytest.mark.parametrize("loop", [False, True], ids=["blocking", "event-loop"])
def test_an_answer_larger_than_the_block_the_index_names_is_refused_unallocated(
    loop: bool,
) -> None:
    """A GET of a block the index says is 4 KiB, with no buffer, answered with 8 MiB: that
    answer is refused before anything of its size is allocated (a peer's frame never decides
    how much a client allocates), the call fails on its own, and the connection stays in step
    (the PING after it is answered)."""
    size = 8 * MIB
    with _one_peer(_answer_get_larger_then_ping(size)) as address:
        get = Call(Op.GET, b"k", write_id=1, expect=4096)
        ping = Call(Op.PING)
        tracemalloc.start()
        try:
            if loop:

                async def scenario() -> None:
                    conn = await open_connection(address, 2.0)
                    try:
                        await conn.exchange([get, ping], 2.0)
                        assert conn.is_open
                    finally:
                        conn.close()

                asyncio.run(scenario())
            else:
                conn = open_blocking(address, 2.0)
                conn.exchange([get, ping], time.monotonic() + 2.0)
                assert not conn.broken
                conn.close()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert isinstance(get.error, TransportError)
    assert "response of 8388608 bytes for a block of 4096" in str(get.error)
    assert get.data is None
    assert ping.status == Status.OK
    assert peak < 2 * MIB


def test_a_busy_poll_ends_when_the_answer_arrives_or_when_its_time_is_up(node: Node) -> None:
    conn = open_blocking(node.address("tcp"), 2.0)
    try:
        # Nothing on the way: it spins the whole time, then says so. The thread was busy, not
        # asleep: a sleeping wait costs well under a millisecond of CPU; a spin costs its
        # thread's whole share of a core (a tenth at least, on a machine as loaded as CI's).
        cpu, started = time.thread_time(), time.monotonic()
        assert conn.busy_poll(0.1) is False
        assert 0.1 <= time.monotonic() - started < 1.0
        assert time.thread_time() - cpu >= 0.01
        # An answer on the way ends it early, and the exchange that polled reads it whole.
        put(conn, "poll/a", b"x" * 1000)
        sink = memoryview(bytearray(1000))
        get = Call(Op.GET, b"poll/a", write_id=1, sink=sink)
        started = time.monotonic()
        conn.exchange([get], time.monotonic() + 2.0, poll_s=5.0)
        assert time.monotonic() - started < 2.0
        assert get.status == Status.OK
        assert bytes(sink) == b"x" * 1000
    finally:
        conn.close()


# --- shared memory ---------------------------------------------------------------------------


def shm_conn(node: Node) -> ShmBlockingConnection:
    conn = open_blocking(node.server.shm_address, 5.0)
    assert isinstance(conn, ShmBlockingConnection)
    return conn


def shm_get(conn: ShmBlockingConnection, keys: list[str], write_id: int = 1) -> Call:
    table = encode_key_table([(k.encode(), write_id, 0, 0) for k in keys])
    call = Call(Op.SHM_GET, payload=table, table=SHM_RECORD, sinks=[None] * len(keys))
    conn.exchange([call], deadline())
    assert call.status == Status.OK
    return call


@needs_shm
def test_a_leased_extent_is_never_reused_until_released(node: Node) -> None:
    data = random.Random(5).randbytes(MIB)
    conn = shm_conn(node)
    try:
        put(conn, "leased", data)
        call = shm_get(conn, ["leased"])
        ((status, tier, _wid, size, checksum, offset, lease),) = call.records
        assert (status, tier, size, checksum) == (
            Status.OK,
            TierLevel.CPU,
            MIB,
            block_checksum(data),
        )
        assert conn.arena is not None
        assert bytes(conn.arena.extent(offset, size)) == data
        # Deleted while leased: gone from the table, but its memory is held for the reader.
        delete = Call(Op.DELETE, b"leased")
        conn.exchange([delete], deadline())
        assert node.call(lambda: node.store.stats().leased_bytes_lingering) == MIB
        for i in range(20):  # the arena fills with other blocks: none lands on the extent
            put(conn, f"filler{i}", bytes([i]) * MIB)
        assert bytes(conn.arena.extent(offset, size)) == data
        conn.notify([Call(Op.SHM_RELEASE, payload=encode_ids([lease]))], deadline())
        ping = Call(Op.PING)
        conn.exchange([ping], deadline())  # the release was handled before this answer
        assert node.call(lambda: node.store.stats().leased_bytes_lingering) == 0
    finally:
        conn.close()


@needs_shm
def test_a_client_that_keeps_a_lease_too_long_is_cut() -> None:
    node = Node(lease_timeout_s=0.3)
    try:
        conn = shm_conn(node)
        put(conn, "k", b"v" * 4096)
        shm_get(conn, ["k"])
        block = node.call(lambda: node.store.block("k", 1))
        assert block is not None
        copy = block.copies[TierLevel.CPU]
        assert copy.leases == 1
        for _ in range(100):
            if not copy.leases:
                break
            time.sleep(0.05)
        assert copy.leases == 0, "the lease outlived lease_timeout_s"
        assert node.server.stalled_cut >= 1
        with pytest.raises((TransportError, DeadlineExceededError)):
            conn.exchange([Call(Op.PING)], deadline(2.0))
        conn.close()
    finally:
        node.close()


@needs_shm
def test_a_put_through_shared_memory_is_checked_and_a_dropped_reservation_is_freed(
    node: Node,
) -> None:
    data = random.Random(7).randbytes(MIB)
    conn = shm_conn(node)
    try:
        table = encode_key_table([(b"p", 3, MIB, block_checksum(data)), (b"q", 4, MIB, 123)])
        reserve = Call(Op.SHM_RESERVE, payload=table, table=RESERVE_RECORD, sinks=[None, None])
        conn.exchange([reserve], deadline())
        (s1, _, off1, r1), (s2, _, off2, r2) = reserve.records
        assert (s1, s2) == (Status.OK, Status.OK)
        assert r1
        assert r2
        assert conn.arena is not None
        conn.arena.extent(off1, MIB)[:] = data
        conn.arena.extent(off2, MIB)[:] = data  # not the bytes its checksum names
        commit = Call(Op.SHM_COMMIT, payload=encode_ids([r1, r2]), table=RESERVE_RECORD,
                      sinks=[None, None])  # fmt: skip
        conn.exchange([commit], deadline())
        assert [r[0] for r in commit.records] == [Status.OK, Status.CHECKSUM_MISMATCH]
        publish = Call(Op.PUBLISH, b"p", write_id=3, version=1)
        conn.exchange([publish], deadline())
        got = shm_get(conn, ["p"], write_id=3)
        assert got.records[0][0] == Status.OK
        # A reservation never committed is freed when its connection goes.
        used = node.call(lambda: node.tier.used_bytes)
        again = Call(Op.SHM_RESERVE, payload=encode_key_table([(b"r", 5, MIB, 1)]),
                     table=RESERVE_RECORD, sinks=[None])  # fmt: skip
        conn.exchange([again], deadline())
        assert node.call(lambda: node.tier.used_bytes) > used
    finally:
        conn.close()
    for _ in range(100):
        if node.call(lambda: node.store.block("r", 5)) is None:
            break
        time.sleep(0.02)
    assert node.call(lambda: node.store.block("r", 5)) is None


@needs_shm
def test_an_unknown_shared_memory_name_is_refused(node: Node) -> None:
    with pytest.raises(TransportError):
        open_blocking("shm://kvpool-no-such-arena", 1.0)


def test_a_large_payload_after_a_header_goes_straight_to_its_destination() -> None:
    sink = bytearray(MIB)

    class Handler:
        frames: list[int] = []

        def frame_sink(self, header: Header, key: bytes) -> memoryview | None:
            return memoryview(sink)

        def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
            self.frames.append(header.payload_len)

        def version_mismatch(self, theirs: int) -> None:
            raise AssertionError

        def bad_frame(self, error: FrameError) -> None:
            raise AssertionError(error)

    handler = Handler()
    reader = FrameReader(handler)
    payload = random.Random(9).randbytes(MIB)
    one = Header(op=Op.PUT, request_id=1, payload_len=MIB, key_len=3).pack() + b"key" + payload
    stream = memoryview(one + one)  # two frames back to back, as a kernel may deliver them
    through_scratch = 0
    while stream:
        buf = reader.get_buffer()
        n = min(len(buf), len(stream))
        buf[:n] = stream[:n]
        if buf.obj is not sink:
            through_scratch += n
        stream = stream[n:]
        reader.buffer_updated(n)
    assert handler.frames == [MIB, MIB]
    assert bytes(sink) == payload
    assert through_scratch <= 2 * PEEK_BYTES  # headers, keys and at most a key's worth more


@pytest.mark.parametrize("size", [DIRECT_THRESHOLD, DIRECT_THRESHOLD + 100, 3 * DIRECT_THRESHOLD])
def test_a_payload_just_past_the_threshold_is_not_read_a_header_at_a_time(size: int) -> None:
    """A 64 KiB block whose header's read took part of its payload with it: the rest goes
    straight to the block in one read, not through scratch 1 KiB at a time (which made a
    batch of 256 such PUTs 4x slower than one of 256 x 63 KiB)."""
    sinks: list[bytearray] = []
    received: list[bytes] = []

    class Handler:
        def frame_sink(self, header: Header, key: bytes) -> memoryview | None:
            sinks.append(bytearray(header.payload_len))
            return memoryview(sinks[-1])

        def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
            received.append(bytes(payload or b""))

        def version_mismatch(self, theirs: int) -> None:
            raise AssertionError

        def bad_frame(self, error: FrameError) -> None:
            raise AssertionError(error)

    reader = FrameReader(Handler())
    payloads = [random.Random(i).randbytes(size) for i in range(8)]
    key = b"kv1/0123456789abcdef/0123456789abcdef"
    stream = memoryview(
        b"".join(
            Header(op=Op.PUT, request_id=i, payload_len=size, key_len=len(key)).pack() + key + p
            for i, p in enumerate(payloads)
        )
    )
    reads = 0
    while stream:  # a socket with everything already there: each read fills what it is offered
        buf = reader.get_buffer()
        n = min(len(buf), len(stream))
        buf[:n] = stream[:n]
        stream = stream[n:]
        reader.buffer_updated(n)
        reads += 1
    assert received == payloads
    assert reads <= 2 * len(payloads)  # a header's read, then the rest of its payload


def test_madvise_is_found_without_forking_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The arena's page tables are filled through libc's madvise, looked up in what the
    process has loaded: ``ctypes.util.find_library`` forks ``ldconfig``, and a fork of an
    engine process (tens of GiB mapped, CUDA) is no small thing in a background thread."""
    import subprocess

    from kvpool.transports.shm import libc_madvise

    def no_fork(*args: object, **kwargs: object) -> None:
        raise AssertionError("a subprocess was started to find libc")

    monkeypatch.setattr(subprocess, "Popen", no_fork)
    libc_madvise.cache_clear()
    try:
        madvise = libc_madvise()
        assert madvise is not None
        assert libc_madvise() is madvise  # once per process
        buf = mmap.mmap(-1, 1 << 16)
        holder = (ctypes.c_char * len(buf)).from_buffer(buf)
        assert madvise(ctypes.addressof(holder), len(buf), 4) == 0  # MADV_DONTNEED
        del holder
        buf.close()
    finally:
        libc_madvise.cache_clear()
