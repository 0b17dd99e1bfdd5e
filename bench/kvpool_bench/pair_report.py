"""The numbers of the ``hand-off`` and ``engine`` modes of ``kvpool-bench peers`` from their raw
samples (:mod:`kvpool_bench.pair_cells`): pure functions, no I/O.

* :func:`summarize_handoffs` — per system and size: hand-offs done, misses (the read found
  nothing although the put returned True), wrong blocks, p50/p99 of the hand-off latency (the
  writer's put start to the reader's read end), of the read alone and of the put, the signal
  (put returned -> the reader has the key) and the pipe's own one-way time.
* :func:`summarize_engine` — per system, query and size: batches/s and GB/s of the whole flow
  (query + read; bytes verified over the sum of the flows' times, median over rounds), p50 and
  p99 of the query and of the flow, presence misses, and for kvpool the index calls per batch.
* :func:`table_lines`, :func:`markdown_lines` — their part of the report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvpool.units import format_size

PAIR_MODES = ("hand-off", "engine")


def _pct(samples: Sequence[float], q: float) -> float:
    if not samples:
        return math.nan
    ordered = sorted(samples)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]


def _median(values: Sequence[float]) -> float:
    vals = sorted(v for v in values if not math.isnan(v))
    if not vals:
        return math.nan
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def _is_kvpool(system: str) -> bool:
    return system == "kvpool" or system.startswith("kvpool-")


def summarize_handoffs(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records: system, mode "hand-off", size_bytes, round, workers (writer's, reader's)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rec in records:
        if rec["mode"] == "hand-off":
            groups.setdefault((rec["system"], int(rec["size_bytes"])), []).append(rec)
    out: list[dict[str, Any]] = []
    for (system, size), recs in groups.items():
        lat: list[float] = []
        read: list[float] = []
        put: list[float] = []
        signal: list[float] = []
        pipe: list[float] = []
        n = {"misses": 0, "wrong": 0, "bytes_read": 0, "bytes_verified": 0, "failures": 0}
        unacked = 0
        errors: list[str] = []
        for rec in recs:
            for w in rec["workers"]:
                hand = w.get("handoff", {})
                pipe.extend(hand.get("pipe_one_way_us", []))
                if "put" in w:
                    put.extend(w["put"]["durations_us"])
                    n["failures"] += int(w["put"]["failures"])
                    errors.extend(e for e in w["put"]["errors"] if e not in errors)
                if "get" in w:
                    lat.extend(hand["latency_us"])
                    signal.extend(hand["signal_us"])
                    unacked += int(hand["unacknowledged"])
                    read.extend(w["get"]["durations_us"])
                    for k in ("misses", "wrong", "bytes_read", "bytes_verified"):
                        n[k] += int(w["get"][k])
                    errors.extend(e for e in w["get"]["errors"] if e not in errors)
        out.append(
            {
                "system": system,
                "mode": "hand-off",
                "size_bytes": size,
                "size": format_size(size),
                "rounds": len(recs),
                "handoffs": len(lat),
                "misses": n["misses"],
                "wrong": n["wrong"],
                "put_failures": n["failures"],
                "unacknowledged": unacked,
                "bytes_read": n["bytes_read"],
                "bytes_verified": n["bytes_verified"],
                "all_bytes_verified": n["wrong"] == 0 and n["bytes_read"] == n["bytes_verified"],
                "latency_p50_us": _median(lat),
                "latency_p99_us": _pct(lat, 0.99),
                "read_p50_us": _median(read),
                "read_p99_us": _pct(read, 0.99),
                "put_p50_us": _median(put),
                "signal_p50_us": _median(signal),
                "signal_p99_us": _pct(signal, 0.99),
                "pipe_one_way_p50_us": _median(pipe),
                "errors": errors[:5],
            }
        )
    out.sort(key=lambda c: (c["size_bytes"], not _is_kvpool(str(c["system"]))))
    return out


def summarize_engine(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records: system, mode "engine", size_bytes, batch, round, workers (each an ``engine``
    dict by query: the reader's timings and counts, the writer's put failures)."""
    groups: dict[tuple[str, str, int], list[tuple[int, list[dict[str, Any]]]]] = {}
    for rec in records:
        if rec["mode"] != "engine":
            continue
        by_query: dict[str, list[dict[str, Any]]] = {}
        for w in rec["workers"]:
            for q, flow in w.get("engine", {}).items():
                by_query.setdefault(q, []).append(flow)
        for q, flows in by_query.items():
            key = (rec["system"], q, int(rec["size_bytes"]))
            groups.setdefault(key, []).append((int(rec["batch"]), flows))
    out: list[dict[str, Any]] = []
    for (system, query, size), runs in groups.items():
        counts = dict.fromkeys(
            ("batches", "keys_asked", "hits", "misses", "phantoms", "read_misses", "wrong",
             "bytes_read", "bytes_verified", "put_failures"),
            0,
        )  # fmt: skip
        query_us: list[float] = []
        flow_us: list[float] = []
        per_round_bps: list[float] = []
        per_round_gbps: list[float] = []
        calls: dict[str, int] | None = None
        label = query
        errors: list[str] = []
        for _batch, flows in runs:
            round_s = 0.0
            round_bytes = round_batches = 0
            for f in flows:
                for k in counts:
                    counts[k] += int(f[k])
                query_us.extend(f["query_us"])
                flow_us.extend(f["flow_us"])
                round_s += sum(f["flow_us"]) / 1e6
                round_bytes += int(f["bytes_verified"])
                round_batches += int(f["batches"])
                if f["query_us"]:
                    label = f["label"]
                if f["index_calls"] is not None:
                    calls = calls or {}
                    for m, c in f["index_calls"].items():
                        calls[m] = calls.get(m, 0) + int(c)
                errors.extend(e for e in f["errors"] if e not in errors)
            if round_s > 0:
                per_round_bps.append(round_batches / round_s)
                per_round_gbps.append(round_bytes / round_s / 1e9)
        batches = counts["batches"]
        out.append(
            {
                "system": system,
                "mode": "engine",
                "query": query,
                "calls": label,
                "size_bytes": size,
                "size": format_size(size),
                "keys_per_batch": runs[0][0],
                **counts,
                "all_bytes_verified": counts["wrong"] == 0
                and counts["bytes_read"] == counts["bytes_verified"],
                "batches_per_s": _median(per_round_bps),
                "GBps": _median(per_round_gbps),
                "query_p50_us": _median(query_us),
                "query_p99_us": _pct(query_us, 0.99),
                "flow_p50_us": _median(flow_us),
                "flow_p99_us": _pct(flow_us, 0.99),
                "index_calls": calls,
                "index_calls_per_batch": (
                    {m: c / batches for m, c in sorted(calls.items())}
                    if calls is not None and batches
                    else None
                ),
                "errors": errors[:5],
            }
        )
    out.sort(key=lambda c: (c["size_bytes"], not _is_kvpool(str(c["system"])), str(c["system"])))
    return out


