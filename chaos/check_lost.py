"""Checker 2, nothing lost: every put acknowledged ``ok`` is still known to the index once faults
heal — the key's final entry has that put's version or a newer one.

A put whose key has no entry at the end is excused, and counted by why, when:

* ``removed`` — a remove of the key that may have applied after the put (any outcome but
  ``fail``, not completed before the put was invoked);
* ``node_lost`` — every replica the receipt names is on a member that is no longer live in the
  final node table (its node died, or was declared down, after the put: member ids are never
  reused, and a restarted node is a new member); fault events on those nodes are quoted;
* ``superseded`` — another write of the key that may have applied after it took the entry over:
  an acknowledged one with a newer version (that write answers for itself), or one of unknown
  fate (it may have committed on replicas that are gone since; counted apart as
  ``superseded_uncertain``);
* ``possibly_evicted`` — every replica is gone or on a node whose eviction counter is above zero
  (reported separately: eviction is allowed, but a run meant to be eviction-free should show 0).

An entry with an *older* version than an acknowledged put (the index went back), or the same
version with another write id, fails with no excuse. Without a final state the check is
skipped.
"""

from __future__ import annotations

from kvpool.chaos.final_state import FinalState
from kvpool.chaos.history import (
    CheckContext,
    CheckResult,
    Findings,
    History,
    Write,
    describe_op,
)

NAME = "nothing_lost"


def _may_follow(later_effect_end_t: float, earlier_invoke_t: float) -> bool:
    """Whether an operation whose effect took place by ``later_effect_end_t`` (+inf when its
    fate is unknown) may have applied after one invoked at ``earlier_invoke_t``."""
    return later_effect_end_t >= earlier_invoke_t


class _Judge:
    def __init__(self, history: History, context: CheckContext, final: FinalState) -> None:
        self.history = history
        self.context = context
        self.final = final
        self.live = final.live_member_ids()

    def replicas_gone(self, w: Write) -> bool:
        """Every replica of ``w`` is on a member that is no longer live (or, with no node table,
        on a node a fault touched after the put was invoked)."""
        receipt = w.receipt
        assert receipt is not None
        if self.final.nodes_known:
            return bool(receipt.member_ids) and all(m not in self.live for m in receipt.member_ids)
        return bool(receipt.nodes) and all(
            any(f.affects_after(node, w.invoke_t) for f in self.context.faults)
            for node in receipt.nodes
        )

    def faults_on(self, w: Write) -> str:
        receipt = w.receipt
        assert receipt is not None
        hits = [
            f"{f.name or f.kind} on {','.join(f.targets)} at t={f.start_t:.3f}"
            for f in self.context.faults
            if any(f.affects_after(node, w.invoke_t) for node in receipt.nodes)
        ]
        return "; ".join(hits[:3]) if hits else "no fault recorded on them"

    def evicting(self, w: Write) -> bool:
        """Every replica is gone or on a node that evicted something, and at least one evicted."""
        receipt = w.receipt
        assert receipt is not None
        any_evicting = False
        for member_id in receipt.member_ids:
            if member_id not in self.live:
                continue
            node = self.final.node(member_id)
            if node is None or not node.evictions_total:
                return False
            any_evicting = True
        return any_evicting

    def removed(self, w: Write) -> bool:
        return any(
            r.outcome != "fail" and _may_follow(r.effect_end_t, w.invoke_t)
            for r in self.history.removes(w.key)
        )

    def superseded(self, w: Write) -> str | None:
        """``"superseded"`` / ``"superseded_uncertain"`` when another write of the key may have
        taken the entry over after ``w``; else None."""
        receipt = w.receipt
        assert receipt is not None
        uncertain = False
        for other in self.history.writes(w.key):
            if other is w or other.outcome == "fail":
                continue
            if not _may_follow(other.effect_end_t, w.invoke_t):
                continue
            if other.receipt is not None:
                if other.receipt.version > receipt.version:
                    return "superseded"
            elif other.outcome == "unknown":
                uncertain = True
        return "superseded_uncertain" if uncertain else None


def check(history: History, context: CheckContext) -> CheckResult:
    final = context.final_state
    if final is None:
        return CheckResult(NAME, True, "skipped: no final state", skipped=True)
    judge = _Judge(history, context, final)
    findings = Findings(context.max_details)
    counters: dict[str, float] = {
        "acknowledged": 0,
        "kept": 0,
        "removed": 0,
        "node_lost": 0,
        "superseded": 0,
        "superseded_uncertain": 0,
        "possibly_evicted": 0,
        "unverified": 0,
        "lost": 0,
    }
    unresolved = set(final.unresolved)
    for w in history.writes():
        receipt = w.receipt
        if w.outcome != "ok" or receipt is None:
            continue
        counters["acknowledged"] += 1
        if w.key in unresolved or w.key not in final.entries:
            counters["unverified"] += 1
            continue
        entry = final.entries[w.key]
        where = f"{describe_op(w.op)} value {w.value} (version {receipt.version})"
        if entry is not None:
            same = entry.version == receipt.version
            if entry.version > receipt.version or (same and entry.write_id == receipt.write_id):
                counters["kept"] += 1
            elif same:
                counters["lost"] += 1
                findings.add(
                    f"{where}: the index holds write id {entry.write_id:#x} under the same "
                    f"version, the put was acknowledged with {receipt.write_id:#x}"
                )
            else:
                counters["lost"] += 1
                findings.add(f"{where}: the index went back to the older version {entry.version}")
            continue
        if judge.removed(w):
            counters["removed"] += 1
        elif judge.replicas_gone(w):
            counters["node_lost"] += 1
        elif (why := judge.superseded(w)) is not None:
            counters[why] += 1
        elif judge.evicting(w):
            counters["possibly_evicted"] += 1
        else:
            counters["lost"] += 1
            nodes = ",".join(receipt.nodes) or "?"
            findings.add(
                f"{where}: the index no longer knows the key; replicas on {nodes} "
                f"(members {list(receipt.member_ids)}) are live and did not evict "
                f"({judge.faults_on(w)})"
            )
    excused = sum(
        counters[k]
        for k in ("removed", "node_lost", "superseded", "superseded_uncertain", "possibly_evicted")
    )
    summary = (
        f"{int(counters['acknowledged'])} acknowledged puts: {int(counters['kept'])} kept, "
        f"{int(excused)} excused ({int(counters['node_lost'])} with their nodes, "
        f"{int(counters['possibly_evicted'])} possibly evicted), "
        f"{int(counters['lost'])} lost"
    )
    if counters["unverified"]:
        summary += f", {int(counters['unverified'])} not verifiable (no lookup answer)"
    return CheckResult(NAME, not findings, summary, findings.with_more(), counters)
