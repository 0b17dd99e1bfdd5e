"""CPU time per put, process by process: where a put's work goes on this machine.

Starts a local cluster (3 masters, 2 nodes), waits for it to settle, then measures each
process's CPU time (user and system, from ``/proc/<pid>/stat``; this process's from
``getrusage``) over ``--puts`` sequential calls — ``put`` of one ``--size`` block, or
``batch_put`` of ``--batch`` of them — and again over as long with no calls (the idle share:
Raft's ticks and heartbeats, the nodes' and masters' timers). On a machine with fewer CPUs than
busy processes, a put's latency is bound by the sum: ``p50 ≈ total CPU per put / CPUs`` once
the processes queue for a CPU.

    python scripts/put_cpu.py [--puts 2000] [--size 4KiB] [--batch 1] [--transport tcp]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvpool import Client
from kvpool.launcher.cluster import LocalCluster
from kvpool.units import parse_size

SETTLE_S = 5.0
"""A new node fills its arena's page tables in the background first (``cpu_tier_prefault``)."""


def _cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--puts", type=int, default=2000, help="calls measured [2000]")
    parser.add_argument("--size", default="4KiB", help="block size [4KiB]")
    parser.add_argument("--batch", type=int, default=1, help="blocks per call: 1 is put [1]")
    parser.add_argument("--transport", default="tcp", help="the client's transport [tcp]")
    args = parser.parse_args(argv)
    if args.puts < 10 or args.batch < 1:
        parser.error("--puts must be at least 10 and --batch at least 1")
    try:
        size = parse_size(args.size)
    except ValueError as e:
        parser.error(str(e))
    if not Path("/proc/self/stat").exists():
        print("needs /proc (Linux)", file=sys.stderr)
        return 2
    value = os.urandom(size)

    def call(client: Client, name: str) -> None:
        if args.batch == 1:
            ok = [client.put(name, value)]
        else:
            ok = client.batch_put([(f"{name}-{j}", value) for j in range(args.batch)])
        if not all(ok):
            raise SystemExit(f"a put failed: {name}")

    with tempfile.TemporaryDirectory(prefix="kvpool-put-cpu-") as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster", masters=3, nodes=2, cpu_cache_size="1GiB")
        try:
            cluster.start()
            cluster.wait_for_leader()
            os.environ.update(cluster.client_env)
            client = Client(cluster.client_master_addresses, transport=args.transport)
            try:
                time.sleep(SETTLE_S)
                for i in range(max(20, args.puts // 10)):
                    call(client, f"warm-{i}")
                pids = {name: p.pid for name, p in cluster.processes.items()}
                before = {name: _cpu_s(pid) for name, pid in pids.items()}
                mine = resource.getrusage(resource.RUSAGE_SELF)
                started = time.perf_counter()
                latencies = []
                for i in range(args.puts):
                    t = time.perf_counter()
                    call(client, f"k{i}")
                    latencies.append(time.perf_counter() - t)
                wall = time.perf_counter() - started
                after = {name: _cpu_s(pid) for name, pid in pids.items()}
                done = resource.getrusage(resource.RUSAGE_SELF)
                time.sleep(wall)
                idle = {name: _cpu_s(pid) for name, pid in pids.items()}
            finally:
                client.close()
        finally:
            for name in list(cluster.processes):
                cluster.terminate(name)
    n = args.puts
    what = "put" if args.batch == 1 else f"batch_put of {args.batch}"
    print(
        f"{what} x {args.size} over {args.transport}: p50 {statistics.median(latencies) * 1e6:,.0f}"
        f" µs, wall per call {wall / n * 1e6:,.0f} µs"
    )
    print("µs of CPU per call  (user + system; idle: the same span with no calls)")
    total = 0.0
    rows = [(name, after[name], before[name], idle[name]) for name in pids]
    for name, a, b, i in rows:
        user, system = (a[0] - b[0]) / n * 1e6, (a[1] - b[1]) / n * 1e6
        quiet = (i[0] + i[1] - a[0] - a[1]) / n * 1e6
        total += user + system
        print(f"  {name:<10} {user:>8,.0f} + {system:>6,.0f}   idle {quiet:>6,.0f}")
    user = (done.ru_utime - mine.ru_utime) / n * 1e6
    system = (done.ru_stime - mine.ru_stime) / n * 1e6
    total += user + system
    print(f"  {'client':<10} {user:>8,.0f} + {system:>6,.0f}")
    cpus = os.cpu_count() or 1
    print(f"  total {total:,.0f} µs per call; / {cpus} CPUs = {total / cpus:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
