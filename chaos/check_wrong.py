"""Checker 1, nothing wrong: every read returned None or exactly the bytes of one put of that key
whose invocation came before the read completed.

A read fails the check when its bytes were not a value of its key (another key's bytes, a mix of
two values, a short read, a flipped byte — :func:`~kvpool.chaos.values.decode_value` says
which), when no operation of the history wrote the value it returned, when every operation that
wrote it failed (bad input: it never happened), or when the put was invoked only after the read
had completed (a read from the future). get_or_compute counts as a read too: its result is
either a stored value or the value its own compute function returned.
"""

from __future__ import annotations

from kvpool.chaos.history import (
    READ_KINDS,
    CheckContext,
    CheckResult,
    Findings,
    History,
    KeyResult,
    Op,
    describe_op,
)
from kvpool.chaos.values import WRONG_KEY, ValueId

NAME = "nothing_wrong"


def _judge(history: History, op: Op, r: KeyResult, value: ValueId) -> str | None:
    """Why reading ``value`` in ``op`` is wrong, or None when it is a value some put of the key
    may have stored before the read completed."""
    writes = history.writes_of(r.key, value)
    if not writes:
        return f"read value {value} of {r.key!r}, which no operation of the history wrote"
    live = [w for w in writes if w.outcome != "fail"]
    if not live:
        return f"read value {value} of {r.key!r}, written only by failed operations: " + "; ".join(
            describe_op(w.op) for w in writes[:3]
        )
    first = min(live, key=lambda w: w.invoke_t)
    if first.invoke_t > op.end_t:
        return (
            f"read value {value} of {r.key!r} before it was written: the read completed at "
            f"t={op.end_t:.3f}, the put was invoked at t={first.invoke_t:.3f} "
            f"({describe_op(first.op)})"
        )
    return None


def check(history: History, context: CheckContext) -> CheckResult:
    findings = Findings(context.max_details)
    reads = hits = misses = corrupt = computed = 0
    for op in history.ops:
        if op.kind not in READ_KINDS or op.outcome != "ok":
            continue
        for r in op.results:
            reads += 1
            if r.corruption is not None:
                corrupt += 1
                c = r.corruption
                whose = ""
                if c.reason == WRONG_KEY and c.key_hash is not None:
                    other = history.key_of_hash(c.key_hash)
                    whose = f" (the bytes of key {other!r})" if other else " (another key's bytes)"
                findings.add(f"{describe_op(op)}: read bytes of {r.key!r} that are {c}{whose}")
                continue
            if r.read is None:
                misses += 1
                continue
            if op.kind == "get_or_compute" and r.read == r.written:
                computed += 1  # the value its own compute function returned
                continue
            hits += 1
            why = _judge(history, op, r, r.read)
            if why is not None:
                findings.add(f"{describe_op(op)}: {why}")
    counters: dict[str, float] = {
        "reads": reads,
        "hits": hits,
        "misses": misses,
        "computed": computed,
        "corrupt": corrupt,
        "wrong": findings.count,
    }
    if findings:
        summary = f"{findings.count} wrong read(s) of {reads} ({corrupt} corrupt)"
    else:
        summary = f"{reads} reads: {hits} correct values, {misses} misses, none wrong"
    return CheckResult(NAME, not findings, summary, findings.with_more(), counters)
