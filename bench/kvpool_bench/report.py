"""The numbers of ``kvpool-bench peers`` from its raw samples: pure functions, no I/O.

* :func:`summarize_cells` — one summary per (system, op, mode, size, clients): GB/s and keys/s
  (the median over rounds of each round's total bytes over total time), p50 and p99 of the
  calls (every call of every round, pooled), and the verification counts.
* :func:`add_ratios` — for every kvpool cell, its ratio to each peer's same cell (and for a
  peer's cell, to each other peer's), and for every cell its fraction of each machine limit;
  each ratio is taken within a round (the two were measured minutes apart at most) and the
  median over rounds is reported.
* :func:`evaluate_targets` — the data-path targets, and the first-read targets when first
  reads were measured, met or missed, from the cells.
* :func:`render_table` — the table a person reads (with the hand-off and engine modes'
  sections from :mod:`kvpool_bench.pair_report`).

Throughput of two clients is their combined bytes over the span from the first start to the
last end of each pass (both start together at a barrier). In a first-read cell only the
workers that did an op count for it: with one client, worker 0's puts and worker 1's gets.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from kvpool.units import format_size
from kvpool_bench import pair_report

GB = 1e9
OPS = ("put", "get")
MODES = ("single", "batch", "first-read")
MIB = 1 << 20


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..1); NaN for no samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(len(ordered), rank) - 1]


def median(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


def round_rate(workers: Sequence[dict[str, Any]]) -> dict[str, float]:
    """One round of one op from its workers' passes: pass i of every worker ran together, so
    its time is the span from the earliest start to the latest end."""
    n_passes = min(len(w["passes"]) for w in workers) if workers else 0
    total_bytes = total_keys = 0
    total_s = 0.0
    for i in range(n_passes):
        passes = [w["passes"][i] for w in workers]
        total_s += max(p["end"] for p in passes) - min(p["start"] for p in passes)
        total_bytes += sum(int(p["bytes"]) for p in passes)
        total_keys += sum(int(p["keys"]) for p in passes)
    if total_s <= 0:
        return {"GBps": math.nan, "keys_per_s": math.nan, "bytes": 0, "keys": 0, "time_s": 0.0}
    return {
        "GBps": total_bytes / total_s / GB,
        "keys_per_s": total_keys / total_s,
        "bytes": total_bytes,
        "keys": total_keys,
        "time_s": total_s,
    }


def summarize_cells(
    records: Sequence[dict[str, Any]], apis: dict[str, dict[str, str]]
) -> list[dict[str, Any]]:
    """Records are one cell run each: system, mode, size_bytes, clients, batch, round and
    ``workers`` (each worker's raw ``put`` and ``get`` samples)."""
    groups: dict[tuple[str, str, str, int, int], list[tuple[int, dict[str, Any], list[Any]]]] = {}
    for rec in records:
        for op in OPS:
            key = (rec["system"], op, rec["mode"], int(rec["size_bytes"]), int(rec["clients"]))
            raw = [w[op] for w in rec["workers"] if op in w]
            if not raw:
                continue
            groups.setdefault(key, []).append((int(rec["round"]), rec, raw))
    cells = []
    for (system, op, mode, size, clients), runs in groups.items():
        rounds = []
        durations: list[float] = []
        counts = {"failures": 0, "misses": 0, "wrong": 0, "bytes_read": 0, "bytes_verified": 0}
        errors: list[str] = []
        for rnd, _rec, raw in runs:
            rate = round_rate(raw)
            rounds.append({"round": rnd, **rate})
            for w in raw:
                durations.extend(w["durations_us"])
                for k in counts:
                    counts[k] += int(w.get(k, 0))
                errors.extend(e for e in w["errors"] if e not in errors)
        batch = int(runs[0][1]["batch"])
        api_name = apis.get(system, {}).get(op if mode != "batch" else f"batch_{op}", "?")
        cell: dict[str, Any] = {
            "system": system,
            "op": op,
            "mode": mode,
            "size_bytes": size,
            "size": format_size(size),
            "clients": clients,
            "keys_per_call": batch if mode == "batch" else 1,
            "api": api_name,
            "GBps": median(r["GBps"] for r in rounds),
            "keys_per_s": median(r["keys_per_s"] for r in rounds),
            "p50_us": median(durations) if durations else math.nan,
            "p99_us": percentile(durations, 0.99),
            "calls": len(durations),
            "keys": sum(r["keys"] for r in rounds),
            "bytes": sum(r["bytes"] for r in rounds),
            "rounds": rounds,
            "errors": errors[:5],
        }
        if op == "put":
            cell["failures"] = counts["failures"]
        else:
            for k in ("misses", "wrong", "bytes_read", "bytes_verified"):
                cell[k] = counts[k]
            cell["all_bytes_verified"] = (
                counts["wrong"] == 0 and counts["bytes_read"] == counts["bytes_verified"]
            )
        cells.append(cell)
    order = {s: i for i, s in enumerate(dict.fromkeys(r["system"] for r in records))}
    cells.sort(
        key=lambda c: (
            OPS.index(c["op"]),
            MODES.index(c["mode"]),
            c["size_bytes"],
            c["clients"],
            order[c["system"]],
        )
    )
    return cells


def is_kvpool(system: str) -> bool:
    return system == "kvpool" or system.startswith("kvpool-")


def _per_round(a: dict[str, Any], b: dict[str, Any], field: str) -> dict[int, tuple[float, float]]:
    rb = {r["round"]: r[field] for r in b["rounds"]}
    return {r["round"]: (r[field], rb[r["round"]]) for r in a["rounds"] if r["round"] in rb}


def _ratio(x: float, y: float) -> float:
    return x / y if y and not math.isnan(x) and not math.isnan(y) else math.nan


def _round_trip_text(lim: dict[str, Any]) -> str:
    """The request/response floor, where the run measured it (older JSON has none)."""
    if "round_trip_us" not in lim:
        return ""
    return f", a 64-byte request and its answer between them {_num(lim['round_trip_us'])} us p50"


def add_ratios(cells: list[dict[str, Any]], limits: Sequence[dict[str, Any]]) -> None:
    """Add ``vs`` (kvpool cells: GB/s ratio and p50 ratio to each peer) and ``of_limit``
    (every cell: fraction of memcpy and of loopback TCP) in place."""
    index = {(c["system"], c["op"], c["mode"], c["size_bytes"], c["clients"]): c for c in cells}
    peers = sorted({c["system"] for c in cells if not is_kvpool(c["system"])})
    by_round = {int(lim["round"]): lim for lim in limits}
    for c in cells:
        c["of_limit"] = {}
        for name in ("memcpy", "loopback_tcp"):
            fractions = [
                _ratio(r["GBps"], by_round[r["round"]][f"{name}_GBps"])
                for r in c["rounds"]
                if r["round"] in by_round
            ]
            c["of_limit"][name] = median(fractions)
        others = [p for p in peers if p != c["system"]]
        if not is_kvpool(c["system"]) and not others:
            continue
        c["vs"] = {}
        for peer in others:
            other = index.get((peer, c["op"], c["mode"], c["size_bytes"], c["clients"]))
            if other is None:
                continue
            pairs = _per_round(c, other, "GBps")
            c["vs"][peer] = {
                "GBps_ratio": median(_ratio(x, y) for x, y in pairs.values()),
                "p50_ratio": _ratio(c["p50_us"], other["p50_us"]),
            }


def _find(cells: Sequence[dict[str, Any]], **want: Any) -> list[dict[str, Any]]:
    return [c for c in cells if all(c.get(k) == v for k, v in want.items())]


def _target(
    text: str, checks: list[tuple[str, float, bool]], group: str = "data-path"
) -> dict[str, Any]:
    """checks: (label, value, passed) per measured point; none measured -> not measured."""
    if not checks:
        return {"target": text, "group": group, "status": "not measured", "detail": ""}
    met = all(ok for _, _, ok in checks)
    return {
        "target": text,
        "group": group,
        "status": "met" if met else "missed",
        "detail": ", ".join(label for label, _, _ in checks),
        "values": {label.split(":")[0]: value for label, value, _ in checks},
    }


def evaluate_targets(cells: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The data-path targets from the cells at hand (one client unless the target says two),
    then the first-read targets where first reads were measured."""
    systems = {c["system"] for c in cells}
    tcp = "kvpool-tcp" if "kvpool-tcp" in systems else "kvpool"
    out = []

    def vs(op: str, mode: str, peer: str, sizes: tuple[int, int], threshold: float) -> Any:
        checks = []
        for c in _find(cells, system=tcp, op=op, mode=mode, clients=1):
            if sizes[0] <= c["size_bytes"] <= sizes[1] and peer in c.get("vs", {}):
                r = c["vs"][peer]["GBps_ratio"]
                checks.append((f"{c['size']}: {r:.2f}x", r, r >= threshold))
        return checks

    out.append(
        _target(
            "get_into of >= 1 MiB over TCP, one key per call: >= 1.5x Mooncake get_into",
            vs("get", "single", "mooncake", (MIB, 1 << 62), 1.5),
        )
    )
    out.append(
        _target(
            "batch_put of >= 1 MiB blocks: >= 1.25x Mooncake batch_put_from",
            vs("put", "batch", "mooncake", (MIB, 1 << 62), 1.25),
        )
    )
    p50 = []
    for c in _find(cells, system=tcp, op="get", mode="single", clients=1, size_bytes=4096):
        if "mooncake" in c.get("vs", {}):
            r = c["vs"]["mooncake"]["p50_ratio"]
            p50.append((f"4 KiB: {c['p50_us']:.0f} us, {r:.2f}x Mooncake's p50", r, r <= 1.0))
    out.append(_target("one 4 KiB get: p50 <= Mooncake's", p50))
    out.append(
        _target(
            "batched gets of 4 KiB blocks (256 per call): keys/s >= Redis pipelined GET",
            vs("get", "batch", "redis", (4096, 4096), 1.0),
        )
    )
    shm = []
    for c in _find(cells, system="kvpool-shm", op="get", mode="single", clients=1):
        if c["size_bytes"] >= MIB:
            shm.append((f"{c['size']}: {c['GBps']:.2f} GB/s", c["GBps"], c["GBps"] >= 8.0))
    out.append(_target("same-host client through shared memory: >= 8 GB/s get at >= 1 MiB", shm))
    put = []
    for c in _find(cells, system=tcp, op="put", mode="single", clients=1, size_bytes=4096):
        put.append((f"4 KiB: p50 {c['p50_us']:.0f} us", c["p50_us"], c["p50_us"] <= 1000.0))
    out.append(_target("one put at 4 KiB: p50 <= 1 ms", put))
    two = []
    for c in _find(cells, system=tcp, clients=2):
        if c["mode"] == "first-read":  # the data-path targets are for the single and batch modes
            continue
        one = _find(
            cells, system=tcp, op=c["op"], mode=c["mode"], size_bytes=c["size_bytes"], clients=1
        )
        if one:
            r = _ratio(c["GBps"], one[0]["GBps"])
            label = f"{c['op']} {c['mode']} {c['size']}: {r:.2f}x"
            two.append((label, r, r >= 1.0))
    out.append(_target("two client processes: aggregate >= one client's", two))
    if _find(cells, mode="first-read"):
        out += _first_read_targets(cells, tcp)
    return out


def _first_read_targets(cells: Sequence[dict[str, Any]], tcp: str) -> list[dict[str, Any]]:
    """The first-read targets: the first read of a block by another client (one reader)."""
    reads = _find(cells, op="get", mode="first-read", clients=1)
    big, small = [], []
    for c in _find(reads, system=tcp):
        peer = c.get("vs", {}).get("mooncake")
        if peer is None:
            continue
        if c["size_bytes"] >= MIB:
            r = peer["GBps_ratio"]
            big.append((f"{c['size']}: {r:.2f}x", r, r >= 1.5))
        elif c["size_bytes"] in (4096, 64 << 10):
            r = peer["p50_ratio"]
            label = f"{c['size']}: {c['p50_us']:.0f} us, {r:.2f}x Mooncake's p50"
            small.append((label, r, r <= 1.0))
    shm = []
    for c in _find(reads, system="kvpool-shm"):
        floor = {MIB: 5.0, 4 * MIB: 8.0}.get(c["size_bytes"])
        if floor is not None:
            label = f"{c['size']}: {c['GBps']:.2f} GB/s (>= {floor:.0f})"
            shm.append((label, c["GBps"], c["GBps"] >= floor))
    return [
        _target(
            "first read of >= 1 MiB over TCP, one key per call: >= 1.5x Mooncake get_into",
            big,
            group="first-read",
        ),
        _target(
            "first read of 4 KiB and 64 KiB over TCP: p50 <= Mooncake's", small, group="first-read"
        ),
        _target(
            "first read through shared memory: >= 8 GB/s at 4 MiB, >= 5 GB/s at 1 MiB",
            shm,
            group="first-read",
        ),
    ]


# --- the table -------------------------------------------------------------------------------


def _num(x: float, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def _times(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}x"


SECTION = {
    ("put", "single"): "PUT, one key per call",
    ("put", "batch"): "PUT, batched",
    ("put", "first-read"): "PUT, one key per call, by the writer of a first read",
    ("get", "single"): "GET, one key per call",
    ("get", "batch"): "GET, batched",
    ("get", "first-read"): "GET, first read by another client, one key per call",
}


def render_table(doc: dict[str, Any]) -> str:
    """The human-readable report of a ``kvpool-bench peers`` document."""
    lines: list[str] = []
    opts = doc["options"]
    lines.append(
        f"kvpool-bench peers: medians of {opts['rounds']} interleaved round(s); "
        f"GB = 10^9 bytes; {doc['host']['cpus']} CPUs; p50/p99 per call"
    )
    lim = doc["limits"]
    lines.append(
        f"machine limits: numpy memcpy {_num(lim['memcpy_GBps'])} GB/s "
        f"({format_size(lim['memcpy_size_bytes'])} buffers), loopback TCP "
        f"{_num(lim['loopback_tcp_GBps'])} GB/s (one stream between two Python processes)"
        + _round_trip_text(lim)
    )
    lines.append("systems:")
    for name, info in doc["systems"].items():
        if info["status"] == "measured":
            api = info.get("api", {})
            calls = ", ".join(
                f"{k}={api[k]}" for k in ("put", "get", "batch_put", "batch_get") if k in api
            )
            setup = "; ".join(f"{k} {v}" for k, v in info.get("setup", {}).items())
            lines.append(f"  {name:16s} {api.get('client', '')}")
            lines.append(f"  {'':16s} calls: {calls}")
            if setup:
                lines.append(f"  {'':16s} {setup}")
        else:
            hint = f" (install: {info['install']})" if info.get("install") else ""
            lines.append(f"  {name:16s} {info['status']}: {info.get('reason', '')}{hint}")
    peers = [n for n, i in doc["systems"].items() if i["status"] == "measured" and not is_kvpool(n)]
    header = f"{'size':>9} {'cl':>2} {'keys/call':>9}  {'system':16s} {'GB/s':>7} {'keys/s':>10}"
    header += f" {'p50 us':>9} {'p99 us':>9}"
    header += "".join(f" {'vs ' + p:>12} {'p50 vs':>7}" for p in peers)
    header += f" {'memcpy':>7} {'tcp':>7}"
    cells = doc["cells"]
    for (op, mode), title in SECTION.items():
        section = [c for c in cells if c["op"] == op and c["mode"] == mode]
        if not section:
            continue
        lines.append("")
        lines.append(title)
        lines.append(header)
        for c in section:
            row = f"{c['size']:>9} {c['clients']:>2} {c['keys_per_call']:>9}  {c['system']:16s}"
            row += f" {_num(c['GBps'], 3):>7} {_num(c['keys_per_s'], 0):>10}"
            row += f" {_num(c['p50_us'], 0):>9} {_num(c['p99_us'], 0):>9}"
            for p in peers:
                vs = c.get("vs", {}).get(p, {})
                mine = p != c["system"]
                row += f" {_times(vs.get('GBps_ratio')) if mine else '':>12}"
                row += f" {_times(vs.get('p50_ratio')) if mine else '':>7}"
            row += f" {_pct(c['of_limit']['memcpy']):>7} {_pct(c['of_limit']['loopback_tcp']):>7}"
            lines.append(row)
    if cells:  # (a run of the hand-off and engine modes alone has none)
        lines.append("")
        lines.append(
            "vs PEER: the system's GB/s over the peer's in the same round (> 1 is faster); p50 "
            "vs: its p50 over the peer's (< 1 is faster); memcpy, tcp: share of that machine limit"
        )
    if any(c["mode"] == "first-read" for c in cells):
        lines.append(
            "first read: cl 1 = one process puts, another reads each block once; cl 2 = each "
            "of two processes reads the other's blocks, both at once"
        )
    lines += pair_report.table_lines(doc)
    v = doc["verification"]
    lines.append(
        f"verified: {v['bytes_read']:,} bytes read, {v['bytes_verified']:,} equal to what was "
        f"put; wrong blocks {v['wrong']}, misses {v['misses']}, failed puts {v['put_failures']}"
    )
    groups = dict.fromkeys(t.get("group", "data-path") for t in doc.get("targets", []))
    for group in groups:
        lines.append("")
        lines.append(f"{group} targets:")
        for t in doc["targets"]:
            if t.get("group", "data-path") != group:
                continue
            detail = f" ({t['detail']})" if t["detail"] else ""
            lines.append(f"  [{t['status']:>12}] {t['target']}{detail}")
    for problem in doc.get("problems", []):
        lines.append(f"problem: {problem}")
    return "\n".join(lines)


def render_markdown(doc: dict[str, Any]) -> str:
    """The same numbers as Markdown tables (one per op and mode and client count), for
    docs/benchmarks.md and closing notes."""
    measured = [n for n, i in doc["systems"].items() if i["status"] == "measured"]
    kv = [n for n in measured if is_kvpool(n)]
    peers = [n for n in measured if not is_kvpool(n)]
    lim = doc["limits"]
    out = [
        f"Medians of {doc['options']['rounds']} interleaved rounds; GB = 10^9 bytes; "
        f"{doc['host']['cpus']} CPUs. Machine limits: numpy memcpy "
        f"**{_num(lim['memcpy_GBps'])} GB/s**, loopback TCP between two Python processes "
        f"**{_num(lim['loopback_tcp_GBps'])} GB/s**{_round_trip_text(lim)}.",
    ]
    index = {
        (c["system"], c["op"], c["mode"], c["size_bytes"], c["clients"]): c for c in doc["cells"]
    }
    sizes = sorted({c["size_bytes"] for c in doc["cells"]})
    clients = sorted({c["clients"] for c in doc["cells"]})
    for n_clients in clients:
        for (op, mode), title in SECTION.items():
            rows = [s for s in sizes if any((m, op, mode, s, n_clients) in index for m in measured)]
            if not rows:
                continue
            who = "one client process" if n_clients == 1 else f"{n_clients} client processes"
            if mode == "first-read":
                who = (
                    "one reader (another process wrote)"
                    if n_clients == 1
                    else f"{n_clients} processes, each reading the other's"
                )
            out += ["", f"**{title}, {who}**", ""]
            head = ["size", "keys/call"] + [f"{m} GB/s (keys/s)" for m in measured]
            head += [f"{k} ÷ {p}" for k in kv for p in peers]
            head += [f"{m} p50 µs" for m in measured] + [f"{k} of TCP" for k in kv]
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "---|" * len(head))
            for size in rows:
                cells = {m: index.get((m, op, mode, size, n_clients)) for m in measured}
                first = next(c for c in cells.values() if c is not None)
                row = [first["size"], str(first["keys_per_call"])]
                row += [
                    f"{_num(c['GBps'], 3)} ({_num(c['keys_per_s'], 0)})" if c else "-"
                    for c in cells.values()
                ]
                for k in kv:
                    for p in peers:
                        c = cells[k]
                        row.append(_times(c["vs"][p]["GBps_ratio"]) if c and p in c["vs"] else "-")
                row += [_num(c["p50_us"], 0) if c else "-" for c in cells.values()]
                for k in kv:
                    c = cells[k]
                    row.append(_pct(c["of_limit"]["loopback_tcp"]) if c else "-")
                out.append("| " + " | ".join(row) + " |")
    out += pair_report.markdown_lines(doc)
    v = doc["verification"]
    out += [
        "",
        f"Verified: {v['bytes_read']:,} bytes read, every one compared with what was put: "
        f"{v['wrong']} wrong blocks, {v['misses']} misses, {v['put_failures']} failed puts.",
    ]
    if doc.get("targets"):
        out += ["", "| target | status | measured |", "|---|---|---|"]
        for t in doc["targets"]:
            target = f"{t.get('group', 'data-path')}: {t['target']}"
            out.append(f"| {target} | {t['status']} | {t['detail'] or '-'} |")
    return "\n".join(out) + "\n"
