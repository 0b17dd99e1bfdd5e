"""What a fresh client's first calls cost, with and without ``warm_up()``: an engine's first
request after start (time-to-first-token) pays for every connection the client opens then.

    python scripts/first_call.py                       # a local cluster, 10 rounds
    python scripts/first_call.py --rounds 20 --masters HOST:PORT,...

Each round starts one fresh process per cell (transport tcp / shm, ``warm_up()`` or not), the
order alternating round by round. A process times its ``warm_up()`` (when asked), then a 4 KiB
``put``, a ``get`` of a 4 KiB block another client wrote (a first read) and a second ``put``.
Prints the median of each over the rounds, in milliseconds, and every read's bytes are checked.
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

_CHILD = """
import json, sys, time
from kvpool import Client
masters, transport, warm, key, expected = json.loads(sys.argv[1])
kv = Client(masters, transport=transport, timeout_s=5.0)
out = {}
start = time.perf_counter()
if warm:
    report = kv.warm_up()
    assert report.ok, report.summary()
out["warm_up"] = time.perf_counter() - start
for name, call in (
    ("first put", lambda: kv.put(f"first-call/{time.time_ns()}", b"p" * 4096)),
    ("first read", lambda: kv.get(key)),
    ("second put", lambda: kv.put(f"first-call/{time.time_ns()}", b"q" * 4096)),
):
    start = time.perf_counter()
    result = call()
    out[name] = time.perf_counter() - start
    assert result == bytes.fromhex(expected) if name == "first read" else result, name
kv.close()
print(json.dumps(out))
"""


def _cell(masters: list[str], transport: str, warm: bool, key: str, value: bytes) -> dict:
    arg = json.dumps([masters, transport, warm, key, value.hex()])
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, arg],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise SystemExit(f"{transport} warm={warm}: {done.stderr.strip()}")
    result: dict = json.loads(done.stdout)
    return result


def _measure(masters: list[str], rounds: int) -> None:
    from kvpool import Client

    cells = [(t, w) for t in ("tcp", "shm") for w in (False, True)]
    times: dict[tuple[str, bool], list[dict]] = {cell: [] for cell in cells}
    with Client(masters, timeout_s=5.0) as writer:
        for r in range(rounds):
            for transport, warm in cells if r % 2 == 0 else cells[::-1]:
                key, value = f"first-call/read/{time.time_ns()}", os.urandom(4096)
                assert writer.put(key, value)
                times[(transport, warm)].append(_cell(masters, transport, warm, key, value))
            print(f"round {r + 1}/{rounds}", file=sys.stderr)
    steps = ("warm_up", "first put", "first read", "second put")
    print("median ms      " + "".join(f"{s:>12}" for s in steps))
    for (transport, warm), runs in times.items():
        row = [1e3 * statistics.median(run[s] for run in runs) for s in steps]
        label = f"{transport} {'warm_up' if warm else 'cold'}"
        print(f"{label:<15}" + "".join(f"{v:>12.2f}" for v in row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds [10]")
    parser.add_argument("--masters", default="", help="a running cluster's masters [a local one]")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.masters:
        _measure([m.strip() for m in args.masters.split(",") if m.strip()], args.rounds)
        return
    from kvpool.launcher.cluster import LocalCluster

    with tempfile.TemporaryDirectory() as work:
        cluster = LocalCluster(Path(work) / "cluster", masters=3, nodes=2, cpu_cache_size="256MiB")
        try:
            cluster.start()
            _measure(cluster.client_master_addresses, args.rounds)
        finally:
            cluster.stop()


if __name__ == "__main__":
    main()
