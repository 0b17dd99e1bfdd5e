"""How the transports name a failed socket: one typed error per way a connect, a send or a
receive can fail, whichever connection (blocking or on the event loop) met it."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from kvpool.errors import DeadlineExceededError, KVPoolError, TransportError
from kvpool.proto.wire import HEADER_SIZE
from kvpool.transports import auth
from kvpool.transports.blocking import BlockingConnection, connect_tcp_blocking, connecting
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


@pytest.mark.parametrize(
    ("raised", "kind", "text"),
    [
        (TimeoutError(), DeadlineExceededError, "tcp://node:1: connect timed out"),
        # a time-out of the token's proof inside the connect is the connect's time-out
        (DeadlineExceededError("slow token"), DeadlineExceededError, "connect timed out"),
        (ConnectionRefusedError(111, "refused"), TransportError, "connect failed: [Errno 111]"),
    ],
)
def test_a_failed_connect_is_named_and_its_socket_closed(
    raised: Exception, kind: type[KVPoolError], text: str
) -> None:
    sock = socket.socket()
    with pytest.raises(kind) as failed, connecting("tcp://node:1", sock):
        raise raised
    assert text in str(failed.value)
    assert failed.value.__suppress_context__
    assert sock.fileno() == -1  # closed


def test_a_typed_error_or_a_cancellation_goes_through_as_it_is() -> None:
    for raised in (TransportError("not a kvpool shared-memory peer"), asyncio.CancelledError()):
        sock = socket.socket()
        with pytest.raises(type(raised)) as failed, connecting("shm://x", sock):
            raise raised
        assert failed.value is raised
        assert sock.fileno() == -1  # closed


def test_a_connect_that_succeeds_keeps_its_socket() -> None:
    sock = socket.socket()
    with connecting("tcp://node:1", sock):
        pass
    assert sock.fileno() != -1
    sock.close()


def test_an_awaited_connect_out_of_time_is_a_deadline() -> None:
    async def connect() -> None:
        with connecting("tcp://node:1"):
            async with asyncio.timeout(0.01):
                await asyncio.sleep(1)

    with pytest.raises(DeadlineExceededError, match="connect timed out"):
        asyncio.run(connect())


def test_a_port_nobody_listens_on_is_a_transport_error() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(TransportError, match="connect failed"):
        connect_tcp_blocking("127.0.0.1", port, address=f"tcp://127.0.0.1:{port}", timeout_s=1.0)


def test_a_peer_gone_while_the_token_is_proved_reads_the_same_either_way() -> None:
    async def on_the_loop(sock: socket.socket) -> None:
        sock.setblocking(False)
        await auth._recv_exact(sock, HEADER_SIZE, "tcp://node:1")

    for read in (
        lambda sock: auth._recv_exact_blocking(
            sock, HEADER_SIZE, time.monotonic() + 1.0, "tcp://node:1"
        ),
        lambda sock: asyncio.run(on_the_loop(sock)),
    ):
        ours, theirs = socket.socketpair()
        theirs.close()
        with pytest.raises(TransportError, match="tcp://node:1: connection closed during auth"):
            read(ours)
        ours.close()
    assert str(auth._lost("a", OSError(104, "reset"))) == (
        "a: connection lost during authentication: [Errno 104] reset"
    )


def test_a_blocking_connection_speaks_frames_once_the_token_is_proved() -> None:
    ours, theirs = socket.socketpair()
    conn = auth.blocking_connection(ours, b"", "inproc://x", 1.0)  # no token: nothing to prove
    assert isinstance(conn, BlockingConnection)
    assert conn.address == "inproc://x"
    conn.close()
    theirs.close()

    ours, theirs = socket.socketpair()
    theirs.close()  # the peer leaves before answering the token
    with pytest.raises(TransportError, match="inproc://x"):
        auth.blocking_connection(ours, b"secret", "inproc://x", 1.0)
    assert ours.fileno() == -1  # closed
