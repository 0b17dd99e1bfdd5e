"""``kvpool-bench client``: the data path through ``kvpool.Client`` on a local cluster.

Measures the data path the client is held to (the targets in docs/performance.md), with the
machine's limits measured in the same run:

* single-key ``get_into`` of 1, 4 and 16 MiB blocks (GB/s, p50) over TCP and shared memory;
* one 4 KiB get (p50, p99): index entry cached, and not (a Lookup call each);
* ``batch_get`` of 256 x 4 KiB (keys/s); ``batch_get_into`` of 16 x 1 MiB against 16 sequential
  ``get_into`` calls;
* ``batch_put`` of 1 MiB blocks (GB/s); one 4 KiB put (p50); 8 threads putting at once (puts/s,
  p50, and how many CommitPuts requests their puts shared);
* two client processes against one (aggregate GB/s and keys/s);
* memcpy and loopback TCP between two Python processes (the limits).

Transports are interleaved inside every round (tcp, then shm) and every number is the median
over ``--rounds`` rounds. Every byte read is compared with what was put (outside the timing).

    kvpool-bench client [--rounds 5] [--quick] [--json] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.client.sync import Client
from kvpool.launcher.cluster import LocalCluster
from kvpool_bench.peer_servers import wait_prefaulted

MIB = 1 << 20
KIB = 1 << 10
TRANSPORTS = ("tcp", "shm")


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rng_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class BenchError(RuntimeError):
    """A read came back wrong or a put failed: the numbers would mean nothing."""


# --- machine limits -------------------------------------------------------------------------------


def memcpy_gbps(size: int = 16 * MIB, reps: int = 50) -> float:
    src = np.frombuffer(_rng_bytes(size, 1), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    t = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    return size * reps / (time.perf_counter() - t) / 1e9


def _tcp_sink(port_pipe: Any, total: int, chunk: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_pipe.send(server.getsockname()[1])
    conn, _ = server.accept()
    buf = memoryview(bytearray(chunk))
    got = 0
    while got < total:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    conn.sendall(b"k")
    conn.close()
    server.close()


def loopback_tcp_gbps(total: int = 1 << 30, chunk: int = MIB) -> float:
    """One Python process sends ``total`` bytes to another over loopback TCP (1 MiB writes)."""
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.Process(target=_tcp_sink, args=(child, total, chunk), daemon=True)
    proc.start()
    try:
        port = parent.recv()
        sock = socket.create_connection(("127.0.0.1", port))
        data = memoryview(_rng_bytes(chunk, 2))
        t = time.perf_counter()
        sent = 0
        while sent < total:
            sock.sendall(data)
            sent += chunk
        sock.recv(1)
        elapsed = time.perf_counter() - t
        sock.close()
        return total / elapsed / 1e9
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


# --- the cases ------------------------------------------------------------------------------------


class Bench:
    def __init__(self, masters: list[str], quick: bool) -> None:
        self.masters = masters
        self.quick = quick
        self.clients = {t: Client(masters, timeout_s=10.0, transport=t) for t in TRANSPORTS}
        self.cold = {
            t: Client(masters, timeout_s=10.0, transport=t, lookup_cache_size=0) for t in TRANSPORTS
        }
        self.values: dict[str, bytes] = {}

    def close(self) -> None:
        for kv in [*self.clients.values(), *self.cold.values()]:
            kv.close()

    def load(self, prefix: str, count: int, size: int) -> list[str]:
        """Put ``count`` blocks of ``size`` bytes (in batches of at most 64 MiB)."""
        keys = [f"{prefix}/{size}/{i}" for i in range(count)]
        per_call = max(1, min(256, (64 * MIB) // max(size, 1)))
        kv = self.clients["tcp"]
        for start in range(0, count, per_call):
            batch = {k: _rng_bytes(size, hash(k) & 0xFFFF) for k in keys[start : start + per_call]}
            if not all(kv.batch_put(batch)):
                raise BenchError(f"batch_put of {len(batch)} x {size} B failed")
            self.values.update(batch)
        return keys

    def _check(self, key: str, got: bytes | bytearray | memoryview | None) -> None:
        if got is None or bytes(got) != self.values[key]:
            raise BenchError(f"{key}: read back wrong or missing")

    def get_into(self, transport: str, keys: list[str], size: int) -> dict[str, float]:
        kv = self.clients[transport]
        buf = bytearray(size)
        times = []
        for key in keys:
            t = time.perf_counter()
            n = kv.get_into(key, buf)
            times.append(time.perf_counter() - t)
            if n != size:
                raise BenchError(f"get_into {key}: {n}")
            self._check(key, buf)
        return {
            "gbps": size * len(keys) / sum(times) / 1e9,
            "p50_us": statistics.median(times) * 1e6,
        }

    def get_small(self, kv: Client, keys: list[str]) -> dict[str, float]:
        times = []
        for key in keys:
            t = time.perf_counter()
            got = kv.get(key)
            times.append(time.perf_counter() - t)
            self._check(key, got)
        return {"p50_us": statistics.median(times) * 1e6, "p99_us": _pct(times, 0.99) * 1e6}

    def batch_get(self, transport: str, keys: list[str], per_call: int) -> dict[str, float]:
        kv = self.clients[transport]
        elapsed = 0.0
        for start in range(0, len(keys), per_call):
            chunk = keys[start : start + per_call]
            t = time.perf_counter()
            got = kv.batch_get(chunk)
            elapsed += time.perf_counter() - t
            for key, value in zip(chunk, got, strict=True):
                self._check(key, value)
        return {"keys_per_s": len(keys) / elapsed}

    def batch_get_into(self, transport: str, keys: list[str], size: int) -> dict[str, float]:
        kv = self.clients[transport]
        bufs = [bytearray(size) for _ in keys]
        t = time.perf_counter()
        sizes = kv.batch_get_into(keys, bufs)
        elapsed = time.perf_counter() - t
        if sizes != [size] * len(keys):
            raise BenchError(f"batch_get_into: {sizes}")
        for key, buf in zip(keys, bufs, strict=True):
            self._check(key, buf)
        return {"gbps": size * len(keys) / elapsed / 1e9}

    def batch_put(self, transport: str, count: int, size: int, tag: str) -> dict[str, float]:
        kv = self.clients[transport]
        value = _rng_bytes(size, 3)
        batch = {f"put/{tag}/{transport}/{size}/{i}": value for i in range(count)}
        t = time.perf_counter()
        ok = kv.batch_put(batch)
        elapsed = time.perf_counter() - t
        if not all(ok):
            raise BenchError("batch_put failed")
        first = next(iter(batch))
        self.values[first] = value
        self._check(first, kv.get(first))
        return {"gbps": size * count / elapsed / 1e9}

    def put_small(self, transport: str, count: int, tag: str) -> dict[str, float]:
        kv = self.clients[transport]
        value = _rng_bytes(4 * KIB, 4)
        times = []
        for i in range(count):
            t = time.perf_counter()
            ok = kv.put(f"put1/{tag}/{transport}/{i}", value)
            times.append(time.perf_counter() - t)
            if not ok:
                raise BenchError("put failed")
        return {"p50_us": statistics.median(times) * 1e6, "p99_us": _pct(times, 0.99) * 1e6}

    def concurrent_puts(self, transport: str, threads: int, per_thread: int, tag: str) -> Any:
        kv = self.clients[transport]
        value = _rng_bytes(4 * KIB, 5)
        committer = kv._committer
        before = (committer.requests, committer.jobs)
        times: list[float] = []
        errors: list[str] = []

        def worker(w: int) -> None:
            for i in range(per_thread):
                t = time.perf_counter()
                if not kv.put(f"putN/{tag}/{transport}/{w}/{i}", value):
                    errors.append("put failed")
                times.append(time.perf_counter() - t)

        pool = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
        t = time.perf_counter()
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        elapsed = time.perf_counter() - t
        if errors:
            raise BenchError(errors[0])
        requests = committer.requests - before[0]
        jobs = committer.jobs - before[1]
        return {
            "puts_per_s": threads * per_thread / elapsed,
            "p50_us": statistics.median(times) * 1e6,
            "puts_per_commit_request": jobs / max(1, requests),
        }


# --- two processes --------------------------------------------------------------------------------


def _worker(job: dict[str, Any], out: Any) -> None:
    masters, transport, mode = job["masters"], job["transport"], job["mode"]
    keys, size, start_at, duration_s = job["keys"], job["size"], job["start_at"], job["duration_s"]
    with Client(masters, timeout_s=10.0, transport=transport) as kv:
        buf = bytearray(size)
        for key in keys[:4]:
            kv.get_into(key, buf)  # connections, cache
        while time.time() < start_at:
            time.sleep(0.001)
        done = 0
        end = start_at + duration_s
        i = 0
        while time.time() < end:
            if mode == "get_into":
                if kv.get_into(keys[i % len(keys)], buf) != size:
                    raise BenchError("get_into failed")
                done += size
            else:
                chunk = [keys[(i * 256 + j) % len(keys)] for j in range(256)]
                if any(v is None for v in kv.batch_get(chunk)):
                    raise BenchError("batch_get missed")
                done += 256
            i += 1
        out.put(done)


def processes(
    masters: list[str],
    transport: str,
    mode: str,
    *,
    keys: list[str],
    size: int,
    n: int,
    dur: float,
) -> float:
    """Aggregate rate of ``n`` client processes (bytes/s or keys/s)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 3.0
    job = {
        "masters": masters,
        "transport": transport,
        "mode": mode,
        "keys": keys,
        "size": size,
        "start_at": start_at,
        "duration_s": dur,
    }
    procs = [ctx.Process(target=_worker, args=(job, out)) for _ in range(n)]
    for p in procs:
        p.start()
    total = sum(int(out.get(timeout=60 + dur)) for _ in procs)
    for p in procs:
        p.join(10)
    return float(total / dur)


