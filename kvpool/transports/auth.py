"""The cluster token on data-plane connections: one ``AUTH`` frame when a connection opens.

A client with a token sends ``AUTH`` (payload: the token) as the first frame of every connection
and waits for the answer before anything else: OK, or UNAUTHORIZED with a message (the peer then
closes). A server with a token runs :func:`admit` on each accepted socket before it speaks frames
on it: the first frame must be a matching ``AUTH``. The check costs one round trip per
connection; frames after it are not checked again (the connection is the proof). A server
without a token answers ``AUTH`` with OK from its ordinary frame handler.

Everything here works on the raw socket, before a :class:`~kvpool.transports.stream.FrameStream`
or :class:`~kvpool.transports.blocking.BlockingConnection` takes it over, and reads exactly the
bytes of one frame, so nothing that follows is consumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from typing import Any

from kvpool.errors import (
    DeadlineExceededError,
    ProtocolVersionError,
    TransportError,
    UnauthenticatedError,
)
from kvpool.logs import OncePer
from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.wire import (
    HEADER_SIZE,
    MAX_ERROR_MESSAGE_BYTES,
    FrameError,
    Header,
    Op,
    Status,
    unpack_header,
    version_mismatch_message,
)
from kvpool.security import MAX_TOKEN_BYTES, tokens_equal
from kvpool.transports.blocking import BlockingConnection

REFUSED_MISSING = (
    "this kvpool node or master requires the cluster token on every connection; configure "
    "cluster_token_file (or KVPOOL_CLUSTER_TOKEN) on the client"
)
REFUSED_WRONG = "wrong cluster token: the client's cluster_token differs from this cluster's"
DRAIN_S = 0.2
"""How long a refusing server keeps reading what the refused peer already sent, so that
closing does not reset the connection before the peer has read why."""


def auth_frame(token: bytes) -> bytes:
    return Header(op=Op.AUTH, payload_len=len(token)).pack() + token


def check_answer(header: Header, message: bytes, address: str) -> None:
    """Raise the typed error an answer to AUTH stands for (nothing when it is OK)."""
    text = message.decode("utf-8", "replace")
    if header.status == Status.OK and header.op == Op.AUTH:
        return
    if header.status == Status.UNAUTHORIZED:
        raise UnauthenticatedError(f"{address}: {text or 'refused'}")
    if header.status == Status.VERSION_MISMATCH or header.protocol_version != PROTOCOL_VERSION:
        theirs = header.protocol_version
        raise ProtocolVersionError(
            f"{address}: {text or version_mismatch_message(PROTOCOL_VERSION, theirs)}"
        )
    raise TransportError(
        f"{address}: the peer answered the cluster token with status {header.status}"
        + (f": {text}" if text else "")
        + " (does it run this kvpool release?)"
    )


def _parse(raw: bytes | bytearray, address: str) -> Header:
    try:
        return unpack_header(raw)
    except FrameError as e:
        raise TransportError(f"{address}: {e}") from None


def _lost(address: str, error: OSError | None) -> TransportError:
    """The error for a socket that failed with ``error`` (None: the peer closed it) while the
    token was being proved."""
    if error is None:
        return TransportError(f"{address}: connection closed during authentication")
    return TransportError(f"{address}: connection lost during authentication: {error}")


# --- client, in the calling thread ------------------------------------------------------------


def _recv_exact_blocking(sock: socket.socket, size: int, deadline: float, address: str) -> bytes:
    out = bytearray()
    while len(out) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DeadlineExceededError(f"{address}: no answer to the cluster token in time")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(size - len(out))
        except TimeoutError:
            raise DeadlineExceededError(
                f"{address}: no answer to the cluster token in time"
            ) from None
        except OSError as e:
            raise _lost(address, e) from None
        if not chunk:
            raise _lost(address, None)
        out += chunk
    return bytes(out)


def read_answer_blocking(
    sock: socket.socket, deadline: float, address: str, head: bytes = b""
) -> None:
    """Read the answer to AUTH from a blocking socket (``head``: its first bytes, already
    read); raise its typed error."""
    rest = HEADER_SIZE - len(head)
    raw = head + (_recv_exact_blocking(sock, rest, deadline, address) if rest > 0 else b"")
    header = _parse(raw, address)
    size = header.key_len + min(header.payload_len, MAX_ERROR_MESSAGE_BYTES)
    body = _recv_exact_blocking(sock, size, deadline, address) if size else b""
    check_answer(header, body[header.key_len :], address)


def authenticate_blocking(
    sock: socket.socket, token: bytes, address: str, timeout_s: float
) -> None:
    """Prove ``token`` on a fresh blocking socket (nothing when ``token`` is empty)."""
    if not token:
        return
    deadline = time.monotonic() + max(0.001, timeout_s)
    previous = sock.gettimeout()
    try:
        sock.settimeout(max(0.001, timeout_s))
        try:
            sock.sendall(auth_frame(token))
        except OSError as e:
            raise TransportError(f"{address}: sending the cluster token failed: {e}") from None
        read_answer_blocking(sock, deadline, address)
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(previous)


def blocking_connection(
    sock: socket.socket, token: bytes, address: str, timeout_s: float
) -> BlockingConnection:
    """Frames over the fresh connected blocking socket ``sock``, once ``token`` is proved on it
    (``sock`` is closed when that fails)."""
    try:
        authenticate_blocking(sock, token, address, timeout_s)
    except BaseException:
        sock.close()
        raise
    return BlockingConnection(sock, address, timeout_s=timeout_s)


# --- client, on the event loop ----------------------------------------------------------------


async def _recv_exact(sock: socket.socket, size: int, address: str) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    while len(out) < size:
        try:
            chunk = await loop.sock_recv(sock, size - len(out))
        except OSError as e:
            raise _lost(address, e) from None
        if not chunk:
            raise _lost(address, None)
        out += chunk
    return bytes(out)


async def read_answer(sock: socket.socket, address: str, head: bytes = b"") -> None:
    """Read the answer to AUTH from a non-blocking socket (``head``: its first bytes, already
    read); raise its typed error."""
    rest = HEADER_SIZE - len(head)
    raw = head + (await _recv_exact(sock, rest, address) if rest > 0 else b"")
    header = _parse(raw, address)
    size = header.key_len + min(header.payload_len, MAX_ERROR_MESSAGE_BYTES)
    body = await _recv_exact(sock, size, address) if size else b""
    check_answer(header, body[header.key_len :], address)


async def authenticate(sock: socket.socket, token: bytes, address: str, timeout_s: float) -> None:
    """Prove ``token`` on a fresh non-blocking socket (nothing when ``token`` is empty)."""
    if not token:
        return
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(max(0.001, timeout_s)):
            try:
                await loop.sock_sendall(sock, auth_frame(token))
            except OSError as e:
                raise TransportError(f"{address}: sending the cluster token failed: {e}") from None
            await read_answer(sock, address)
    except TimeoutError:
        raise DeadlineExceededError(f"{address}: no answer to the cluster token in time") from None


# --- server -----------------------------------------------------------------------------------


async def admit(sock: socket.socket, token: bytes, timeout_s: float) -> str | None:
    """Check the first frame of an accepted socket (non-blocking) against ``token``.

    Returns None once the peer is admitted (OK has been sent; the socket is positioned at the
    next frame), else why it was refused (UNAUTHORIZED has been sent and the socket closed).
    """
    loop = asyncio.get_running_loop()
    header: Header | None = None
    try:
        async with asyncio.timeout(timeout_s):
            raw = await _recv_exact(sock, HEADER_SIZE, "peer")
            try:
                header = unpack_header(raw)
            except FrameError as e:
                await _refuse(sock, None, Status.BAD_REQUEST, str(e))
                return f"bad frame: {e}"
            if header.protocol_version != PROTOCOL_VERSION:
                message = version_mismatch_message(PROTOCOL_VERSION, header.protocol_version)
                await _refuse(sock, header, Status.VERSION_MISMATCH, message)
                return "protocol version mismatch"
            if header.op != Op.AUTH:
                await _refuse(sock, header, Status.UNAUTHORIZED, REFUSED_MISSING)
                return "missing cluster token"
            if header.payload_len > MAX_TOKEN_BYTES:
                await _refuse(sock, header, Status.UNAUTHORIZED, REFUSED_WRONG)
                return "wrong cluster token"
            body = await _recv_exact(sock, header.key_len + header.payload_len, "peer")
            if not tokens_equal(token, body[header.key_len :]):
                await _refuse(sock, header, Status.UNAUTHORIZED, REFUSED_WRONG)
                return "wrong cluster token"
            await loop.sock_sendall(sock, Header(op=Op.AUTH, request_id=header.request_id).pack())
            return None
    except TimeoutError:
        if header is None:  # silent: it may wait for us to speak first (shared memory)
            await _refuse(sock, None, Status.UNAUTHORIZED, REFUSED_MISSING)
        with contextlib.suppress(OSError):
            sock.close()
        return "no cluster token in time"
    except (TransportError, OSError) as e:
        with contextlib.suppress(OSError):
            sock.close()
        return f"connection lost before the cluster token ({type(e).__name__})"


async def _refuse(
    sock: socket.socket, request: Header | None, status: Status, message: str
) -> None:
    """Answer ``status`` with ``message``, stop writing, read what the peer already sent for a
    moment (a close with unread bytes would reset the connection, dropping the answer), close."""
    loop = asyncio.get_running_loop()
    body = message.encode("utf-8")[:MAX_ERROR_MESSAGE_BYTES]
    answer = Header(
        op=request.op if request else 0,
        status=status,
        request_id=request.request_id if request else 0,
        payload_len=len(body),
    )
    try:
        await loop.sock_sendall(sock, answer.pack() + body)
        sock.shutdown(socket.SHUT_WR)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DRAIN_S):
                while await loop.sock_recv(sock, 1 << 16):
                    pass
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sock.close()


AUTH_TIMEOUT_S = 5.0
"""How long an accepted connection has to prove the token before it is closed."""


class Gate:
    """Hands accepted sockets to ``adopt``: directly without a token; with one, only once
    :func:`admit` has accepted the peer (each check runs in its own task on the loop)."""

    def __init__(
        self,
        token: bytes,
        adopt: Callable[[socket.socket], None],
        *,
        log: Any = None,
        timeout_s: float = AUTH_TIMEOUT_S,
        max_connections: int = 0,
        live: Callable[[], int] | None = None,
        limit_name: str = "max_connections",
    ) -> None:
        """``max_connections`` (0: no bound): with ``live()`` connections open, and those still
        proving their token, a new one is closed at once (logged naming the setting,
        ``limit_name``)."""
        self.token = token
        self._adopt = adopt
        self._log = log
        self._once = OncePer(log) if log is not None else None
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._max_connections = max_connections
        self._live = live
        self._limit_name = limit_name
        self.refused = 0
        self.over_limit = 0

    def __call__(self, sock: socket.socket) -> None:
        live = self._live
        if (
            self._max_connections
            and live is not None
            and live() + len(self._tasks) >= self._max_connections
        ):
            self.over_limit += 1
            peer = peer_of(sock)
            with contextlib.suppress(OSError):
                sock.close()
            if self._once is not None:
                self._once.warning(
                    "connection_refused",
                    peer.rsplit(":", 1)[0],
                    peer=peer,
                    reason=f"more than {self._limit_name} ({self._max_connections}) open",
                )
            return
        if not self.token:
            self._adopt(sock)
            return
        sock.setblocking(False)
        task = asyncio.get_running_loop().create_task(self._admit(sock))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _admit(self, sock: socket.socket) -> None:
        peer = peer_of(sock)
        try:
            reason = await admit(sock, self.token, self._timeout_s)
        except asyncio.CancelledError:  # the server is closing
            with contextlib.suppress(OSError):
                sock.close()
            raise
        if reason is not None:
            self.refused += 1
            if self._once is not None:  # once per peer host and period, not per connection
                self._once.warning(
                    "connection_refused", peer.rsplit(":", 1)[0], peer=peer, reason=reason
                )
            return
        try:
            self._adopt(sock)
        except Exception as e:
            with contextlib.suppress(OSError):
                sock.close()
            if self._once is not None:
                self._once.warning("adopt_failed", peer.rsplit(":", 1)[0], peer=peer, error=repr(e))

    def close(self) -> None:
        """Drop the connections still proving their token."""
        for task in list(self._tasks):
            task.cancel()


def peer_of(sock: socket.socket) -> str:
    """The peer's ``host:port`` for logs ("local" for a Unix socket, "?" once it is gone)."""
    try:
        addr = sock.getpeername()
    except OSError:
        return "?"
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return "local"
