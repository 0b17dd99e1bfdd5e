"""Where the data path spends its time: py-spy on the client, the store node and the leader.

Starts a local cluster (3 masters, 1 node), loads blocks, then for each workload runs it in this
process for ``--seconds`` while py-spy samples this process, the node and the Raft leader
(``--nonblocking``: the targets are not paused). Prints, per workload and process, the share of
samples in each leaf function (self time: py-spy leaves out threads it judges idle, but a thread
blocked in a socket call counts; ``--gil`` keeps only threads holding the GIL, Python's own CPU
time) and the operation rate reached under the profiler. Needs py-spy
(``pip install -e 'bench[peers]'``) and permission to ptrace the processes (root, or
``kernel.yama.ptrace_scope=0``).

    python scripts/profile_data_path.py [--seconds 8] [--top 10] [--transport tcp|shm]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvpool import Client
from kvpool.launcher.cluster import LocalCluster

KIB, MIB = 1 << 10, 1 << 20
PY_SPY = shutil.which(
    "py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
)


def leaf_shares(raw: Path, top: int) -> tuple[int, list[tuple[str, float]]]:
    """(samples, [(leaf frame, share)]) from py-spy's raw (collapsed) output."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        name, _, where = leaf.partition(" (")
        short = where.rstrip(")").rsplit("/", 2)[-2:]
        counts[f"{name} ({'/'.join(short).split(':')[0]})"] += int(n)
        total += int(n)
    return total, [(f, c / total) for f, c in counts.most_common(top)] if total else []


def profile(
    name: str,
    op: Callable[[], int],
    *,
    pids: dict[str, int],
    seconds: float,
    top: int,
    out: Path,
    gil: bool,
) -> None:
    spies = {}
    for who, pid in pids.items():
        path = out / f"{name}-{who}.txt"
        spies[who] = (
            path,
            subprocess.Popen(
                [
                    PY_SPY or "py-spy",
                    "record",
                    "--pid",
                    str(pid),
                    "--duration",
                    str(int(seconds)),
                    "--rate",
                    "200",
                    "--nonblocking",
                    *(["--gil"] if gil else []),
                    "--format",
                    "raw",
                    "--output",
                    str(path),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            ),
        )
    time.sleep(0.5)  # py-spy attaches
    done, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds - 1.0:
        done += op()
    rate = done / (time.monotonic() - t0)
    print(f"\n== {name}: {rate:,.0f} ops/s under the profiler")
    for who, (path, proc) in spies.items():
        _, err = proc.communicate(timeout=seconds + 30)
        if proc.returncode != 0 or not path.exists():
            print(f"  {who}: py-spy failed: {err.decode(errors='replace').strip()[-300:]}")
            continue
        total, shares = leaf_shares(path, top)
        print(f"  {who} ({total} samples {'holding the GIL' if gil else 'while busy'})")
        for frame, share in shares:
            print(f"    {share:6.1%}  {frame}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=8.0, help="per workload [8]")
    p.add_argument("--top", type=int, default=10, help="leaf functions shown per process [10]")
    p.add_argument(
        "--gil",
        action="store_true",
        help="sample only threads holding the GIL: Python CPU time, not time in system calls",
    )
    p.add_argument("--transport", default="tcp", choices=("tcp", "shm"), help="[tcp]")
    args = p.parse_args()
    if PY_SPY is None:
        print("py-spy is not installed: pip install -e 'bench[peers]'", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="kvpool-profile-"))
    cluster = LocalCluster(root, masters=3, nodes=1, cpu_cache_size="1GiB", log_level="warning")
    try:
        cluster.start()
        leader = next(m for m in cluster.masters if m.name == cluster.leader_name())
        pids = {"client": os.getpid(), "node": cluster.nodes[0].pid, "leader": leader.pid}
        with Client(cluster.master_addresses, transport=args.transport) as kv:
            small = [f"p/small/{i}" for i in range(4096)]
            big = [f"p/big/{i}" for i in range(16)]
            blob4k, blob1m = os.urandom(4 * KIB), os.urandom(MIB)
            for i in range(0, len(small), 256):
                kv.batch_put(dict.fromkeys(small[i : i + 256], blob4k))
            kv.batch_put(dict.fromkeys(big, blob1m))
            kv.batch_get(small)
            buf = bytearray(MIB)
            counter = iter(range(1 << 40))
            lock = threading.Lock()

            def put_4k() -> int:
                with lock:
                    n = next(counter)
                return int(kv.put(f"p/put/{n}", blob4k))

            workloads: dict[str, Callable[[], int]] = {
                "get 4 KiB (entry cached)": lambda: int(kv.get(small[0]) is not None),
                "get_into 1 MiB": lambda: int(kv.get_into(big[1], buf) is not None),
                "batch_get 256 x 4 KiB (keys)": lambda: sum(
                    v is not None for v in kv.batch_get(small[:256])
                ),
                "put 4 KiB": put_4k,
            }
            out = root / "profiles"
            out.mkdir()
            for name, op in workloads.items():
                profile(
                    name, op, pids=pids, seconds=args.seconds, top=args.top, out=out, gil=args.gil
                )
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
