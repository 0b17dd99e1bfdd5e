"""Observability on real processes: one trace across client, master and node; /metrics of
every process; the Grafana dashboard's queries; master readiness over gRPC health."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.client.sync import Client
from kvpool.launcher.cluster import LocalCluster
from kvpool.tracing import TRACE_FILE_ENV
from tests.signals import interruptible_module

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "kvpool.json"

CLIENT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from kvpool import Client
    from kvpool.tracing import tracer

    masters = sys.argv[1].split(",")
    with Client(masters, timeout_s=5.0) as writer:  # another engine put it: a lookup to read
        assert writer.put("obs/key", b"x" * 4096)
    # tcp: a same-host client reads blocks in memory through the node's shared directory, with
    # no message and so no node span; this trace is the one of a read the node serves.
    with Client(masters, timeout_s=5.0, transport="tcp") as kv:
        kv.get("obs/warm")  # connections and the RPC port learned outside the traced get
        assert kv.get("obs/key") == b"x" * 4096
        assert kv.get("obs/absent") is None
    print(json.dumps({"ok": True}))
    """
)


ASYNC_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from kvpool import AsyncClient

    async def main():
        async with AsyncClient(sys.argv[1].split(","), timeout_s=5.0) as writer:
            assert await writer.put("obs/async", b"a" * 2048)  # read by another client below
        kv = AsyncClient(sys.argv[1].split(","), timeout_s=5.0, transport="tcp")
        try:
            await kv.get("obs/warm-async")
            assert await kv.get("obs/async") == b"a" * 2048
        finally:
            await kv.close()

    asyncio.run(main())
    """
)


@pytest.fixture(scope="module")
def traced_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Path]]:
    """One master and one node exporting spans to a file, with /metrics on ephemeral ports."""
    directory = tmp_path_factory.mktemp("obs")
    spans = directory / "spans.jsonl"
    saved = {k: os.environ.get(k) for k in (TRACE_FILE_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT")}
    os.environ[TRACE_FILE_ENV] = str(spans)
    os.environ.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    cluster = LocalCluster(
        directory / "cluster", masters=1, nodes=1, cpu_cache_size="64MiB", metrics=True
    )
    try:
        cluster.start()
        cluster.wait_for_leader()
        yield cluster, spans
    finally:
        cluster.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_client(cluster: LocalCluster, spans: Path, script: str = CLIENT_SCRIPT) -> int:
    env = dict(os.environ)
    env[TRACE_FILE_ENV] = str(spans)
    proc = subprocess.run(
        [sys.executable, "-c", script, ",".join(cluster.master_addresses)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return 0


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        assert resp.status == 200
        return str(resp.read().decode())


def _value(text: str, name: str, labels: str = "") -> float:
    """The value of one sample (``labels`` as in the exposition, e.g. 'tier="cpu"')."""
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"")
    m = re.search(r"^" + pattern + r" ([0-9.e+-]+)$", text, re.MULTILINE)
    assert m is not None, f"no sample {name}{{{labels}}} in the scrape"
    return float(m.group(1))


def _metrics_addresses(cluster: LocalCluster) -> dict[str, str]:
    out = {}
    for info in cluster.processes.values():
        address = info.extra.get("metrics")
        assert address, f"{info.name} wrote no metrics address in its ready file"
        out[info.name] = address
    return out


def test_one_get_is_one_trace_across_client_master_and_node(
    traced_cluster: tuple[LocalCluster, Path],
) -> None:
    cluster, spans_file = traced_cluster
    _run_client(cluster, spans_file)
    deadline = time.monotonic() + 10
    while True:
        spans = _spans(spans_file)
        gets = [
            s
            for s in spans
            if s["name"] == "kvpool.get" and s["attributes"].get("kvpool.hit") is True
        ]
        if gets:
            trace_id = gets[-1]["trace_id"]
            in_trace = [s for s in spans if s["trace_id"] == trace_id]
            if {s["service"] for s in in_trace} >= {"kvpool-master", "kvpool-node"}:
                break
        assert time.monotonic() < deadline, f"no complete trace of a get in {spans}"
        time.sleep(0.2)
    by_id = {s["span_id"]: s for s in in_trace}
    names = {s["name"] for s in in_trace}
    assert names == {
        "kvpool.get",
        "kvpool.client.lookup",
        "kvpool.v1.Master/Lookup",
        "kvpool.node.get",
    }, names
    # Three processes, one trace, every span's parent inside it (but the root).
    assert len({s["pid"] for s in in_trace}) == 3
    roots = [s for s in in_trace if s["parent_id"] is None]
    assert [r["name"] for r in roots] == ["kvpool.get"]
    for span in in_trace:
        if span["parent_id"] is not None:
            assert span["parent_id"] in by_id, f"{span['name']}: parent outside the trace"
    node_get = next(s for s in in_trace if s["name"] == "kvpool.node.get")
    assert by_id[node_get["parent_id"]]["name"] == "kvpool.get"  # one node: no per-node span
    assert node_get["attributes"]["kvpool.tier"] == "cpu"
    assert node_get["attributes"]["kvpool.bytes"] == 4096
    lookup = next(s for s in in_trace if s["name"] == "kvpool.v1.Master/Lookup")
    assert by_id[lookup["parent_id"]]["name"] == "kvpool.client.lookup"
    root = roots[0]
    assert root["attributes"]["kvpool.keys"] == 1
    assert root["attributes"]["kvpool.bytes"] == 4096
    assert root["attributes"]["kvpool.tier"] == ["cpu"]
    # The miss of an absent key says why.
    misses = [
        s
        for s in _spans(spans_file)
        if s["name"] == "kvpool.get" and s["attributes"].get("kvpool.hit") is False
    ]
    assert any(s["attributes"].get("kvpool.miss_reason") == ["absent"] for s in misses)


def test_the_async_client_traces_its_gets_too(traced_cluster: tuple[LocalCluster, Path]) -> None:
    cluster, spans_file = traced_cluster
    _run_client(cluster, spans_file, ASYNC_SCRIPT)
    deadline = time.monotonic() + 10
    while True:
        spans = _spans(spans_file)
        gets = [
            s
            for s in spans
            if s["name"] == "kvpool.get" and s["attributes"].get("kvpool.bytes") == 2048
        ]
        in_trace = [s for s in spans if gets and s["trace_id"] == gets[-1]["trace_id"]]
        names = {s["name"] for s in in_trace}
        if {"kvpool.v1.Master/Lookup", "kvpool.node.get"} <= names:
            break
        assert time.monotonic() < deadline, f"no complete trace of an async get in {spans}"
        time.sleep(0.2)
    root = gets[-1]
    lookup = next(s for s in in_trace if s["name"] == "kvpool.v1.Master/Lookup")
    node_get = next(s for s in in_trace if s["name"] == "kvpool.node.get")
    # The same spans as the synchronous client's: the Lookup under a kvpool.client.lookup
    # (over gRPC: traceparent metadata), that under the get.
    asked = next(s for s in in_trace if s["span_id"] == lookup["parent_id"])
    assert asked["name"] == "kvpool.client.lookup"
    assert asked["parent_id"] == root["span_id"]
    assert node_get["parent_id"] == root["span_id"]  # over the data plane: the frame header
    assert node_get["attributes"]["kvpool.bytes"] == 2048


def test_every_process_serves_metrics(traced_cluster: tuple[LocalCluster, Path]) -> None:
    cluster, spans_file = traced_cluster
    _run_client(cluster, spans_file)
    addresses = _metrics_addresses(cluster)
    master = _scrape(addresses[cluster.master_names[0]])
    node = _scrape(addresses[cluster.node_names[0]])
    until = time.monotonic() + 5.0  # the client's PUBLISHes are posted, not waited for
    while _value(node, "kvpool_node_publishes_total") < 1 and time.monotonic() < until:
        time.sleep(0.05)
        node = _scrape(addresses[cluster.node_names[0]])
    assert _value(master, "kvpool_raft_role", 'role="leader"') == 1
    assert _value(master, "kvpool_raft_term") >= 1
    assert _value(master, "kvpool_raft_commit_index") >= 1
    assert _value(master, "kvpool_raft_ready") == 1
    # A group of one elects itself with no one to ask or to answer: the election guards'
    # counters are served, at 0 (tests/integration/test_lease_raft.py counts them in a group).
    for name in ("prevotes", "votes_refused", "stale_appends_answered", "stepdowns"):
        assert _value(master, f"kvpool_raft_{name}_total") == 0
    assert _value(master, "kvpool_index_entries") >= 1
    assert _value(master, "kvpool_index_live_nodes") == 1
    assert _value(master, "kvpool_replica_repairs_total") >= 0
    assert _value(master, "kvpool_replica_under_target_blocks") >= 0
    # Lookups arrive on the frame RPC port; sub-millisecond buckets exist.
    assert (
        _value(
            master,
            "kvpool_rpc_server_latency_seconds_count",
            'method="Lookup",transport="frame"',
        )
        >= 1
    )
    assert 'le="0.0001"' in master
    assert _value(node, "kvpool_node_hits_total") >= 1
    # The client's puts were published by their commit receipts: no Lookup asked of the leader.
    assert _value(node, "kvpool_node_publishes_total") >= 1
    assert _value(node, "kvpool_node_receipt_publishes_total") == _value(
        node, "kvpool_node_publishes_total"
    )
    assert _value(node, "kvpool_node_tier_capacity_bytes", 'tier="cpu"') == 64 * 2**20
    assert _value(node, "kvpool_node_tier_used_bytes", 'tier="cpu"') >= 4096
    assert _value(node, "kvpool_node_watermark_ratio", 'mark="high"') == 0.85
    assert _value(node, "kvpool_node_misses_total", 'reason="evicted"') == 0
    assert _value(node, "kvpool_node_replica_repairs_total") == 0
    assert _value(node, "kvpool_node_transfer_latency_seconds_count", 'op="get",tier="cpu"') >= 1
    assert _value(node, "kvpool_node_registered") == 1
    with urllib.request.urlopen(
        f"http://{addresses[cluster.node_names[0]]}/metrics", timeout=5
    ) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")


def test_a_client_serves_its_metrics_when_asked(traced_cluster: tuple[LocalCluster, Path]) -> None:
    cluster, _ = traced_cluster
    with Client(cluster.master_addresses, timeout_s=5.0) as quiet:
        assert quiet.metrics_address == ""  # off by default
    with Client(cluster.master_addresses, timeout_s=5.0, metrics_port=0) as kv:
        assert kv.put("obs/client", b"c" * 100)
        assert kv.get("obs/client") == b"c" * 100
        assert kv.get("obs/client-absent") is None
        text = _scrape(kv.metrics_address)
        address = kv.metrics_address
    assert _value(text, "kvpool_client_hits_total") == 1
    assert _value(text, "kvpool_client_misses_total", 'reason="absent"') == 1
    assert _value(text, "kvpool_client_misses_total", 'reason="checksum_mismatch"') == 0
    assert _value(text, "kvpool_client_puts_total", 'result="ok"') == 1
    with pytest.raises(urllib.error.URLError):  # closed with the client
        _scrape(address)


def test_grafana_dashboard_queries_only_served_metrics(
    traced_cluster: tuple[LocalCluster, Path],
) -> None:
    cluster, spans_file = traced_cluster
    _run_client(cluster, spans_file)
    with Client(cluster.master_addresses, timeout_s=5.0, metrics_port=0) as kv:
        kv.get("obs/key")
        client = _scrape(kv.metrics_address)
    scraped = "\n".join([client, *(_scrape(a) for a in _metrics_addresses(cluster).values())])
    # Sample names, and families declared without samples yet (follower lag on a lone master).
    served = set(re.findall(r"^(kvpool_[a-z_]+)", scraped, re.MULTILINE))
    served |= set(re.findall(r"^# TYPE (kvpool_[a-z_]+) gauge", scraped, re.MULTILINE))
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    assert len(exprs) >= 10
    queried = {name for expr in exprs for name in re.findall(r"\b(kvpool_[a-z_]+)", expr)}
    missing = sorted(queried - served)
    assert not missing, f"the dashboard queries metrics no process serves: {missing}"


def test_master_readiness_over_grpc_health(traced_cluster: tuple[LocalCluster, Path]) -> None:
    cluster, _ = traced_cluster
    with grpc.insecure_channel(cluster.master_addresses[0]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        live = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        ready = stub.Check(health_pb2.HealthCheckRequest(service="kvpool.v1.Master"), timeout=5)
    assert live.status == health_pb2.HealthCheckResponse.SERVING
    assert ready.status == health_pb2.HealthCheckResponse.SERVING


def test_status_shows_tiers_and_hit_rate_and_watch_stops_on_ctrl_c(
    traced_cluster: tuple[LocalCluster, Path],
) -> None:
    cluster, spans_file = traced_cluster
    _run_client(cluster, spans_file)
    masters = ",".join(cluster.master_addresses)
    cli = [sys.executable, "-m", "kvpool", "status", "--masters", masters]
    once = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert once.returncode == 0, once.stderr
    (node,) = json.loads(once.stdout)["nodes"]
    assert [t["name"] for t in node["tiers"]] == ["cpu"]
    assert node["tiers"][0]["capacity_bytes"] == 64 * 2**20
    assert node["tiers"][0]["blocks"] >= 1
    assert 0 < node["hit_rate"] <= 1
    watch = subprocess.Popen(  # ctrl-c ends the watch (as a user at a terminal would)
        interruptible_module("kvpool", *cli[3:], "--watch", "0.3"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(3)
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=20)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate()
    assert watch.returncode == 0, err
    assert "Traceback" not in err
    assert out.count("kvpool status  ") >= 2
    assert "HIT RATE" in out
