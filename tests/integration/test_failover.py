"""Real kills and restarts: what survives a dead leader, a dead node, a full master restart."""

from __future__ import annotations

import functools
import time

import pytest

from kvpool import Client
from kvpool.errors import BlockMissError
from kvpool.launcher.probe import probe_masters

from .conftest import ClusterFactory

pytestmark = pytest.mark.integration


def _value(key: str, size: int = 8192) -> bytes:
    seed = key.encode()
    return (seed * (size // len(seed) + 1))[:size]


def test_kill_leader_puts_resume_and_committed_keys_survive(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(masters=3, nodes=2, cpu_cache_size="128MiB")
    keys = [f"failover/{i}" for i in range(200)]
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        assert all(kv.batch_put([(k, _value(k)) for k in keys]))
        leader = cluster.leader_name()
        killed_at = time.monotonic()
        cluster.kill(leader)
        resumed = None
        i = 0
        while time.monotonic() - killed_at < 20:
            i += 1
            if kv.put(f"failover/after/{i}", _value(str(i))):
                resumed = time.monotonic() - killed_at
                break
        assert resumed is not None, "writes did not resume within 20 s of the leader's death"
        assert resumed < 10.0
        assert cluster.leader_name() != leader
        # Every committed key is still in the index and readable.
        assert kv.batch_get(keys) == [_value(k) for k in keys]
        # The killed master comes back and catches up.
        cluster.restart(leader)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            probes = probe_masters(cluster.master_addresses)
            applied = {p.address: p.status.master.last_applied for p in probes if p.status}
            if len(applied) == 3 and len(set(applied.values())) == 1:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"restarted master did not catch up: {applied}")


def test_kill_store_node_gets_miss_within_deadline_and_recompute(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(masters=3, nodes=2, cpu_cache_size="128MiB", node_timeout_s=2.0)
    keys = [f"nodekill/{i}" for i in range(100)]
    timeout_s = 1.0
    with Client(cluster.master_addresses, timeout_s=timeout_s) as kv:
        assert all(kv.batch_put([(k, _value(k)) for k in keys]))
        victim = cluster.nodes[0]
        cluster.kill(victim.name)
        started = time.monotonic()
        results = {}
        for k in keys:
            t = time.monotonic()
            results[k] = kv.get(k)
            assert time.monotonic() - t < timeout_s + 0.5, "a get outlived its deadline"
        lost = [k for k, v in results.items() if v is None]
        kept = [k for k, v in results.items() if v is not None]
        assert lost, "the killed node held none of the blocks (placement is broken?)"
        assert kept, "the surviving node held none of the blocks"
        assert all(results[k] == _value(k) for k in kept)
        # get_or_compute recomputes what was lost, and the recomputed block is stored again.
        calls: list[str] = []

        def recompute(key: str) -> bytes:
            calls.append(key)
            return _value(key)

        for k in lost:
            assert kv.get_or_compute(k, functools.partial(recompute, k)) == _value(k)
        assert sorted(calls) == sorted(lost)
        # Once the node is declared down, new puts go to the survivor and are readable.
        deadline = started + 15
        while time.monotonic() < deadline:
            if kv.put("nodekill/new", b"fresh") and kv.get("nodekill/new") == b"fresh":
                break
            time.sleep(0.2)
        else:
            pytest.fail("puts did not work again after the node was declared down")
        with pytest.raises(BlockMissError):
            kv.get(lost[0] + "/never-put", strict=True)


def test_stop_and_restart_every_master_keeps_the_index(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(masters=3, nodes=1, cpu_cache_size="128MiB")
    keys = [f"restart/{i}" for i in range(300)]
    with Client(cluster.master_addresses, timeout_s=5.0, strict=True) as kv:  # say why, if not
        assert all(kv.batch_put([(k, _value(k)) for k in keys]))
    for m in cluster.masters:
        cluster.terminate(m.name)
    assert not any(cluster.is_running(m.name) for m in cluster.masters)
    for m in cluster.masters:
        cluster.restart(m.name)
    cluster.wait_for_leader(30)
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        deadline = time.monotonic() + 20
        got: list[bytes | None] = []
        while time.monotonic() < deadline:
            got = kv.batch_get(keys)
            if all(v is not None for v in got):
                break
            time.sleep(0.3)
        assert got == [_value(k) for k in keys]
