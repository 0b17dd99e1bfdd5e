"""The fuzz suite, in one process (issue 16): hypothesis over the frame header and every message
into the frame reader and the decoders, and into a real data server over loopback (after each
input: the store consistent, no request memory held, no connection left, the known block read
back exactly); atheris (coverage-guided) on the parsers, briefly here and longer as a slow test.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
import subprocess
import sys
import time
import tracemalloc
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.checksum import block_checksum
from kvpool.errors import KVPoolError
from kvpool.proto.wire import (
    COUNT,
    MGET_RECORD,
    FrameError,
    Header,
    Op,
    Status,
    decode_ids,
    decode_key_table,
    encode_key_table,
)
from kvpool.raft_master.rpc_port import METHODS
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.cpu_tier import CpuTier
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.eviction import LruPolicy
from kvpool.store_node.publish_check import IndexVersions
from kvpool.transports.blocking import BlockingConnection
from kvpool.transports.calls import MAX_ALLOC_BYTES, Call, table_head_size, table_rest
from kvpool.transports.frames import FrameReader, Scatter
from kvpool.transports.limits import IngressLimits
from kvpool.transports.tcp import FrameConnection, TcpConnection
from tests.fuzzing import hostile, messages
from tests.unit.test_hostile_input import FakeIndex

MIB = 1 << 20


class Recorder:
    def __init__(self) -> None:
        self.frames: list[tuple[Header, bytes, bytes | None]] = []
        self.stopped = ""

    def frame_sink(self, header: Header, key: bytes) -> memoryview | Scatter | None:
        if header.payload_len <= 4096:
            return memoryview(bytearray(header.payload_len))
        return None

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        self.frames.append((header, key, bytes(payload) if payload is not None else None))

    def version_mismatch(self, theirs: int) -> None:
        self.stopped = "version"

    def bad_frame(self, error: FrameError) -> None:
        self.stopped = "bad"


@settings(max_examples=300, deadline=None)
@given(data=hostile(), cut=st.integers(1, 97))
def test_the_frame_reader_takes_anything_in_any_pieces(data: bytes, cut: int) -> None:
    rec = Recorder()
    reader = FrameReader(rec, scratch_bytes=64 * 1024)
    for i in range(0, len(data), cut):
        if reader.stopped:
            break
        reader.feed(data[i : i + cut])
        assert reader.scratch_bytes <= 64 * 1024
    for header, _, payload in rec.frames:
        assert payload is None or len(payload) == header.payload_len
    reader.release()
    assert reader.scratch_bytes == 0


@settings(max_examples=200, deadline=None)
@given(data=messages())
def test_every_message_parses_back_whole(data: bytes) -> None:
    rec = Recorder()
    FrameReader(rec).feed(data)
    assert not rec.stopped
    assert len(rec.frames) == 1


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=512))
def test_decoders_raise_only_their_own_errors(data: bytes) -> None:
    for parse in (decode_key_table, decode_ids):
        with contextlib.suppress(FrameError):
            parse(data)
    for request_type in METHODS.values():
        with contextlib.suppress(DecodeError):
            request_type.FromString(data)


class _Node:
    """A data server on loopback with one known committed block, kept across examples."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.tier = CpuTier(32 * MIB)
        self.store = BlockStore(self.tier, LruPolicy(), max_block_size=8 * MIB, clock=lambda: 0.0)
        self.server = DataServer(self.store, limits=IngressLimits(frame_timeout_s=0.3))
        self.index = FakeIndex()
        self.server.versions = IndexVersions(self.index, timeout_s=1.0)
        self.port = self.loop.run_until_complete(self.server.start("127.0.0.1", 0))
        self.known = b"known block " * 1000
        self.loop.run_until_complete(self._put_known())

    async def _put_known(self) -> None:
        conn = await TcpConnection.open("127.0.0.1", self.port, timeout_s=5)
        put = await conn.request(
            Op.PUT, b"known", write_id=9, checksum=block_checksum(self.known),
            payload=self.known, timeout_s=5,
        )  # fmt: skip
        assert put.status == Status.OK
        self.index.entries["known"] = (9, 1)
        assert (await conn.request(Op.PUBLISH, b"known", write_id=9, timeout_s=5)).status == 0
        conn.close()

    async def attack(self, data: bytes) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(data)
        try:
            await asyncio.wait_for(writer.drain(), 0.5)
            await asyncio.wait_for(reader.read(1 << 16), 0.05)
        except (TimeoutError, OSError):
            pass
        writer.close()

    async def check(self) -> None:
        deadline = self.loop.time() + 2.0
        while self.server.connections and self.loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        assert not self.server.connections
        assert self.server.budget.used_bytes == 0
        assert self.store.receiving_bytes == 0
        self.store.check_invariants()
        conn = await TcpConnection.open("127.0.0.1", self.port, timeout_s=5)
        sink = bytearray(len(self.known))
        got = await conn.request(Op.GET, b"known", write_id=9, sink=memoryview(sink), timeout_s=5)
        assert (got.status, bytes(sink)) == (Status.OK, self.known)
        conn.close()

    def close(self) -> None:
        assert self.server.versions is not None
        self.loop.run_until_complete(self.server.versions.close())
        self.loop.run_until_complete(self.server.close())
        self.loop.close()
        self.tier.close()