# --- the run --------------------------------------------------------------------------------------


def _median_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        if isinstance(values[0], dict):
            out[key] = _median_rounds(values)
        else:
            out[key] = round(statistics.median(values), 3)
    return out


def run(rounds: int = 5, quick: bool = False, directory: str | None = None) -> dict[str, Any]:
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="kvpool-bench-client-"))
    cluster = LocalCluster(
        root, masters=3, nodes=2, cpu_cache_size="1GiB" if quick else "3GiB", log_level="warning"
    )
    result: dict[str, Any] = {"limits": {}}
    try:
        result["limits"]["memcpy_gbps"] = round(memcpy_gbps(), 2)
        result["limits"]["loopback_tcp_gbps"] = round(loopback_tcp_gbps(), 2)
        cluster.start()
        wait_prefaulted(cluster)
        bench = Bench(cluster.master_addresses, quick)
        try:
            big_sizes = [MIB, 4 * MIB] if quick else [MIB, 4 * MIB, 16 * MIB]
            big = {s: bench.load("big", 8 if quick else 16, s) for s in big_sizes}
            small = bench.load("small", 1024 if quick else 4096, 4 * KIB)
            for kv in bench.clients.values():  # warm: connections, cache, pages
                kv.batch_get(small[:512])
                for s in big_sizes:
                    kv.get_into(big[s][0], bytearray(s))
            per_round: list[dict[str, Any]] = []
            for r in range(rounds):
                row: dict[str, Any] = {}
                for t in TRANSPORTS:
                    for s in big_sizes:
                        row[f"get_into_{s // MIB}MiB_{t}"] = bench.get_into(t, big[s], s)
                    row[f"get_4KiB_cached_{t}"] = bench.get_small(bench.clients[t], small[:200])
                    row[f"get_4KiB_uncached_{t}"] = bench.get_small(bench.cold[t], small[:200])
                    row[f"batch_get_256x4KiB_{t}"] = bench.batch_get(t, small, 256)
                    row[f"batch_get_into_16x1MiB_{t}"] = bench.batch_get_into(t, big[MIB][:16], MIB)
                    row[f"batch_put_16x1MiB_{t}"] = bench.batch_put(t, 16, MIB, f"r{r}")
                    row[f"batch_put_8x4MiB_{t}"] = bench.batch_put(t, 8, 4 * MIB, f"r{r}")
                    row[f"put_4KiB_{t}"] = bench.put_small(t, 50 if quick else 200, f"r{r}")
                    row[f"puts_8_threads_{t}"] = bench.concurrent_puts(
                        t, 8, 25 if quick else 100, f"r{r}"
                    )
                per_round.append(row)
            result["cases"] = _median_rounds(per_round)
        finally:
            bench.close()
        dur = 2.0 if quick else 5.0
        two: dict[str, Any] = {}
        for t in TRANSPORTS:
            for mode, keys, size in (("get_into", big[MIB], MIB), ("batch_get", small, 4 * KIB)):
                one, both = (
                    processes(cluster.master_addresses, t, mode, keys=keys, size=size, n=n, dur=dur)
                    for n in (1, 2)
                )
                unit = 1e9 if mode == "get_into" else 1.0
                two[f"{mode}_{t}"] = {
                    "one_process": round(one / unit, 3),
                    "two_processes": round(both / unit, 3),
                    "ratio": round(both / one, 2),
                }
        result["two_processes"] = two
        return result
    finally:
        cluster.stop()
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)


def render(result: dict[str, Any]) -> str:
    lines = [
        f"{'case':40s} {'tcp':>22s} {'shm':>22s}",
        "-" * 86,
    ]
    cases = result.get("cases", {})
    names = sorted({k.rsplit("_", 1)[0] for k in cases})
    for name in names:
        cells = []
        for t in TRANSPORTS:
            v = cases.get(f"{name}_{t}", {})
            cells.append(", ".join(f"{k} {x:g}" for k, x in v.items()))
        lines.append(f"{name:40s} {cells[0]:>22s} {cells[1]:>22s}")
    lines.append("")
    for name, v in result.get("two_processes", {}).items():
        lines.append(f"two processes {name:26s} {v}")
    lines.append(f"limits: {result.get('limits')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool-bench client", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds [5]")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--dir", help="keep the cluster's data and logs here [a temp dir]")
    args = parser.parse_args(argv)
    result = run(rounds=args.rounds, quick=args.quick, directory=args.dir)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0
