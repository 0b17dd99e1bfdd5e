"""The chaos harness on real processes: namespaces, partitions, link proxies, fake clocks, the
nemesis, and a tear-down that leaves nothing behind — also when a test fails half-way.

Tests marked ``needs_root`` run where network namespaces can be made (CI runs as root) and are
skipped elsewhere with the reason; the others run anywhere."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvpool import Client
from kvpool.chaos.clock import FakeClocks
from kvpool.chaos.harness import ChaosHarness
from kvpool.chaos.nemesis import FAULTS, Nemesis
from kvpool.chaos.netns import (
    LoopbackNetwork,
    NamespaceNetwork,
    NetworkUnavailableError,
    new_run_id,
)
from kvpool.chaos.proxy import LinkBehaviour, LinkProxy
from kvpool.chaos.runs import RUN_DIR
from kvpool.launcher.cluster import ClusterError, pid_runs_kvpool
from kvpool.launcher.probe import probe_masters
from tests.signals import CTRL_C_REACHES

pytestmark = pytest.mark.chaos

NO_NETNS = NamespaceNetwork.unsupported_reason()
F = TypeVar("F", bound=Callable[..., None])


def needs_netns(test: F) -> F:
    """Marked needs_root; skipped, with the reason, where namespaces cannot be made."""
    skip = pytest.mark.skipif(NO_NETNS is not None, reason=f"no network namespaces: {NO_NETNS}")
    return pytest.mark.needs_root(skip(test))  # type: ignore[no-any-return]


def _value(key: str, size: int = 4096) -> bytes:
    seed = key.encode()
    return (seed * (size // len(seed) + 1))[:size]


def _leftovers(run_id: str, pids: list[int]) -> list[str]:
    """What a run left behind: namespaces, links, its marker, processes still running."""
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    found += [f"netns {line.split()[0]}" for line in netns.stdout.splitlines() if run_id in line]
    links = subprocess.run(["ip", "-j", "link"], capture_output=True, text=True, check=True)
    found += [
        f"link {e['ifname']}"
        for e in json.loads(links.stdout)
        if e["ifname"].startswith("kvp") and run_id in e["ifname"]
    ]
    if (RUN_DIR / f"{run_id}.json").exists():
        found.append("marker")
    found += [f"pid {pid}" for pid in pids if pid_runs_kvpool(pid)]
    return found


def _state(pid: int) -> str:
    """The process state letter of /proc/PID/stat (T or t: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


# --- namespaces -------------------------------------------------------------------------------


@needs_netns
def test_a_namespace_cluster_serves_the_root_namespace_and_leaves_nothing(tmp_path: Path) -> None:
    began = time.monotonic()
    with ChaosHarness(tmp_path, masters=3, nodes=2, network="netns", log_level="warning") as h:
        setup_s = time.monotonic() - began
        run_id = h.run_id
        pids = h.started_pids()
        assert h.partitions_supported
        assert h.skip_reason == ""
        namespaces = set()
        for info in h.cluster.processes.values():
            # the pid held is the kvpool python process itself, inside its own namespace
            assert pid_runs_kvpool(info.pid), info.name
            assert "python" in os.readlink(f"/proc/{info.pid}/exe")
            namespaces.add(os.readlink(f"/proc/{info.pid}/ns/net"))
            assert info.host == h.network.ip_of(info.name)
        assert len(namespaces) == 5
        assert os.readlink("/proc/self/ns/net") not in namespaces
        for m in h.cluster.masters:
            assert m.grpc.startswith(f"{m.host}:")
            assert m.raft.startswith(f"{m.host}:")
        for n in h.cluster.nodes:
            assert n.data == f"tcp://{n.host}:7400"
        keys = [f"netns/{i}" for i in range(100)]
        with Client(h.masters_for_clients(), timeout_s=5.0) as kv:
            assert all(kv.batch_put([(k, _value(k)) for k in keys]))
            assert kv.batch_get(keys) == [_value(k) for k in keys]
        # a pause stops the kvpool process itself, a resume lets it run on
        node = h.cluster.nodes[0]
        h.pause(node.name)
        assert _state(node.pid) in ("T", "t")
        h.resume(node.name)
        assert _state(node.pid) not in ("T", "t")
        closing = time.monotonic()
    teardown_s = time.monotonic() - closing
    assert _leftovers(run_id, pids) == []
    print(f"\nnamespace cluster 3+2: set-up {setup_s:.2f} s, tear-down {teardown_s:.2f} s")


@needs_netns
def test_a_leader_cut_from_the_followers_is_replaced_and_rejoins_after_heal(
    tmp_path: Path,
) -> None:
    with ChaosHarness(tmp_path, masters=3, nodes=1, network="netns", log_level="warning") as h:
        keys = [f"cut/{i}" for i in range(50)]
        with Client(h.masters_for_clients(), timeout_s=2.0) as kv:
            assert all(kv.batch_put([(k, _value(k)) for k in keys]))
            old = h.cluster.leader_name()
            majority = [m for m in h.master_names if m != old]
            cut_at = time.monotonic()
            h.network.isolate(old, majority)
            committed_after = None
            i = 0
            while time.monotonic() - cut_at < 20:
                i += 1
                if kv.put(f"cut/after/{i}", b"x" * 100):
                    committed_after = time.monotonic() - cut_at
                    break
            assert committed_after is not None, "no commit within 20 s of cutting the leader off"
            # The cut-off master believes it leads until its fallback time-out, and one round of
            # probes may miss the new leader's answer on a loaded machine (then the old one, the
            # only "leader" heard, is named): ask again until a master of the majority is named.
            new = h.leader()
            named_until = time.monotonic() + 10
            while new not in majority and time.monotonic() < named_until:
                time.sleep(0.2)
                new = h.leader()
            assert new in majority, f"{old} was cut off, a write committed, and {new} is named"
            print(f"\nleader {old} cut off: {new} committed after {committed_after:.2f} s")
            h.network.heal()
            # the old leader rejoins as a follower and catches up
            status: dict[str, object] = {}
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                probes = probe_masters(h.cluster.master_addresses, timeout_s=0.5)
                masters = {p.address: p.status.master for p in probes if p.status is not None}
                status = {a: (m.role, m.last_applied, m.commit_index) for a, m in masters.items()}
                old_status = masters.get(h.cluster.processes[old].grpc)
                leaders = [m for m in masters.values() if m.role == "leader"]
                if (
                    len(masters) == 3
                    and old_status is not None
                    and old_status.role == "follower"
                    and len(leaders) == 1
                    and old_status.last_applied >= leaders[0].commit_index
                ):
                    break
                time.sleep(0.2)
            else:
                pytest.fail(f"{old} did not rejoin after the heal: {status}")
            assert kv.batch_get(keys) == [_value(k) for k in keys]


@needs_netns
def test_a_node_cut_from_clients_misses_in_time_and_stays_registered(tmp_path: Path) -> None:
    timeout_s = 0.5
    with ChaosHarness(
        tmp_path, masters=3, nodes=2, network="netns", node_timeout_s=2.0, log_level="warning"
    ) as h:
        keys = [f"fromclients/{i}" for i in range(30)]
        with Client(h.masters_for_clients(), timeout_s=timeout_s) as kv:
            setup_by = time.monotonic() + 10  # a loaded machine: the first puts may time out
            while not all(kv.batch_put([(k, _value(k)) for k in keys])):
                assert time.monotonic() < setup_by, "the fresh cluster took no puts"
            h.network.cut_from_clients("node-1")
            cut_at = time.monotonic()
            results = {}
            for k in keys:
                t = time.monotonic()
                results[k] = kv.get(k)
                assert time.monotonic() - t < timeout_s + 0.5, "a get outlived its deadline"
            missed = [k for k, v in results.items() if v is None]
            assert missed, "nothing was on node-1"
            assert len(missed) < len(keys), "nothing was on node-2"
            assert all(v == _value(k) for k, v in results.items() if v is not None)
            # node-1 still heartbeats the masters: after twice the node timeout it is live
            time.sleep(max(0.0, cut_at + 4.0 - time.monotonic()))
            status = probe_masters([h.cluster.master_addresses[0]])[0].status
            assert status is not None
            live = {n.member.node_id for n in status.nodes if n.member.live}
            assert live == {"node-1", "node-2"}
            h.network.heal()
            # A fresh client: the one that saw the partition may keep its silent connections
            # to node-1 until TCP's retransmission backoff expires (a client-side limitation).
            with Client(h.masters_for_clients(), timeout_s=timeout_s) as fresh:
                deadline = time.monotonic() + 10
                while fresh.batch_get(missed) != [_value(k) for k in missed]:
                    assert time.monotonic() < deadline, "node-1's blocks did not come back"
                    time.sleep(0.2)


ECHO_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 9000))
conn, _ = server.accept()
while data := conn.recv(1024):
    conn.sendall(data)