@pytest.fixture(scope="module")
def data_node() -> Any:
    node = _Node()
    yield node
    node.close()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=hostile())
def test_a_data_server_survives_anything_and_keeps_its_blocks(
    data_node: _Node, data: bytes
) -> None:
    data_node.loop.run_until_complete(data_node.attack(data))
    data_node.loop.run_until_complete(data_node.check())


def _atheris(runs: int) -> None:
    if importlib.util.find_spec("atheris") is None:
        pytest.skip("atheris is not installed (the dev extra installs it on Linux x86-64)")
    done = subprocess.run(
        [sys.executable, "-m", "tests.fuzz.atheris_frames", f"-runs={runs}", "-max_len=8192"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "DONE" in done.stderr


def test_atheris_briefly() -> None:
    _atheris(20_000)


@pytest.mark.slow
def test_atheris_long() -> None:
    _atheris(1_000_000)


class TableReader(Recorder):
    """An MGET answer scattered as an event-loop connection does it (``calls.table_rest``)."""

    def __init__(self, call: Call) -> None:
        super().__init__()
        self.call = call

    def frame_sink(self, header: Header, key: bytes) -> memoryview | Scatter | None:
        size = table_head_size(self.call)
        if size is None or size > header.payload_len:
            return None
        head = memoryview(bytearray(size))
        return Scatter(head, lambda left: table_rest(self.call, head, left))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    records=st.lists(
        st.tuples(st.sampled_from([Status.OK, Status.MISS]), st.integers(0, 3000)), max_size=6
    ),
    sinks=st.lists(st.sampled_from(["none", "fits", "small"]), min_size=6, max_size=6),
    lie=st.integers(-3, 3),
    cut=st.integers(1, 97),
)
def test_an_mget_answer_of_any_shape_is_scattered_whole_or_stops_the_reader(
    records: list[tuple[int, int]], sinks: list[str], lie: int, cut: int
) -> None:
    """Each hit's bytes land in its caller's buffer (or a fresh one) exactly; an answer whose
    data is longer or shorter than its table says stops the reader, and nothing raises."""
    buffers: list[memoryview | None] = []
    for (_status, size), kind in zip(records, sinks, strict=False):
        n = {"none": -1, "fits": size, "small": max(0, size - 1)}[kind]
        buffers.append(None if n < 0 else memoryview(bytearray(n)))
    call = Call(Op.MGET, table=MGET_RECORD, sinks=buffers)
    pieces = [
        bytes([i + 1]) * size if status == Status.OK else b""
        for i, (status, size) in enumerate(records)
    ]
    table = COUNT.pack(len(records)) + b"".join(
        MGET_RECORD.pack(status, 0, 1, size if status == Status.OK else 0, 0)
        for status, size in records
    )
    data = b"".join(pieces)
    data = data + b"x" * lie if lie >= 0 else data[:lie]
    payload = table + data
    header = Header(op=Op.MGET, status=Status.OK, request_id=1, payload_len=len(payload))
    rec = TableReader(call)
    reader = FrameReader(rec, scratch_bytes=64 * 1024)
    stream = header.pack() + payload
    for i in range(0, len(stream), cut):
        if reader.stopped:
            break
        reader.feed(stream[i : i + cut])
    if lie == 0 or (lie < 0 and not data and not any(pieces)):
        assert not rec.stopped
        assert len(rec.frames) == 1
        assert call.sinks is not None
        for (status, size), piece, buffer, got in zip(
            records, pieces, buffers, call.sinks, strict=True
        ):
            if status != Status.OK or (buffer is not None and buffer.nbytes != size):
                assert got is None  # a miss, or a buffer of the wrong size: dropped
            else:
                assert got is not None
                assert bytes(got) == piece
                if buffer is not None:
                    assert got is buffer
    else:
        assert rec.stopped == "bad"
        assert rec.frames == []


def test_an_mget_answer_declaring_gigabytes_is_refused_before_anything_is_allocated() -> None:
    """A node's answer says its one hit, which the caller gave no buffer for, is 2 GiB: the
    reader stops at the table; no 2 GiB buffer is made for bytes that may never come."""
    call = Call(Op.MGET, table=MGET_RECORD, sinks=[None])
    size = 2 << 30
    table = COUNT.pack(1) + MGET_RECORD.pack(Status.OK, 0, 1, size, 0)
    header = Header(op=Op.MGET, status=Status.OK, request_id=1, payload_len=len(table) + size)
    rec = TableReader(call)
    reader = FrameReader(rec)
    tracemalloc.start()
    try:
        reader.feed(header.pack() + table + b"x" * 100)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rec.stopped == "bad"
    assert peak < 1 << 20


@st.composite
def answers(draw: st.DrawFn) -> bytes:
    """What a broken or hostile node answers a client's three requests (ids 1-3: a GET with a
    4 KiB buffer, a GET without one, an MGET of two keys, one with a buffer): headers naming
    those ids or others, any status and length, tables that match or do not, then anything."""
    out = b""
    for _ in range(draw(st.integers(1, 4))):
        request_id = draw(st.sampled_from([1, 2, 3, 3, 7]))
        status = draw(st.sampled_from([Status.OK, Status.OK, Status.MISS, 1, 9, 255]))
        if draw(st.booleans()):  # a table
            count = draw(st.sampled_from([0, 1, 2, 2, 3, 1 << 20]))
            records = b"".join(
                MGET_RECORD.pack(
                    draw(st.sampled_from([Status.OK, Status.MISS, 7])),
                    0,
                    1,
                    draw(st.sampled_from([0, 3, 4096, 1 << 31, U64_MAX])),
                    0,
                )
                for _ in range(min(count, 3))
            )
            body = COUNT.pack(count) + records + draw(st.binary(max_size=600))
        else:
            body = draw(st.binary(max_size=5000))
        declared = draw(st.sampled_from([len(body), len(body), 0, len(body) + 1, 1 << 40]))
        header = Header(op=Op.GET, status=status, request_id=request_id, payload_len=declared)
        out += header.pack() + body
    if draw(st.booleans()):
        out = _cut(out, draw(st.integers(0, len(out))))
    return out


U64_MAX = (1 << 64) - 1


def _cut(data: bytes, at: int) -> bytes:
    return data[:at]


def _three_calls() -> list[Call]:
    return [
        Call(Op.GET, b"a", write_id=1, sink=memoryview(bytearray(4096))),
        Call(Op.GET, b"b", write_id=1),
        Call(
            Op.MGET,
            payload=encode_key_table([(b"c", 1, 0, 0), (b"d", 1, 0, 0)]),
            table=MGET_RECORD,
            sinks=[memoryview(bytearray(3)), None],
        ),
    ]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(answers(), hostile()))
