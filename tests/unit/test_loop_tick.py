"""PySyncObj's poller on the asyncio loop, and the ticker that runs Raft's tick there."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

from pysyncobj.poller import POLL_EVENT_TYPE

from kvpool.raft_master.loop_tick import LoopPoller, LoopTicker


class Log:
    def __init__(self) -> None:
        self.events: list[str] = []

    def exception(self, event: str, **_: Any) -> None:
        self.events.append(event)


def test_a_subscribed_socket_is_served_by_the_loop_and_asks_for_a_tick() -> None:
    async def run() -> None:
        poller = LoopPoller(asyncio.get_running_loop())
        asked: list[int] = []
        poller.on_event = lambda: asked.append(1)
        a, b = socket.socketpair()
        a.setblocking(False)
        seen: list[tuple[int, bytes]] = []

        def on_a(descr: Any, event: int) -> None:
            seen.append((event, a.recv(16)))

        try:
            poller.subscribe(a.fileno(), on_a, POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)
            b.send(b"one")
            for _ in range(50):
                if seen:
                    break
                await asyncio.sleep(0.01)
            assert seen == [(POLL_EVENT_TYPE.READ, b"one")]
            assert asked == [1]
            # poll() never waits: the loop does.
            poller.poll(10.0)
            poller.unsubscribe(a.fileno())
            poller.unsubscribe(a.fileno())  # twice: nothing to do
            b.send(b"two")
            await asyncio.sleep(0.05)
            assert seen == [(POLL_EVENT_TYPE.READ, b"one")]
        finally:
            poller.unsubscribe(a.fileno())
            a.close()
            b.close()

    asyncio.run(run())


def test_an_event_while_ticks_on_events_are_off_is_served_without_asking_for_a_tick() -> None:
    """A follower with read leases answers an append inside the message's handler; its tick
    waits for the timer (``LeasedSyncObj.ticks_on_messages``)."""

    async def run() -> None:
        poller = LoopPoller(asyncio.get_running_loop())
        asked: list[int] = []
        poller.on_event = lambda: asked.append(1)
        follower = [True]
        poller.tick_on_events = lambda: not follower[0]
        a, b = socket.socketpair()
        a.setblocking(False)
        seen: list[bytes] = []
        try:
            poller.subscribe(a.fileno(), lambda d, e: seen.append(a.recv(16)), POLL_EVENT_TYPE.READ)

            async def deliver(data: bytes) -> None:
                b.send(data)
                for _ in range(50):
                    if seen and seen[-1] == data:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"{data!r} was not served")

            await deliver(b"append")
            assert asked == []  # served, no tick asked
            follower[0] = False  # a candidate or a leader
            await deliver(b"vote")
            assert asked == [1]
        finally:
            poller.unsubscribe(a.fileno())
            a.close()
            b.close()

    asyncio.run(run())


def test_writable_interest_is_served_and_a_new_subscription_replaces_the_old() -> None:
    async def run() -> None:
        poller = LoopPoller(asyncio.get_running_loop())
        a, b = socket.socketpair()
        events: list[str] = []
        try:
            poller.subscribe(a.fileno(), lambda d, e: events.append(f"w{e}"), POLL_EVENT_TYPE.WRITE)
            await asyncio.sleep(0.02)
            assert events
            assert set(events) == {f"w{POLL_EVENT_TYPE.WRITE}"}
            # Read interest only now: the writer is gone, nothing more until data arrives.
            poller.subscribe(a.fileno(), lambda d, e: events.append("r"), POLL_EVENT_TYPE.READ)
            events.clear()
            await asyncio.sleep(0.02)
            assert events == []
        finally:
            poller.unsubscribe(a.fileno())
            a.close()
            b.close()

    asyncio.run(run())


def test_ticks_run_periodically_and_when_asked_once_per_turn() -> None:
    async def run() -> None:
        ticks: list[float] = []
        loop = asyncio.get_running_loop()
        ticker = LoopTicker(loop, lambda: ticks.append(loop.time()), 0.01, Log())
        ticker.start()
        await asyncio.sleep(0.1)
        periodic = len(ticks)
        assert periodic >= 4  # ~10 in 0.1 s; a loaded machine runs fewer
        before = len(ticks)
        for _ in range(5):
            ticker.request()  # asked five times in one turn: one tick
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(ticks) - before in (1, 2)  # the asked one (and perhaps a periodic one)
        assert ticker.alive()
        ticker.stop()
        after = len(ticks)
        ticker.request()
        await asyncio.sleep(0.05)
        assert len(ticks) == after
        assert not ticker.alive()

    asyncio.run(run())


def test_now_ticks_at_once_on_the_loop_and_defers_within_a_tick_or_from_another_thread() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        ticks: list[str] = []
        ticker: LoopTicker

        def tick() -> None:
            ticks.append("tick")
            if len(ticks) == 2:
                ticker.now()  # within a tick: not run inside this one, but on the next turn
                ticks.append("asked")

        ticker = LoopTicker(loop, tick, 60.0, Log())  # no periodic tick during the test
        ticker.start()
        await asyncio.sleep(0)
        assert ticks == ["tick"]  # the first periodic one
        ticker.now()
        assert ticks == ["tick", "tick", "asked"]  # ran before now() returned, once
        await asyncio.sleep(0)
        assert ticks == ["tick", "tick", "asked", "tick"]
        other = threading.Thread(target=ticker.now)
        other.start()
        other.join()
        assert len(ticks) == 4  # another thread's now() does not tick there…
        await asyncio.sleep(0.01)
        assert len(ticks) == 5  # …but hands the tick to the loop
        ticker.stop()

    asyncio.run(run())


def test_a_tick_that_raises_is_logged_and_ticking_goes_on() -> None:
    async def run() -> None:
        calls: list[int] = []
        log = Log()

        def tick() -> None:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("boom")

        ticker = LoopTicker(asyncio.get_running_loop(), tick, 0.01, log)
        ticker.start()
        await asyncio.sleep(0.08)
        ticker.stop()
        assert log.events == ["raft_tick_failed"]
        assert len(calls) >= 3

    asyncio.run(run())


def test_on_loop_runs_on_the_loop_thread_whoever_calls_it() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        ticker = LoopTicker(loop, lambda: None, 0.01, Log())
        ran_on: list[threading.Thread] = []
        ticker.on_loop(lambda: ran_on.append(threading.current_thread()), 1.0)  # here: at once
        assert ran_on == [threading.current_thread()]
        # From a worker thread (a server stops Raft that way): handed to the loop, waited for.
        await asyncio.to_thread(
            ticker.on_loop, lambda: ran_on.append(threading.current_thread()), 5.0
        )
        assert ran_on == [threading.current_thread()] * 2

    asyncio.run(run())
