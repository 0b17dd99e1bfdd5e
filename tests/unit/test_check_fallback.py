"""check_fallback on hand-made histories: calls end within their deadline plus the margin, and
get_or_compute always returns the right value."""

from __future__ import annotations

from kvpool.chaos import check_fallback
from kvpool.chaos.history import CheckContext, CheckResult, History, KeyResult, Op, OpKind
from kvpool.chaos.values import ValueId, computed_writer, decode_value, make_value

CTX = CheckContext(timeout_s=2.0, margin_s=1.0)
MINE = ValueId(computed_writer(1), 7)


def op(kind: OpKind, t0: float, t1: float | None, i: int = 1) -> Op:
    r = KeyResult("k", "ok", written=ValueId(1, i) if kind == "put" else None)
    return Op(1, i, kind, "ok", t0, t1, 0.0, (r,))


def goc(result: KeyResult, t0: float = 10.0, t1: float = 10.5, outcome: str = "ok") -> Op:
    return Op(1, 7, "get_or_compute", "ok" if outcome == "ok" else "fail", t0, t1, 0.0, (result,))


def run(*ops: Op) -> CheckResult:
    return check_fallback.check(History(ops), CTX)


# --- histories that pass ------------------------------------------------------------------------


def test_calls_within_the_deadline_and_margin_pass() -> None:
    result = run(
        op("put", 0.0, 0.1, 1),
        op("get", 1.0, 3.9),  # 2.9 s: over timeout_s but within the margin
        op("remove", 4.0, 6.9),
        Op(1, 9, "get_or_compute", "ok", 7.0, 11.9, 0.0, (KeyResult("k", "ok", MINE, MINE),)),
    )
    assert result.ok, result.details
    assert result.counters["calls"] == 4
    assert result.counters["get_max_s"] == 2.9


def test_get_or_compute_returning_its_computed_value_or_a_put_value_passes() -> None:
    result = run(
        op("put", 1.0, 2.0, 3),
        goc(KeyResult("k", "ok", written=MINE, read=MINE)),
        goc(KeyResult("k", "ok", written=MINE, read=ValueId(1, 3)), 11.0, 11.2),
    )
    assert result.ok, result.details
    assert result.counters["get_or_compute"] == 2
    assert result.counters["computed"] == 1


def test_unfinished_calls_are_counted_not_judged() -> None:
    result = run(op("put", 1.0, None))
    assert result.ok
    assert result.counters["unfinished"] == 1


# --- histories that must fail ------------------------------------------------------------------


def test_a_call_past_its_deadline_and_margin_fails() -> None:
    result = run(op("put", 0.0, 3.2))
    assert not result.ok
    assert result.counters["late"] == 1
    assert "took 3.200s, allowed 3.000s" in result.details[0]


def test_get_or_compute_is_allowed_two_calls_and_no_more() -> None:
    ok = KeyResult("k", "ok", written=MINE, read=MINE)
    assert run(goc(ok, 0.0, 4.9)).ok
    result = run(goc(ok, 0.0, 5.1))
    assert not result.ok
    assert "allowed 5.000s" in result.details[0]


def test_get_or_compute_returning_none_fails() -> None:
    result = run(goc(KeyResult("k", "ok", written=MINE)))
    assert not result.ok
    assert "returned None" in result.details[0]


def test_get_or_compute_raising_fails() -> None:
    result = run(goc(KeyResult("k", "fail", written=MINE), outcome="fail"))
    assert not result.ok
    assert "raised" in result.details[0]


def test_get_or_compute_returning_bytes_that_are_not_a_value_fails() -> None:
    corruption = decode_value("k", make_value("other", 1, 1, 100))
    assert not isinstance(corruption, ValueId)
    result = run(goc(KeyResult("k", "ok", written=MINE, corruption=corruption)))
    assert not result.ok
    assert "wrong_key" in result.details[0]


def test_get_or_compute_returning_a_value_nobody_wrote_fails() -> None:
    result = run(goc(KeyResult("k", "ok", written=MINE, read=ValueId(4, 4))))
    assert not result.ok
    assert "neither stored by any put nor computed" in result.details[0]


def test_get_or_compute_returning_a_value_put_only_later_fails() -> None:
    result = run(goc(KeyResult("k", "ok", written=MINE, read=ValueId(1, 3))), op("put", 20, 21, 3))
    assert not result.ok
    assert "before any put of it was invoked" in result.details[0]
