"""PySyncObj ticked from the master's event loop, not from a thread of its own.

PySyncObj runs Raft on its own thread (``autoTick``): a proposal made by a request handler on the
event loop is queued and a pipe wakes that thread; the commit's callback comes back to the loop
through ``call_soon_threadsafe``; and the two threads take turns on the GIL in between. Timed
inside the leader (docs/performance.md, "Where the time goes"), these two hops were 300 to 400 µs
of every put on a 2-vCPU VM.

Here the SyncObj is built with ``autoTick=False`` around a :class:`LoopPoller` — PySyncObj's
poller interface on the asyncio loop: the Raft port's listening socket, its connections and
PySyncObj's wake-up pipe become the loop's readers and writers — and a :class:`LoopTicker` runs
the tick (``SyncObj._onTick``) on the loop: after every socket event, after every proposal, and
every ``period_s`` besides (PySyncObj's timers: elections, heartbeats, the read lease). A tick
never blocks: the poller's ``poll`` returns at once, the loop does the waiting.

What moves onto the loop with it: encoding and decoding every Raft message, applying committed
entries (under the index lock, as before), the journal's writes. A tick that raises is logged
and the next one runs as usual, as PySyncObj's own thread does.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pysyncobj.syncobj as pysyncobj_syncobj
from pysyncobj.poller import POLL_EVENT_TYPE


class LoopPoller:
    """PySyncObj's ``Poller`` (``subscribe``, ``unsubscribe``, ``poll``) on an asyncio loop.

    A subscribed descriptor's callback runs from the loop when the descriptor is readable or
    writable, then ``on_event`` (set to :meth:`LoopTicker.request`) asks for a tick — unless
    ``tick_on_events`` says not now (a follower with read leases:
    :meth:`~kvpool.raft_master.lease.LeasedSyncObj.ticks_on_messages`), when the next timed tick
    does what the tick would. ``poll`` does nothing: the loop waits for events, not the tick."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._callbacks: dict[Any, Callable[[Any, int], None]] = {}
        self.on_event: Callable[[], None] | None = None
        self.tick_on_events: Callable[[], bool] = lambda: True

    def subscribe(self, descr: Any, callback: Callable[[Any, int], None], eventMask: int) -> None:  # noqa: N803 - PySyncObj's name
        self.unsubscribe(descr)
        self._callbacks[descr] = callback
        if eventMask & POLL_EVENT_TYPE.READ:
            self._loop.add_reader(descr, self._event, descr, POLL_EVENT_TYPE.READ)
        if eventMask & POLL_EVENT_TYPE.WRITE:
            self._loop.add_writer(descr, self._event, descr, POLL_EVENT_TYPE.WRITE)

    def unsubscribe(self, descr: Any) -> None:
        if self._callbacks.pop(descr, None) is None:
            return
        with contextlib.suppress(OSError, ValueError):  # a descriptor closed meanwhile
            self._loop.remove_reader(descr)
            self._loop.remove_writer(descr)

    def poll(self, timeout: float) -> None:
        """Nothing to wait for here: the loop delivers the events."""

    def _event(self, descr: Any, event: int) -> None:
        callback = self._callbacks.get(descr)
        if callback is not None:
            callback(descr, event)
        if self.on_event is not None and self.tick_on_events():
            self.on_event()


def supported() -> bool:
    """Whether this PySyncObj makes its poller where :func:`poller_for_construction` can
    hand it ours."""
    return callable(getattr(pysyncobj_syncobj, "createPoller", None))


@contextlib.contextmanager
def poller_for_construction(poller: LoopPoller) -> Iterator[None]:
    """While a SyncObj is built: PySyncObj makes its poller with ``createPoller`` in
    ``SyncObj.__init__`` and hands it to the transport and its wake-up pipe there, so ours must
    be the one made. Built on the loop's thread, one SyncObj at a time."""
    make = pysyncobj_syncobj.createPoller  # checked by supported()
    pysyncobj_syncobj.createPoller = lambda _kind: poller
    try:
        yield
    finally:
        pysyncobj_syncobj.createPoller = make


class LoopTicker:
    """Runs ``tick`` on ``loop``: when asked (coalesced: one pending tick at a time) and every
    ``period_s``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        tick: Callable[[], None],
        period_s: float,
        log: Any,
    ) -> None:
        self._loop = loop
        self._tick = tick
        self._period_s = period_s
        self._log = log
        self._pending = False
        self._timer: asyncio.Handle | None = None
        self._stopped = False
        self._ticking = False
        self.thread_id: int | None = None  # the loop's thread, once started

    def start(self) -> None:
        self.thread_id = threading.get_ident()  # started on the loop's thread
        self._timer = self._loop.call_soon(self._periodic)

    def request(self) -> None:
        """Tick soon (on the loop's next turn), once however often it is asked meanwhile."""
        if not self._pending and not self._stopped:
            self._pending = True
            self._loop.call_soon(self._requested)

    def on_loop_thread(self) -> bool:
        """Whether the caller runs on the loop's thread (where the ticks run), once started."""
        return threading.get_ident() == self.thread_id

    def now(self) -> None:
        """Tick at once, on the loop's thread (a proposal's entry goes out without waiting for
        the loop's next turn, ~80 µs of a put on a 2-vCPU VM); from within a tick as
        :meth:`request`; from another thread, handed to the loop."""
        if not self.on_loop_thread():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self.request)
        elif self._ticking:
            self.request()
        else:
            self._run()

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def on_loop(self, fn: Callable[[], None], timeout_s: float) -> None:
        """Run ``fn`` on the ticker's loop and return when it has run (or ``timeout_s`` passed):
        at once when called there, else handed to the loop (a Raft member is stopped from a
        worker thread). A loop that no longer runs cannot take it: then it runs here."""
        loop = self._loop
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here or loop.is_closed() or not loop.is_running():
            fn()
            return
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(run)
        except RuntimeError:  # closed meanwhile
            fn()
            return
        done.wait(timeout_s)

    def alive(self) -> bool:
        """Not stopped. (Not "ticked lately": ticks run on the loop that would ask, so a long
        tick — a large snapshot installed — is over before anyone on the loop can look.)"""
        return not self._stopped

    def _requested(self) -> None:
        self._pending = False
        self._run()

    def _periodic(self) -> None:
        if self._stopped:
            return
        self._run()
        self._timer = self._loop.call_later(self._period_s, self._periodic)

    def _run(self) -> None:
        if self._stopped:
            return
        self._ticking = True
        try:
            self._tick()
        except Exception:  # as PySyncObj's own thread does: log, and tick again next time
            self._log.exception("raft_tick_failed")
        finally:
            self._ticking = False
