"""Checker 4, monotonic reads: per workload process and key, never read a value older than one
already seen.

Value A is older than value B when put(A) completed before put(B) was invoked (real-time order;
concurrent puts are unordered; a put of unknown fate may apply late, so it never "completed"),
or when both puts were acknowledged and A's version (from its receipt) is lower than B's.

What a process has *seen* of a key: every value it read (get, batch_get, and get_or_compute
when it returned a stored value), and every put of its own that was acknowledged (the client's
read floor covers its own commits: read-your-writes). A value get_or_compute computed itself is
not seen: storing it is best effort.

Misses are not reads of a value (a key may be removed or lost, then be put again). Reads of
values no put wrote are check_wrong's business and skipped here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpool.chaos.history import (
    CheckContext,
    CheckResult,
    Findings,
    History,
    Op,
    describe_op,
)
from kvpool.chaos.values import ValueId

NAME = "monotonic"


@dataclass(frozen=True, slots=True)
class _Known:
    """What the history says of a value: the earliest invocation of the operations that wrote
    it, the latest time one of them may have applied it (+inf for a write of unknown fate: a
    timed-out commit may be applied late), and its version when a put of it was
    acknowledged."""

    invoke_t: float
    end_t: float
    version: int | None


@dataclass(slots=True)
class _Seen:
    """The newest evidence a process holds for a key."""

    invoke_t: float = -math.inf  # latest invocation among the puts of values seen
    invoke_value: ValueId | None = None
    invoke_op: Op | None = None
    version: int = 0  # highest acknowledged version among values seen
    version_value: ValueId | None = None
    version_op: Op | None = None


def _known(history: History, key: str, value: ValueId) -> _Known | None:
    writes = [w for w in history.writes_of(key, value) if w.outcome != "fail"]
    if not writes:
        return None
    versions = [w.receipt.version for w in writes if w.receipt is not None]
    return _Known(
        invoke_t=min(w.invoke_t for w in writes),
        end_t=max(w.effect_end_t for w in writes),
        version=max(versions) if versions else None,
    )


def check(history: History, context: CheckContext) -> CheckResult:
    findings = Findings(context.max_details)
    seen: dict[tuple[int, str], _Seen] = {}
    observations = 0
    by_process = sorted(history.ops, key=lambda o: (o.process, o.index))
    for op in by_process:
        if op.outcome != "ok":
            continue
        for r in op.results:
            if op.kind in ("put", "batch_put"):
                if r.outcome != "ok" or r.receipt is None or r.written is None:
                    continue
                value, is_read = r.written, False
            elif op.kind in ("get", "batch_get", "get_or_compute"):
                if r.read is None or r.read == r.written:
                    continue  # a miss, or get_or_compute's own computed value
                value, is_read = r.read, True
            else:
                continue
            known = _known(history, r.key, value)
            if known is None:
                continue
            observations += 1
            state = seen.setdefault((op.process, r.key), _Seen())
            if is_read:
                if known.end_t < state.invoke_t:
                    assert state.invoke_op is not None
                    findings.add(
                        f"{describe_op(op)}: read {value} of {r.key!r}, whose put completed at "
                        f"t={known.end_t:.3f}, after {describe_op(state.invoke_op)} had shown "
                        f"{state.invoke_value}, put from t={state.invoke_t:.3f} on"
                    )
                elif known.version is not None and known.version < state.version:
                    assert state.version_op is not None
                    findings.add(
                        f"{describe_op(op)}: read {value} of {r.key!r} at version "
                        f"{known.version}, after {describe_op(state.version_op)} had shown "
                        f"{state.version_value} at version {state.version}"
                    )
            if known.invoke_t > state.invoke_t:
                state.invoke_t, state.invoke_value, state.invoke_op = known.invoke_t, value, op
            if known.version is not None and known.version > state.version:
                state.version, state.version_value, state.version_op = known.version, value, op
    counters: dict[str, float] = {
        "observations": observations,
        "process_keys": len(seen),
        "violations": findings.count,
    }
    if findings:
        summary = f"{findings.count} read(s) went back to an older value"
    else:
        summary = (
            f"{observations} observations over {len(seen)} (process, key) pairs, "
            "never an older value after a newer one"
        )
    return CheckResult(NAME, not findings, summary, findings.with_more(), counters)
