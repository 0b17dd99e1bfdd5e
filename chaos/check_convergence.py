"""Checker 5, convergence: after healing, all masters reach the same commit index and applied
revision within ``converge_within_s``, and the hit rate of a verification read pass over
acknowledged, non-lost keys recovers to ``hit_rate_target`` within ``hit_rate_within_s``.

Evidence, all optional (a rule with no evidence is skipped and says so; with none at all the
check is skipped):

* commit samples (the runner's probes after healing): the first sample at or after ``heal_t``
  fixes a target — the highest commit index and revision any master had — and some sample no
  later than ``heal_t + converge_within_s`` must show every master at or past it;
* the final state: the masters must have been seen to agree exactly (same commit index and
  revision, one leader) within ``converge_within_s`` of healing — or of the moment the
  collector began to look, when that was later (it cannot see earlier);
* hit-rate samples: some sample no later than ``heal_t + hit_rate_within_s`` must reach the
  target, and no verification read may return bytes that are not a value of its key.

``heal_t`` defaults to the earliest evidence when the run had no faults.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.chaos.final_state import CommitSample, HitRateSample
from kvpool.chaos.history import CheckContext, CheckResult, Findings, History

NAME = "convergence"


def _catch_up(
    samples: Sequence[CommitSample], heal_t: float, within_s: float, findings: Findings
) -> float | None:
    """Seconds from healing until every master reached the target, or None (a finding)."""
    after = sorted((s for s in samples if s.t >= heal_t), key=lambda s: s.t)
    if not after:
        findings.add(f"no commit sample at or after healing (t={heal_t:.3f})")
        return None
    first = after[0]
    names = sorted(set(first.commit_index) | {n for s in after for n in s.commit_index})
    target_commit = max((c for c in first.commit_index.values() if c is not None), default=0)
    target_rev = max((r for r in first.revision.values() if r is not None), default=0)
    for s in after:
        if s.t > heal_t + within_s:
            break
        commits = [s.commit_index.get(n) for n in names]
        revisions = [s.revision.get(n) for n in names] if s.revision else []
        if any(c is None or c < target_commit for c in commits):
            continue
        if any(r is None or r < target_rev for r in revisions):
            continue
        return s.t - heal_t
    last = after[-1]
    behind = {
        n: last.commit_index.get(n)
        for n in names
        if (last.commit_index.get(n) or 0) < target_commit
    }
    findings.add(
        f"masters did not all reach commit index {target_commit} (revision {target_rev}) "
        f"within {within_s}s of healing; last sample at +{last.t - heal_t:.1f}s: behind {behind}"
    )
    return None


def _recovery(
    samples: Sequence[HitRateSample],
    heal_t: float,
    target: float,
    within_s: float,
    findings: Findings,
) -> float | None:
    """Seconds from healing until the hit rate reached ``target``, or None (a finding)."""
    for s in samples:
        if s.wrong:
            findings.add(
                f"verification read pass at +{s.t - heal_t:.1f}s: {s.wrong} read(s) returned "
                "bytes that are not a value of their key"
            )
    after = sorted((s for s in samples if s.t >= heal_t), key=lambda s: s.t)
    if not after:
        findings.add(f"no hit-rate sample at or after healing (t={heal_t:.3f})")
        return None
    for s in after:
        if s.t > heal_t + within_s:
            break
        if s.hit_rate >= target:
            return s.t - heal_t
    best = max(after, key=lambda s: s.hit_rate)
    findings.add(
        f"hit rate did not recover to {target:.0%} within {within_s}s of healing; best "
        f"{best.hit_rate:.1%} ({best.hits}/{best.reads}) at +{best.t - heal_t:.1f}s"
    )
    return None


def check(history: History, context: CheckContext) -> CheckResult:
    final = context.final_state
    commit_samples = list(context.commit_samples)
    hit_samples = list(context.hit_rate_samples)
    if final is None and not commit_samples and not hit_samples:
        return CheckResult(NAME, True, "skipped: no probe samples and no final state", skipped=True)
    starts = [s.t for s in commit_samples] + [s.t for s in hit_samples]
    if final is not None:
        starts.append(final.t)
    heal_t = context.heal_t if context.heal_t is not None else min(starts)
    findings = Findings(context.max_details)
    counters: dict[str, float] = {}
    parts: list[str] = []
    if commit_samples:
        took = _catch_up(commit_samples, heal_t, context.converge_within_s, findings)
        if took is not None:
            counters["catch_up_s"] = round(took, 3)
            parts.append(f"masters caught up in {took:.1f}s")
    if final is not None:
        if final.settled_t is None:
            states = {
                m.address: (m.commit_index, m.revision, m.error or m.role) for m in final.masters
            }
            findings.add(f"masters never agreed on commit index and revision: {states}")
        else:
            since = max(heal_t, final.started_t if final.started_t is not None else heal_t)
            agreed_s = max(0.0, final.settled_t - since)
            counters["agree_s"] = round(agreed_s, 3)
            if agreed_s > context.converge_within_s:
                findings.add(
                    f"masters agreed only {agreed_s:.1f}s after healing (or looking) "
                    f"(allowed {context.converge_within_s}s)"
                )
            else:
                commit = final.masters[0].commit_index if final.masters else 0
                parts.append(f"masters agree at commit index {commit} after {agreed_s:.1f}s")
    if hit_samples:
        took = _recovery(
            hit_samples, heal_t, context.hit_rate_target, context.hit_rate_within_s, findings
        )
        if took is not None:
            counters["hit_rate_recovery_s"] = round(took, 3)
            parts.append(f"hit rate ≥ {context.hit_rate_target:.0%} after {took:.1f}s")
        counters["final_hit_rate"] = round(max(hit_samples, key=lambda s: s.t).hit_rate, 4)
    else:
        parts.append("no hit-rate samples")
    counters["violations"] = findings.count
    summary = "; ".join(parts) if not findings else f"{findings.count} convergence failure(s)"
    return CheckResult(NAME, not findings, summary, findings.with_more(), counters)