def test_a_blocking_connection_takes_any_answer_and_fails_only_as_kvpool_fails(data: bytes) -> None:
    """Whatever a node sends back, the client's call ends with its answers or a typed error
    (never another exception: an engine's thread would take it), and nothing of the size a
    header merely declares is allocated."""
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(data)
        theirs.shutdown(socket.SHUT_WR)  # then the end of the stream: nothing waits forever
        conn = BlockingConnection(ours, "fuzz", timeout_s=1.0)
        calls = _three_calls()
        tracemalloc.start()
        try:
            conn.exchange(calls, time.monotonic() + 1.0)
        except KVPoolError:
            assert conn.broken
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < MAX_ALLOC_BYTES
        for call in calls:
            if call.data is not None and call.sink is not None and call.header is not None:
                assert call.data.nbytes in (call.sink.nbytes, call.header.payload_len)
    finally:
        ours.close()
        theirs.close()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(answers(), hostile()))
def test_an_event_loop_connection_takes_any_answer_and_fails_only_as_kvpool_fails(
    data: bytes,
) -> None:
    unretrieved: list[BaseException] = []

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = []
        make = loop.create_future

        def recorded() -> asyncio.Future[Any]:
            futures.append(make())
            return futures[-1]

        loop.create_future = recorded  # type: ignore[method-assign]
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        conn = FrameConnection("fuzz")
        conn.attach(ours)
        try:
            theirs.sendall(data)
            theirs.shutdown(socket.SHUT_WR)
            with contextlib.suppress(KVPoolError):
                await conn.exchange(_three_calls(), 1.0)
        finally:
            conn.close()
            theirs.close()
            await asyncio.sleep(0)
        # An error nobody took would be logged as "Future exception was never retrieved" when
        # its future is collected: asyncio marks such a future (_log_traceback) until then.
        unretrieved.extend(
            f.exception() or Exception()
            for f in futures
            if f.done() and not f.cancelled() and getattr(f, "_log_traceback", False)
        )

    asyncio.run(scenario())
    assert not unretrieved, unretrieved