"""


@needs_netns
def test_a_partition_silences_an_established_connection_until_healed() -> None:
    with NamespaceNetwork(new_run_id(), ["a"]) as net:
        ip = net.ip_of("a")
        server = subprocess.Popen([*net.command_prefix("a"), sys.executable, "-c", ECHO_SERVER, ip])
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    sock = socket.create_connection((ip, 9000), timeout=1.0)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            with sock:
                sock.sendall(b"ping")
                assert sock.recv(4) == b"ping"
                net.cut_from_clients("a")
                assert net.blocked_pairs() == [("a", "clients")]
                sock.sendall(b"lost")
                sock.settimeout(1.0)
                with pytest.raises(TimeoutError):  # silence: no reply, no reset
                    sock.recv(4)
                net.heal()
                sock.settimeout(15.0)
                got = b""
                while len(got) < 4:
                    got += sock.recv(4 - len(got))
                assert got == b"lost"  # TCP retransmitted once the path was back
        finally:
            server.kill()
            server.wait(5)


@needs_netns
def test_close_leaves_nothing_after_an_exception_or_a_failed_start(tmp_path: Path) -> None:
    seen: dict[str, list[int] | str] = {}

    def fail_in_the_middle() -> None:
        with ChaosHarness(
            tmp_path / "a", masters=1, nodes=1, network="netns", proxies=True, fake_clocks=True
        ) as h:
            seen["run_id"] = h.run_id
            seen["pids"] = h.started_pids()
            assert len(h.started_pids()) == 4  # master, node, and their two proxies
            h.pause("node-1")  # a paused process must still be stopped
            raise RuntimeError("in the middle")

    with pytest.raises(RuntimeError, match="in the middle"):
        fail_in_the_middle()
    run_id, pids = seen["run_id"], seen["pids"]
    assert isinstance(run_id, str)
    assert isinstance(pids, list)
    assert _leftovers(run_id, pids) == []

    failing = ChaosHarness(
        tmp_path / "b", masters=3, nodes=1, network="netns", extra_master_flags=["--no-such"]
    )
    with pytest.raises(ClusterError, match="exited"):
        failing.start()
    assert _leftovers(failing.run_id, failing.started_pids()) == []
    failing.close()  # idempotent


@needs_netns
def test_cleanup_stale_removes_dead_runs_and_spares_live_ones() -> None:
    dead_owner = subprocess.Popen(["true"])
    dead_owner.wait()
    stale = NamespaceNetwork(new_run_id(), ["a", "b"], owner_pid=dead_owner.pid).start()
    live = NamespaceNetwork(new_run_id(), ["a"]).start()
    # a kvpool process the crashed run started and nobody stopped
    proxy_args = ["--listen", "127.0.0.1:0", "--target", "127.0.0.1:9", "--control", "/none"]
    orphan = subprocess.Popen([sys.executable, "-m", "kvpool.chaos.proxy", *proxy_args])
    try:
        assert _eventually(lambda: pid_runs_kvpool(orphan.pid))
        stale.record_pid(orphan.pid)
        assert _leftovers(stale.run_id, []) != []
        removed = NamespaceNetwork.cleanup_stale()
        assert f"run {stale.run_id}" in removed
        assert f"pid {orphan.pid}" in removed
        assert orphan.wait(5) == -9
        assert _leftovers(stale.run_id, []) == []
        assert f"run {live.run_id}" not in removed
        assert len(_leftovers(live.run_id, [])) == 4  # netns, veth, bridge, marker
    finally:
        orphan.kill()
        orphan.wait(5)
        live.close()
        stale.close()
    assert _leftovers(live.run_id, []) == []


@needs_netns
def test_the_nemesis_injects_and_heals_every_kind_of_fault(tmp_path: Path) -> None:
    with ChaosHarness(
        tmp_path,
        masters=3,
        nodes=2,
        network="netns",
        proxies=True,
        fake_clocks=True,
        node_timeout_s=2.0,
        log_level="warning",
    ) as h:
        nemesis = Nemesis(h, random.Random(20261129))
        with Client(h.masters_for_clients(), timeout_s=2.0) as kv:
            for name in (
                "isolate-leader",
                "pause-node",
                "kill-node",
                "cut-node-from-masters",
                "split-masters",
                "clock-forward",
                "slow-node-link",
                "kill-leader",
                "rolling-restart",
            ):
                event = nemesis.inject(FAULTS[name])
                assert event.outcome == "ok", (name, event.reason)
                if event.selector == "node":
                    assert event.node_ids == event.targets
                kv.put(f"nemesis/{name}", _value(name))  # may fail during the fault
                if event.seq in nemesis.active:
                    healed = nemesis.heal(event)
                    assert healed.outcome == "ok", (name, healed.reason)
            assert nemesis.active == {}
            assert h.wait_caught_up(20)
            deadline = time.monotonic() + 15
            while not kv.put("nemesis/end", b"end") and time.monotonic() < deadline:
                time.sleep(0.2)
            assert kv.get("nemesis/end") == b"end"
        events = [e.to_json() for e in nemesis.events]
        json.dumps(events)
        assert [e["monotonic_s"] for e in events] == sorted(e["monotonic_s"] for e in events)
        assert all(h.cluster.is_running(n) for n in [*h.master_names, *h.node_names])


HARNESS = """
import json, sys, time
from kvpool.chaos.harness import ChaosHarness
with ChaosHarness(sys.argv[1], masters=1, nodes=1, log_level="warning") as h, h.handle_signals():
    print("READY", json.dumps({"run_id": h.run_id, "pids": h.started_pids()}), flush=True)
    time.sleep(120)
