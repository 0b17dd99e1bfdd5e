"""A strict client's own deadline error reaches the caller as it is (a DeadlineExceededError is
also a TimeoutError, which the synchronous front end once mistook for its loop thread hanging)."""

from __future__ import annotations

import socket
import time

import pytest

from kvpool.client.sync import Client
from kvpool.errors import DeadlineExceededError, UnavailableError


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there


def test_a_strict_deadline_error_keeps_its_message() -> None:
    with Client([_dead_address()], timeout_s=0.3, strict=True) as kv:
        started = time.monotonic()
        with pytest.raises((DeadlineExceededError, UnavailableError)) as caught:
            kv.prefix_match(["a", "b"])
        assert time.monotonic() - started < 0.3 + 1.0  # not the loop-thread grace (5 s)
        assert "event loop" not in str(caught.value)
        assert "Master.Lookup" in str(caught.value)  # prefix_match asks a Lookup
