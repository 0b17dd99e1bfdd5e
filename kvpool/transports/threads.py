"""Blocking connections shared out to threads: one per calling thread and address.

A blocking connection serves one thread at a time, so a synchronous client (its data plane, its
calls to the masters' RPC ports) gives each thread its own. Engines differ in how they use
threads: a fixed pool keeps its threads, but a server that starts a thread per request would,
with plain thread-locals, leave one connection per ended thread open until the client closes —
descriptors and node connections without bound — and pay a new connection (TCP, AUTH, HELLO, a
shared memory's mapping) in every thread. Here an ended thread's healthy connections are kept
for the next thread that needs one, up to ``max_idle`` per address; the rest are closed.
"""

from __future__ import annotations

import threading
import weakref

from kvpool.errors import UnavailableError
from kvpool.transports.blocking import BlockingConnection


class _Mine:
    """One thread's connections (a thread-local's value: when the thread ends, it goes)."""

    __slots__ = ("__weakref__", "conns")

    def __init__(self) -> None:
        self.conns: dict[str, BlockingConnection] = {}


class ThreadConnections:
    """Connections by address, one per thread; an ended thread's kept for others (thread-safe;
    see the module doc)."""

    def __init__(self, max_idle: int) -> None:
        self._max_idle = max_idle
        self._local = threading.local()
        self._all: set[BlockingConnection] = set()
        self._idle: dict[str, list[BlockingConnection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def get(self, address: str) -> BlockingConnection | None:
        """This thread's connection to ``address`` — its own, else one an ended thread left —
        or None: open one and :meth:`add` it. A broken or closed one is dropped on the way."""
        conns = self._mine()
        conn = conns.get(address)
        if conn is not None and _usable(conn):
            return conn
        if conn is not None:
            self.discard(address, conn)
        dead = []
        with self._lock:
            idle = self._idle.get(address)
            while idle:
                conn = idle.pop()
                if _usable(conn):
                    conns[address] = conn
                    break
                self._all.discard(conn)
                dead.append(conn)
            else:
                conn = None
        for gone in dead:
            gone.close()
        return conn

    def add(self, address: str, conn: BlockingConnection) -> None:
        """``conn``, just opened, is this thread's connection to ``address`` (once closed:
        it is closed and UnavailableError raised)."""
        with self._lock:
            if self._closed:
                conn.close()
                raise UnavailableError("this kvpool client is closed")
            self._all.add(conn)
        self._mine()[address] = conn

    def discard(self, address: str, conn: BlockingConnection) -> None:
        """Close ``conn`` (this thread's to ``address``) and forget it."""
        conns = self._mine()
        if conns.get(address) is conn:
            del conns[address]
        with self._lock:
            self._all.discard(conn)
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._all = self._all, set()
            self._idle.clear()
        for conn in conns:
            conn.close()

    def lend_this_threads(self) -> None:
        """This thread's connections become ones any thread may take (as if it had ended, but
        none is closed: those over ``max_idle`` stay this thread's)."""
        self._to_idle(self._mine(), close_rest=False)

    def of_this_thread(self) -> dict[str, BlockingConnection]:
        """This thread's connections, by address (a copy)."""
        return dict(self._mine())

    def __len__(self) -> int:
        """How many connections are open (every thread's and the idle ones)."""
        with self._lock:
            return len(self._all)

    def _mine(self) -> dict[str, BlockingConnection]:
        mine: _Mine | None = getattr(self._local, "mine", None)
        if mine is None:
            mine = self._local.mine = _Mine()
            # Not a bound method: the registry would keep this object (and every thread's
            # connections) alive as long as the thread lives — for the main thread, forever.
            weakref.finalize(mine, _thread_ended, weakref.ref(self), mine.conns).atexit = False
        return mine.conns

    def _to_idle(self, conns: dict[str, BlockingConnection], *, close_rest: bool) -> None:
        """Move a thread's usable ``conns`` to the idle pool, up to ``max_idle`` per address
        (none once closed); the rest are closed (``close_rest``) or left in ``conns``."""
        extra = []
        with self._lock:
            for address, conn in list(conns.items()):
                idle = self._idle.setdefault(address, [])
                if not self._closed and _usable(conn) and len(idle) < self._max_idle:
                    idle.append(conn)
                    del conns[address]
                elif close_rest:
                    self._all.discard(conn)
                    extra.append(conn)
        for conn in extra:
            conn.close()


def _usable(conn: BlockingConnection) -> bool:
    return not conn.broken and not conn.closed


def _thread_ended(
    owner: weakref.ref[ThreadConnections], conns: dict[str, BlockingConnection]
) -> None:
    """A thread's connections, once it has ended (or its :class:`ThreadConnections` is gone)."""
    connections = owner()
    if connections is not None:
        connections._to_idle(conns, close_rest=True)
        return
    for conn in conns.values():
        conn.close()
