"""``kvpool-bench tracing``: what tracing costs a get, and what the trace of one get shows.

A local cluster (3 masters, 2 nodes) exports spans over OTLP to a small collector run by this
command (it counts and keeps what it receives), as a production cluster would to its collector.
The client here reads 4 KiB blocks in rounds, tracing on and off in alternation (the order
flipped each round, so drift in the machine's load hits both alike): off, the client sends no
trace context and no process makes a span — the cost of an untraced request on a traced
cluster, which is also that of a cluster with no ``OTEL_*`` variables at all (one attribute
test per call site). Reports gets/s per mode (median of rounds, with every round), the ratio,
and the spans of one traced get: name, process, duration, nesting.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from kvpool import tracing
from kvpool.client.sync import Client
from kvpool.launcher.cluster import LocalCluster

SIZE = 4096
TRACED_GETS = 21


class _Collector:
    """An OTLP/gRPC trace collector in a child process (so that decoding what it is sent takes
    no CPU from the measured client), appending every span it receives to a JSON-lines file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool_bench.tracing", str(path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        self.port = int(self._proc.stdout.readline())

    @property
    def spans(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        lines = self.path.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        return [s for s in self.spans if s["trace_id"] == trace_id]

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def collector_main(path: str) -> None:
    """The collector process: serve OTLP trace exports, print the port, run until killed."""
    from opentelemetry.proto.collector.trace.v1 import (
        trace_service_pb2,
        trace_service_pb2_grpc,
    )

    lock = threading.Lock()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC name
            lines = [json.dumps(doc) + "\n" for doc in _span_docs(request)]
            with lock, open(path, "a", encoding="utf-8") as f:
                f.write("".join(lines))
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
        Service(), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def _span_docs(request: Any) -> list[dict[str, Any]]:
    out = []
    for resource_spans in request.resource_spans:
        service = next(
            (
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            ),
            "?",
        )
        for scope in resource_spans.scope_spans:
            for span in scope.spans:
                out.append(
                    {
                        "name": span.name,
                        "service": service,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_id": span.parent_span_id.hex() or None,
                        "start_ns": span.start_time_unix_nano,
                        "duration_us": (span.end_time_unix_nano - span.start_time_unix_nano) / 1e3,
                    }
                )
    return out


def _sampled_tracer(ratio: float) -> Any:
    """A tracer that samples ``ratio`` of the client's gets (the servers follow the caller's
    decision: their default sampler is parent-based), exporting like the client's own."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    base = tracing.STATE.provider
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)), resource=base.resource)
    provider.add_span_processor(BatchSpanProcessor(tracing.otlp_exporter(os.environ)))
    return provider.get_tracer("kvpool")


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by this process and ``pids``."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _measure(kv: Client, keys: list[str], gets: int, pids: list[int]) -> tuple[float, float]:
    """(gets per second, CPU µs per get summed over the client and every kvpool process)."""
    cpu = _cpu_s(pids)
    started = time.perf_counter()
    for i in range(gets):
        if kv.get(keys[i % len(keys)]) is None:
            raise RuntimeError("a get missed during the measurement")
    elapsed = time.perf_counter() - started
    return gets / elapsed, (_cpu_s(pids) - cpu) / gets * 1e6


def _gets_per_s(kv: Client, keys: list[str], gets: int) -> float:
    return _measure(kv, keys, gets, [])[0]


def _tree(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Spans in depth-first order with their depth (children by start time)."""
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for s in spans:
        parent = s["parent_id"] if s["parent_id"] in ids else None
        children.setdefault(parent, []).append(s)
    out: list[dict[str, Any]] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s["start_ns"]):
            out.append({**s, "depth": depth})
            walk(s["span_id"], depth + 1)

    walk(None, 0)
    return out


