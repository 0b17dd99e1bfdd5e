"""``kvpool bench``: the numbers behind the closing notes, measured the same way every time.

* ``kvpool bench cluster`` — a local cluster (3 masters, 2 nodes): put/get latency at 4 KiB and
  1 MiB (rounds interleaved, medians reported), batched puts per second, group commits, and
  failover time over several leader kills.
* ``kvpool bench index`` — the master alone: index memory per million entries, apply rate,
  compaction stall at 1 M entries, commit latency and group-commit throughput.
* ``kvpool bench data-plane`` — one store node's data server over loopback TCP.
* ``kvpool bench tiers`` — the tiered node: a write flood of three times its CPU tier (puts,
  demotions and SSD writes per second, refusals while demotions drain), GET GB/s from CPU
  memory against the SSD, eviction decisions per second, warm-restart time for 10k blocks.

The machine is shared and noisy: compare ratios measured in one run, and rerun.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.client.sync import Client
from kvpool.launcher.cluster import LocalCluster
from kvpool.units import format_size


def _pct(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(samples) * 1e3, 3),
        "p99_ms": round(_pct(samples, 0.99) * 1e3, 3),
        "n": len(samples),
    }


def _latency(kv: Client, sizes: list[int], rounds: int, rng: np.random.Generator) -> dict[str, Any]:
    """Single-key put and get, sizes interleaved inside every round."""
    puts: dict[int, list[float]] = {n: [] for n in sizes}
    gets: dict[int, list[float]] = {n: [] for n in sizes}
    into: dict[int, list[float]] = {n: [] for n in sizes}
    values = {n: rng.bytes(n) for n in sizes}
    buffers = {n: bytearray(n) for n in sizes}
    failures = 0
    for r in range(rounds):
        for n in sizes:
            key = f"bench/lat/{n}/{r}"
            t = time.perf_counter()
            ok = kv.put(key, values[n])
            puts[n].append(time.perf_counter() - t)
            t = time.perf_counter()
            got = kv.get(key)
            gets[n].append(time.perf_counter() - t)
            t = time.perf_counter()
            got_n = kv.get_into(key, buffers[n])
            into[n].append(time.perf_counter() - t)
            failures += (not ok) + (got != values[n]) + (got_n != n)
    out: dict[str, Any] = {"failures": failures}
    for n in sizes:
        out[format_size(n)] = {
            "put": _summary(puts[n]),
            "get": _summary(gets[n]),
            "get_into": _summary(into[n]),
        }
    return out


def _batched(kv: Client, batch: int, batches: int, size: int) -> dict[str, Any]:
    value = bytes(size)
    t = time.perf_counter()
    ok = 0
    for b in range(batches):
        ok += sum(kv.batch_put([(f"bench/batch/{b}/{i}", value) for i in range(batch)]))
    put_s = time.perf_counter() - t
    t = time.perf_counter()
    hits = 0
    for b in range(batches):
        got = kv.batch_get([f"bench/batch/{b}/{i}" for i in range(batch)])
        hits += sum(v is not None for v in got)
    get_s = time.perf_counter() - t
    return {
        "block": format_size(size),
        "keys_per_call": batch,
        "batch_put_keys_per_s": round(ok / put_s),
        "batch_put_calls_per_s": round(batches / put_s, 1),
        "batch_get_keys_per_s": round(hits / get_s),
        "failures": batch * batches - ok + (batch * batches - hits),
    }


def _failover(cluster: LocalCluster, kv: Client, kills: int) -> dict[str, Any]:
    times = []
    for k in range(kills):
        leader = cluster.leader_name()
        killed = time.monotonic()
        cluster.kill(leader)
        i = 0
        while time.monotonic() - killed < 30:
            i += 1
            if kv.put(f"bench/failover/{k}/{i}", b"x" * 4096):
                times.append(time.monotonic() - killed)
                break
        cluster.restart(leader)
        cluster.wait_for_leader(30)
        time.sleep(1.0)  # let the restarted master catch up before the next kill
    return {
        "kills": kills,
        "writes_resumed_s": {
            "min": round(min(times), 3) if times else None,
            "median": round(statistics.median(times), 3) if times else None,
            "max": round(max(times), 3) if times else None,
        },
        "never_resumed": kills - len(times),
    }


def bench_cluster(
    rounds: int = 200, kills: int = 3, directory: str | None = None
) -> dict[str, Any]:
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="kvpool-bench-"))
    cluster = LocalCluster(root, masters=3, nodes=2, cpu_cache_size="1GiB", log_level="warning")
    rng = np.random.default_rng(0)
    try:
        cluster.start()
        with Client(cluster.master_addresses, timeout_s=5.0) as kv:
            _latency(kv, [4096, 1 << 20], 20, rng)  # warm-up: connections, ring, page faults
            result: dict[str, Any] = {
                "latency": _latency(kv, [4096, 1 << 20], rounds, rng),
                "batched_4KiB": _batched(kv, 256, 40, 4096),
                "batched_1MiB": _batched(kv, 16, 20, 1 << 20),
                "failover": _failover(cluster, kv, kills) if kills else None,
            }
        return result
    finally:
        cluster.stop()
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)


def bench_index(quick: bool = False) -> dict[str, Any]:
    from kvpool.raft_master import bench

    result: dict[str, Any] = bench.run_all(quick=quick)
    return result


def bench_tiers(quick: bool = False, directory: str | None = None) -> dict[str, Any]:
    from kvpool.store_node import tier_bench

    result: dict[str, Any] = tier_bench.run_all(quick=quick, directory=directory)
    return result


def print_result(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2, default=str))
        return

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            print(f"{prefix:60s} {value}")

    walk("", result)
