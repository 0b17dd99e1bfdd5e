"""check_monotonic on hand-made histories: a process never reads a value older than one it has
already seen of that key."""

from __future__ import annotations

from kvpool.chaos import check_monotonic
from kvpool.chaos.history import CheckContext, CheckResult, History, KeyResult, Op, Outcome, Receipt
from kvpool.chaos.values import ValueId, computed_writer


def put(
    p: int, i: int, t0: float, t1: float, version: int = 0, out: Outcome = "ok", key: str = "k"
) -> Op:
    receipt = Receipt(version, version, version, ("node-1",), (1,)) if version else None
    r = KeyResult(key, out, written=ValueId(p, i), receipt=receipt)
    return Op(p, i, "put", out, t0, t1, 0.0, (r,))


def get(p: int, i: int, value: ValueId | None, t0: float, key: str = "k") -> Op:
    return Op(p, i, "get", "ok", t0, t0 + 0.01, 0.0, (KeyResult(key, "ok", read=value),))


A = ValueId(1, 1)  # put at 1..2
B = ValueId(1, 2)  # put at 3..4: newer than A


def run(*ops: Op) -> CheckResult:
    return check_monotonic.check(History(ops), CheckContext())


# --- histories that pass ------------------------------------------------------------------------


def test_reading_newer_values_over_time_passes() -> None:
    result = run(
        put(9, 1, 1, 2, version=1),
        put(1, 2, 3, 4, version=2),
        get(9, 2, ValueId(9, 1), 5),
        get(9, 3, None, 6),
        get(9, 4, B, 7),
    )
    assert result.ok, result.details
    assert result.counters["observations"] == 4  # two acknowledged puts, two reads


def test_concurrent_puts_may_be_read_in_either_order() -> None:
    c = ValueId(2, 1)
    ops = [put(1, 1, 1.0, 3.0), put(2, 1, 2.0, 4.0), get(9, 1, A, 5), get(9, 2, c, 6)]
    ops += [get(9, 3, A, 7), get(8, 1, c, 5), get(8, 2, A, 6)]
    result = run(*ops)
    assert result.ok, result.details


def test_a_put_of_unknown_fate_may_apply_late() -> None:
    # A's put timed out at 2.0 but its commit may be applied after B's.
    ops = [put(1, 1, 1.0, 2.0, out="unknown"), put(2, 1, 3.0, 4.0), get(9, 1, ValueId(2, 1), 5)]
    ops.append(get(9, 2, A, 6))
    result = run(*ops)
    assert result.ok, result.details


def test_different_keys_and_processes_are_independent() -> None:
    ops = [put(1, 1, 1, 2, key="x"), put(1, 2, 3, 4, key="y")]
    ops += [get(9, 1, ValueId(1, 2), 5, key="y"), get(9, 2, ValueId(1, 1), 6, key="x")]
    ops += [get(8, 1, B, 5), get(7, 1, A, 6)]  # B and A are of "x"/"y" only: unknown here
    result = run(*ops)
    assert result.ok, result.details


def test_get_or_compute_own_computed_value_is_not_an_observation() -> None:
    mine = ValueId(computed_writer(9), 5)
    goc = Op(9, 1, "get_or_compute", "ok", 5.0, 5.1, 0.0, (KeyResult("k", "ok", mine, mine),))
    result = run(put(1, 1, 1, 2), goc, get(9, 2, A, 6))
    assert result.ok, result.details


# --- histories that must fail ------------------------------------------------------------------


def test_reading_an_older_value_after_a_newer_one_fails() -> None:
    result = run(put(1, 1, 1, 2), put(1, 2, 3, 4), get(9, 1, B, 5), get(9, 2, A, 6))
    assert not result.ok
    assert result.counters["violations"] == 1
    assert "read 1:1" in result.details[0]
    assert "had shown 1:2" in result.details[0]


def test_a_miss_in_between_does_not_reset_what_was_seen() -> None:
    result = run(
        put(1, 1, 1, 2), put(1, 2, 3, 4), get(9, 1, B, 5), get(9, 2, None, 6), get(9, 3, A, 7)
    )
    assert not result.ok


def test_versions_order_concurrent_acknowledged_puts() -> None:
    # Concurrent in real time, but the index ordered A (version 9) after C (version 4).
    c = ValueId(2, 1)
    ops = [put(1, 1, 1.0, 3.0, version=9), put(2, 1, 2.0, 4.0, version=4)]
    ops += [get(9, 1, A, 5), get(9, 2, c, 6)]
    result = run(*ops)
    assert not result.ok
    assert "at version 4" in result.details[0]


def test_reading_older_than_an_own_acknowledged_put_fails() -> None:
    c = ValueId(2, 1)
    result = run(put(2, 1, 0.5, 0.9), put(9, 1, 1.0, 2.0, version=5), get(9, 2, c, 3.0))
    assert not result.ok


def test_batch_reads_count_per_key() -> None:
    rs = (KeyResult("k", "ok", read=B), KeyResult("x", "ok"))
    ops = [put(1, 1, 1, 2), put(1, 2, 3, 4), Op(9, 1, "batch_get", "ok", 5, 5.1, 0.0, rs)]
    result = run(*ops, get(9, 2, A, 6))
    assert not result.ok
