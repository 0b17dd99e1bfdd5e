"""Measure the stalls a client process's full garbage collections cause, with and without
``kvpool.gctune.freeze_after_slow_collections``.

Starts a local cluster (1 master, 1 node), puts 4096 blocks of 4 KiB, then runs client
processes that call ``batch_get`` of 256 keys (entries cached: no master involved) for a few
seconds, each timing every call and every full (generation 2) collection of its own process.

    .venv/bin/python scripts/gc_stalls.py --processes 2 --seconds 8
    .venv/bin/python scripts/gc_stalls.py --processes 2 --seconds 8 --freeze
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpool.client.sync import Client
from kvpool.gctune import freeze_after_slow_collections
from kvpool.launcher.cluster import LocalCluster

KEYS = [f"gc-stalls/{i}" for i in range(4096)]


def _worker(masters: list[str], seconds: float, freeze: bool, out: Any) -> None:
    full: list[float] = []
    started = [0.0]

    def watch(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            full.append((time.perf_counter() - started[0]) * 1e3)

    gc.callbacks.append(watch)
    if freeze:
        freeze_after_slow_collections()
    with Client(masters, timeout_s=10.0, transport="tcp") as kv:
        for i in range(0, len(KEYS), 256):
            kv.batch_get(KEYS[i : i + 256])  # connections open, entries cached
        calls: list[float] = []
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            chunk = KEYS[(i * 256) % len(KEYS) :][:256]
            i += 1
            t = time.monotonic()
            if any(v is None for v in kv.batch_get(chunk)):
                raise SystemExit("a batch_get missed")
            calls.append(time.monotonic() - t)
    out.put({"calls": calls, "full_ms": full})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2, help="client processes [2]")
    parser.add_argument("--seconds", type=float, default=8.0, help="seconds of gets [8]")
    parser.add_argument(
        "--freeze", action="store_true", help="clients freeze after slow full collections"
    )
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="kvpool-gc-stalls-") as tmp,
        LocalCluster(Path(tmp), masters=1, nodes=1, cpu_cache_size="256MiB") as cluster,
    ):
        with Client(cluster.master_addresses, timeout_s=10.0) as kv:
            for i in range(0, len(KEYS), 256):
                kv.batch_put([(k, os.urandom(4096)) for k in KEYS[i : i + 256]])
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        procs = [
            ctx.Process(
                target=_worker, args=(cluster.master_addresses, args.seconds, args.freeze, out)
            )
            for _ in range(args.processes)
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=120 + args.seconds) for _ in procs]
        for p in procs:
            p.join(10)
    total_keys = 0
    for n, r in enumerate(results):
        calls = sorted(r["calls"])
        full = r["full_ms"]
        total_keys += 256 * len(calls)
        print(
            f"client {n}: {len(calls)} batch_gets, p50 {calls[len(calls) // 2] * 1e3:.2f} ms, "
            f"p99 {calls[int(len(calls) * 0.99)] * 1e3:.1f} ms, max {calls[-1] * 1e3:.1f} ms, "
            f"{sum(c > 0.02 for c in calls)} over 20 ms; full collections: {len(full)}, "
            f"median {statistics.median(full) if full else 0:.1f} ms, "
            f"max {max(full) if full else 0:.1f} ms"
        )
    print(
        f"{'frozen' if args.freeze else 'default gc'}: {total_keys / args.seconds:,.0f} keys/s "
        f"from {args.processes} processes"
    )


if __name__ == "__main__":
    main()
