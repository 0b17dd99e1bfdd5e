"""``kvpool-bench cluster``, ``index`` and ``tiers``: the numbers behind the closing notes,
measured the same way every time.

* ``kvpool-bench cluster`` — a local cluster (3 masters, 2 nodes): put/get latency at 4 KiB and
  1 MiB (rounds interleaved, medians reported), batched puts per second, group commits, and
  failover time over several leader kills (and SIGSTOPs, ``--pauses``), with the elections
  that follow the old leader's return.
* ``kvpool-bench index`` — the master alone: index memory per million entries, apply rate,
  compaction stall at 1 M entries, commit latency and group-commit throughput.
* ``kvpool-bench tiers`` — the tiered node: a write flood of three times its CPU tier (puts,
  demotions and SSD writes per second, refusals while demotions drain), GET GB/s from CPU
  memory against the SSD, eviction decisions per second, warm-restart time for 10k blocks.

The machine is shared and noisy: compare ratios measured in one run, and rerun.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.cli.bench import latency
from kvpool.client.sync import Client
from kvpool.launcher.cluster import LocalCluster
from kvpool.launcher.probe import probe_masters
from kvpool.units import format_size


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


RETURN_WATCH_S = 3.0
"""How long the terms are watched after the old leader is back (restarted or resumed)."""
STATUS_SETTLE_S = 0.3
"""A master's status (its term) is a snapshot taken at most every 0.1 s: waited out before the
term is read, so that the election that ended the failover is not counted after the return."""


def _highest_term(cluster: LocalCluster) -> int:
    running = [p.grpc for p in cluster.masters if cluster.is_running(p.name)]
    probes = probe_masters(running, timeout_s=0.5, security=cluster.security)
    return max((p.status.master.term for p in probes if p.status is not None), default=0)


def _failover(cluster: LocalCluster, kv: Client, faults: int, how: str) -> dict[str, Any]:
    """``faults`` times: kill -9 (``how="kill"``) or SIGSTOP (``"pause"``) the leader, time
    until a put is acknowledged again, bring the old leader back (restart / SIGCONT), and count
    the elections in the next :data:`RETURN_WATCH_S` (the term's rise: 0 when the returning
    master does not disturb the new leader)."""
    times = []
    elections_after_return = []
    for k in range(faults):
        leader = cluster.leader_name()
        struck = time.monotonic()
        if how == "kill":
            cluster.kill(leader)
        else:
            cluster.pause(leader)
        i = 0
        while time.monotonic() - struck < 30:
            i += 1
            if kv.put(f"bench/failover/{how}/{k}/{i}", b"x" * 4096):
                times.append(time.monotonic() - struck)
                break
        time.sleep(STATUS_SETTLE_S)
        term = _highest_term(cluster)
        if how == "kill":
            cluster.restart(leader)
        else:
            cluster.resume(leader)
        time.sleep(RETURN_WATCH_S)
        elections_after_return.append(max(0, _highest_term(cluster) - term))
        cluster.wait_for_leader(30)
        cluster.wait_caught_up(30)  # the returned master has caught up before the next fault
    return {
        "faults": faults,
        "writes_resumed_s": {
            "min": round(min(times), 3) if times else None,
            "median": round(statistics.median(times), 3) if times else None,
            "max": round(max(times), 3) if times else None,
        },
        "never_resumed": faults - len(times),
        "elections_after_return": elections_after_return,
    }


def bench_cluster(
    rounds: int = 200, kills: int = 3, directory: str | None = None, pauses: int = 0
) -> dict[str, Any]:
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="kvpool-bench-"))
    cluster = LocalCluster(root, masters=3, nodes=2, cpu_cache_size="1GiB", log_level="warning")
    rng = np.random.default_rng(0)
    try:
        cluster.start()
        with Client(cluster.master_addresses, timeout_s=5.0) as kv:
            latency(kv, [4096, 1 << 20], 20, rng)  # warm-up: connections, ring, page faults
            result: dict[str, Any] = {
                "latency": latency(kv, [4096, 1 << 20], rounds, rng),
                "batched_4KiB": _batched(kv, 256, 40, 4096),
                "batched_1MiB": _batched(kv, 16, 20, 1 << 20),
                "failover": _failover(cluster, kv, kills, "kill") if kills else None,
                "failover_pause": _failover(cluster, kv, pauses, "pause") if pauses else None,
            }
        return result
    finally:
        cluster.stop()
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)


def bench_index(quick: bool = False) -> dict[str, Any]:
    from kvpool_bench import index

    result: dict[str, Any] = index.run_all(quick=quick)
    return result


def bench_tiers(quick: bool = False, directory: str | None = None) -> dict[str, Any]:
    from kvpool_bench import tiers

    result: dict[str, Any] = tiers.run_all(quick=quick, directory=directory)
    return result
