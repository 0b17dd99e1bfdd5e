"""Checker 3, fallback: every call returned within its deadline plus a stated margin, and every
get_or_compute returned the right value.

The deadline of a call is the workload's ``timeout_s``; get_or_compute makes two calls (the get,
then the store of the computed value), each with its own deadline, so it is allowed twice as
much. A call may overrun by ``margin_s`` (scheduling, the loop thread's hand-off). Operations
that never completed (their process was killed) are counted, not judged.

get_or_compute must never raise and never return None; what it returns must decode as a value
of its key — a value some put of the key may have stored before it returned, or the value its
own compute function produced.
"""

from __future__ import annotations

from kvpool.chaos.history import (
    CheckContext,
    CheckResult,
    Findings,
    History,
    Op,
    describe_op,
)

NAME = "fallback"


def calls_of(kind: str) -> int:
    """How many deadline-bound calls one operation of ``kind`` makes."""
    return 2 if kind == "get_or_compute" else 1


def allowed_s(kind: str, context: CheckContext) -> float:
    return calls_of(kind) * context.timeout_s + context.margin_s


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def _judge_goc(history: History, op: Op) -> str | None:
    """Why this get_or_compute did not return the right value, or None."""
    if op.outcome != "ok":
        return f"raised instead of returning a value ({op.error or op.outcome})"
    (r,) = op.results
    if r.corruption is not None:
        return f"returned bytes that are not a value of the key: {r.corruption}"
    if r.read is None:
        return "returned None"
    if r.read == r.written:
        return None  # its own computed value
    writes = [w for w in history.writes_of(r.key, r.read) if w.outcome != "fail"]
    if not writes:
        return f"returned value {r.read}, neither stored by any put nor computed by this call"
    if min(w.invoke_t for w in writes) > op.end_t:
        return f"returned value {r.read} before any put of it was invoked"
    return None


def check(history: History, context: CheckContext) -> CheckResult:
    late = Findings(context.max_details)
    wrong = Findings(context.max_details)
    durations: dict[str, list[float]] = {}
    unfinished = gocs = computed = 0
    for op in history.ops:
        duration = op.duration_s
        if duration is None:
            unfinished += 1
        else:
            durations.setdefault(op.kind, []).append(duration)
            limit = allowed_s(op.kind, context)
            if duration > limit:
                late.add(
                    f"{describe_op(op)}: took {duration:.3f}s, allowed {limit:.3f}s "
                    f"({calls_of(op.kind)} x timeout_s={context.timeout_s} + "
                    f"margin_s={context.margin_s})"
                )
        if op.kind == "get_or_compute" and op.complete_t is not None:
            gocs += 1
            why = _judge_goc(history, op)
            if why is not None:
                wrong.add(f"{describe_op(op)}: {why}")
            elif op.results[0].read == op.results[0].written:
                computed += 1
    counters: dict[str, float] = {
        "calls": sum(len(d) for d in durations.values()),
        "late": late.count,
        "unfinished": unfinished,
        "get_or_compute": gocs,
        "computed": computed,
        "get_or_compute_wrong": wrong.count,
    }
    for kind, values in sorted(durations.items()):
        values.sort()
        counters[f"{kind}_p99_s"] = round(_percentile(values, 0.99), 4)
        counters[f"{kind}_max_s"] = round(values[-1], 4)
    ok = not late and not wrong
    if ok:
        slowest = max((v[-1] for v in durations.values()), default=0.0)
        summary = (
            f"{int(counters['calls'])} calls within their deadline + {context.margin_s}s "
            f"(slowest {slowest:.3f}s); {gocs} get_or_compute all right ({computed} computed)"
        )
    else:
        summary = f"{late.count} call(s) over their deadline, {wrong.count} wrong get_or_compute"
    return CheckResult(NAME, ok, summary, late.with_more() + wrong.with_more(), counters)
