"""How to reach a node: TCP, or its shared memory when it is on this host.

A client's first connection to a node's ``tcp://`` address asks HELLO; the answer names what the
node offers (MGET, a ``shm://`` address) and how it sees the connection. Shared memory is used
only when the node runs on this host (same kernel boot id), the TCP connection is direct — the
node's view of its two ends is exactly ours, so no proxy or NAT sits between (a proxy in front of
a node is there to be obeyed: a slow or cut link must stay slow or cut) — and the client's
``transport`` setting allows it: ``auto`` (shared memory where possible), ``shm`` (shared memory
or nothing: a read or put that cannot use it fails) or ``tcp``.

Pure: the shells (event loop, blocking) open connections and feed answers in. What each address
offered is remembered per client (thread-safe), so later connections skip the HELLO. How one
connection is made — HELLO or the offer remembered, shared memory or TCP, falling back or asking
again when the shared memory cannot be reached — is :func:`open_flow`, written once: it says
which connection to open next (:class:`Dial`) and takes what opening it gave, and each shell
carries the dials out with its own I/O.
"""

from __future__ import annotations

import dataclasses
import json
import select
import socket
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvpool.client.plans import NodeRead, ReadItem, read_listed
from kvpool.errors import ConfigError, DeadlineExceededError, KVPoolError, TransportError
from kvpool.proto.wire import Op, Status
from kvpool.transports import host_id, schemes
from kvpool.transports.calls import Call
from kvpool.transports.shm import Arena

TRANSPORTS = ("auto", "tcp", "shm")


def check_transport(transport: str) -> str:
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport: expected one of {', '.join(TRANSPORTS)}, got {transport!r}")
    return transport


@dataclass(frozen=True, slots=True)
class NodeOffer:
    """What a node's HELLO answer offers this client."""

    mget: bool = False
    trace: bool = False  # frames may carry a trace context (wire.EXT_TRACED)
    direct: bool = False  # reads a key by its content: write id 0 (BlockStore.resolve)
    shm_address: str = ""  # shared memory this client may use ("": none)
    why_not_shm: str = "the node offers no shared memory"


NO_OFFER = NodeOffer()


def hello_call() -> Call:
    return Call(Op.HELLO)


def read_hello(call: Call, local: str, peer: str) -> NodeOffer:
    """The offer in a HELLO answer on a connection whose ends are ``local`` (ours) and
    ``peer`` (the node's), as this side sees them. A node that does not know HELLO offers
    nothing (plain GETs, TCP)."""
    if call.error is not None or call.status != Status.OK or call.data is None:
        return NO_OFFER
    try:
        info = json.loads(bytes(call.data))
        features = set(info.get("features", ()))
    except (ValueError, TypeError, AttributeError):
        return NO_OFFER
    offer = NodeOffer(
        mget="mget" in features, trace="trace" in features, direct="direct" in features
    )
    shm = str(info.get("shm", "")) if "shm" in features else ""
    if not shm:
        return offer
    if "shm" not in schemes():
        return dataclasses.replace(offer, why_not_shm="this platform cannot map shared memory")
    if info.get("host") != host_id():
        return dataclasses.replace(offer, why_not_shm="the node runs on another host")
    if info.get("peer") != local or info.get("local") != peer:
        return dataclasses.replace(
            offer,
            why_not_shm=f"the connection is not direct (we see {local} -> {peer}; the node "
            f"sees {info.get('peer')} -> {info.get('local')}: a proxy or NAT between)",
        )
    return dataclasses.replace(offer, shm_address=shm, why_not_shm="")


def offered_features(offer: NodeOffer, *extra: str) -> frozenset[str]:
    """The features a connection to a node with ``offer`` has (plus ``extra``)."""
    named = (("mget", offer.mget), ("trace", offer.trace), ("direct", offer.direct))
    return frozenset([*extra, *(name for name, has in named if has)])


class Links:
    """Per address: what the node offered (None until asked), and the transport policy."""

    def __init__(self, transport: str) -> None:
        self.transport = check_transport(transport)
        self._offers: dict[str, NodeOffer] = {}
        self._lock = threading.Lock()

    def offer(self, address: str) -> NodeOffer | None:
        return self._offers.get(address)

    def learn(self, address: str, offer: NodeOffer) -> None:
        with self._lock:
            self._offers[address] = offer

    def forget(self, address: str) -> None:
        """The shared memory named for ``address`` could not be reached: ask again."""
        with self._lock:
            self._offers.pop(address, None)

    def shm_failed(
        self, address: str, offer: NodeOffer, error: Exception, *, remembered: bool
    ) -> NodeOffer | None:
        """Opening ``address``'s shared memory failed with ``error``: the offer to go on with
        over TCP, or None when the caller must ask the node again (``remembered``: the offer was
        remembered from earlier, the node may have restarted); raises ``error`` when going on
        cannot help — a time-out (the node is slow or paused: asking again or falling back to
        TCP would spend the caller's deadline twice) or a client that insists on shm."""
        if isinstance(error, DeadlineExceededError):
            raise error
        if remembered:
            self.forget(address)
            return None
        if self.transport == "shm":
            raise error
        return self.unreachable(address, offer, error)  # another namespace: TCP it is

    def unreachable(self, address: str, offer: NodeOffer, error: Exception) -> NodeOffer:
        """A fresh offer's shared memory could not be reached (another network namespace,
        say: abstract unix sockets belong to one): TCP from now on for ``address``."""
        fallback = NodeOffer(
            mget=offer.mget, trace=offer.trace, why_not_shm=f"shared memory unreachable: {error}"
        )
        self.learn(address, fallback)
        return fallback

    def is_local(self, address: str) -> bool:
        """Reads from ``address`` go through shared memory (the node is on this host and
        offered it): such a replica is read first."""
        offer = self._offers.get(address)
        return offer is not None and bool(offer.shm_address) and self.transport != "tcp"

    def shm_for(self, address: str, offer: NodeOffer) -> str:
        """The ``shm://`` address to use for ``address`` ("" for TCP); TransportError when
        the client insists on shared memory and the node cannot give it."""
        if self.transport == "tcp":
            return ""
        if offer.shm_address:
            return offer.shm_address
        if self.transport == "shm":
            raise TransportError(
                f"{address}: transport='shm' but shared memory is not possible: {offer.why_not_shm}"
            )
        return ""


