"""Checker 7, read after acknowledge: once a put was acknowledged to any process, every get
invoked later, by any process, finds that write or a newer one — judged over the whole run,
during faults too, not only after healing.

For each single-key ``get`` (whose misses carry a reason) the acknowledged puts of its key that
completed before the get was invoked are gathered; the one with the highest version is the
*floor*. The get must then return

* the floor's value, or the value of another write that may have applied after the floor was
  invoked (a concurrent or later put: acknowledged with a higher version, or of unknown fate);
  anything older is a **stale read** — excused only where the writer could not have removed
  the older copy: ``stale_orphan``, the older value's write was stored on a node the floor's
  write was not placed on, or ``stale_node_fault``, a fault touched a node holding it between
  that older write and the get's end (the writer deletes or replaces the replaced write's
  blocks before it returns, but cannot when it cannot reach them; a reader whose cached index
  entry still names them reads them until the entry expires: a known limit, counted, see
  docs/operations.md);
* or miss, excused (and counted by why) when:

  - ``unavailable`` — the index named the block but its bytes could not be had (the node is
    down, slow or restarted: ``node_down``, ``timeout``, ``version_mismatch``…); a lookup that
    failed outright is an error, not a miss, and is not judged;
  - ``removed`` — a remove of the key may have applied after the floor was invoked and before
    the get ended;
  - ``node_fault`` — a fault touched a node the floor's receipt names, between the floor's
    invocation and the get's end (a killed node's replicas leave the index);
  - ``superseded_uncertain`` — a write of unknown fate may have replaced the floor;
  - ``possibly_evicted`` — a member holding the floor evicted something during the run (by its
    counter at the end, or by its node's log for a member a restart replaced).

  An ``absent`` or ``evicted`` miss with none of these is a **lost read**: the index said
  "not there" about a block acknowledged before the question was asked — what a reader on
  another machine sees as a recompute. Batched gets carry no miss reason and are counted as
  unjudged.
"""

from __future__ import annotations

from kvpool.chaos.history import (
    CheckContext,
    CheckResult,
    Findings,
    History,
    Op,
    Write,
    describe_op,
)
from kvpool.chaos.values import ValueId

NAME = "read_after_ack"
INDEX_MISSES = frozenset({"absent", "evicted"})


class _Judge:
    def __init__(self, history: History, context: CheckContext) -> None:
        self.history = history
        self.context = context
        final = context.final_state
        self.evicting = context.evicted_members | {
            n.member_id for n in (final.nodes if final is not None else ()) if n.evictions_total
        }
        self.acked: dict[str, list[Write]] = {}
        for w in history.writes():
            if w.outcome == "ok" and w.receipt is not None and w.op.complete_t is not None:
                self.acked.setdefault(w.key, []).append(w)

    def floor(self, key: str, before_t: float) -> Write | None:
        done = [w for w in self.acked.get(key, ()) if w.end_t < before_t]
        return max(done, key=lambda w: w.receipt.version if w.receipt else 0, default=None)

    def newer_or_concurrent(self, floor: Write, value: ValueId) -> bool:
        """A write of ``value`` that may have applied after ``floor`` was invoked."""
        assert floor.receipt is not None
        for w in self.history.writes_of(floor.key, value):
            if w.outcome == "fail" or w.effect_end_t < floor.invoke_t:
                continue
            if w.receipt is None or w.receipt.version >= floor.receipt.version:
                return True
        return False

    def faulted(self, nodes: tuple[str, ...], from_t: float, to_t: float) -> bool:
        """A fault touched one of ``nodes`` between ``from_t`` and ``to_t``."""
        return any(
            f.start_t < to_t and any(f.affects_after(n, from_t) for n in nodes)
            for f in self.context.faults
        )

    def stale_excuse(self, floor: Write, value: ValueId, get: Op) -> str | None:
        """Why the writer of ``floor`` may not have reached an older copy of ``value``."""
        assert floor.receipt is not None
        reached = set(floor.receipt.nodes)
        held = [w for w in self.history.writes_of(floor.key, value) if w.receipt is not None]
        if any(not set(w.receipt.nodes) <= reached for w in held if w.receipt):
            return "stale_orphan"
        # The clean-up of the older copy (a DELETE, a replacing PUBLISH) may have been lost at any
        # time after it was written.
        if any(self.faulted(w.receipt.nodes, w.invoke_t, get.end_t) for w in held if w.receipt):
            return "stale_node_fault"
        return None

    def wrote(self, result: object) -> str:
        """Where the value a stale read returned came from (the writes that stored it)."""
        key, value = getattr(result, "key", ""), getattr(result, "read", None)
        if value is None:
            return ""
        parts = []
        for w in self.history.writes_of(key, value):
            receipt = w.receipt
            where = f" version {receipt.version} on {','.join(receipt.nodes)}" if receipt else ""
            parts.append(f"{describe_op(w.op)}{where}")
        return f", written by {'; '.join(parts)}" if parts else ""

    def excuse(self, floor: Write, get: Op) -> str | None:
        receipt = floor.receipt
        assert receipt is not None
        end = get.end_t
        for r in self.history.removes(floor.key):
            if r.outcome != "fail" and r.effect_end_t >= floor.invoke_t and r.invoke_t < end:
                return "removed"
        if self.faulted(receipt.nodes, floor.invoke_t, end):
            return "node_fault"
        for w in self.history.writes(floor.key):
            if w.outcome == "unknown" and w.effect_end_t >= floor.invoke_t and w.invoke_t < end:
                return "superseded_uncertain"
        if any(m in self.evicting for m in receipt.member_ids):
            return "possibly_evicted"
        return None