def pair_verification(
    handoffs: Sequence[dict[str, Any]], engine: Sequence[dict[str, Any]]
) -> dict[str, int]:
    """What the two modes add to the run's verification counts."""
    rows = [*handoffs, *engine]
    return {
        "bytes_read": sum(int(c["bytes_read"]) for c in rows),
        "bytes_verified": sum(int(c["bytes_verified"]) for c in rows),
        "wrong": sum(int(c["wrong"]) for c in rows),
        "misses": sum(int(c["misses"]) for c in handoffs)
        + sum(int(c["misses"]) + int(c["read_misses"]) for c in engine),
        "put_failures": sum(int(c["put_failures"]) for c in rows),
    }


def pair_problems(
    handoffs: Sequence[dict[str, Any]], engine: Sequence[dict[str, Any]]
) -> list[str]:
    """Problem lines: a kvpool hand-off miss first and loud (the read-after-ack guarantee
    forbids it), then a peer's, then the engine mode's presence errors."""
    out = []
    for c in handoffs:
        if c["misses"] and _is_kvpool(c["system"]):
            out.append(
                f"HAND-OFF MISS ({c['system']} {c['size']}): {c['misses']} of "
                f"{c['handoffs']} acknowledged block(s) not found by the other client: "
                "kvpool's read-after-ack guarantee forbids this, a defect"
            )
    for c in handoffs:
        if c["misses"] and not _is_kvpool(c["system"]):
            out.append(
                f"{c['system']} hand-off {c['size']}: {c['misses']} of {c['handoffs']} "
                "acknowledged block(s) not found by the other client"
            )
    for c in engine:
        bad = {k: c[k] for k in ("misses", "phantoms", "read_misses") if c[k]}
        if bad:
            detail = ", ".join(f"{k} {v}" for k, v in bad.items())
            out.append(f"{c['system']} engine {c['query']} {c['size']}: {detail}")
    return out


