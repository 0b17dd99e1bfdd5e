"""check_wrong on hand-made histories: every read is None or one put's value of that key, put
before the read returned."""

from __future__ import annotations

from kvpool.chaos import check_wrong
from kvpool.chaos.history import CheckContext, CheckResult, History, KeyResult, Op, Outcome, Receipt
from kvpool.chaos.values import Corruption, ValueId, computed_writer, decode_value, make_value


def put(p: int, i: int, key: str, v: ValueId, t0: float, t1: float, out: Outcome = "ok") -> Op:
    receipt = Receipt(i, i, i, ("node-1",), (1,)) if out == "ok" else None
    r = KeyResult(key, out, written=v, receipt=receipt)
    return Op(p, i, "put", out, t0, t1, 0.0, (r,))


def read(key: str, data: bytes) -> KeyResult:
    decoded = decode_value(key, data)
    if isinstance(decoded, Corruption):
        return KeyResult(key, "ok", corruption=decoded)
    return KeyResult(key, "ok", read=decoded)


def get(p: int, i: int, key: str, data: bytes | None, t0: float, t1: float) -> Op:
    r = read(key, data) if data is not None else KeyResult(key, "ok", miss="absent")
    return Op(p, i, "get", "ok", t0, t1, 0.0, (r,))


def value(key: str, writer: int, seq: int, size: int = 200) -> bytes:
    return make_value(key, writer, seq, size)


A = ValueId(1, 1)
B = ValueId(2, 1)


def run(*ops: Op, max_details: int = 20) -> CheckResult:
    return check_wrong.check(History(ops), CheckContext(max_details=max_details))


# --- histories that pass ------------------------------------------------------------------------


def test_reads_of_completed_and_concurrent_puts_and_misses_pass() -> None:
    result = run(
        put(1, 1, "k", A, 1.0, 2.0),
        get(2, 1, "k", value("k", 1, 1), 3.0, 3.1),  # after the put
        put(1, 2, "k", B, 4.0, 6.0),
        get(2, 2, "k", value("k", 2, 1), 5.0, 5.5),  # concurrent with the put of B
        get(2, 3, "k", value("k", 1, 1), 5.6, 5.7),  # the old value while B's put runs
        get(2, 4, "other", None, 7.0, 7.1),
    )
    assert result.ok, result.details
    assert result.counters["hits"] == 3
    assert result.counters["misses"] == 1
    assert result.counters["wrong"] == 0


def test_a_read_of_a_put_of_unknown_fate_passes() -> None:
    result = run(put(1, 1, "k", A, 1.0, 3.0, "unknown"), get(2, 1, "k", value("k", 1, 1), 4, 5))
    assert result.ok, result.details


def test_a_read_that_completes_just_as_the_put_is_invoked_passes() -> None:
    result = run(put(1, 1, "k", A, 2.0, 3.0), get(2, 1, "k", value("k", 1, 1), 1.0, 2.0))
    assert result.ok, result.details


def test_get_or_compute_returning_its_own_computed_value_passes() -> None:
    mine = ValueId(computed_writer(1), 1)
    r = KeyResult("k", "ok", written=mine, read=mine)
    result = run(Op(1, 1, "get_or_compute", "ok", 1.0, 1.2, 0.0, (r,)))
    assert result.ok, result.details
    assert result.counters["computed"] == 1


def test_a_value_computed_by_another_process_and_stored_passes() -> None:
    theirs = ValueId(computed_writer(2), 9)
    stored = KeyResult("k", "ok", written=theirs, read=theirs)
    seen = read("k", make_value("k", theirs.writer, theirs.seq, 100))
    result = run(
        Op(2, 9, "get_or_compute", "ok", 1.0, 1.2, 0.0, (stored,)),
        Op(1, 1, "get", "ok", 2.0, 2.1, 0.0, (seen,)),
    )
    assert result.ok, result.details


def test_failed_reads_are_not_judged() -> None:
    r = KeyResult("k", "fail")
    result = run(Op(1, 1, "get", "fail", 1.0, 3.0, 0.0, (r,), "DeadlineExceededError"))
    assert result.ok
    assert result.counters["reads"] == 0


