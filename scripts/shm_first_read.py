"""A first read over shared memory, with the nodes' directory and without it, in one run.

One process puts ``--count`` blocks of ``--size`` (keys of kvpool's scheme by default, or opaque
keys with ``--keys opaque``), then a fresh reader process (``warm_up()`` first, as the engine
backends do) reads each once with ``get_into`` and checks every byte; the reader alternates
between the directory on and off (``KVPOOL_SHM_DIRECTORY=0``) for ``--rounds`` rounds each.
Prints each round's p50 and the medians:

    python scripts/shm_first_read.py --size 1MiB --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpool import Client
from kvpool.launcher.cluster import LocalCluster
from kvpool.units import parse_size

READER = """
import json, os, statistics, sys, time
from kvpool import Client
masters, keys, size, seed = json.loads(sys.argv[1])
kv = Client(masters, transport="shm", timeout_s=5.0)
kv.warm_up()
buf = bytearray(size)
lat = []
for i, key in enumerate(keys):
    t = time.perf_counter()
    n = kv.get_into(key, buf)
    lat.append(time.perf_counter() - t)
    want = (seed + i % 251).to_bytes(1, "little") * size
    assert n == size and buf == want, f"{key}: wrong or missing"
print(json.dumps({"p50_us": statistics.median(lat) * 1e6, "direct": kv.stats["direct_hits"]}))
kv.close()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1MiB", help="block size [1MiB]")
    ap.add_argument("--count", type=int, default=200, help="blocks per round [200]")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each setting [3]")
    ap.add_argument("--keys", choices=("scheme", "opaque"), default="scheme")
    ap.add_argument("--cpu-cache-size", default="1GiB", help="each node's CPU tier [1GiB]")
    args = ap.parse_args()
    size = parse_size(args.size)
    if size <= 0 or args.count <= 0 or args.rounds <= 0:
        ap.error("--size, --count and --rounds must be positive")
    results: dict[str, list[float]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp), masters=3, nodes=2, cpu_cache_size=args.cpu_cache_size)
        cluster.start()
        try:
            with Client(cluster.master_addresses, transport="shm", timeout_s=5.0) as writer:
                for r in range(args.rounds * 2):
                    setting = "on" if r % 2 == 0 else "off"
                    tag = os.urandom(6).hex()
                    keys = [
                        f"kv1/{tag}{size:020x}/{i:032x}"
                        if args.keys == "scheme"
                        else f"first-read/{tag}/{i}"
                        for i in range(args.count)
                    ]
                    seed = r % 256
                    for i in range(0, len(keys), 16):
                        batch = [
                            (k, (seed + j % 251).to_bytes(1, "little") * size)
                            for j, k in enumerate(keys[i : i + 16], i)
                        ]
                        assert all(writer.batch_put(batch)), "a put failed"
                    time.sleep(0.5)  # the nodes confirm the commits with the index
                    env = dict(os.environ, KVPOOL_SHM_DIRECTORY="1" if setting == "on" else "0")
                    spec = json.dumps([cluster.master_addresses, keys, size, seed])
                    out = subprocess.run(
                        [sys.executable, "-c", READER, spec],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=300,
                        check=False,
                    )
                    if out.returncode:
                        print(out.stderr, file=sys.stderr)
                        return 1
                    row = json.loads(out.stdout.strip().splitlines()[-1])
                    results[setting].append(row["p50_us"])
                    print(
                        f"round {r // 2 + 1} directory {setting:3}: p50 {row['p50_us']:7.0f} us"
                        f" = {size / row['p50_us'] / 1e3:5.2f} GB/s"
                    )
                    writer.batch_remove(keys)
        finally:
            cluster.stop()
    on, off = statistics.median(results["on"]), statistics.median(results["off"])
    print(
        f"median p50: directory on {on:.0f} us ({size / on / 1e3:.2f} GB/s), "
        f"off {off:.0f} us ({size / off / 1e3:.2f} GB/s): {on / off:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