# --- opening a connection -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dial:
    """Open a connection to ``address`` with its own transport. ``hello``: ask what the node
    offers on it too (:func:`hello_call`, :func:`read_hello`), and answer with both."""

    address: str
    hello: bool = False


class Link(Protocol):
    """What the flow does with a connection it was given: close it, or name its features."""

    features: frozenset[str]

    def close(self) -> None: ...


T = TypeVar("T")


def open_flow(links: Links, address: str) -> Generator[Dial, Any, Any]:
    """How a connection to the data address ``address`` is made: the node's shared memory where
    it offers it and the transport setting allows, else the address's own transport.

    Yields each connection to open (:func:`~kvpool.client.ops.drive` carries it out); a
    :class:`Dial` is answered with the connection (a ``hello`` one with the connection and the
    node's :class:`NodeOffer`), or with the KVPoolError opening it raised — raised here, where
    the flow decides: a shared memory that cannot be reached is
    given up for TCP or asked about again (:meth:`Links.shm_failed`); any other failure ends the
    flow. Returns the connection to use, its ``features`` set; a connection it does not return
    it closes (the answers' ``close`` and ``features``, :class:`Link`, are all it touches)."""
    if not address.startswith(("tcp://", "inproc://")):
        return _opened((yield Dial(address)))
    offer = links.offer(address)
    first: Link | None = None
    if offer is None:
        first, offer = _opened((yield Dial(address, hello=True)))
        links.learn(address, offer)
    for _attempt in range(2):
        try:
            shm = links.shm_for(address, offer) if address.startswith("tcp://") else ""
        except KVPoolError:
            if first is not None:
                first.close()
            raise
        if not shm:
            break
        try:
            conn: Link = _opened((yield Dial(shm)))
        except KVPoolError as e:
            try:
                fallback = links.shm_failed(address, offer, e, remembered=first is None)
            except KVPoolError:
                if first is not None:
                    first.close()
                raise
            if fallback is None:  # remembered from before the node restarted, maybe: ask again
                first, offer = _opened((yield Dial(address, hello=True)))
                links.learn(address, offer)
                continue
            offer = fallback
            break
        conn.features = offered_features(offer, "mget", "shm")
        if first is not None:
            first.close()
        return conn
    if first is None:
        first = _opened((yield Dial(address)))
    first.features = offered_features(offer)
    return first


def _opened(answer: T) -> T:
    """What a dial was answered with: raised here when it is the KVPoolError opening raised."""
    if isinstance(answer, KVPoolError):
        raise answer
    return answer


def conn_arena(conn: object) -> Arena | None:
    """The mapped arena of a shared-memory connection (None for any other)."""
    arena = getattr(conn, "arena", None)
    return arena if isinstance(arena, Arena) else None


def node_read(
    address: str,
    items: list[ReadItem],
    conn: Any,
    content: Callable[[str], bool] | None = None,
) -> NodeRead:
    """The reads of ``items`` from the node at ``address`` over ``conn``, as its features
    allow (MGET, shared memory, reads by content). Over shared memory the blocks the node's
    directory lists are read here, with no message (:func:`~kvpool.client.plans.read_listed`;
    ``content``: which keys name their content): the plan then holds only the others, and no
    call at all when none is left."""
    features = conn.features
    arena = conn_arena(conn)
    if arena is not None and _node_alive(arena, conn):
        items = read_listed(items, arena, content)
    return NodeRead(
        address,
        items,
        mget="mget" in features,
        arena=arena,
        direct="direct" in features,
    )


_CLOSED = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


def _node_alive(arena: Arena, conn: Any) -> bool:
    """The node offers a directory and renews it, and (a blocking connection) has not closed
    ``conn``: a killed node's memory stays mapped here, but is not read."""
    directory = arena.directory
    if directory is None or not directory.alive():
        return False
    sock = getattr(conn, "socket", None)
    if not isinstance(sock, socket.socket):
        return True  # an event-loop connection: its close is seen as it happens
    try:  # the peer's end closed, even with answers posted earlier still unread here
        poller = select.poll()
        poller.register(sock, _CLOSED)
        return not poller.poll(0)
    except (OSError, ValueError):
        return False
