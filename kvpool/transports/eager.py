"""Run a request handler's coroutine at once, making a task only if it has to wait.

A server that answers each frame with ``loop.create_task(handle(...))`` pays for the task and
for two more turns of the event loop (the task's first step, then the flush of its answer) even
when the handler never waits — and most never do: a lookup reads the index and answers. Measured
on the master's frame port (one 1-key lookup at a time, cProfile of the leader): three loop turns
per request, each an ``epoll_wait`` and a pass over the ready callbacks.

:func:`start_eagerly` runs the coroutine's first step now, in a context of its own (what it sets
in context variables — a trace span — stays its own, as in a task); if it finishes there, that
was all, and its answer leaves with the flush at the end of the read that brought the request. If
it waits on something, the rest runs in a task as usual: that task resumes the same coroutine
from the future it is waiting on, and cancelling the task cancels the wait, as it would have
cancelled a task made at the start. This is what Python 3.12's ``asyncio.eager_task_factory``
does for every task; kvpool supports 3.11, and wants it for request handlers only.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from typing import Any


def start_eagerly(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]
) -> asyncio.Task[None] | None:
    """Run ``coro`` until it first waits; None if it finished, else the task running the rest.

    An exception the coroutine raises in its first step is raised here (a task would have kept
    it), so handlers catch their own errors, as the master's do."""
    context = contextvars.copy_context()
    try:
        waiting_on = context.run(coro.send, None)
    except StopIteration:
        return None
    return loop.create_task(_rest(coro, waiting_on), context=context)


async def _rest(coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
    await _Resume(coro, waiting_on)


class _Resume:
    """Awaiting this goes on with a coroutine suspended on ``waiting_on``: the future (or the
    bare ``None`` of ``asyncio.sleep(0)``) is handed to the task, which resumes us when it is
    done; what the task throws in (a cancellation) is thrown into the coroutine."""

    __slots__ = ("_coro", "_waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
        self._coro = coro
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, None, None]:
        coro, waiting_on = self._coro, self._waiting_on
        while True:
            try:
                yield waiting_on
            except GeneratorExit:  # this awaitable is being closed: close the coroutine too
                coro.close()
                raise
            except BaseException as e:  # a cancellation (or any throw) goes on into the coroutine
                try:
                    waiting_on = coro.throw(e)
                except StopIteration:
                    return
                continue
            try:
                waiting_on = coro.send(None)
            except StopIteration:
                return
