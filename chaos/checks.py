"""Run every checker on a recorded history and aggregate the verdict.

    history = load_history(paths)
    verdict = run_all(history, CheckContext(timeout_s=2.0, final_state=final, ...))
    print(json.dumps(verdict.to_json()))
    sys.exit(0 if verdict.ok else 1)

A checker that crashes fails the run (a check that cannot run proves nothing); a skipped checker
(nothing to judge by) does not.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.chaos import (
    check_convergence,
    check_fallback,
    check_lost,
    check_monotonic,
    check_read_after_ack,
    check_replicas,
    check_wrong,
)
from kvpool.chaos.history import CheckContext, CheckResult, History

Checker = Callable[[History, CheckContext], CheckResult]

CHECKERS: dict[str, Checker] = {
    check_wrong.NAME: check_wrong.check,
    check_lost.NAME: check_lost.check,
    check_fallback.NAME: check_fallback.check,
    check_monotonic.NAME: check_monotonic.check,
    check_read_after_ack.NAME: check_read_after_ack.check,
    check_convergence.NAME: check_convergence.check,
    check_replicas.NAME: check_replicas.check,
}
"""Every checker by name, in report order."""


@dataclass
class Verdict:
    """Every checker's result; ``ok`` when none failed."""

    results: list[CheckResult] = field(default_factory=list)
    operations: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results if not r.ok]

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "failed": self.failed,
            "operations": self.operations,
            "checks": [r.to_json() for r in self.results],
        }

    def to_text(self) -> str:
        lines = []
        for r in self.results:
            mark = "SKIP" if r.skipped else ("ok" if r.ok else "FAIL")
            lines.append(f"{mark:>4}  {r.name}: {r.summary}")
            lines.extend(f"        {d}" for d in r.details)
        lines.append("verdict: " + ("ok" if self.ok else "FAILED (" + ", ".join(self.failed) + ")"))
        return "\n".join(lines)


def run_one(name: str, history: History, context: CheckContext) -> CheckResult:
    try:
        checker = CHECKERS[name]
    except KeyError:
        raise ValueError(f"no checker named {name!r}; known: {', '.join(CHECKERS)}") from None
    try:
        return checker(history, context)
    except Exception as e:
        tb = traceback.format_exc(limit=5).strip().splitlines()
        return CheckResult(
            name, False, f"checker crashed: {type(e).__name__}: {e}", tb[-6:], {"crashed": 1}
        )


def run_all(history: History, context: CheckContext, only: Sequence[str] | None = None) -> Verdict:
    """Run the checkers (all, or those named in ``only``) in report order."""
    names = list(CHECKERS) if only is None else list(only)
    return Verdict([run_one(n, history, context) for n in names], history.counts())
