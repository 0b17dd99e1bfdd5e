"""ThreadConnections: one blocking connection per thread and address, and what becomes of a
thread's connections when it ends (no sockets: fake connections)."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any, cast

import pytest

from kvpool.errors import UnavailableError
from kvpool.transports.blocking import BlockingConnection
from kvpool.transports.threads import ThreadConnections

A, B = "tcp://10.0.0.1:7400", "tcp://10.0.0.2:7400"


class FakeConn:
    def __init__(self, name: str) -> None:
        self.name = name
        self.broken = False
        self.closed = False

    def close(self) -> None:
        self.closed = True


def conn(name: str) -> BlockingConnection:
    return cast(BlockingConnection, FakeConn(name))


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a thread of its own that has ended by the time this returns."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    return out[0]


def test_each_thread_has_its_own_connection_and_keeps_it() -> None:
    conns = ThreadConnections(max_idle=2)
    mine = conn("main")
    assert conns.get(A) is None
    conns.add(A, mine)
    assert conns.get(A) is mine
    # Another thread, while this one lives, does not get this thread's connection.
    assert in_thread(lambda: conns.get(A)) is None
    assert conns.get(A) is mine
    assert conns.of_this_thread() == {A: mine}


def test_an_ended_threads_connections_serve_the_next_thread_up_to_max_idle_per_address() -> None:
    conns = ThreadConnections(max_idle=2)
    opened = [conn(f"t{i}") for i in range(3)]
    barrier = threading.Barrier(3)

    def open_one(c: BlockingConnection) -> None:
        conns.add(A, c)
        barrier.wait(5)  # all three alive at once: three connections

    threads = [threading.Thread(target=open_one, args=(c,)) for c in opened]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(conns) == 2  # two kept idle, the third closed
    assert sum(c.closed for c in opened) == 1
    reused = [in_thread(lambda: conns.get(A)) for _ in range(3)]
    # Each later thread took an idle one (and, ending, left it idle again): none opened anew.
    assert all(r is not None and not r.closed for r in reused)
    assert {id(r) for r in reused} <= {id(c) for c in opened if not c.closed}
    assert in_thread(lambda: conns.get(B)) is None  # idle connections are per address


def test_a_broken_connection_is_dropped_not_reused() -> None:
    conns = ThreadConnections(max_idle=2)
    left = conn("left")
    in_thread(lambda: conns.add(A, left))
    cast(FakeConn, left).broken = True
    assert in_thread(lambda: conns.get(A)) is None
    assert len(conns) == 0
    own = conn("own")
    conns.add(A, own)
    cast(FakeConn, own).broken = True
    assert conns.get(A) is None  # this thread's own broken one: closed and forgotten
    assert own.closed


def test_close_closes_every_connection_and_refuses_new_ones() -> None:
    conns = ThreadConnections(max_idle=2)
    idle, mine = conn("idle"), conn("mine")
    in_thread(lambda: conns.add(A, idle))
    conns.add(B, mine)
    conns.close()
    assert idle.closed
    assert mine.closed
    late = conn("late")
    with pytest.raises(UnavailableError, match="closed"):
        conns.add(A, late)
    assert late.closed
    # A thread that ends after the close has its connections closed, not kept.
    after = conn("after")
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        conns._mine()[A] = after  # as if it had been added before the close
        started.set()
        release.wait(5)

    thread = threading.Thread(target=hold)
    thread.start()
    started.wait(5)
    release.set()
    thread.join(10)
    assert after.closed


def test_a_lent_connection_serves_another_thread_and_none_over_max_idle_is_lent() -> None:
    conns = ThreadConnections(max_idle=1)
    first, second = conn("warm"), conn("mine")
    conns.add(A, first)
    conns.lend_this_threads()
    assert conns.of_this_thread() == {}
    assert in_thread(lambda: conns.get(A)) is first  # taken over; that thread ended: idle again
    conns.add(B, second)
    in_thread(lambda: conns.add(B, conn("other")))  # ended: its connection fills B's idle slot
    conns.lend_this_threads()
    assert conns.of_this_thread() == {B: second}  # B's one idle slot is taken: kept, not closed
    assert not second.closed
    assert len(conns) == 3


def test_connections_a_living_thread_used_are_freed_with_them() -> None:
    # The main thread never ends: what it used must go when the connections object does (a
    # process that makes and closes clients one after another kept every one before).
    conns = ThreadConnections(max_idle=2)
    mine = conn("main")
    conns.add(A, mine)
    gone = weakref.ref(conns)
    del conns
    gc.collect()
    assert gone() is None
    assert mine.closed
