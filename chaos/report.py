"""The text report of a chaos run (the JSON one is :meth:`RunResult.to_json`)."""

from __future__ import annotations

import statistics
from typing import Any

from kvpool.chaos.runner import RunResult
from kvpool.chaos.scenarios import ScenarioListing

OUTCOMES = ("ok", "fail", "unknown")


def render_run(result: RunResult) -> str:
    lines = [
        f"chaos run: {result.scenario}   seed {result.seed}   {result.duration_s:.0f} s   "
        f"network {result.network}   (cluster up in {result.setup_s:.1f} s)",
        "",
        "operations            ok     fail  unknown",
    ]
    for kind, by_outcome in sorted(result.counts.items()):
        cells = "".join(f"{by_outcome.get(o, 0):>9}" for o in OUTCOMES)
        lines.append(f"  {kind:<16}{cells}")
    injects = [f for f in result.faults if f["phase"] == "inject"]
    heals = {f["heals"]: f for f in result.faults if f["phase"] == "heal"}
    t0 = result.started_t
    by_outcome = {o: sum(f["outcome"] == o for f in injects) for o in ("ok", "skipped", "failed")}
    lines += [
        "",
        f"faults: {len(injects)} injected ({by_outcome['ok']} ok, {by_outcome['skipped']} "
        f"skipped, {by_outcome['failed']} failed)",
    ]
    for f in injects:
        heal = heals.get(f["seq"])
        healed = f"healed +{heal['monotonic_s'] - t0:.1f}s" if heal else "not healed"
        targets = ",".join(f["targets"]) or "-"
        lines.append(
            f"  +{f['monotonic_s'] - t0:5.1f}s  {f['fault']:<24} {targets:<20} "
            f"{f['outcome']:<8} {healed if f['outcome'] == 'ok' else f['reason']}"
        )
    for fault, reason in result.skipped_reasons.items():
        lines.append(f"  skipped {fault}: {reason}")
    if result.network == "loopback" and result.skipped_reasons:
        lines.append("  (partitions and clock jumps need root: network namespaces, nftables)")
    if result.failover_s:
        fo = result.failover_s
        lines.append(
            f"\nfailover (first acknowledged put after a leader fault): "
            f"{min(fo):.2f} / {statistics.median(fo):.2f} / {max(fo):.2f} s "
            f"(min / median / max of {len(fo)})"
        )
    lines.append("")
    for phase in ("during_faults", "outside_faults"):
        lat: dict[str, Any] = result.latency.get(phase, {})
        if lat.get("calls"):
            lines.append(
                f"latency {phase.replace('_', ' '):<15} p50 {lat['p50_ms']:8.2f} ms   "
                f"p99 {lat['p99_ms']:8.2f} ms   ({lat['calls']} calls)"
            )
    lines += ["", "checks:", result.verdict.to_text()]
    if result.directory:
        lines.append(f"\nhistories, logs and cluster data kept in {result.directory}")
    return "\n".join(lines)


def render_listing(items: list[ScenarioListing]) -> str:
    lines = []
    for s in items:
        needs = f"  [needs {', '.join(s.needs)}]" if s.needs else ""
        lines.append(f"{s.name}{needs}")
        lines.append(f"    {s.description}")
        lines.append(f"    faults: {', '.join(s.faults)}")
        if s.catches:
            lines.append(f"    catches: {s.catches}")
    return "\n".join(lines)