"""
HARNESS_CHILD = f"{CTRL_C_REACHES}\n{HARNESS}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_to_the_runner_stops_every_process_and_removes_the_network(
    tmp_path: Path, sig: signal.Signals
) -> None:
    runner = subprocess.Popen(
        [sys.executable, "-c", HARNESS_CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    started: dict[str, Any] = {"run_id": "", "pids": []}
    try:
        assert runner.stdout is not None
        line = ""
        while not line.startswith("READY "):  # (log lines may come first)
            line = runner.stdout.readline()
            assert line, f"the runner failed to start its harness (exit code {runner.wait(5)})"
        started = json.loads(line.removeprefix("READY "))
        assert all(pid_runs_kvpool(p) for p in started["pids"])
        runner.send_signal(sig)
        # The harness stops nodes then masters, each group with up to 10 s to exit after
        # SIGTERM and 5 more after SIGKILL: 30 s at worst, ~2 s on an idle machine.
        runner.wait(45)
        left = [p for p in started["pids"] if pid_runs_kvpool(p)]
        assert left == []
        if NO_NETNS is None:
            assert _leftovers(started["run_id"], []) == []
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(5)
        for pid in started["pids"]:  # what a failed run left: ours to stop
            if pid_runs_kvpool(pid):
                os.kill(pid, signal.SIGKILL)
        NamespaceNetwork.cleanup_stale()


def test_without_namespaces_auto_falls_back_to_loopback_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        NamespaceNetwork, "unsupported_reason", staticmethod(lambda: "not root (simulated)")
    )
    with pytest.raises(NetworkUnavailableError, match="simulated"):
        ChaosHarness(tmp_path / "netns", masters=1, nodes=0, network="netns").start()
    with ChaosHarness(tmp_path / "auto", masters=1, nodes=0, log_level="warning") as h:
        assert isinstance(h.network, LoopbackNetwork)
        assert not h.partitions_supported
        assert "not root (simulated)" in h.skip_reason
        assert h.cluster.masters[0].host == "127.0.0.1"
        assert h.leader() == "master-1"


def test_loopback_skips_partitions_and_clocks_with_their_reasons(proxied: ChaosHarness) -> None:
    assert not proxied.partitions_supported
    assert "loopback" in proxied.skip_reason
    nemesis = Nemesis(proxied, random.Random(1))
    for name in ("isolate-leader", "split-masters", "cut-node-from-clients", "clock-forward"):
        event = nemesis.inject(FAULTS[name])
        assert event.outcome == "skipped", name
        assert event.reason
    assert nemesis.active == {}
    assert nemesis.events[0].reason == proxied.skip_reason


# --- links (no root needed) -------------------------------------------------------------------


@pytest.fixture
def echo_server() -> Iterator[str]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stopping = threading.Event()

    def echo(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                return

    def serve() -> None:
        while not stopping.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stopping.set()
        thread.join(2)
        server.close()


def _eventually(check: Callable[[], bool], timeout_s: float = 2.0) -> bool:
    """True once ``check()`` is (the proxy reports its counters every 100 ms)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _roundtrip(address: str, payload: bytes, timeout_s: float = 3.0) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        return got


