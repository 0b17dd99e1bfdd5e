"""``kvpool bench``: an operator's smoke run against a running cluster.

    kvpool bench --masters HOST:PORT,... | --dir DIR  [--rounds 50] [--sizes 4KiB,1MiB] [--json]

Single-key put, get and get_into at each size, sizes interleaved inside every round, medians and
p99 printed; every value read is compared with what was put. The keys live under a fresh prefix
and are removed at the end. It needs nothing but kvpool and a cluster (``kvpool cluster up
--detach --dir DIR`` starts one here).

The benchmarks (a local cluster's failover, the index, the tiers, Redis and Mooncake Store side
by side, inside SGLang ...) are a distribution of their own, ``kvpool-bench``, in a kvpool
checkout's ``bench/`` folder: :data:`BENCHMARKS` says how to install and run them.
"""

from __future__ import annotations

import json
import secrets
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.client.sync import Client
from kvpool.units import format_size

BENCHMARK_NAMES = (
    "cluster",
    "index",
    "data-plane",
    "tiers",
    "peers",
    "engines",
    "client",
    "replicas",
    "tracing",
)
BENCHMARKS = (
    "the benchmarks are in kvpool-bench: from a kvpool checkout, pip install -e bench, "
    "then kvpool-bench {what} (kvpool-bench --help lists them)"
)


def percentile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``samples`` (nan when there are none)."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median and p99 of durations in seconds, as milliseconds, and how many there were."""
    return {
        "p50_ms": round(statistics.median(samples) * 1e3, 3),
        "p99_ms": round(percentile(samples, 0.99) * 1e3, 3),
        "n": len(samples),
    }


def latency(
    kv: Client,
    sizes: list[int],
    rounds: int,
    rng: np.random.Generator,
    prefix: str = "bench/lat",
) -> dict[str, Any]:
    """Single-key put and get, sizes interleaved inside every round."""
    puts: dict[int, list[float]] = {n: [] for n in sizes}
    gets: dict[int, list[float]] = {n: [] for n in sizes}
    into: dict[int, list[float]] = {n: [] for n in sizes}
    values = {n: rng.bytes(n) for n in sizes}
    buffers = {n: bytearray(n) for n in sizes}
    failures = 0
    for r in range(rounds):
        for n in sizes:
            key = f"{prefix}/{n}/{r}"
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
            "put": summary(puts[n]),
            "get": summary(gets[n]),
            "get_into": summary(into[n]),
        }
    return out


def smoke(
    masters: list[str], *, sizes: list[int], rounds: int, timeout_s: float = 5.0
) -> dict[str, Any]:
    """Put, get and get_into ``rounds`` times at each size against the cluster at ``masters``
    (after a few warm-up rounds), under a fresh key prefix removed at the end."""
    prefix = f"kvpool-bench-smoke/{secrets.token_hex(6)}"
    rng = np.random.default_rng(0)
    with Client(masters, timeout_s=timeout_s) as kv:
        try:
            latency(kv, sizes, min(rounds, 5), rng, prefix=f"{prefix}/warm-up")
            result = latency(kv, sizes, rounds, rng, prefix=prefix)
        finally:
            more = True
            while more:
                _, more = kv.remove_prefix(prefix + "/")
    return {"masters": masters, "rounds": rounds, "latency": result}


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