# --- histories that must fail ------------------------------------------------------------------


def test_another_keys_bytes_fail_and_name_that_key() -> None:
    result = run(
        put(1, 1, "other", A, 1.0, 2.0),
        Op(2, 1, "get", "ok", 3.0, 3.1, 0.0, (read("k", value("other", 1, 1)),)),
    )
    assert not result.ok
    assert result.counters["corrupt"] == 1
    assert "wrong_key" in result.details[0]
    assert "'other'" in result.details[0]


def test_a_mix_of_two_puts_fails() -> None:
    torn = value("k", 1, 1, 4096)[:2048] + value("k", 2, 1, 4096)[2048:]
    result = run(
        put(1, 1, "k", A, 1.0, 2.0),
        put(2, 1, "k", B, 1.0, 2.0),
        Op(3, 1, "get", "ok", 3.0, 3.1, 0.0, (read("k", torn),)),
    )
    assert not result.ok
    assert "bad_bytes" in result.details[0]


def test_a_flipped_byte_and_a_short_read_fail() -> None:
    flipped = bytearray(value("k", 1, 1, 512))
    flipped[300] ^= 4
    result = run(
        put(1, 1, "k", A, 1.0, 2.0),
        get(2, 1, "k", bytes(flipped), 3.0, 3.1),
        get(2, 2, "k", value("k", 1, 1, 512)[:511], 3.2, 3.3),
    )
    assert not result.ok
    assert result.counters["wrong"] == 2
    assert "bad_bytes" in result.details[0]
    assert "wrong_size" in result.details[1]


def test_a_value_no_operation_wrote_fails() -> None:
    result = run(put(1, 1, "k", A, 1.0, 2.0), get(2, 1, "k", value("k", 7, 7), 3.0, 3.1))
    assert not result.ok
    assert "no operation of the history wrote" in result.details[0]


def test_a_value_of_the_same_writer_under_another_key_fails() -> None:
    # ValueId (1, 1) exists, but it was written under "x"; "k" never had it.
    result = run(put(1, 1, "x", A, 1.0, 2.0), get(2, 1, "k", value("k", 1, 1), 3.0, 3.1))
    assert not result.ok


def test_a_value_only_a_failed_put_wrote_fails() -> None:
    result = run(put(1, 1, "k", A, 1.0, 1.1, "fail"), get(2, 1, "k", value("k", 1, 1), 3, 3.1))
    assert not result.ok
    assert "failed operations" in result.details[0]


def test_a_read_from_the_future_fails() -> None:
    result = run(get(2, 1, "k", value("k", 1, 1), 1.0, 2.0), put(1, 1, "k", A, 2.5, 3.0))
    assert not result.ok
    assert "before it was written" in result.details[0]


def test_one_bad_key_of_a_batch_get_fails_the_check() -> None:
    results = (
        read("a", value("a", 1, 1)),
        KeyResult("b", "ok"),
        read("c", value("a", 1, 1)),
    )
    result = run(put(1, 1, "a", A, 1.0, 2.0), Op(2, 1, "batch_get", "ok", 3, 3.1, 0.0, results))
    assert not result.ok
    assert result.counters["reads"] == 3
    assert result.counters["wrong"] == 1


def test_get_or_compute_returning_a_value_nobody_wrote_fails() -> None:
    mine = ValueId(computed_writer(1), 1)
    r = KeyResult("k", "ok", written=mine, read=ValueId(5, 5))
    result = run(Op(1, 1, "get_or_compute", "ok", 1.0, 1.2, 0.0, (r,)))
    assert not result.ok


def test_details_are_capped_and_everything_is_counted() -> None:
    ops = [get(1, i, "k", value("k", 9, i), float(i), i + 0.5) for i in range(1, 11)]
    result = run(*ops, max_details=3)
    assert not result.ok
    assert result.counters["wrong"] == 10
    assert len(result.details) == 4
    assert result.details[-1] == "... and 7 more"
