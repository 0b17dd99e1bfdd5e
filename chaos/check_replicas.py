"""Checker 6, replicas: after healing, every key the index holds has at least the scenario's
``replica_target`` live replicas (capped by the live nodes) — blocks that lost a replica to a
dead or drained node were re-replicated from a survivor. Keys the index no longer holds are
check_lost's business, not this one's. Skipped when the scenario sets no target or the final
state lacks the index or the node table."""

from __future__ import annotations

from kvpool.chaos.history import CheckContext, CheckResult, Findings, History

NAME = "replicas"


def check(history: History, context: CheckContext) -> CheckResult:
    target = context.replica_target
    final = context.final_state
    if target <= 0:
        return CheckResult(NAME, True, "skipped: the scenario sets no replica target", skipped=True)
    if final is None or not final.nodes_known or not final.entries:
        return CheckResult(NAME, True, "skipped: no final index and node table", skipped=True)
    live = final.live_member_ids()
    want = min(target, len(live))
    findings = Findings(context.max_details)
    held = 0
    for key, entry in sorted(final.entries.items()):
        if entry is None:
            continue
        held += 1
        replicas = [m for m in entry.member_ids if m in live]
        if len(replicas) < want:
            findings.add(
                f"{key!r} (write {entry.write_id:#x}) has {len(replicas)} live replica(s) "
                f"{replicas}; want {want}"
            )
    counters: dict[str, float] = {
        "keys": held,
        "under_target": findings.count,
        "live_nodes": len(live),
    }
    if findings:
        return CheckResult(
            NAME,
            False,
            f"{findings.count} of {held} keys under {want} live replicas",
            findings.with_more(),
            counters,
        )
    return CheckResult(NAME, True, f"all {held} keys at >= {want} live replicas", [], counters)
