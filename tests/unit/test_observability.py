"""Traces, metrics and log fields in one process: the frame header's trace context, the exporter
choice from OTEL_* variables, trace ids in log lines, the /metrics server."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvpool import tracing
from kvpool.checksum import block_checksum
from kvpool.config import NodeConfig
from kvpool.logs import configure_logging, get_logger
from kvpool.metrics import MetricsServer, register_collector, render
from kvpool.proto.wire import (
    EXT_TRACED,
    HEADER_SIZE,
    MAX_KEY_BYTES,
    TRACE_CONTEXT_SIZE,
    FrameError,
    Header,
    Op,
    Status,
    pack_trace,
    unpack_header,
    unpack_trace,
)
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.cpu_tier import CpuTier
from kvpool.store_node.data_server import DataServer
from kvpool.store_node.eviction import LruPolicy
from kvpool.store_node.node_metrics import node_families
from kvpool.transports.blocking import BlockingConnection
from kvpool.transports.calls import Call
from kvpool.transports.frames import FrameReader

TRACE = pack_trace(0x0123456789ABCDEF0123456789ABCDEF, 0x1122334455667788, 1)
UNSAMPLED = pack_trace(0x0123456789ABCDEF0123456789ABCDEF, 0x99, 0)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, spans kept in memory; off again afterwards."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    saved = (tracing.STATE.enabled, tracing.STATE.tracer)
    tracing.STATE.tracer = provider.get_tracer("test")
    tracing.STATE.enabled = True
    try:
        yield exporter
    finally:
        tracing.STATE.enabled, tracing.STATE.tracer = saved
        provider.shutdown()


class Frames:
    def __init__(self) -> None:
        self.got: list[tuple[Header, bytes]] = []
        self.errors: list[FrameError] = []

    def frame_sink(self, header: Header, key: bytes) -> memoryview | None:
        return None

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        self.got.append((header, key))

    def version_mismatch(self, theirs: int) -> None:
        raise AssertionError(theirs)

    def bad_frame(self, error: FrameError) -> None:
        self.errors.append(error)


def feed(data: bytes) -> Frames:
    handler = Frames()
    reader = FrameReader(handler)
    view = memoryview(data)
    while view and not reader.stopped:
        buf = reader.get_buffer()
        n = min(len(buf), len(view))
        buf[:n] = view[:n]
        reader.buffer_updated(n)
        view = view[n:]
    return handler


def test_a_traced_frame_reaches_the_handler_with_its_context_and_its_key_alone() -> None:
    key = b"k" * MAX_KEY_BYTES  # the longest key still fits beside the context
    head = Header(op=Op.GET, request_id=7, write_id=9, key_len=len(key), trace=TRACE).pack()
    assert len(head) == HEADER_SIZE + TRACE_CONTEXT_SIZE
    plain = Header(op=Op.GET, request_id=8, key_len=3).pack() + b"abc"
    handler = feed(head + key + plain)
    assert handler.errors == []
    (first, first_key), (second, second_key) = handler.got
    assert first_key == key
    assert first.key_len == len(key)
    assert first.trace == TRACE
    assert first.write_id == 9
    assert first.request_id == 7
    assert unpack_trace(first.trace) == (0x0123456789ABCDEF0123456789ABCDEF, 0x1122334455667788, 1)
    assert second_key == b"abc"
    assert second.trace == b""


def test_a_frame_that_claims_a_context_it_has_no_room_for_is_refused() -> None:
    raw = bytearray(Header(op=Op.GET, key_len=3).pack())
    raw[52:56] = EXT_TRACED.to_bytes(4, "little")  # the extensions word
    with pytest.raises(FrameError):
        unpack_header(bytes(raw))
    assert feed(bytes(raw) + b"abc").errors


def test_a_peer_that_did_not_offer_trace_never_gets_a_context() -> None:
    ours, theirs = socket.socketpair()
    try:
        conn = BlockingConnection(ours, "test", timeout_s=2)
        deadline = time.monotonic() + 10
        conn.send([Call(Op.PING, b"key")], deadline, trace=TRACE)  # no "trace" offered
        conn.features = frozenset({"trace"})
        conn.send([Call(Op.PING, b"key")], deadline, trace=TRACE)
        wire = b""
        want = 2 * (HEADER_SIZE + 3) + TRACE_CONTEXT_SIZE
        while len(wire) < want:
            wire += theirs.recv(4096)
        handler = feed(wire)
        assert [(h.trace, k) for h, k in handler.got] == [(b"", b"key"), (TRACE, b"key")]
        assert unpack_header(wire[:HEADER_SIZE]).ext == 0
    finally:
        ours.close()
        theirs.close()


def test_a_node_serves_a_traced_get_in_a_child_span_of_the_callers(
    spans: InMemorySpanExporter,
) -> None:
    data = b"v" * 4096

    async def scenario() -> None:
        tier = CpuTier(16 << 20)
        store = BlockStore(tier, LruPolicy(), max_block_size=1 << 20, clock=lambda: 0.0)
        server = DataServer(store)
        try:
            port = await server.start("127.0.0.1", 0)
            conn = await asyncio.to_thread(_blocking, port)
            try:
                calls = [
                    Call(Op.PUT, b"blk", write_id=3, checksum=block_checksum(data), payload=data),
                    Call(Op.PUBLISH, b"blk", write_id=3, version=1),
                ]
                await asyncio.to_thread(conn.exchange, calls, time.monotonic() + 10)
                unsampled = Call(Op.GET, b"blk", write_id=3)
                await asyncio.to_thread(
                    conn.exchange, [unsampled], time.monotonic() + 10, trace=UNSAMPLED
                )
                assert unsampled.status == Status.OK  # served, and no span made for it
                hit = Call(Op.GET, b"blk", write_id=3, sink=memoryview(bytearray(len(data))))
                miss = Call(Op.GET, b"blk", write_id=4)
                await asyncio.to_thread(
                    conn.exchange, [hit, miss], time.monotonic() + 10, trace=TRACE
                )
                assert hit.status == Status.OK
                assert bytes(hit.data or b"") == data
                assert miss.status == Status.MISS
            finally:
                conn.close()
        finally:
            await server.close()
            tier.close()

    asyncio.run(scenario())
    finished = {s.name: s for s in spans.get_finished_spans()}
    node_spans = [s for s in spans.get_finished_spans() if s.name == "kvpool.node.get"]
    assert len(node_spans) == 2
    for span in node_spans:
        assert span.parent is not None
        assert span.parent.span_id == 0x1122334455667788
        assert span.context.trace_id == 0x0123456789ABCDEF0123456789ABCDEF
    hit_span, miss_span = sorted(
        node_spans, key=lambda s: not dict(s.attributes or {})["kvpool.hit"]
    )
    hit_attrs, miss_attrs = dict(hit_span.attributes or {}), dict(miss_span.attributes or {})
    assert hit_attrs["kvpool.tier"] == "cpu"
    assert hit_attrs["kvpool.bytes"] == 4096
    assert miss_attrs["kvpool.miss_reason"] == "version_mismatch"
    assert "kvpool.tier.read" not in finished  # a CPU block is sent from where it lies


def _blocking(port: int) -> BlockingConnection:
    conn = BlockingConnection(socket.create_connection(("127.0.0.1", port)), "node")
    conn.features = frozenset({"trace"})
    return conn


@pytest.mark.parametrize(
    ("env", "chosen"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, []),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, []),  # no endpoint: nothing to send to
        ({tracing.TRACE_FILE_ENV: "/tmp/x"}, ["file"]),
    ],
)
def test_exporters_come_only_from_the_otel_variables(env: dict[str, str], chosen: Any) -> None:
    assert tracing.chosen_exporters(env) == chosen


def test_untraced_processes_set_nothing_up() -> None:
    assert tracing.setup_tracing("test", {}) is False
    assert tracing.frame_trace() == b""
    assert tracing.grpc_metadata((("a", "b"),)) == (("a", "b"),)


def test_log_lines_inside_a_span_carry_its_trace_and_span_ids(
    spans: InMemorySpanExporter,
) -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    log = get_logger("test.obs")
    try:
        log.info("outside")
        with tracing.tracer().start_as_current_span("request") as span:
            log.info("inside")
        ctx = span.get_span_context()
    finally:
        configure_logging("info", "json")
    outside, inside = (json.loads(line) for line in out.getvalue().splitlines())
    assert "trace_id" not in outside
    assert "span_id" not in outside
    assert inside["trace_id"] == f"{ctx.trace_id:032x}"
    assert inside["span_id"] == f"{ctx.span_id:016x}"


def test_metrics_server_answers_the_text_format_and_404_elsewhere() -> None:
    tier = CpuTier(8 << 20)
    store = BlockStore(tier, LruPolicy(), max_block_size=1 << 20, clock=lambda: 0.0)
    remove = register_collector(lambda: node_families(store))

    async def fetch(port: int, path: str) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await writer.drain()
        body = await reader.read()
        writer.close()
        return body

    async def scenario() -> tuple[bytes, bytes]:
        server = MetricsServer()
        port = await server.start("127.0.0.1", 0)
        try:
            return await fetch(port, "/metrics"), await fetch(port, "/nope")
        finally:
            await server.close()

    try:
        ok, missing = asyncio.run(scenario())
    finally:
        remove()
        tier.close()
    assert ok.startswith(b"HTTP/1.0 200")
    assert b'kvpool_node_tier_capacity_bytes{tier="cpu"} 8.388608e+06' in ok
    assert b'kvpool_node_misses_total{reason="checksum_mismatch"} 0.0' in ok
    assert missing.startswith(b"HTTP/1.0 404")
    assert b"kvpool_node_tier_capacity_bytes" not in render()  # removed again


@pytest.mark.parametrize(("port", "ok"), [(-1, True), (0, True), (9100, True), (-2, False)])
def test_metrics_port_is_validated(port: int, ok: bool) -> None:
    errors = NodeConfig(metrics_port=port).validate()
    assert (not any(e.startswith("metrics_port") for e in errors)) is ok


def _status_doc(fill: float) -> dict[str, Any]:
    return {
        "leader": "127.0.0.1:7300",
        "ring_version": 3,
        "masters": [
            {
                "address": "127.0.0.1:7300",
                "reachable": True,
                "role": "leader",
                "term": 2,
                "commit_index": 10,
                "last_applied": 10,
                "lag": 0,
                "ready": True,
                "entries": 5,
            }
        ],
        "nodes": [
            {
                "node_id": "node-1",
                "member_id": 1,
                "data_address": "tcp://127.0.0.1:7400",
                "hit_rate": 0.75,
                "blocks": 12,
                "capacity_bytes": 100,
                "used_bytes": 50,
                "fill": 0.5,
                "tiers": [
                    {"name": "cpu", "capacity_bytes": 1 << 30, "used_bytes": 0, "fill": fill},
                    {"name": "ssd", "capacity_bytes": 1 << 30, "used_bytes": 0, "fill": 0.1},
                ],
            }
        ],
    }


def test_status_highlights_a_tier_at_the_85_percent_alarm() -> None:
    from kvpool.cli.status import ALARM_ON, render_status

    calm = render_status(_status_doc(0.84), color=True)
    assert "ALARM" not in calm
    assert "75.0%" in calm  # the hit rate
    plain = render_status(_status_doc(0.85))
    assert "85% !ALARM" in plain
    assert ALARM_ON not in plain  # no escape codes when not on a terminal
    colored = render_status(_status_doc(0.9), color=True)
    assert f"{ALARM_ON}90% !ALARM" in colored
    assert "10%" in colored  # the SSD tier's own row, not alarmed
    assert colored.count("!ALARM") == 1


def test_status_shows_how_full_the_index_is_against_its_limit() -> None:
    from kvpool.cli.status import render_status

    doc = _status_doc(0.1)
    assert " 5\n" in render_status(doc) + "\n"  # an older master names no limit
    doc["masters"][0]["max_entries"] = 100
    assert "5 of 100 (5%)" in render_status(doc)
    doc["masters"][0]["entries"] = 90
    assert "90 of 100 (90% !ALARM)" in render_status(doc)


def test_status_watch_refreshes_and_ctrl_c_exits_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (a real SIGINT, here during the third round's collection) stops the watch once
    that round's collection is over — not in the middle of it, where it once landed inside
    ``asyncio.run``'s shutdown and a traceback followed —: that round is not printed, the exit
    is 0, and the previous SIGINT handler is back."""
    import signal

    from kvpool.cli import status

    docs = iter([_status_doc(0.1), _status_doc(0.9), _status_doc(0.2)])
    asked: list[float] = []
    finished: list[bool] = []

    def collect(masters: list[str], timeout_s: float) -> dict[str, Any]:
        asked.append(time.monotonic())
        if len(asked) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the round is collected
            time.sleep(0.05)  # a default handler would raise KeyboardInterrupt here
            finished.append(True)
        return next(docs)

    monkeypatch.setattr(status, "collect_status", collect)
    before = signal.getsignal(signal.SIGINT)
    out = io.StringIO()
    assert status.watch_status(["127.0.0.1:7300"], 0.2, out=out) == 0
    text = out.getvalue()
    assert text.count("kvpool status  ") == 2  # two refreshes, then Ctrl-C
    assert "90% !ALARM" in text
    assert len(asked) == 3
    assert finished == [True]  # the round's collection was not interrupted
    assert all(b - a >= 0.19 for a, b in itertools.pairwise(asked))  # every 0.2 s
    assert signal.getsignal(signal.SIGINT) is before


