"""Draining a store node for real (issue 6): under a steady write load, and through a leader
kill. The draining mark is replicated: clients stop placing puts on the node, and a new leader
carries the drain on by itself."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool import Client
from kvpool.cli import main
from kvpool.grpcutil import call_once_sync
from kvpool.launcher.cluster import LocalCluster
from kvpool.proto.v1 import common_pb2, master_pb2, master_pb2_grpc
from kvpool.store_node.admin import SERVICE_NAME as NODE_ADMIN_SERVICE

from .conftest import ClusterFactory

pytestmark = pytest.mark.integration

VALUE_BYTES = 4096


def _value(key: str) -> bytes:
    seed = key.encode()
    return (seed * (VALUE_BYTES // len(seed) + 1))[:VALUE_BYTES]


def _call(address: str, method: str, request: object, timeout_s: float = 5.0) -> object:
    return call_once_sync(address, master_pb2_grpc.MasterStub, method, request, timeout_s=timeout_s)


def members(cluster: LocalCluster) -> list[common_pb2.Member]:
    response = _call(cluster.wait_for_leader(), "GetMembers", master_pb2.GetMembersRequest())
    assert isinstance(response, master_pb2.GetMembersResponse)
    return list(response.members)


def member_of(cluster: LocalCluster, node_id: str) -> common_pb2.Member:
    return next(m for m in members(cluster) if m.node_id == node_id)


def drain(cluster: LocalCluster, node_id: str, *, wait: bool, timeout_s: float = 5.0) -> object:
    request = master_pb2.DrainNodeRequest(node_id=node_id, wait=wait)
    return _call(cluster.wait_for_leader(), "DrainNode", request, timeout_s=timeout_s)


class Writer:
    """Puts fresh keys in a loop on its own client; records when each put was acknowledged."""

    def __init__(self, cluster: LocalCluster) -> None:
        self._cluster = cluster
        self.acked: dict[str, float] = {}
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drain-writer", daemon=True)

    def __enter__(self) -> Writer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        with Client(self._cluster.master_addresses, timeout_s=5.0) as kv:
            i = 0
            while not self._stop.is_set():
                key = f"during/{i}"
                i += 1
                if kv.put(key, _value(key)):
                    self.acked[key] = time.monotonic()
                else:
                    self.failed += 1
                time.sleep(0.002)


def test_a_drain_under_a_steady_write_load_finishes_and_loses_nothing(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(
        masters=1,
        nodes=3,
        cpu_cache_size="256MiB",
        extra_master_flags=["--repair-blocks-per-s", "300"],  # a drain of ~1-2 s
    )
    before = [f"before/{i}" for i in range(900)]
    victim = cluster.node_names[0]
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        assert all(kv.batch_put([(k, _value(k)) for k in before]))
        with Writer(cluster) as writer:
            while len(writer.acked) < 50:  # the load is steady before the drain starts
                assert writer.failed < 50, "the writer cannot put"
                time.sleep(0.05)
            started = time.monotonic()
            response = drain(cluster, victim, wait=True, timeout_s=30.0)
            drained_s = time.monotonic() - started
            assert isinstance(response, master_pb2.DrainNodeResponse)
            assert response.left, f"not drained in 30 s: {response.blocks_left} blocks left"
            assert response.blocks_left == 0
            during = {k for k, t in writer.acked.items() if t >= started}
            time.sleep(0.5)
        done_at = started + drained_s
        print(f"drain {drained_s:.2f} s, {len(during)} puts during it, {len(writer.acked)} in all")
        assert len(during) > 10, "the writer made no progress during the drain"
        assert writer.failed <= len(writer.acked) // 100, f"{writer.failed} puts failed"
        cluster.terminate(victim)
        # Every acknowledged key reads back exactly, those acknowledged after the drain
        # answered too: the drained node, still running for 0.5 s, did not rejoin and take
        # puts, so stopping it lost nothing.
        keys = before + sorted(writer.acked)
        got = kv.batch_get(keys)
        wrong = [k for k, v in zip(keys, got, strict=True) if v is not None and v != _value(k)]
        assert wrong == []
        missed = [k for k, v in zip(keys, got, strict=True) if v is None]
        late = sum(writer.acked.get(k, 0.0) >= done_at for k in missed)
        assert missed == [], f"{len(missed)} missed, {late} of them put after the drain answered"
    print(
        f"drained in {drained_s:.2f} s under load: {len(during)} puts acknowledged during the "
        f"drain, {writer.failed} failed, {len(writer.acked)} in all"
    )


def test_a_drain_survives_a_leader_kill_and_can_be_cancelled(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(
        masters=3,
        nodes=3,
        cpu_cache_size="256MiB",
        extra_master_flags=["--repair-blocks-per-s", "60"],  # slow enough to kill mid-drain
    )
    keys = [f"failover/{i}" for i in range(600)]
    victim, other = cluster.node_names[0], cluster.node_names[1]
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        assert all(kv.batch_put([(k, _value(k)) for k in keys]))

        # The mark is replicated and listed; --cancel clears it.
        response = drain(cluster, other, wait=False)
        assert isinstance(response, master_pb2.DrainNodeResponse)
        assert response.draining
        assert member_of(cluster, other).draining
        masters = ",".join(cluster.master_addresses)
        assert main(["node", "drain", other, "--masters", masters, "--cancel"]) == 0
        assert not member_of(cluster, other).draining

        response = drain(cluster, victim, wait=False)
        assert isinstance(response, master_pb2.DrainNodeResponse)
        assert response.draining
        assert response.blocks_left > 60, "the drain would end before the leader dies"
        drained_member = response.member_id
        leader = cluster.leader_name()
        killed_at = time.monotonic()
        cluster.kill(leader)  # kill -9 of the leader pid this test started; nobody re-asks

        def gone() -> bool:
            try:
                return all(m.member_id != drained_member for m in members(cluster))
            except Exception:  # no leader yet: keep polling
                return False

        deadline = killed_at + 60
        while not gone():
            assert time.monotonic() < deadline, "the new leader did not finish the drain"
            time.sleep(0.2)
        finished_s = time.monotonic() - killed_at
        assert cluster.leader_name() != leader
        cluster.terminate(victim)
        got = kv.batch_get(keys)
        assert got == [_value(k) for k in keys]  # every block handed over, none lost
    print(f"drain finished {finished_s:.2f} s after the leader was killed")


def _node_ready(cluster: LocalCluster, name: str) -> bool:
    response = call_once_sync(
        cluster.processes[name].grpc,
        health_pb2_grpc.HealthStub,
        "Check",
        health_pb2.HealthCheckRequest(service=NODE_ADMIN_SERVICE),
        timeout_s=5.0,
    )
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def _log_events(cluster: LocalCluster, name: str) -> list[dict[str, object]]:
    text = Path(cluster.processes[name].log).read_text(errors="replace")
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_a_drained_node_that_keeps_running_does_not_rejoin_until_restarted(
    cluster_factory: ClusterFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = cluster_factory(masters=1, nodes=3, cpu_cache_size="64MiB")
    victim = cluster.node_names[0]
    old = member_of(cluster, victim)
    masters = ",".join(cluster.master_addresses)
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        before = [f"kept/{i}" for i in range(200)]
        assert all(kv.batch_put([(k, _value(k)) for k in before]))

        assert main(["node", "drain", victim, "--masters", masters, "--timeout", "60"]) == 0
        answered = time.time()
        out = capsys.readouterr().out
        assert "left the cluster" in out
        assert "may be stopped now" in out
        assert "does not rejoin" in out

        # Its process keeps running for several heartbeats (0.5 s each) while clients put.
        during: list[str] = []
        seen_ids: set[int] = set()
        watch_until = time.monotonic() + 4.0
        while time.monotonic() < watch_until:
            now = members(cluster)
            assert victim not in {m.node_id for m in now}, "the drained node rejoined"
            seen_ids |= {m.member_id for m in now}
            batch = [f"during/{len(during) + i}" for i in range(20)]
            assert all(kv.batch_put([(k, _value(k)) for k in batch]))
            during += batch
            time.sleep(0.2)
        assert cluster.is_running(victim)
        assert not _node_ready(cluster, victim)
        events = [e["event"] for e in _log_events(cluster, victim)]
        assert events.count("node_drained_stopped_serving") == 1, events
        refused = next(
            e for e in _log_events(cluster, victim) if e["event"] == "node_drained_stopped_serving"
        )
        refused_s = datetime.fromisoformat(str(refused["timestamp"])).timestamp() - answered
        assert events.count("node_reregistered") == 0

        # No key was committed on it: every replica the index names is a member seen above,
        # none of them the drained node's.
        lookup = _call(
            cluster.wait_for_leader(), "Lookup", master_pb2.LookupRequest(keys=before + during)
        )
        assert isinstance(lookup, master_pb2.LookupResponse)
        assert all(e.found for e in lookup.entries)
        named = {m for e in lookup.entries for m in e.replicas}
        assert named <= seen_ids
        assert old.member_id not in named
        assert kv.batch_get(before + during) == [_value(k) for k in before + during]

        # SIGTERM: it exits cleanly; a restart (a new incarnation) joins as a new member.
        cluster.terminate(victim)
        assert not cluster.is_running(victim)
        stopped = [e for e in _log_events(cluster, victim) if e["event"] == "node_stopped"]
        assert [e["status"] for e in stopped] == [0]
        cluster.restart(victim)
        deadline = time.monotonic() + 15
        while victim not in {m.node_id for m in members(cluster)}:
            assert time.monotonic() < deadline, "the restarted node did not rejoin"
            time.sleep(0.1)
        new = member_of(cluster, victim)
        assert new.member_id != old.member_id
        assert new.incarnation != old.incarnation
        assert new.live
        assert not new.draining
        assert _node_ready(cluster, victim)

        # It takes puts again.
        after = [f"after/{i}" for i in range(300)]
        deadline = time.monotonic() + 15
        while True:
            assert all(kv.batch_put([(k, _value(k)) for k in after]))
            lookup = _call(
                cluster.wait_for_leader(), "Lookup", master_pb2.LookupRequest(keys=after)
            )
            assert isinstance(lookup, master_pb2.LookupResponse)
            if any(new.member_id in e.replicas for e in lookup.entries):
                break
            assert time.monotonic() < deadline, "no put was placed on the rejoined node"
            time.sleep(0.2)
    print(
        f"the drained node, still running, was refused {refused_s:.2f} s after the drain answered"
    )
