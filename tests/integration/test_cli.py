"""The ``kvpool`` command as an operator uses it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.client.sync import Client
from kvpool.launcher.cluster import LocalCluster, pid_runs_kvpool
from tests.integration.conftest import ClusterFactory


def kvpool(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ((), "cluster"),
        (("master",), "--raft-peers"),
        (("node",), "--cpu-cache-size"),
        (("cluster", "up"), "--detach"),
        (("cluster", "down"), "--dir"),
        (("status",), "--json"),
        (("demo",), "--blocks"),
        (("bench",), "kvpool-bench"),
    ],
)
def test_every_command_has_help(command: tuple[str, ...], expected: str) -> None:
    result = kvpool(*command, "--help")
    assert result.returncode == 0
    assert expected in result.stdout


def test_master_without_secret_is_refused_with_the_setting_named(tmp_path: Path) -> None:
    result = kvpool("master", "--data-dir", str(tmp_path), "--raft-secret", "")
    assert result.returncode == 2
    assert "raft_secret" in result.stderr


def test_node_with_a_cpu_tier_above_the_memory_limit_is_refused() -> None:
    result = kvpool("node", "--cpu-cache-size", "64TiB")
    assert result.returncode == 2
    assert "cpu_cache_size" in result.stderr
    assert "memory" in result.stderr


def test_bad_values_are_all_reported_at_once() -> None:
    result = kvpool(
        "node", "--cpu-cache-size", "lots", "--high-watermark", "high", "--listen", "nowhere"
    )
    assert result.returncode == 2
    for name in ("cpu_cache_size", "high_watermark"):
        assert name in result.stderr


@pytest.mark.integration
def test_cluster_up_detach_status_and_down(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    try:
        up = kvpool("cluster", "up", "--detach", "--dir", str(directory), "--in-memory")
        assert up.returncode == 0, up.stderr
        doc = json.loads((directory / "cluster.json").read_text())
        roles = sorted(p["role"] for p in doc["processes"])
        assert roles == ["master", "master", "master", "node", "node"]
        pids = [p["pid"] for p in doc["processes"]]
        assert all(pid_runs_kvpool(pid) for pid in pids)

        # A cluster that has just started may still be settling (on a loaded 2-core machine a
        # starved follower can stand as candidate once): wait for one leader, two followers.
        deadline = time.monotonic() + 20
        while True:
            status = kvpool("status", "--dir", str(directory), "--json")
            assert status.returncode == 0, status.stderr
            report = json.loads(status.stdout)
            roles = sorted(m.get("role", "unreachable") for m in report["masters"])
            if roles == ["follower", "follower", "leader"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert roles == ["follower", "follower", "leader"]
        assert report["leader"] in doc["masters"]
        assert sorted(n["node_id"] for n in report["nodes"]) == ["node-1", "node-2"]

        table = kvpool("status", "--masters", ",".join(doc["masters"]))
        assert table.returncode == 0
        assert "leader" in table.stdout
        assert "node-1" in table.stdout

        down = kvpool("cluster", "down", "--dir", str(directory))
        assert down.returncode == 0
        assert "stopped 5 processes" in down.stdout
        assert not any(pid_runs_kvpool(pid) for pid in pids)
    finally:
        if (directory / "cluster.json").exists():
            LocalCluster.from_dir(directory).stop()


def test_status_of_unreachable_masters_says_so() -> None:
    result = kvpool("status", "--masters", "127.0.0.1:1", "--timeout-s", "0.3")
    assert result.returncode == 1
    assert "unreachable" in result.stdout


@pytest.mark.parametrize("what", ["peers", "cluster", "tiers"])
def test_a_benchmark_is_pointed_to_kvpool_bench(what: str) -> None:
    result = kvpool("bench", what, "--quick")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "pip install -e bench" in result.stderr
    assert f"kvpool-bench {what}" in result.stderr


def test_bench_without_a_cluster_says_how_to_name_one() -> None:
    result = kvpool("bench")
    assert result.returncode == 2
    assert "--masters" in result.stderr
    assert "--dir" in result.stderr


@pytest.mark.integration
def test_bench_smoke_run_on_a_running_cluster(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(masters=1, nodes=1, in_memory=True)
    masters = ",".join(cluster.master_addresses)
    result = kvpool(
        "bench", "--masters", masters, "--rounds", "3", "--sizes", "4KiB,64KiB", "--json"
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["latency"]["failures"] == 0
    for size in ("4.0 KiB", "64.0 KiB"):
        assert doc["latency"][size]["get"]["n"] == 3
        assert doc["latency"][size]["put"]["p50_ms"] > 0
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        assert kv.remove_prefix("kvpool-bench-smoke/") == (0, False)  # it removed its keys
