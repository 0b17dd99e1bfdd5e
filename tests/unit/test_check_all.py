"""Histories as written and loaded, and checks.run_all: every checker, one verdict, JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.chaos import checks
from kvpool.chaos.final_state import FinalState, IndexEntry, MasterState, NodeState
from kvpool.chaos.history import (
    CheckContext,
    CheckResult,
    History,
    HistoryWriter,
    KeyResult,
    Op,
    Outcome,
    Receipt,
    load_history,
)
from kvpool.chaos.values import ValueId, decode_value, make_value

A = ValueId(1, 1)


def put_op(i: int, key: str, t0: float, t1: float | None, version: int = 0) -> Op:
    receipt = Receipt(version, 77, version, ("node-1",), (1,)) if version else None
    out: Outcome = "ok" if version else "unknown"
    r = KeyResult(key, out, written=ValueId(1, i), receipt=receipt)
    return Op(1, i, "put", out, t0, t1, 1.7e9, (r,))


def get_op(p: int, i: int, key: str, data: bytes, t0: float) -> Op:
    decoded = decode_value(key, data)
    assert isinstance(decoded, ValueId)
    return Op(p, i, "get", "ok", t0, t0 + 0.1, 1.7e9, (KeyResult(key, "ok", read=decoded),))


# --- history files ------------------------------------------------------------------------------


def test_a_history_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "h1.jsonl"
    writer = HistoryWriter(path)
    writer.meta(process=1, seed=3)
    op = put_op(1, "k", 1.0, 1.5, version=4)
    writer.invoke(Op(1, 1, "put", "unknown", 1.0, None, 1.7e9, (KeyResult("k", "unknown", A),)))
    writer.complete(op)
    writer.end(process=1, ops=1)
    writer.close()
    history = load_history([path])
    assert history.ops == [op]
    assert history.meta[1]["seed"] == 3
    assert history.ended == {1}
    assert history.malformed_lines == 0


def test_an_invocation_with_no_completion_becomes_unknown(tmp_path: Path) -> None:
    path = tmp_path / "h1.jsonl"
    writer = HistoryWriter(path, flush_interval_s=3600)
    writer.invoke(Op(1, 5, "put", "unknown", 2.0, None, 1.7e9, (KeyResult("k", "unknown", A),)))
    writer.complete(put_op(6, "k", 3.0, 3.1, version=9))  # buffered, not flushed yet
    # A SIGKILL now loses the buffered completion but never the invocation.
    history = load_history([path])
    (op,) = history.ops
    assert op.outcome == "unknown"
    assert op.complete_t is None
    assert op.results[0].written == A
    assert history.writes_of("k", A)[0].effect_end_t == float("inf")
    writer.close()


def test_a_truncated_last_line_is_counted_and_skipped(tmp_path: Path) -> None:
    path = tmp_path / "h1.jsonl"
    good = json.dumps({"type": "op", **put_op(1, "k", 1.0, 1.1, 3).to_json()})
    path.write_text(good + "\n" + good[: len(good) // 2])
    history = load_history([path])
    assert len(history) == 1
    assert history.malformed_lines == 1


def test_histories_of_several_processes_merge_by_invocation_time(tmp_path: Path) -> None:
    paths = []
    for p, times in ((1, [1.0, 5.0]), (2, [3.0, 4.0])):
        path = tmp_path / f"h{p}.jsonl"
        writer = HistoryWriter(path)
        for i, t in enumerate(times):
            writer.complete(get_op(p, i, "k", make_value("k", 1, 1, 64), t))
        writer.close()
        paths.append(path)
    history = load_history(paths)
    assert [o.invoke_t for o in history.ops] == [1.0, 3.0, 4.0, 5.0]
    assert history.processes == [1, 2]


def test_acknowledged_keys_leave_out_keys_removed_afterwards() -> None:
    removed = Op(2, 1, "remove", "ok", 5.0, 5.1, 0.0, (KeyResult("b", "ok", removed=True),))
    history = History(
        [put_op(1, "a", 1.0, 2.0, 3), put_op(2, "b", 1.0, 2.0, 4), put_op(3, "c", 1, 2), removed]
    )
    assert history.acknowledged_keys() == ["a"]
    assert history.acknowledged_keys(live_members={1}) == ["a"]
    assert history.acknowledged_keys(live_members={2}) == []  # a's replica (member 1) is gone


# --- run_all ------------------------------------------------------------------------------------


def _context(entries: dict[str, IndexEntry | None]) -> CheckContext:
    state = FinalState(
        t=50.0,
        masters=[MasterState("127.0.0.1:1", "leader", 2, 9, 9, 7)],
        nodes=[NodeState(1, "node-1", 1)],
        nodes_known=True,
        entries=entries,
        settled_t=49.0,
    )
    return CheckContext(timeout_s=2.0, margin_s=1.0, final_state=state)


def test_run_all_passes_a_correct_history_with_a_json_verdict() -> None:
    history = History(
        [put_op(1, "k", 1.0, 1.5, 4), get_op(2, 1, "k", make_value("k", 1, 1, 99), 2)]
    )
    verdict = checks.run_all(history, _context({"k": IndexEntry(4, 77, (1,))}))
    assert verdict.ok, verdict.to_text()
    assert [r.name for r in verdict.results] == list(checks.CHECKERS)
    doc = json.loads(json.dumps(verdict.to_json()))
    assert doc["ok"] is True
    assert doc["operations"] == {
        "put": {"ok": 1, "fail": 0, "unknown": 0},
        "get": {"ok": 1, "fail": 0, "unknown": 0},
    }
    assert "verdict: ok" in verdict.to_text()


def test_run_all_fails_when_one_checker_fails() -> None:
    history = History([put_op(1, "k", 1.0, 1.5, 4)])
    verdict = checks.run_all(history, _context({"k": None}))
    assert not verdict.ok
    assert verdict.failed == ["nothing_lost"]
    assert "FAIL  nothing_lost" in verdict.to_text()


def test_a_crashing_checker_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(history: History, context: CheckContext) -> CheckResult:
        raise ZeroDivisionError("oops")

    monkeypatch.setitem(checks.CHECKERS, "nothing_wrong", boom)
    verdict = checks.run_all(History([]), CheckContext())
    assert not verdict.ok
    result = verdict.results[0]
    assert result.summary == "checker crashed: ZeroDivisionError: oops"


def test_run_all_can_run_some_checkers_only() -> None:
    verdict = checks.run_all(History([]), CheckContext(), only=["monotonic"])
    assert [r.name for r in verdict.results] == ["monotonic"]
    with pytest.raises(ValueError, match="no checker named"):
        checks.run_all(History([]), CheckContext(), only=["nope"])


def test_final_state_round_trips_through_json() -> None:
    state = FinalState(
        t=1.0,
        nodes=[NodeState(1, "node-1", 5, evictions_total=2)],
        nodes_known=True,
        entries={"a": IndexEntry(3, 4, (1, 2)), "b": None},
        settled_t=0.5,
    )
    again = FinalState.from_json(json.loads(json.dumps(state.to_json())))
    assert again == state
