"""``kvpool-bench peers``: the smoke run a user (and CI) gets with ``--quick``, and the kvpool
drivers against a real cluster — the sync Client, an async client, and the newer client
features picked up when they exist. Peers not installed here are skipped by the bench itself,
with the line saying how to install them."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvpool.client.core import ClientCore
from kvpool.client.settings import make_config
from kvpool.client.sync import Client
from kvpool.launcher.cluster import LocalCluster
from kvpool_bench.drivers import KvpoolAsyncDriver, KvpoolDriver, _client_kwargs
from kvpool_bench.peer_servers import KvpoolServers, _shared_rss, wait_prefaulted
from kvpool_bench.worker import Worker

pytestmark = pytest.mark.integration


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline}")
    return found


def _quick_run(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    """``kvpool-bench peers --quick FLAGS`` as a user runs it: its output and its JSON, once it
    exited 0 and left no process behind."""
    out = tmp_path / "peers.json"
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_bench", "peers", "--quick", *flags, "--json", str(out),
         "--dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not _processes_mentioning(str(run_dir)), "the bench left processes running"
    return proc, json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_quick_run_measures_everything_and_verifies_every_byte(tmp_path: Path) -> None:
    proc, doc = _quick_run(tmp_path)

    assert doc["schema"] == "kvpool-bench-peers/1"
    assert doc["limits"]["memcpy_GBps"] > 0.1
    assert doc["limits"]["loopback_tcp_GBps"] > 0.01
    assert 0 < doc["limits"]["round_trip_us"] < 1e6
    assert "a 64-byte request and its answer between them" in proc.stdout
    systems = doc["systems"]
    measured = [name for name, s in systems.items() if s["status"] == "measured"]
    assert any(name.startswith("kvpool") for name in measured)
    for name in ("redis", "mooncake"):
        state = systems[name]
        assert state["status"] in ("measured", "skipped"), state
        if state["status"] == "skipped":
            assert "pip install" in state["install"] or "apt-get install" in state["install"]
            assert re.search(rf"^\s+{name}\s+skipped: .*\(install: ", proc.stdout, re.M)

    sizes = doc["options"]["sizes"]
    for name in measured:
        cells = [c for c in doc["cells"] if c["system"] == name]
        shape = {(c["op"], c["mode"], c["size_bytes"], c["clients"]) for c in cells}
        expected = {
            (op, mode, size, clients)
            for op in ("put", "get")
            for mode in ("single", "batch")
            for size in sizes
            for clients in (1, 2)
        }
        assert shape == expected, name
        for c in cells:
            assert c["GBps"] > 0, c
            assert c["keys_per_s"] > 0, c
            assert c["p50_us"] > 0, c
            assert c["p99_us"] >= c["p50_us"]
            assert set(c["of_limit"]) == {"memcpy", "loopback_tcp"}
            if c["op"] == "get":
                # every byte read was compared with what was put, and none differed
                assert c["wrong"] == 0, c
                assert c["misses"] == 0, c
                assert c["bytes_read"] == c["bytes_verified"] == c["bytes"] > 0, c
                assert c["all_bytes_verified"]
            else:
                assert c["failures"] == 0, c
            if name.startswith("kvpool"):
                peers = [p for p in measured if not p.startswith("kvpool")]
                assert sorted(c["vs"]) == sorted(peers)
    verification = doc["verification"]
    assert verification["all_bytes_verified"]
    assert verification["bytes_read"] == verification["bytes_verified"] > 0
    assert len(doc["targets"]) == 7
    assert "GET, one key per call" in proc.stdout
    assert "verified:" in proc.stdout


@pytest.mark.timeout(300)
def test_quick_hand_off_and_engine_modes_report_their_numbers(tmp_path: Path) -> None:
    """The two modes of one writer and one reader process, in quick form, on the default
    cluster (3 masters): a kvpool hand-off miss would break the read-after-ack guarantee."""
    proc, doc = _quick_run(tmp_path, "--modes", "hand-off,engine", "--kvpool-busy-poll-us", "300")
    measured = [n for n, s in doc["systems"].items() if s["status"] == "measured"]
    # every kvpool.Client measured twice: as it comes, and spinning for its answers
    assert {"kvpool-tcp-busy-poll", "kvpool-tcp"} <= set(measured)
    assert not any(n.endswith("-async-busy-poll") for n in doc["systems"])
    sizes = doc["options"]["sizes"]
    assert not doc["cells"]  # no other mode ran
    assert {(c["system"], c["size_bytes"]) for c in doc["handoffs"]} == {
        (s, size) for s in measured for size in sizes
    }
    for c in doc["handoffs"]:
        assert c["handoffs"] > 0, c
        assert c["wrong"] == 0, c
        assert c["bytes_read"] == c["bytes_verified"] == c["handoffs"] * c["size_bytes"], c
        if c["system"].startswith("kvpool"):
            assert c["misses"] == 0, c  # read-after-ack
        assert c["latency_p99_us"] >= c["latency_p50_us"] > 0, c
        assert c["latency_p50_us"] >= c["read_p50_us"] > 0, c
        assert c["signal_p50_us"] >= 0, c
        assert c["pipe_one_way_p50_us"] > 0, c
    engine_systems = [n for n in measured if not n.endswith("-async")]
    expected = {
        (s, q, size)
        for s in engine_systems
        for q in (
            ("prefix_match", "batch_exists") if s.startswith("kvpool")
            else {"redis": ("exists",), "mooncake": ("batch_is_exist",)}[s]
        )
        for size in sizes
    }  # fmt: skip
    assert {(c["system"], c["query"], c["size_bytes"]) for c in doc["engine"]} == expected
    for c in doc["engine"]:
        assert c["batches"] > 0, c
        assert c["batches_per_s"] > 0, c
        assert c["GBps"] > 0, c
        assert c["flow_p50_us"] >= c["query_p50_us"] > 0, c
        assert c["wrong"] == c["misses"] == c["phantoms"] == c["read_misses"] == 0, c
        written = c["keys_per_batch"] - c["keys_per_batch"] // 4
        assert c["hits"] == c["batches"] * written, c
        assert c["bytes_read"] == c["bytes_verified"] == c["hits"] * c["size_bytes"], c
        if c["system"].startswith("kvpool"):
            calls = c["index_calls_per_batch"]
            # One index call per batch: the keys are of kvpool's scheme (they name their
            # content), so prefix_match and batch_exists are each one PrefixMatch (a count, no
            # entries) and the read of the hits goes straight to the nodes, no Lookup
            assert calls.get("Lookup", 0) == 0, c
            assert calls["PrefixMatch"] == 1.0, c
    assert doc["verification"]["all_bytes_verified"]
    assert "HAND-OFF: one process puts a block" in proc.stdout
    assert "ENGINE: per batch" in proc.stdout
    assert "HAND-OFF MISS" not in proc.stdout


_RUNS = itertools.count()


def _run_cell(driver: Any, batch: int) -> dict[str, Any]:
    worker = Worker(0, barrier=None)
    worker.setup({"arena_bytes": 1 << 20, "seed": 3, "systems": []})
    worker.drivers["k"] = driver
    result: dict[str, Any] = worker.cell(
        {
            "system": "k",
            "size_bytes": 16 << 10,
            "keys_per_pass": 16,
            "batch": batch,
            "passes": 2,
            "uid": 1,
            "run": f"it{next(_RUNS)}",  # keys of their own on the shared cluster
            "together": False,
        }
    )
    return result


def _assert_all_verified(result: dict[str, Any]) -> None:
    get = result["get"]
    assert result["put"]["failures"] == 0
    assert get["wrong"] == get["misses"] == 0
    assert get["bytes_verified"] == get["bytes_read"] == 2 * 16 * (16 << 10)


@pytest.mark.parametrize("batch", [0, 8])
def test_sync_and_async_kvpool_drivers_against_a_cluster(
    shared_cluster: LocalCluster, batch: int
) -> None:
    masters = shared_cluster.master_addresses
    sync = KvpoolDriver(Client(masters, timeout_s=10.0))
    try:
        _assert_all_verified(_run_cell(sync, batch))
    finally:
        sync.close()
    # ClientCore has the coroutine methods an AsyncClient offers: the async path runs today.
    driver = KvpoolAsyncDriver(
        lambda: ClientCore(make_config(masters, timeout_s=10.0)),
        name="kvpool",
        client_label="ClientCore",
    )
    try:
        assert driver.api["get"] == "await get_into"
        _assert_all_verified(_run_cell(driver, batch))
    finally:
        driver.close()


class NewerClient:
    """A Client that has what the perf branch adds: batch_get_into and batch_remove."""

    def __init__(self, inner: Client) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def put(self, key: str, value: Any) -> bool:
        return self.inner.put(key, value)

    def get_into(self, key: str, buffer: Any) -> int | None:
        return self.inner.get_into(key, buffer)

    def batch_put(self, items: Any) -> list[bool]:
        return self.inner.batch_put(items)

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int | None]:
        self.calls.append("batch_get_into")
        return [self.inner.get_into(k, b) for k, b in zip(keys, buffers, strict=True)]

    def batch_remove(self, keys: Sequence[str]) -> list[bool]:
        self.calls.append("batch_remove")
        return [self.inner.remove(k) for k in keys]

    def close(self) -> None:
        self.inner.close()


def test_newer_client_calls_are_picked_up(shared_cluster: LocalCluster) -> None:
    client = NewerClient(Client(shared_cluster.master_addresses, timeout_s=10.0))
    driver = KvpoolDriver(client)
    try:
        assert driver.api["batch_get"] == "batch_get_into"
        _assert_all_verified(_run_cell(driver, 8))
        assert "batch_get_into" in client.calls
        assert "batch_remove" in client.calls
    finally:
        driver.close()


def test_a_transport_is_passed_only_to_a_client_that_takes_it() -> None:
    class WithTransport:
        def __init__(self, masters: list[str], *, timeout_s: float, transport: str) -> None:
            pass

    class WithoutTransport:
        def __init__(self, masters: list[str], *, timeout_s: float) -> None:
            pass

    assert _client_kwargs(WithTransport, 2.0, "shm") == {"timeout_s": 2.0, "transport": "shm"}
    assert _client_kwargs(WithoutTransport, 2.0, None) == {"timeout_s": 2.0}
    with pytest.raises(RuntimeError, match="no transport"):
        _client_kwargs(WithoutTransport, 2.0, "shm")


def test_missing_peers_are_skipped_with_how_to_install_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvpool_bench import peers as bench_peers
    from kvpool_bench import report as bench_report
    from kvpool_bench.peer_servers import INSTALL_MOONCAKE, INSTALL_REDIS, Availability

    monkeypatch.setattr(
        bench_peers,
        "redis_availability",
        lambda: Availability(False, "redis-server is not installed", INSTALL_REDIS),
    )
    monkeypatch.setattr(
        bench_peers,
        "mooncake_availability",
        lambda: Availability(False, "mooncake is not installed", INSTALL_MOONCAKE),
    )
    lines: list[str] = []
    opts = bench_peers.PeersOptions.quick_run(
        sizes=(4096,), clients=(1,), modes=("single",), kvpool_masters=1, kvpool_in_memory=True
    )
    doc = bench_peers.run_peers(opts, lines.append)
    for name, install in (("redis", INSTALL_REDIS), ("mooncake", INSTALL_MOONCAKE)):
        assert doc["systems"][name]["status"] == "skipped"
        assert doc["systems"][name]["install"] == install
        assert any(line.startswith(f"{name}: skipped") and install in line for line in lines)
    # only kvpool ran: one system per transport of the client, plus its AsyncClient on the first
    assert {c["system"] for c in doc["cells"]} == {"kvpool-tcp", "kvpool-shm", "kvpool-tcp-async"}
    assert all("vs" in c and not c["vs"] for c in doc["cells"])
    assert doc["verification"]["all_bytes_verified"]
    text = bench_report.render_table(doc)
    assert re.search(r"^\s+redis\s+skipped: redis-server is not installed", text, re.M)
    assert f"(install: {INSTALL_MOONCAKE})" in text
    targets = {t["target"]: t["status"] for t in doc["targets"]}
    assert targets["one put at 4 KiB: p50 <= 1 ms"] in ("met", "missed")
    assert targets["one 4 KiB get: p50 <= Mooncake's"] == "not measured"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("peer", [None, "mooncake"])
def test_a_first_read_by_another_client_is_verified_byte_for_byte(
    tmp_path: Path, peer: str | None
) -> None:
    """One worker puts, the other reads each block once and checks the writer's bytes (the
    worker's own checks, and that a wrong byte counts, are in bench/tests/test_bench_worker.py).
    One master, so that no follower behind the leader can turn a read into a miss here."""
    from kvpool_bench import peers as bench_peers
    from kvpool_bench import report as bench_report
    from kvpool_bench.peer_servers import mooncake_availability

    if peer == "mooncake":
        avail = mooncake_availability()
        if not avail.ok:
            pytest.skip(f"Mooncake Store: {avail.reason} (install: {avail.install})")
    opts = bench_peers.PeersOptions.quick_run(
        sizes=(4096, 64 << 10),
        clients=(1, 2),
        modes=("first-read",),
        peers=(peer,) if peer else (),
        kvpool_masters=1,
        kvpool_in_memory=True,
        kvpool_api="sync",
        directory=str(tmp_path / "run"),
    )
    doc = bench_peers.run_peers(opts)
    systems = ["kvpool-tcp", "kvpool-shm"] + ([peer] if peer else [])
    assert [n for n, s in doc["systems"].items() if s["status"] == "measured"] == systems
    reads = [c for c in doc["cells"] if c["op"] == "get"]
    assert {(c["system"], c["size_bytes"], c["clients"]) for c in reads} == {
        (s, size, n) for s in systems for size in opts.sizes for n in (1, 2)
    }
    for c in reads:
        plan = bench_peers.plan_cell(opts, c["size_bytes"], "first-read")
        blocks = plan.keys_per_pass * plan.passes * c["clients"]  # each read exactly once
        assert (c["mode"], c["keys_per_call"], c["calls"]) == ("first-read", 1, blocks), c
        assert c["wrong"] == c["misses"] == 0, c
        assert c["bytes_read"] == c["bytes_verified"] == blocks * c["size_bytes"], c
        assert c["GBps"] > 0, c
        assert c["p99_us"] >= c["p50_us"] > 0, c
        if peer and c["system"] != peer:
            assert c["vs"][peer]["GBps_ratio"] > 0
            assert c["vs"][peer]["p50_ratio"] > 0
    assert doc["verification"]["all_bytes_verified"]
    first_read_targets = [t for t in doc["targets"] if t["group"] == "first-read"]
    assert len(first_read_targets) == 3
    small = next(t for t in first_read_targets if "4 KiB and 64 KiB" in t["target"])
    assert small["status"] in (("not measured",) if peer is None else ("met", "missed"))
    assert "GET, first read by another client" in bench_report.render_table(doc)


def test_kvpool_servers_start_once_the_node_has_faulted_its_tier_in(tmp_path: Path) -> None:
    # A node faults its CPU tier in on a thread after it is ready; a benchmark that started at
    # once would measure against that thread (on a 2-core machine, most of the first seconds).
    servers = KvpoolServers(tmp_path, masters=1, nodes=1, cpu_cache_size="256MiB", in_memory=True)
    try:
        servers.start()
        (node,) = servers.cluster.nodes
        assert _shared_rss(node.pid) >= 256 << 20
        assert wait_prefaulted(servers.cluster, timeout_s=0.0)
    finally:
        servers.stop()
    assert _shared_rss(node.pid) == 1 << 62  # gone: nothing to wait for