def test_a_grpc_call_carries_the_callers_trace_and_is_timed(
    spans: InMemorySpanExporter,
) -> None:
    from kvpool.grpcutil import create_channel, start_server, unary
    from kvpool.metrics import REGISTRY
    from kvpool.proto.v1 import master_pb2, master_pb2_grpc

    class Members(master_pb2_grpc.MasterServicer):
        async def GetMembers(self, request: Any, context: Any) -> Any:
            return master_pb2.GetMembersResponse(ring_version=7)

    def count() -> float:
        value = REGISTRY.get_sample_value(
            "kvpool_rpc_server_latency_seconds_count",
            {"method": "GetMembers", "transport": "grpc"},
        )
        return value or 0.0

    async def scenario() -> tuple[int, int]:
        handle = await start_server(
            "127.0.0.1:0",
            [
                (
                    master_pb2_grpc.add_MasterServicer_to_server,
                    Members(),  # type: ignore[abstract]
                    "kvpool.v1.Master",
                )
            ],
        )
        channel = create_channel(f"127.0.0.1:{handle.port}")
        try:
            stub = master_pb2_grpc.MasterStub(channel)
            await unary(stub.GetMembers, master_pb2.GetMembersRequest(), timeout_s=5)  # no span
            with tracing.tracer().start_as_current_span("caller") as caller:
                answer = await unary(stub.GetMembers, master_pb2.GetMembersRequest(), timeout_s=5)
            assert answer.ring_version == 7
            ctx = caller.get_span_context()
            return ctx.trace_id, ctx.span_id
        finally:
            await channel.close()
            await handle.stop(0)

    before = count()
    trace_id, caller_id = asyncio.run(scenario())
    assert count() - before == 2  # both calls timed
    served = [s for s in spans.get_finished_spans() if s.name == "kvpool.v1.Master/GetMembers"]
    assert len(served) == 1  # the untraced call made no span
    assert served[0].context.trace_id == trace_id
    assert served[0].parent is not None
    assert served[0].parent.span_id == caller_id