def _n(x: float | None, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _calls(c: dict[str, Any]) -> str:
    per = c.get("index_calls_per_batch")
    if per is None:
        return "-"
    return " ".join(f"{m} {v:.2g}" for m, v in per.items()) or "0"


def table_lines(doc: dict[str, Any]) -> list[str]:
    """The hand-off and engine sections of the terminal table (nothing when neither ran)."""
    lines: list[str] = []
    handoffs = doc.get("handoffs", [])
    if handoffs:
        lines += [
            "",
            "HAND-OFF: one process puts a block, another reads it once the put returned True "
            "(latency: the put's start to the read's end, one clock)",
            f"{'size':>9}  {'system':16s} {'done':>5} {'misses':>6} {'wrong':>5}"
            f" {'p50 us':>8} {'p99 us':>8} {'read p50':>8} {'put p50':>8} {'signal':>7}"
            f" {'pipe':>6}",
        ]
        for c in handoffs:
            lines.append(
                f"{c['size']:>9}  {c['system']:16s} {c['handoffs']:>5} {c['misses']:>6}"
                f" {c['wrong']:>5} {_n(c['latency_p50_us']):>8} {_n(c['latency_p99_us']):>8}"
                f" {_n(c['read_p50_us']):>8} {_n(c['put_p50_us']):>8}"
                f" {_n(c['signal_p50_us']):>7} {_n(c['pipe_one_way_p50_us']):>6}"
            )
        for c in handoffs:
            if c["misses"] and _is_kvpool(c["system"]):
                lines.append(
                    f"!!! {c['system']} {c['size']}: {c['misses']} HAND-OFF MISS(ES), a read "
                    "after an acknowledged put found nothing: a defect (read-after-ack)"
                )
        lines.append(
            "signal: p50 from the put's return to the reader holding the key (inside the "
            "latency); pipe: p50 one-way time of the same pipe, no store call"
        )
    engine = doc.get("engine", [])
    if engine:
        lines += [
            "",
            "ENGINE: per batch, ask which keys are present, then read the hits (another process "
            "wrote 3/4 of each batch; the reader's client had never seen the keys)",
            f"{'size':>9} {'keys':>4}  {'system':16s} {'query':14s} {'batch/s':>8} {'GB/s':>7}"
            f" {'query p50':>9} {'flow p50':>8} {'hits':>6} {'miss':>4} {'wrong':>5}"
            "  index calls/batch",
        ]
        for c in engine:
            miss = c["misses"] + c["phantoms"] + c["read_misses"]
            lines.append(
                f"{c['size']:>9} {c['keys_per_batch']:>4}  {c['system']:16s} {c['query']:14s}"
                f" {_n(c['batches_per_s']):>8} {_n(c['GBps'], 3):>7}"
                f" {_n(c['query_p50_us']):>9} {_n(c['flow_p50_us']):>8} {c['hits']:>6}"
                f" {miss:>4} {c['wrong']:>5}  {_calls(c)}"
            )
        lines.append(
            "batch/s, GB/s: of the whole flow (query + read, bytes verified); p50 in us; "
            "index calls: kvpool client's calls to the masters, counted by wrapping its stub"
        )
    return lines


def markdown_lines(doc: dict[str, Any]) -> list[str]:
    """The same two sections as Markdown tables."""
    out: list[str] = []
    handoffs = doc.get("handoffs", [])
    if handoffs:
        out += [
            "",
            "**Hand-off: one process puts, another reads each block once the put returned "
            "True** (latency: put start to read end)",
            "",
            "| size | system | hand-offs | misses | wrong | p50 µs | p99 µs | read p50 µs "
            "| put p50 µs | signal p50 µs | pipe one-way p50 µs |",
            "|" + "---|" * 11,
        ]
        for c in handoffs:
            out.append(
                f"| {c['size']} | {c['system']} | {c['handoffs']} | {c['misses']} | "
                f"{c['wrong']} | {_n(c['latency_p50_us'])} | {_n(c['latency_p99_us'])} | "
                f"{_n(c['read_p50_us'])} | {_n(c['put_p50_us'])} | {_n(c['signal_p50_us'])} | "
                f"{_n(c['pipe_one_way_p50_us'])} |"
            )
    engine = doc.get("engine", [])
    if engine:
        out += [
            "",
            "**Engine: per batch, which keys are present, then read the hits** (another "
            "process wrote 3/4 of each batch)",
            "",
            "| size | keys/batch | system | calls | batches/s | GB/s | query p50 µs "
            "| flow p50 µs | misses | wrong | index calls/batch |",
            "|" + "---|" * 11,
        ]
        for c in engine:
            miss = c["misses"] + c["phantoms"] + c["read_misses"]
            out.append(
                f"| {c['size']} | {c['keys_per_batch']} | {c['system']} | {c['calls']} | "
                f"{_n(c['batches_per_s'])} | {_n(c['GBps'], 3)} | {_n(c['query_p50_us'])} | "
                f"{_n(c['flow_p50_us'])} | {miss} | {c['wrong']} | {_calls(c)} |"
            )
    return out
