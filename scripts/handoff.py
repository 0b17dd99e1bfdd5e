"""The P/D hand-off, counted: one client puts a block, a second client (another process, which
has never looked the key up) reads it right after the put returned. Every miss is a block
acknowledged to one engine and recomputed by the next.

    python scripts/handoff.py                      # 10,000 hand-offs of 4 KiB, a local cluster
    python scripts/handoff.py --count 2000 --size 1MiB
    python scripts/handoff.py --load               # with a CPU-bound process beside it
    python scripts/handoff.py --masters HOST:PORT,...   # against a running cluster
    python scripts/handoff.py --keys opaque        # keys that do not name their content

Keys are of kvpool's scheme by default (``kv1/…``, as engines build them), so the reader reads
each block by content, from its node with no Lookup (``direct_reads``); ``--keys opaque`` reads
through the index.

Prints one JSON line: hand-offs, misses by reason, wrong reads (bytes that differ: must be 0),
the reader's latency percentiles (p50 to p99.9, and the slowest), how many reads took over 1, 5
and 20 ms, and how many of its reads went by content (``direct_hits``) or missed there and were
looked up (``direct_misses``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path

from kvpool import Client
from kvpool.errors import KVPoolError
from kvpool.launcher.cluster import LocalCluster
from kvpool.units import parse_size


def _reader(masters: list[str], size: int, conn: Connection) -> None:
    buffer = bytearray(size)
    with Client(masters, timeout_s=3.0) as kv:
        conn.send("ready")
        while True:
            job = conn.recv()
            if job is None:
                break
            key, expected = job
            started = time.perf_counter()
            try:
                got = kv.get_into(key, buffer, strict=True)
                outcome = "hit" if got == size and buffer == expected else "wrong"
            except KVPoolError as e:
                outcome = getattr(e, "reason", "") or type(e).__name__
            conn.send((outcome, time.perf_counter() - started))
        conn.send((kv.stats["direct_hits"], kv.stats["direct_misses"]))


def _burn(stop_at: float) -> None:
    x = 0
    while time.monotonic() < stop_at:
        x = (x * 31 + 7) % 1_000_003


def handoff_key(keys: str, size: int, i: int) -> str:
    """The key of hand-off ``i``: of kvpool's scheme (``scheme``), or an opaque one."""
    if keys == "scheme":
        return f"kv1/{os.getpid():016x}{size:016x}/{i:032x}"
    return f"handoff/{size}/{os.getpid()}/{i}"


def run(
    masters: list[str], count: int, size: int, load: bool, keys: str = "scheme"
) -> dict[str, object]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    reader = ctx.Process(target=_reader, args=(masters, size, there), daemon=True)
    reader.start()
    burner = None
    try:
        if here.recv() != "ready":
            raise RuntimeError("the reader did not start")
        if load:
            burner = ctx.Process(target=_burn, args=(time.monotonic() + 3600,), daemon=True)
            burner.start()
        outcomes: Counter[str] = Counter()
        latencies = []
        with Client(masters, timeout_s=3.0) as writer:
            for i in range(count):
                key = handoff_key(keys, size, i)
                value = os.urandom(8) * (size // 8) + os.urandom(size % 8)
                if not writer.put(key, value):
                    outcomes["put_failed"] += 1
                    continue
                here.send((key, value))
                outcome, seconds = here.recv()
                outcomes[outcome] += 1
                latencies.append(seconds)
                if sys.stderr.isatty() and i % 500 == 0:
                    print(f"\r{i}/{count}", end="", file=sys.stderr)
        here.send(None)
        direct_hits, direct_misses = here.recv()
        reader.join(10)
    finally:
        if burner is not None:
            burner.kill()
            burner.join()
        if reader.is_alive():
            reader.kill()
            reader.join()
    latencies.sort()
    misses = {k: v for k, v in outcomes.items() if k not in ("hit", "wrong", "put_failed")}
    return {
        "handoffs": sum(v for k, v in outcomes.items() if k != "put_failed"),
        "size_bytes": size,
        "loaded": load,
        "keys": keys,
        "hits": outcomes["hit"],
        "misses": sum(misses.values()),
        "miss_reasons": misses,
        "wrong": outcomes["wrong"],
        "put_failed": outcomes["put_failed"],
        "direct_hits": direct_hits,
        "direct_misses": direct_misses,
        **{
            f"read_{name}_us": round(latencies[int(q * (len(latencies) - 1))] * 1e6)
            if latencies
            else None
            for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))
        },
        "read_max_us": round(latencies[-1] * 1e6) if latencies else None,
        "slow_reads": {f">{ms} ms": sum(1 for s in latencies if s > ms / 1e3) for ms in (1, 5, 20)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10_000, help="hand-offs (default 10000)")
    parser.add_argument("--size", default="4KiB", help="block size (default 4KiB)")
    parser.add_argument("--load", action="store_true", help="a CPU-bound process beside it")
    parser.add_argument("--masters", default="", help="a running cluster's masters, comma-sep.")
    parser.add_argument(
        "--keys",
        choices=("scheme", "opaque"),
        default="scheme",
        help="kvpool's scheme (read by content, the default) or opaque keys (read via a Lookup)",
    )
    args = parser.parse_args()
    size = parse_size(args.size)
    if args.count <= 0 or size <= 0:
        parser.error("--count and --size must be positive")
    if args.masters:
        result = run(args.masters.split(","), args.count, size, args.load, args.keys)
    else:
        with tempfile.TemporaryDirectory(prefix="kvpool-handoff-") as d:
            cluster = LocalCluster(Path(d), masters=3, nodes=2, cpu_cache_size="1GiB")
            cluster.start()
            try:
                result = run(
                    cluster.client_master_addresses, args.count, size, args.load, args.keys
                )
            finally:
                cluster.stop()
    print(json.dumps(result))
    return 0 if result["misses"] == 0 and result["wrong"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
