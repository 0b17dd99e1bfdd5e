"""``make demo`` / ``kvpool demo``: a throwaway local cluster, a real workload, a leader kill.

Prints a short report: the cluster, blocks put and read back byte for byte, hit rate, put/get
latency, how long writes paused when the leader was killed, and that every committed block was
still found afterwards. Everything it started is stopped, also on failure or Ctrl-C.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvpool.cli.status import render_status, status_document
from kvpool.client.sync import Client
from kvpool.launcher.cluster import LocalCluster
from kvpool.launcher.probe import probe_masters
from kvpool.units import format_size

SIZES = (4096, 16 * 1024, 64 * 1024, 256 * 1024, 1 << 20)


def _p50_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.2f} ms" if samples else "n/a"


def _say(text: str = "") -> None:
    print(text, flush=True)


def run_demo(blocks: int = 400, directory: str | None = None, seed: int = 7) -> int:
    keep = directory is not None
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="kvpool-demo-"))
    rng = np.random.default_rng(seed)
    cluster = LocalCluster(root, masters=3, nodes=2, cpu_cache_size="256MiB")
    _say(f"kvpool demo: starting 3 masters and 2 store nodes on 127.0.0.1 (in {root})")
    t0 = time.monotonic()
    try:
        cluster.start()
        _say(f"cluster up in {time.monotonic() - t0:.1f} s")
        _say(render_status(status_document(probe_masters(cluster.master_addresses))))
        _say()
        with Client(cluster.master_addresses, timeout_s=5.0) as kv:
            sizes = [SIZES[i % len(SIZES)] for i in range(blocks)]
            values = {f"demo/{i:05d}": rng.bytes(n) for i, n in enumerate(sizes)}
            put_lat: dict[int, list[float]] = {n: [] for n in SIZES}
            committed = []
            for key, value in values.items():
                t = time.perf_counter()
                ok = kv.put(key, value)
                put_lat[len(value)].append(time.perf_counter() - t)
                if ok:
                    committed.append(key)
            total_bytes = sum(len(values[k]) for k in committed)
            _say(f"put {len(committed)}/{blocks} blocks, {format_size(total_bytes)}")

            get_lat: dict[int, list[float]] = {n: [] for n in SIZES}
            hits = exact = 0
            for key in committed:
                t = time.perf_counter()
                got = kv.get(key)
                get_lat[len(values[key])].append(time.perf_counter() - t)
                if got is not None:
                    hits += 1
                    exact += got == values[key]
            rate = hits / len(committed) if committed else 0.0
            _say(
                f"read back {hits}/{len(committed)} (hit rate {rate:.1%}), "
                f"{exact} byte-for-byte identical, {hits - exact} wrong"
            )
            _say("latency p50   put            get")
            for n in SIZES:
                _say(
                    f"  {format_size(n):>9}   {_p50_ms(put_lat[n]):>12}   {_p50_ms(get_lat[n]):>12}"
                )

            t = time.perf_counter()
            batch = kv.batch_get(committed[:256])
            batch_s = time.perf_counter() - t
            batch_ok = sum(1 for k, v in zip(committed[:256], batch, strict=True) if v == values[k])
            _say(
                f"batch_get of {len(batch)} keys in one call: {batch_s * 1e3:.1f} ms, "
                f"{batch_ok} correct"
            )

            leader = cluster.leader_name()
            _say()
            _say(f"killing the leader ({leader}) with SIGKILL ...")
            killed_at = time.monotonic()
            cluster.kill(leader)
            attempts = 0
            resumed_s = None
            while time.monotonic() - killed_at < 30:
                attempts += 1
                value = rng.bytes(4096)
                if kv.put(f"demo/after-kill/{attempts}", value):
                    resumed_s = time.monotonic() - killed_at
                    break
            if resumed_s is None:
                _say("writes did NOT resume within 30 s")
                return 1
            new_leader = cluster.leader_name()
            _say(
                f"writes resumed after {resumed_s:.2f} s ({attempts} attempts); "
                f"new leader {new_leader}"
            )
            found = sum(1 for ok in kv.batch_get(committed) if ok is not None)
            _say(f"after failover: {found}/{len(committed)} committed blocks still found")
            _say(f"restarting {leader} ...")
            restarted_at = time.monotonic()
            cluster.restart(leader)
            caught_up = cluster.wait_caught_up(timeout_s=30)
            if not caught_up:
                _say(f"{leader} did NOT catch up within 30 s")
            else:
                _say(
                    f"{leader} caught up {time.monotonic() - restarted_at:.2f} s after its restart"
                )
            _say()
            _say(render_status(status_document(probe_masters(cluster.master_addresses))))
            wrong = hits - exact
            ok = wrong == 0 and found == len(committed) and len(committed) == blocks and caught_up
            _say()
            _say(
                "demo "
                + ("passed" if ok else "FAILED")
                + ": nothing wrong was read"
                + ("" if wrong == 0 else " -- WRONG READS SEEN")
            )
            return 0 if ok else 1
    finally:
        stopped = cluster.stop()
        _say(f"stopped {len(stopped)} processes")
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            _say(f"data and logs kept in {root}")
        sys.stdout.flush()