def test_the_link_proxy_forwards_delays_stalls_resets_and_corrupts(
    tmp_path: Path, echo_server: str
) -> None:
    proxy = LinkProxy("echo", listen_host="127.0.0.1", target=echo_server, directory=tmp_path)
    proxy.start()
    try:
        assert pid_runs_kvpool(proxy.pid)
        payload = os.urandom(200_000)
        assert _roundtrip(proxy.address, payload) == payload
        t = time.monotonic()
        _roundtrip(proxy.address, b"x")
        clean_s = time.monotonic() - t

        proxy.set(LinkBehaviour(delay_ms=150))
        t = time.monotonic()
        assert _roundtrip(proxy.address, b"y") == b"y"
        assert time.monotonic() - t >= clean_s + 0.28  # both directions delayed

        proxy.set(LinkBehaviour(bandwidth_bytes_per_s=500_000))
        t = time.monotonic()
        assert _roundtrip(proxy.address, payload) == payload
        assert time.monotonic() - t >= 0.38  # 200 kB at 500 kB/s (the ways overlap)

        proxy.set(LinkBehaviour(corrupt_probability=1.0))
        flipped = _roundtrip(proxy.address, payload)
        assert len(flipped) == len(payload)
        assert flipped != payload
        assert _eventually(lambda: proxy.stats()["corrupted"] >= 2)

        proxy.set(LinkBehaviour(reset_probability=1.0))
        with pytest.raises(ConnectionResetError):
            _roundtrip(proxy.address, b"z")
        assert _eventually(lambda: proxy.stats()["resets"] >= 1)

        proxy.set(LinkBehaviour(stall=True))
        with pytest.raises(TimeoutError):
            _roundtrip(proxy.address, b"w", timeout_s=0.5)
        proxy.heal()
        assert _roundtrip(proxy.address, payload) == payload
    finally:
        proxy.stop()
    assert not proxy.is_running()


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosHarness]:
    """One master and one node on loopback, the node's data path and the master's client path
    each behind a link proxy."""
    with ChaosHarness(
        tmp_path_factory.mktemp("proxied"),
        masters=1,
        nodes=1,
        network="loopback",
        proxies=True,
        cpu_cache_size="64MiB",
        log_level="warning",
    ) as h:
        yield h


