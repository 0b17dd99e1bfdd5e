"""ops.drive and ops.drive_async: how a driver carries a flow out (no socket, no client)."""

from __future__ import annotations

import asyncio
from collections.abc import Generator

import pytest

from kvpool.client.ops import drive, drive_async


def flow(log: list[object]) -> Generator[str, int, str]:
    """Asks "a" then "b"; answers with what it was told, in order."""
    first = yield "a"
    log.append(first)
    second = yield "b"
    log.append(second)
    return f"{first}+{second}"


def test_drive_performs_each_step_in_order_and_answers_the_flows_value() -> None:
    log: list[object] = []
    performed: list[str] = []

    def perform(step: str) -> int:
        performed.append(step)
        return len(performed) * 10

    assert drive(flow(log), perform) == "10+20"
    assert performed == ["a", "b"]
    assert log == [10, 20]


def test_drive_async_awaits_each_step() -> None:
    log: list[object] = []

    async def perform(step: str) -> int:
        await asyncio.sleep(0)
        return {"a": 1, "b": 2}[step]

    assert asyncio.run(drive_async(flow(log), perform)) == "1+2"
    assert log == [1, 2]


def test_a_failed_step_stops_the_flow_and_propagates() -> None:
    log: list[object] = []

    def perform(step: str) -> int:
        if step == "b":
            raise TimeoutError("node did not answer")
        return 1

    with pytest.raises(TimeoutError, match="did not answer"):
        drive(flow(log), perform)
    assert log == [1]  # the flow never saw an answer to "b"

    async def perform_async(step: str) -> int:
        raise ConnectionResetError(step)

    with pytest.raises(ConnectionResetError, match="a"):
        asyncio.run(drive_async(flow([]), perform_async))


def test_a_flow_with_no_step_answers_at_once() -> None:
    def empty(steps: list[str]) -> Generator[str, int, int]:
        yield from steps  # none here: the flow returns before its first step
        return 7

    assert drive(empty([]), lambda step: pytest.fail(f"performed {step}")) == 7


def test_a_flow_may_catch_its_steps_failure_and_go_on() -> None:
    """What a step raised is thrown into the flow at that step, for both drivers."""

    def careful(log: list[object]) -> Generator[str, int, str]:
        try:
            yield "a"
        except TimeoutError as e:
            log.append(f"caught {e}")
        answer = yield "b"
        return f"then {answer}"

    def perform(step: str) -> int:
        if step == "a":
            raise TimeoutError("slow")
        return 2

    log: list[object] = []
    assert drive(careful(log), perform) == "then 2"
    assert log == ["caught slow"]

    async def perform_async(step: str) -> int:
        return perform(step)

    log.clear()
    assert asyncio.run(drive_async(careful(log), perform_async)) == "then 2"
    assert log == ["caught slow"]
