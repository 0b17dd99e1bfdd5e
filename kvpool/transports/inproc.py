"""The ``inproc://name`` transport: a socket pair inside one process, for tests.

A server registers a name and an ``adopt`` callback (run on the server's event loop with its end
of a new socket pair); a client's connect makes the pair, hands one end to the server and speaks
frames on the other, exactly as over TCP — the same code paths, no port.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable

from kvpool.errors import TransportError
from kvpool.transports.auth import authenticate, blocking_connection
from kvpool.transports.blocking import BlockingConnection
from kvpool.transports.tcp import FrameConnection

Adopt = Callable[[socket.socket], None]

_SERVERS: dict[str, tuple[Adopt, asyncio.AbstractEventLoop]] = {}
_LOCK = threading.Lock()


def register_inproc(name: str, adopt: Adopt) -> None:
    """Serve ``inproc://name`` on the running loop: ``adopt`` gets each new connection."""
    with _LOCK:
        if name in _SERVERS:
            raise TransportError(f"inproc://{name} is already served")
        _SERVERS[name] = (adopt, asyncio.get_running_loop())


def unregister_inproc(name: str) -> None:
    with _LOCK:
        _SERVERS.pop(name, None)


def _connect(address: str) -> socket.socket:
    name = address.removeprefix("inproc://")
    with _LOCK:
        server = _SERVERS.get(name)
    if server is None:
        raise TransportError(f"{address}: nobody serves this name in this process")
    adopt, loop = server
    ours, theirs = socket.socketpair()
    try:
        loop.call_soon_threadsafe(adopt, theirs)
    except RuntimeError:  # the server's loop is closed
        ours.close()
        theirs.close()
        raise TransportError(f"{address}: the server is gone") from None
    return ours


class InprocTransport:
    scheme = "inproc"

    async def open(self, address: str, timeout_s: float, token: bytes = b"") -> FrameConnection:
        conn = FrameConnection(address)
        sock = _connect(address)
        try:
            sock.setblocking(False)
            await authenticate(sock, token, address, timeout_s)
            conn.attach(sock)
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise
        return conn

    def open_blocking(
        self, address: str, timeout_s: float, token: bytes = b""
    ) -> BlockingConnection:
        return blocking_connection(_connect(address), token, address, timeout_s)
