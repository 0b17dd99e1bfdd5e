"""How the transports name a failed socket: one typed error per way a connect, a send or a
receive can fail, whichever connection (blocking or on the event loop) met it."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from kvpool.errors import DeadlineExceededError, KVPoolError, TransportError
from kvpool.transports.blocking import BlockingConnection
from kvpool.transports.calls import Call


@pytest.fixture
def pair() -> Iterator[tuple[BlockingConnection, socket.socket]]:
    ours, theirs = socket.socketpair()
    conn = BlockingConnection(ours, "tcp://node:1", timeout_s=1.0)
    yield conn, theirs
    conn.close()
    theirs.close()


@pytest.mark.parametrize(
    ("error", "doing", "kind", "text"),
    [
        (None, "receive", TransportError, "tcp://node:1: connection closed by the node"),
        (TimeoutError(), "receive", DeadlineExceededError, "tcp://node:1: no answer in time"),
        (BlockingIOError(), "receive", DeadlineExceededError, "tcp://node:1: no answer in time"),
        (TimeoutError(), "send", DeadlineExceededError, "tcp://node:1: send timed out"),
        (BlockingIOError(), "send", DeadlineExceededError, "tcp://node:1: send timed out"),
        (OSError(104, "reset"), "receive", TransportError, "receive failed: [Errno 104] reset"),
        (OSError(32, "pipe"), "send", TransportError, "tcp://node:1: send failed: [Errno 32] pipe"),
    ],
)
def test_a_failed_socket_call_breaks_the_connection_with_its_typed_error(
    pair: tuple[BlockingConnection, socket.socket],
    error: OSError | None,
    doing: str,
    kind: type[KVPoolError],
    text: str,
) -> None:
    conn, _ = pair
    made = conn._broken_by(error, doing)
    assert type(made) is kind
    assert text in str(made)
    assert conn.broken


def test_a_node_that_closes_mid_answer_is_a_transport_error(
    pair: tuple[BlockingConnection, socket.socket],
) -> None:
    conn, theirs = pair
    call = Call(1, b"k")
    conn.send([call], time.monotonic() + 1.0)
    theirs.recv(1 << 16)  # read, so that closing is an end of stream, not a reset
    theirs.close()
    with pytest.raises(TransportError, match="connection closed by the node"):
        conn.receive([call], time.monotonic() + 1.0)
    assert conn.broken


def test_a_silent_node_is_the_deadline_passing(
    pair: tuple[BlockingConnection, socket.socket],
) -> None:
    conn, _ = pair
    call = Call(1, b"k")
    conn.send([call], time.monotonic() + 0.05)  # the kernel's receive time-out: 50 ms
    with pytest.raises(DeadlineExceededError, match="no answer in time"):
        conn.receive([call], time.monotonic() + 0.05)
    assert conn.broken