def bench_tracing(
    rounds: int = 7, gets: int = 2000, directory: str | None = None
) -> dict[str, Any]:
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="kvpool-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    collector = _Collector(root / "spans.jsonl")
    saved = dict(os.environ)
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{collector.port}"
    os.environ["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "500"
    cluster = LocalCluster(
        root / "cluster", masters=3, nodes=2, cpu_cache_size="256MiB", log_level="warning"
    )
    try:
        cluster.start()
        cluster.wait_for_leader()
        with Client(cluster.master_addresses, timeout_s=5.0) as kv:
            if not tracing.enabled():
                raise RuntimeError("tracing did not start in the client")
            keys = [f"bench/trace/{i}" for i in range(64)]
            kv.batch_put({k: bytes([i % 251]) * SIZE for i, k in enumerate(keys)})
            _gets_per_s(kv, keys, 500)  # warm-up: connections, RPC port, lookup paths
            every = tracing.STATE.tracer
            one_in_100 = _sampled_tracer(0.01)
            tracers = {"on": every, "sampled_1pct": one_in_100, "off": None}
            samples: dict[str, list[float]] = {mode: [] for mode in tracers}
            cpu: dict[str, list[float]] = {mode: [] for mode in tracers}
            pids = [p.pid for p in cluster.processes.values()]
            for r in range(rounds):
                order = list(tracers) if r % 2 == 0 else list(reversed(tracers))
                for mode in order:
                    tracer = tracers[mode]
                    tracing.STATE.enabled = tracer is not None
                    if tracer is not None:
                        tracing.STATE.tracer = tracer
                    rate, cpu_us = _measure(kv, keys, gets, pids)
                    samples[mode].append(rate)
                    cpu[mode].append(cpu_us)
            tracing.STATE.enabled, tracing.STATE.tracer = True, every
        with Client(cluster.master_addresses, timeout_s=5.0, lookup_cache_size=0) as uncached:
            for key in keys:  # connections to every node and master RPC port, warm
                uncached.get(key)
            before = time.time_ns()
            for _ in range(TRACED_GETS):  # the trace shown: a warm get that asks the masters
                uncached.get(keys[0])
            one = _median_get_spans(collector, before)
        med = {mode: statistics.median(v) for mode, v in samples.items()}
        return {
            "gets_per_round": gets,
            "block_bytes": SIZE,
            "gets_per_s_tracing_off": med["off"],
            "gets_per_s_tracing_on": med["on"],
            "gets_per_s_sampled_1pct": med["sampled_1pct"],
            "ratio_on_over_off": med["on"] / med["off"],
            "ratio_sampled_1pct_over_off": med["sampled_1pct"] / med["off"],
            # the same ratios taken within each round, then their median (less load drift)
            "median_round_ratio_on_over_off": statistics.median(
                a / b for a, b in zip(samples["on"], samples["off"], strict=True)
            ),
            "median_round_ratio_sampled_1pct_over_off": statistics.median(
                a / b for a, b in zip(samples["sampled_1pct"], samples["off"], strict=True)
            ),
            # CPU time per get, every kvpool process and the client summed: the cost itself,
            # less sensitive than throughput to other load on a shared machine
            "cpu_us_per_get": {mode: statistics.median(v) for mode, v in cpu.items()},
            "rounds": {mode: [round(x) for x in v] for mode, v in samples.items()},
            "rounds_cpu_us_per_get": {mode: [round(x) for x in v] for mode, v in cpu.items()},
            "one_get": [
                {
                    "span": "  " * s["depth"] + s["name"],
                    "process": s["service"],
                    "duration_us": round(s["duration_us"], 1),
                }
                for s in one
            ],
            "spans_received": len(collector.spans),
        }
    finally:
        cluster.stop()
        collector.stop()
        os.environ.clear()
        os.environ.update(saved)
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)


def _median_get_spans(collector: _Collector, since_ns: int) -> list[dict[str, Any]]:
    """The spans of the client's ``kvpool.get`` of median duration among those started after
    ``since_ns``, from every process (waits for the servers' batch exporters)."""
    provider = tracing.STATE.provider
    if provider is not None:
        provider.force_flush()
    deadline = time.monotonic() + 10
    while True:
        spans = collector.spans
        gets = sorted(
            (s for s in spans if s["name"] == "kvpool.get" and s["start_ns"] >= since_ns),
            key=lambda s: s["duration_us"],
        )
        if len(gets) >= TRACED_GETS or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if not gets:
        return []
    time.sleep(1.0)  # the servers' last batches
    return _tree(collector.trace(gets[len(gets) // 2]["trace_id"]))


if __name__ == "__main__":
    collector_main(sys.argv[1])
