"""Data-plane transports, keyed by address scheme.

A store node advertises a data address such as ``tcp://10.0.0.7:7400``; the scheme picks the
transport:

* ``tcp`` (:mod:`kvpool.transports.tcp`) — frames over TCP: header and payload in one vectored
  write, payloads received straight into their destination, connections pooled per node, many
  requests pipelined per connection;
* ``shm`` (:mod:`kvpool.transports.shm`) — a client on the node's host maps the node's CPU
  arena and copies blocks in and out of it directly; the node hands out extents (leased for
  reads, reserved for puts) over a unix socket. Clients learn a node's ``shm://`` address from
  its HELLO answer on a TCP connection;
* ``inproc`` (:mod:`kvpool.transports.inproc`) — a socket pair inside one process (tests);
* ``rdma`` (:mod:`kvpool.transports.rdma`) — registered only when ``pyverbs`` imports and an
  RDMA device exists. Untested: no machine here has one.

Each transport opens a connection two ways: :meth:`Transport.open` on an event loop (the
:class:`~kvpool.transports.tcp.FrameConnection` the async client pipelines on) and
:meth:`Transport.open_blocking` in the calling thread (the
:class:`~kvpool.transports.blocking.BlockingConnection` the synchronous client's fast path uses).
"""

from __future__ import annotations

import functools
import socket
from typing import TYPE_CHECKING, Protocol

from kvpool.errors import TransportError

if TYPE_CHECKING:
    from kvpool.transports.blocking import BlockingConnection
    from kvpool.transports.tcp import FrameConnection


class Transport(Protocol):
    scheme: str

    async def open(self, address: str, timeout_s: float, token: bytes = b"") -> FrameConnection:
        """A connection on the running event loop (typed errors on failure); ``token``: the
        cluster token, proved once when the connection opens (:mod:`kvpool.transports.auth`)."""

    def open_blocking(
        self, address: str, timeout_s: float, token: bytes = b""
    ) -> BlockingConnection:
        """A connection for the calling thread (typed errors on failure)."""


_REGISTRY: dict[str, Transport] = {}
_LOADED = False


def register(transport: Transport) -> None:
    """Add (or replace) the transport for its scheme."""
    _REGISTRY[transport.scheme] = transport


def _load_builtins() -> None:
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from kvpool.transports import inproc, rdma, shm, tcp

    register(tcp.TcpTransport())
    register(inproc.InprocTransport())
    if shm.shm_supported():
        register(shm.ShmTransport())
    if rdma.rdma_available():
        register(rdma.RdmaTransport())


def schemes() -> tuple[str, ...]:
    """The schemes registered in this process."""
    _load_builtins()
    return tuple(sorted(_REGISTRY))


def scheme_of(address: str) -> str:
    """The scheme of a data address; raises TransportError for an unknown or missing one."""
    scheme, sep, _ = address.partition("://")
    if not sep:
        raise TransportError(f"data address without a scheme: {address!r}")
    _load_builtins()
    if scheme not in _REGISTRY:
        raise TransportError(
            f"unsupported transport {scheme!r} in {address!r} "
            f"(supported here: {', '.join(sorted(_REGISTRY))})"
        )
    return scheme


def transport_for(address: str) -> Transport:
    return _REGISTRY[scheme_of(address)]


async def open_connection(address: str, timeout_s: float, token: bytes = b"") -> FrameConnection:
    """A connection to ``address`` on the running loop, by its scheme (``token``: the cluster
    token, when the cluster has one)."""
    return await transport_for(address).open(address, timeout_s, token)


def open_blocking(address: str, timeout_s: float, token: bytes = b"") -> BlockingConnection:
    """A connection to ``address`` for the calling thread, by its scheme."""
    return transport_for(address).open_blocking(address, timeout_s, token)


@functools.cache
def host_id() -> str:
    """This machine's identity for same-host checks: the kernel's boot id (every container on
    the host shares it), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return boot or socket.gethostname()


SCHEMES: tuple[str, ...] = ("tcp", "shm", "inproc", "rdma")
"""Every scheme kvpool knows; :func:`schemes` says which are usable in this process."""