def test_a_corrupting_link_turns_reads_into_misses_never_wrong_bytes(
    proxied: ChaosHarness,
) -> None:
    values = {f"corrupt/{i}": os.urandom(20_000 + i) for i in range(12)}
    proxy = proxied.link_of("node-1")
    # node_retry_ms=0: every read goes through the corrupting link (a garbled frame breaks the
    # connection, which would otherwise hold the node back and make the later reads quick
    # node_down misses before any payload reached the checksum check this test is about).
    with Client(proxied.masters_for_clients(), timeout_s=1.0, node_retry_ms=0) as kv:
        assert all(kv.put(k, v) for k, v in values.items())
        assert kv.get("corrupt/0") == values["corrupt/0"]
        before = proxy.stats().get("corrupted", 0)
        proxy.set(LinkBehaviour(corrupt_probability=1.0))
        try:
            results = {k: kv.get(k) for k in values}
        finally:
            proxy.heal()
        assert _eventually(lambda: proxy.stats()["corrupted"] > before)
        assert all(v is None or v == values[k] for k, v in results.items()), "a wrong read"
        assert all(v is None for v in results.values())
        assert kv.stats["misses_by_reason"].get("checksum_mismatch", 0) > 0
        with Client(proxied.masters_for_clients(), timeout_s=1.0) as fresh:
            deadline = time.monotonic() + 10
            while not all(fresh.get(k) == v for k, v in values.items()):
                assert time.monotonic() < deadline, "reads did not recover on a clean link"
                time.sleep(0.2)
        # The client that read through the corruption recovers too: a connection whose
        # request timed out (a header garbled on the way leaves the node waiting for bytes that
        # never come) is closed, not reused.
        deadline = time.monotonic() + 5
        while not all(kv.get(k) == v for k, v in values.items()):
            assert time.monotonic() < deadline, "the client kept a desynchronised connection"
            time.sleep(0.2)