def check(history: History, context: CheckContext) -> CheckResult:
    judge = _Judge(history, context)
    findings = Findings(context.max_details)
    counters: dict[str, float] = {
        "judged": 0,
        "found": 0,
        "unavailable": 0,
        "removed": 0,
        "node_fault": 0,
        "superseded_uncertain": 0,
        "possibly_evicted": 0,
        "unjudged_batch": 0,
        "stale_orphan": 0,
        "stale_node_fault": 0,
        "stale": 0,
        "lost": 0,
    }
    for op in history.ops:
        if op.outcome != "ok" or op.kind not in ("get", "batch_get"):
            continue
        for r in op.results:
            floor = judge.floor(r.key, op.invoke_t)
            if floor is None or r.corruption is not None:
                continue  # nothing acknowledged before; wrong bytes are check_wrong's
            assert floor.receipt is not None
            where = (
                f"{describe_op(op)} after {describe_op(floor.op)} acknowledged "
                f"{floor.value} (version {floor.receipt.version} on "
                f"{','.join(floor.receipt.nodes)})"
            )
            if r.read is not None:
                counters["judged"] += 1
                if r.read == floor.value or judge.newer_or_concurrent(floor, r.read):
                    counters["found"] += 1
                elif (stale_why := judge.stale_excuse(floor, r.read, op)) is not None:
                    counters[stale_why] += 1
                else:
                    counters["stale"] += 1
                    findings.add(f"{where}: read the older value {r.read}{judge.wrote(r)}")
                continue
            if op.kind == "batch_get":
                counters["unjudged_batch"] += 1
                continue
            counters["judged"] += 1
            if r.miss not in INDEX_MISSES:
                counters["unavailable"] += 1
                continue
            why = judge.excuse(floor, op)
            if why is not None:
                counters[why] += 1
                continue
            counters["lost"] += 1
            nodes = ",".join(floor.receipt.nodes) or "?"
            findings.add(f"{where}: missed ({r.miss}); its replicas on {nodes} saw no fault")
    excused = sum(
        counters[k]
        for k in (
            "unavailable",
            "removed",
            "node_fault",
            "superseded_uncertain",
            "possibly_evicted",
        )
    )
    summary = (
        f"{int(counters['judged'])} gets after an acknowledged put: {int(counters['found'])} "
        f"found it or newer, {int(excused)} excused misses "
        f"({int(counters['unavailable'])} bytes unreachable, {int(counters['node_fault'])} "
        f"nodes faulted), {int(counters['lost'])} lost, {int(counters['stale'])} stale"
    )
    unreached = counters["stale_orphan"] + counters["stale_node_fault"]
    if unreached:
        summary += (
            f"; {int(unreached)} older values read from a node the newer write could not reach "
            "(placed elsewhere, or faulted: a cached entry; known limit)"
        )
    return CheckResult(NAME, not findings, summary, findings.with_more(), counters)
