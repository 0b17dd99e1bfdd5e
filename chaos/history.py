"""What the workload did, as recorded, and what the checkers are given and answer.

One JSON object per line, one file per workload process:

* ``{"type": "meta", ...}`` first: the process's id, seed and settings;
* ``{"type": "invoke", ...}`` before every operation that may change the store (put, batch_put,
  remove, get_or_compute), flushed to the OS before the call, so that a workload killed with
  SIGKILL still leaves every write it may have made in its history;
* ``{"type": "op", ...}`` when an operation completed: the whole record (:class:`Op`);
* ``{"type": "end", ...}`` last, on a clean exit.

:func:`load_history` merges every process's file into one :class:`History`, sorted by invocation
time; an invoke line with no completion becomes an operation with outcome ``unknown`` and no
completion time. All times are ``time.monotonic()`` of the one host every workload process runs
on (one clock base); ``wall_t`` is for humans.

Outcomes: ``ok`` — the call returned (a read that returned data or None is ok); ``fail`` — the
call raised an error that proves nothing happened (bad input), or a read that returned nothing;
``unknown`` — a write whose fate is uncertain (timeout, unavailable, leader change): it may have
been applied.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from kvpool.chaos.final_state import CommitSample, FaultWindow, FinalState, HitRateSample
from kvpool.chaos.values import Corruption, ValueId, key_hash

Outcome = Literal["ok", "fail", "unknown"]
OpKind = Literal["put", "get", "remove", "get_or_compute", "batch_put", "batch_get"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "fail", "unknown")
OP_KINDS: tuple[OpKind, ...] = (
    "put",
    "get",
    "remove",
    "get_or_compute",
    "batch_put",
    "batch_get",
)
READ_KINDS: frozenset[str] = frozenset({"get", "batch_get", "get_or_compute"})
WRITE_KINDS: frozenset[str] = frozenset({"put", "batch_put", "get_or_compute"})
MUTATING_KINDS: frozenset[str] = WRITE_KINDS | {"remove"}


# --- records ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Receipt:
    """The index's answer to a committed put (the client's PutReceipt, as recorded)."""

    version: int
    write_id: int
    revision: int
    nodes: tuple[str, ...]
    member_ids: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "write_id": self.write_id,
            "revision": self.revision,
            "nodes": list(self.nodes),
            "member_ids": list(self.member_ids),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Receipt:
        return cls(
            int(raw["version"]),
            int(raw["write_id"]),
            int(raw["revision"]),
            tuple(str(n) for n in raw.get("nodes", ())),
            tuple(int(m) for m in raw.get("member_ids", ())),
        )


def _corruption_json(c: Corruption) -> dict[str, Any]:
    return {
        "reason": c.reason,
        "detail": c.detail,
        "claimed": c.claimed.to_json() if c.claimed else None,
        "key_hash": c.key_hash,
    }


def _corruption_from(raw: Mapping[str, Any]) -> Corruption:
    claimed = raw.get("claimed")
    key_h = raw.get("key_hash")
    return Corruption(
        str(raw["reason"]),
        str(raw.get("detail", "")),
        ValueId.from_json(claimed) if claimed is not None else None,
        int(key_h) if key_h is not None else None,
    )


@dataclass(frozen=True, slots=True)
class KeyResult:
    """One key of an operation (a single-key operation is a batch of one).

    ``outcome`` is this key's: a batch_put item that was not committed while the call returned
    is ``unknown`` (its commit may have been applied). ``written``: the value a put wrote, or
    the value get_or_compute's compute function returns. ``read``: the value a read returned,
    decoded; None with no ``corruption`` is a miss (``miss`` says why when known).
    """

    key: str
    outcome: Outcome
    written: ValueId | None = None
    read: ValueId | None = None
    corruption: Corruption | None = None
    miss: str = ""
    receipt: Receipt | None = None
    removed: bool | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "outcome": self.outcome}
        if self.written is not None:
            out["written"] = self.written.to_json()
        if self.read is not None:
            out["read"] = self.read.to_json()
        if self.corruption is not None:
            out["corruption"] = _corruption_json(self.corruption)
        if self.miss:
            out["miss"] = self.miss
        if self.receipt is not None:
            out["receipt"] = self.receipt.to_json()
        if self.removed is not None:
            out["removed"] = self.removed
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> KeyResult:
        outcome = str(raw["outcome"])
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}")
        written, read = raw.get("written"), raw.get("read")
        corruption, receipt = raw.get("corruption"), raw.get("receipt")
        removed = raw.get("removed")
        return cls(
            key=str(raw["key"]),
            outcome=outcome,
            written=ValueId.from_json(written) if written is not None else None,
            read=ValueId.from_json(read) if read is not None else None,
            corruption=_corruption_from(corruption) if corruption is not None else None,
            miss=str(raw.get("miss", "")),
            receipt=Receipt.from_json(receipt) if receipt is not None else None,
            removed=bool(removed) if removed is not None else None,
        )


@dataclass(frozen=True, slots=True)
class Op:
    """One operation of one workload process. ``complete_t`` is None when the process never
    recorded a completion (it was killed during the call)."""

    process: int
    index: int
    kind: OpKind
    outcome: Outcome
    invoke_t: float
    complete_t: float | None
    wall_t: float
    results: tuple[KeyResult, ...]
    error: str = ""

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(r.key for r in self.results)

    @property
    def end_t(self) -> float:
        """The completion time, or +inf for an operation that never completed."""
        return math.inf if self.complete_t is None else self.complete_t

    @property
    def effect_end_t(self) -> float:
        """The latest time this operation's effect can take place: its completion when it is
        ``ok``; +inf otherwise (a timed-out write may still be applied, late)."""
        return self.complete_t if self.outcome == "ok" and self.complete_t is not None else math.inf

    @property
    def duration_s(self) -> float | None:
        return None if self.complete_t is None else self.complete_t - self.invoke_t

    def to_json(self) -> dict[str, Any]:
        return {
            "process": self.process,
            "index": self.index,
            "kind": self.kind,
            "outcome": self.outcome,
            "invoke_t": self.invoke_t,
            "complete_t": self.complete_t,
            "wall_t": self.wall_t,
            "results": [r.to_json() for r in self.results],
            "error": self.error,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Op:
        kind, outcome = str(raw["kind"]), str(raw["outcome"])
        if kind not in OP_KINDS or outcome not in OUTCOMES:
            raise ValueError(f"unknown kind {kind!r} or outcome {outcome!r}")
        complete = raw.get("complete_t")
        return cls(
            process=int(raw["process"]),
            index=int(raw["index"]),
            kind=kind,
            outcome=outcome,
            invoke_t=float(raw["invoke_t"]),
            complete_t=float(complete) if complete is not None else None,
            wall_t=float(raw.get("wall_t", 0.0)),
            results=tuple(KeyResult.from_json(r) for r in raw["results"]),
            error=str(raw.get("error", "")),
        )


@dataclass(frozen=True, slots=True)
class Write:
    """A value some operation may have stored under a key."""

    key: str
    value: ValueId
    op: Op
    result: KeyResult

    @property
    def outcome(self) -> Outcome:
        # get_or_compute stores its computed value best effort: never known either way.
        return "unknown" if self.op.kind == "get_or_compute" else self.result.outcome

    @property
    def receipt(self) -> Receipt | None:
        return self.result.receipt

    @property
    def invoke_t(self) -> float:
        return self.op.invoke_t

    @property
    def end_t(self) -> float:
        return self.op.end_t

    @property
    def effect_end_t(self) -> float:
        """The latest time this write may have been applied: its completion when acknowledged,
        +inf when its fate is unknown (a timed-out commit may be applied late)."""
        if self.outcome == "ok" and self.op.complete_t is not None:
            return self.op.complete_t
        return math.inf


# --- writing ------------------------------------------------------------------------------------


class HistoryWriter:
    """Appends one process's records to its JSON-lines file. Invocations of writes are flushed
    at once; completions at most ``flush_interval_s`` later (and on close)."""

    def __init__(
        self,
        path: str | Path,
        *,
        flush_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("w", encoding="utf-8")
        self._flush_interval_s = flush_interval_s
        self._clock = clock
        self._last_flush = clock()

    def _write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        self._file.flush()
        self._last_flush = self._clock()

    def meta(self, **fields: Any) -> None:
        self._write({"type": "meta", **fields})
        self.flush()

    def invoke(self, op: Op) -> None:
        """Record that ``op`` (its planned keys and values, outcome unknown) is being called."""
        self._write({"type": "invoke", **op.to_json()})
        self.flush()

    def complete(self, op: Op) -> None:
        self._write({"type": "op", **op.to_json()})
        if self._clock() - self._last_flush >= self._flush_interval_s:
            self.flush()

    def end(self, **fields: Any) -> None:
        self._write({"type": "end", **fields})
        self.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()


# --- reading ------------------------------------------------------------------------------------


class History:
    """Every process's operations, merged and sorted by invocation time, with the indexes the
    checkers need."""

    def __init__(
        self,
        ops: Iterable[Op],
        *,
        meta: Mapping[int, Mapping[str, Any]] | None = None,
        ended: Iterable[int] = (),
        malformed_lines: int = 0,
    ) -> None:
        self.ops: list[Op] = sorted(ops, key=lambda o: (o.invoke_t, o.process, o.index))
        self.meta: dict[int, dict[str, Any]] = {p: dict(m) for p, m in (meta or {}).items()}
        self.ended: frozenset[int] = frozenset(ended)
        self.malformed_lines = malformed_lines
        self._writes: dict[str, list[Write]] = {}
        self._by_value: dict[tuple[str, ValueId], list[Write]] = {}
        self._removes: dict[str, list[Op]] = {}
        self._key_of_hash: dict[int, str] = {}
        for op in self.ops:
            for r in op.results:
                self._key_of_hash.setdefault(key_hash(r.key), r.key)
                if op.kind == "remove":
                    self._removes.setdefault(r.key, []).append(op)
                if op.kind in WRITE_KINDS and r.written is not None:
                    w = Write(r.key, r.written, op, r)
                    self._writes.setdefault(r.key, []).append(w)
                    self._by_value.setdefault((r.key, r.written), []).append(w)

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    @property
    def processes(self) -> list[int]:
        return sorted({o.process for o in self.ops} | set(self.meta))

    @property
    def keys(self) -> list[str]:
        return sorted(self._key_of_hash.values())

    def writes(self, key: str | None = None) -> list[Write]:
        """Every write (of ``key``), in invocation order, whatever its outcome."""
        if key is not None:
            return list(self._writes.get(key, ()))
        return sorted(
            (w for ws in self._writes.values() for w in ws),
            key=lambda w: (w.invoke_t, w.op.process, w.op.index),
        )

    def writes_of(self, key: str, value: ValueId) -> list[Write]:
        """The operations that wrote ``value`` under ``key`` (normally one)."""
        return list(self._by_value.get((key, value), ()))

    def removes(self, key: str) -> list[Op]:
        return list(self._removes.get(key, ()))

    def key_of_hash(self, khash: int) -> str | None:
        """The key of this history whose hash is ``khash`` (to name another key's bytes)."""
        return self._key_of_hash.get(khash)

    def acknowledged_keys(self, live_members: Collection[int] | None = None) -> list[str]:
        """Keys whose last acknowledged put (the highest version) was not followed by a remove
        that may have applied: the keys a verification read pass should find. With
        ``live_members`` (the member ids live now), keys whose last acknowledged put has no
        replica among them are left out too (lost with their nodes)."""
        out = []
        for key, writes in self._writes.items():
            acked = [w for w in writes if w.outcome == "ok" and w.receipt is not None]
            if not acked:
                continue
            last_invoke = max(w.invoke_t for w in acked)
            if any(
                r.outcome != "fail" and r.effect_end_t >= last_invoke for r in self.removes(key)
            ):
                continue
            if live_members is not None:
                last = max(acked, key=lambda w: w.receipt.version if w.receipt else 0)
                assert last.receipt is not None
                if not any(m in live_members for m in last.receipt.member_ids):
                    continue
            out.append(key)
        return sorted(out)

    def counts(self) -> dict[str, dict[str, int]]:
        """Operations by kind and outcome."""
        out: dict[str, dict[str, int]] = {}
        for op in self.ops:
            by = out.setdefault(op.kind, dict.fromkeys(OUTCOMES, 0))
            by[op.outcome] += 1
        return out


def load_history(paths: Iterable[str | Path]) -> History:
    """Merge workload history files. A truncated or unreadable line (a process killed while
    writing) is counted in ``malformed_lines`` and skipped."""
    ops: dict[tuple[int, int], Op] = {}
    invoked: dict[tuple[int, int], Op] = {}
    meta: dict[int, dict[str, Any]] = {}
    ended: set[int] = set()
    malformed = 0
    for path in paths:
        with Path(path).open(encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                    kind = raw.get("type")
                    if kind == "op":
                        op = Op.from_json(raw)
                        ops[(op.process, op.index)] = op
                    elif kind == "invoke":
                        op = Op.from_json(raw)
                        invoked[(op.process, op.index)] = op
                    elif kind == "meta":
                        meta[int(raw["process"])] = raw
                    elif kind == "end":
                        ended.add(int(raw["process"]))
                    else:
                        malformed += 1
                except (ValueError, KeyError, TypeError):
                    malformed += 1
    for ident, op in invoked.items():
        if ident not in ops:
            # Never completed: the write may or may not have been applied.
            results = tuple(
                KeyResult(r.key, "unknown", written=r.written, removed=None) for r in op.results
            )
            ops[ident] = Op(
                op.process,
                op.index,
                op.kind,
                "unknown",
                op.invoke_t,
                None,
                op.wall_t,
                results,
                "no completion recorded",
            )
    return History(ops.values(), meta=meta, ended=ended, malformed_lines=malformed)


# --- what checkers are given and what they answer -----------------------------------------------


@dataclass(frozen=True)
class CheckContext:
    """What a checker knows beyond the history. Times are the workload's ``time.monotonic()``.

    ``timeout_s`` is the workload's per-call timeout and ``margin_s`` what a call may overrun
    it by; ``heal_t`` is when the last fault healed; ``final_state`` was collected after that;
    ``faults`` lists what the nemesis did; the samples are the runner's probes after healing;
    ``evicted_members``: the members whose nodes logged evictions during the run (any
    incarnation, also those gone by the end, which the final state no longer lists).
    """

    timeout_s: float = 2.0
    margin_s: float = 1.0
    final_state: FinalState | None = None
    faults: Sequence[FaultWindow] = ()
    heal_t: float | None = None
    commit_samples: Sequence[CommitSample] = ()
    hit_rate_samples: Sequence[HitRateSample] = ()
    converge_within_s: float = 30.0
    hit_rate_target: float = 0.9
    hit_rate_within_s: float = 30.0
    replica_target: int = 0  # every indexed key must end with this many live replicas (0: off)
    max_details: int = 20
    evicted_members: frozenset[int] = frozenset()


@dataclass
class CheckResult:
    """A checker's verdict. ``details`` holds at most the context's ``max_details`` findings;
    ``counters`` count everything. ``skipped``: the checker had nothing to judge by (say why
    in ``summary``); a skipped check does not fail the run."""

    name: str
    ok: bool
    summary: str
    details: list[str] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    skipped: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "skipped": self.skipped,
            "summary": self.summary,
            "details": list(self.details),
            "counters": dict(self.counters),
        }


class Findings:
    """Violations found by a checker: all counted, the first ``cap`` described."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.count = 0
        self.details: list[str] = []

    def add(self, text: str) -> None:
        self.count += 1
        if len(self.details) < self.cap:
            self.details.append(text)

    def __bool__(self) -> bool:
        return self.count > 0

    def with_more(self) -> list[str]:
        """The details, plus a line saying how many were left out."""
        if self.count > len(self.details):
            return [*self.details, f"... and {self.count - len(self.details)} more"]
        return list(self.details)


def describe_op(op: Op) -> str:
    """``p1#42 put 'k' [t=12.345..12.402 ok]`` for details."""
    end = "…" if op.complete_t is None else f"{op.complete_t:.3f}"
    keys = ",".join(repr(k) for k in op.keys[:4]) + ("…" if len(op.keys) > 4 else "")
    return f"p{op.process}#{op.index} {op.kind} {keys} [t={op.invoke_t:.3f}..{end} {op.outcome}]"