def test_a_slow_link_slows_reads_and_a_stalled_one_misses_in_time(
    proxied: ChaosHarness,
) -> None:
    data = proxied.link_of("node-1")
    grpc = proxied.link_of("master-1")
    assert proxied.masters_for_clients() == [grpc.address]
    with Client(proxied.masters_for_clients(), timeout_s=2.0) as kv:
        assert kv.put("slow/a", _value("slow/a"))

        def median_get_s(n: int) -> float:
            times = []
            for _ in range(n):
                t = time.monotonic()
                assert kv.get("slow/a") == _value("slow/a")
                times.append(time.monotonic() - t)
            return statistics.median(times)

        baseline = median_get_s(10)
        data.set(LinkBehaviour(delay_ms=150))
        try:
            slow = median_get_s(5)
        finally:
            data.heal()
        assert slow >= baseline + 0.25, (baseline, slow)
        grpc.set(LinkBehaviour(delay_ms=100))
        try:
            t = time.monotonic()
            kv.put("slow/b", b"b")  # a commit: at least one round trip to the master
            assert time.monotonic() - t >= 0.2
        finally:
            grpc.heal()
        data.set(LinkBehaviour(stall=True))
        try:
            t = time.monotonic()
            assert kv.get("slow/a") is None
            assert time.monotonic() - t < 2.0 + 0.5
        finally:
            data.heal()
        deadline = time.monotonic() + 10
        while kv.get("slow/a") != _value("slow/a"):
            assert time.monotonic() < deadline, "reads did not recover after the stall"
            time.sleep(0.2)


# --- clocks (no root needed) ------------------------------------------------------------------


CLOCK_CHILD = """
import time
for _ in range(300):
    print(f"{time.time():.6f} {time.monotonic():.6f}", flush=True)
    time.sleep(0.02)
"""


def test_a_clock_jump_moves_wall_time_only(tmp_path: Path) -> None:
    clocks = FakeClocks(tmp_path)
    env = {**os.environ, **clocks.env_for("child")}
    child = subprocess.Popen(
        [sys.executable, "-c", CLOCK_CHILD], stdout=subprocess.PIPE, env=env, text=True
    )
    out = child.stdout
    assert out is not None
    try:

        def sample() -> tuple[float, float]:
            line = out.readline()
            assert line, f"the child stopped (exit code {child.poll()})"
            wall, mono = line.split()
            return float(wall), float(mono)

        def step_after_jump(offset_s: float) -> tuple[float, float]:
            previous = sample()
            clocks.jump("child", offset_s)
            for _ in range(50):
                current = sample()
                if abs(current[0] - previous[0]) > 1000:
                    return current[0] - previous[0], current[1] - previous[1]
                previous = current
            pytest.fail(f"the child's wall clock did not move after jump({offset_s})")

        wall, _ = sample()
        assert abs(wall - time.time()) < 1.0
        forward, mono_forward = step_after_jump(3600)
        assert 3599 < forward < 3601
        assert 0 < mono_forward < 0.5  # monotonic ran on, it did not jump
        back, mono_back = step_after_jump(-3600)
        assert -7201 < back < -7199
        assert 0 < mono_back < 0.5
        assert clocks.offset_of("child") == -3600
        wall, _ = sample()
        assert abs(wall - (time.time() - 3600)) < 1.0
    finally:
        child.kill()
        child.wait(5)
