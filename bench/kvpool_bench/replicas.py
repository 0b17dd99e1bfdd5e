"""`kvpool-bench replicas`: hot-block replicas and repair.

The bench starts local clusters and measures: how long a block read in a loop takes to reach
``hot_max_replicas``; how long the masters take to bring N blocks back to 2 replicas after a
node is killed (from the node being declared down); the hit rate of a hot read loop through a
node kill, with hot replicas off and on; the latency of gets while one replica's node is paused,
with hedged reads off and on.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpool.cli.node import call_master
from kvpool.client.sync import Client
from kvpool.launcher.cluster import LocalCluster
from kvpool.proto.v1 import master_pb2


def replica_counts(cluster: LocalCluster, keys: list[str]) -> list[int]:
    response = call_master(
        cluster.wait_for_leader(), "ReplicaStatus", master_pb2.ReplicaStatusRequest(keys=keys)
    )
    return list(response.replicas)


def live_nodes(cluster: LocalCluster) -> set[str]:
    response = call_master(cluster.wait_for_leader(), "GetMembers", master_pb2.GetMembersRequest())
    return {m.node_id for m in response.members}


def _wait(check: Callable[[], bool], timeout_s: float, period_s: float = 0.05) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if check():
            return time.monotonic() - started
        time.sleep(period_s)
    return None


def _value(key: str, size: int) -> bytes:
    seed = key.encode()
    return (seed * (size // len(seed) + 1))[:size]


HOT_FLAGS = ["--hot-reads-per-s", "20", "--hot-half-life-s", "1s", "--hot-max-replicas", "3"]


def bench_hot(directory: Path, rounds: int) -> dict[str, Any]:
    """Seconds from the first read of a fresh block (read in a tight loop) to 3 replicas."""
    times: list[float] = []
    with (
        LocalCluster(
            directory, masters=3, nodes=3, cpu_cache_size="256MiB", extra_master_flags=HOT_FLAGS
        ) as cluster,
        Client(cluster.master_addresses, timeout_s=5.0) as kv,
    ):
        for i in range(rounds):
            key = f"bench/hot/{i}"
            kv.put(key, _value(key, 64 << 10))
            started = time.monotonic()
            while replica_counts(cluster, [key])[0] < 3:
                for _ in range(20):
                    kv.get(key)
                if time.monotonic() - started > 30:
                    break
            else:
                times.append(time.monotonic() - started)
    return {
        "rounds": rounds,
        "reached": len(times),
        "median_s": round(statistics.median(times), 3) if times else None,
        "max_s": round(max(times), 3) if times else None,
        "threshold_reads_per_s": 20,
        "heartbeat_interval_s": 0.5,
    }


def bench_repair(directory: Path, blocks: int, size: int) -> dict[str, Any]:
    """Blocks at 2 replicas on 4 nodes; kill one; time until every block is at 2 again."""
    with LocalCluster(directory, masters=3, nodes=4, cpu_cache_size="512MiB") as cluster:
        keys = [f"bench/repair/{i}" for i in range(blocks)]
        with Client(cluster.master_addresses, timeout_s=30.0, replicas=2) as kv:
            for i in range(0, blocks, 500):
                chunk = keys[i : i + 500]
                kv.batch_put([(k, _value(k, size)) for k in chunk])
        victim = cluster.node_names[0]
        lost = sum(1 for c in replica_counts(cluster, keys) if c >= 2)
        killed = time.monotonic()
        cluster.kill(victim)
        declared = _wait(lambda: victim not in live_nodes(cluster), 30.0)
        repaired = _wait(lambda: min(replica_counts(cluster, keys)) >= 2, 120.0, 0.1)
        total = time.monotonic() - killed
    return {
        "blocks": blocks,
        "block_bytes": size,
        "blocks_at_2_before": lost,
        "declared_down_s": round(declared, 3) if declared is not None else None,
        "repair_after_declared_s": round(repaired, 3) if repaired is not None else None,
        "kill_to_repaired_s": round(total, 3),
        "node_timeout_s": cluster.node_timeout_s,
        "repair_rate_limit": "2000 blocks/s, 256 MiB/s (master defaults)",
    }


def bench_kill_hit_rate(directory: Path, hot: bool, seconds: float) -> dict[str, Any]:
    """A loop reading 20 hot keys (put with 1 replica); the holder of most of them is killed;
    the hit rate over ``seconds`` after the kill."""
    flags = HOT_FLAGS if hot else ["--hot-reads-per-s", "0"]
    keys = [f"bench/kill/{i}" for i in range(20)]
    with (
        LocalCluster(
            directory, masters=3, nodes=3, cpu_cache_size="256MiB", extra_master_flags=flags
        ) as cluster,
        Client(cluster.master_addresses, timeout_s=1.0) as kv,
    ):
        kv.batch_put([(k, _value(k, 16 << 10)) for k in keys])
        warm_until = time.monotonic() + 5.0
        while time.monotonic() < warm_until:
            kv.batch_get(keys)
        replicas_before = replica_counts(cluster, keys)
        victim = cluster.node_names[0]
        cluster.kill(victim)
        hits = reads = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            got = kv.batch_get(keys)
            reads += len(got)
            hits += sum(1 for k, v in zip(keys, got, strict=True) if v == _value(k, 16 << 10))
    return {
        "hot_replicas": hot,
        "replicas_before_kill": replicas_before,
        "reads": reads,
        "hit_rate": round(hits / reads, 4) if reads else None,
        "window_s": seconds,
    }


def bench_paused_replica(directory: Path, hedge: bool, seconds: float) -> dict[str, Any]:
    """Single gets of 20 keys at 2 replicas on 2 nodes while one node is paused (SIGSTOP, for
    less than the node timeout: not declared down), with hedged reads on or off: latency and
    hit rate."""
    keys = [f"bench/paused/{i}" for i in range(20)]
    size = 64 << 10
    latencies: list[float] = []
    hits = 0
    with (
        LocalCluster(directory, masters=1, nodes=2, cpu_cache_size="128MiB") as cluster,
        Client(cluster.master_addresses, timeout_s=1.0, replicas=2, hedge_reads=hedge) as kv,
    ):
        kv.batch_put([(k, _value(k, size)) for k in keys])
        for k in keys:  # warm: connections open, entries cached
            kv.get(k)
        victim = cluster.node_names[0]
        cluster.pause(victim)
        try:
            end = time.monotonic() + min(seconds, cluster.node_timeout_s * 0.6)
            i = 0
            while time.monotonic() < end:
                key = keys[i % len(keys)]
                i += 1
                started = time.monotonic()
                value = kv.get(key)
                latencies.append(time.monotonic() - started)
                hits += value == _value(key, size)
        finally:
            cluster.resume(victim)
        stats = kv.stats
    latencies.sort()
    n = len(latencies)
    return {
        "hedged_reads": hedge,
        "gets": n,
        "hit_rate": round(hits / n, 4) if n else None,
        "p50_ms": round(latencies[n // 2] * 1e3, 2) if n else None,
        "p99_ms": round(latencies[min(n - 1, int(n * 0.99))] * 1e3, 2) if n else None,
        "max_ms": round(latencies[-1] * 1e3, 2) if n else None,
        "hedges": stats["hedged_reads"],
        "hedge_wins": stats["hedge_wins"],
    }


def main_bench(args: argparse.Namespace) -> dict[str, Any]:
    blocks, rounds, window = args.blocks, args.rounds, args.window
    if args.quick:
        blocks, rounds, window = min(blocks, 500), min(rounds, 2), min(window, 3.0)
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-replicas-") as tmp:
        base = Path(args.dir) if args.dir else Path(tmp)
        return {
            "hot_block_replication": bench_hot(base / "hot", rounds),
            "repair_after_node_kill": bench_repair(base / "repair", blocks, args.block_size),
            "hit_rate_through_node_kill": {
                "without_hot_replicas": bench_kill_hit_rate(base / "cold", False, window),
                "with_hot_replicas": bench_kill_hit_rate(base / "warm", True, window),
            },
            "gets_with_a_paused_replica": {
                "not_hedged": bench_paused_replica(base / "paused-plain", False, window),
                "hedged": bench_paused_replica(base / "paused-hedged", True, window),
            },
        }
