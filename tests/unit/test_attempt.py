"""client.state.Attempt: the failure policy both drivers carry every call out under (no socket)."""

from __future__ import annotations

import asyncio

import pytest

from kvpool.client.state import Attempt
from kvpool.errors import (
    BlockMissError,
    DeadlineExceededError,
    InvalidArgumentError,
    KVPoolError,
    UnavailableError,
)


def typed(op: str, error: Exception) -> KVPoolError:
    if isinstance(error, TimeoutError):
        return DeadlineExceededError(f"{op}: timed out")
    return UnavailableError(f"{op}: {error}")


def attempt(strict: bool, failures: list[KVPoolError]) -> Attempt:
    return Attempt("get", "neutral", strict, typed, lambda e, _span: failures.append(e))


def test_a_cache_failure_leaves_the_neutral_answer_and_is_counted() -> None:
    failures: list[KVPoolError] = []
    with attempt(False, failures) as a:
        raise BlockMissError("gone", reason="absent")
    assert a.value == "neutral"
    assert [type(e) for e in failures] == [BlockMissError]


def test_any_other_error_is_typed_first_then_follows_the_policy() -> None:
    failures: list[KVPoolError] = []
    with attempt(False, failures) as a:
        raise ConnectionResetError("peer reset")
    assert a.value == "neutral"
    assert [str(e) for e in failures] == ["get: peer reset"]

    failures.clear()
    with (
        pytest.raises(DeadlineExceededError, match="get: timed out") as raised,
        attempt(True, failures),
    ):
        raise TimeoutError
    assert isinstance(raised.value.__cause__, TimeoutError)  # the original is kept
    assert failures == [raised.value]


def test_strict_failures_and_caller_errors_propagate_as_they_are() -> None:
    failures: list[KVPoolError] = []
    with pytest.raises(UnavailableError, match="no leader"), attempt(True, failures):
        raise UnavailableError("no leader")
    with pytest.raises(InvalidArgumentError), attempt(False, failures):
        raise InvalidArgumentError("bad key")
    assert [str(e) for e in failures] == ["no leader"]  # a caller's error is not the cache's


def test_without_typed_other_errors_and_cancellation_pass_untouched() -> None:
    with pytest.raises(ConnectionResetError), Attempt("client.lookup", None, True):
        raise ConnectionResetError
    # Not an Exception: never made a failure.
    with pytest.raises(asyncio.CancelledError), attempt(False, []):
        raise asyncio.CancelledError


def test_a_success_keeps_the_value_set_inside() -> None:
    with attempt(False, []) as a:
        a.value = b"bytes"
    assert a.value == b"bytes"
