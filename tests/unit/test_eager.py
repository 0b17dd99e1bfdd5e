"""kvpool.transports.eager: a handler that does not wait runs at once and makes no task; one
that waits goes on in a task, which can be cancelled; context variables stay the handler's."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from kvpool.transports.eager import start_eagerly

SPAN: contextvars.ContextVar[str] = contextvars.ContextVar("span", default="none")


def test_a_handler_that_never_waits_finishes_at_once_without_a_task() -> None:
    done: list[str] = []

    async def handler() -> None:
        SPAN.set("handler")
        done.append(SPAN.get())

    async def main() -> asyncio.Task[None] | None:
        task = start_eagerly(asyncio.get_running_loop(), handler())
        assert done == ["handler"]  # ran before start_eagerly returned
        assert SPAN.get() == "none"  # what it set stayed in its own context
        return task

    assert asyncio.run(main()) is None


def test_a_handler_that_waits_goes_on_in_a_task_with_its_results_and_its_context() -> None:
    steps: list[object] = []

    async def handler(gate: asyncio.Future[int]) -> None:
        SPAN.set("handler")
        steps.append("before")
        steps.append(await gate)  # a future's result comes through
        await asyncio.sleep(0)  # a bare yield too
        try:
            await asyncio.sleep(0.001)
            raise RuntimeError("boom")
        except RuntimeError as e:
            steps.append(str(e))
        steps.append(SPAN.get())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[int] = loop.create_future()
        task = start_eagerly(loop, handler(gate))
        assert task is not None
        assert steps == ["before"]
        loop.call_later(0.001, gate.set_result, 7)
        await task
        assert SPAN.get() == "none"

    asyncio.run(main())
    assert steps == ["before", 7, "boom", "handler"]


def test_a_failed_future_raises_inside_the_handler() -> None:
    seen: list[str] = []

    async def handler(gate: asyncio.Future[int]) -> None:
        try:
            await gate
        except ValueError as e:
            seen.append(f"caught {e}")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[int] = loop.create_future()
        task = start_eagerly(loop, handler(gate))
        assert task is not None
        gate.set_exception(ValueError("no"))
        await task

    asyncio.run(main())
    assert seen == ["caught no"]


def test_cancelling_the_task_cancels_the_handler_where_it_waits() -> None:
    seen: list[str] = []

    async def handler() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("cleaned up")

    async def main() -> None:
        task = start_eagerly(asyncio.get_running_loop(), handler())
        assert task is not None
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert seen == ["cancelled", "cleaned up"]


def test_an_error_in_the_first_step_is_raised_to_the_caller() -> None:
    async def handler() -> None:
        raise KeyError("first step")

    async def main() -> None:
        with pytest.raises(KeyError):
            start_eagerly(asyncio.get_running_loop(), handler())

    asyncio.run(main())
