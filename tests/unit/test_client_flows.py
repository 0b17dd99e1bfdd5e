"""The client's flows besides reads and puts, driven step by step against the pure
ClientState (no socket, no thread, no event loop): a membership refresh, a warm-up, a query
chain. Both drivers carry exactly these out."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.client.ops import Ask, Connect, Delete, Pause, Step, drive
from kvpool.client.placement import MemberInfo
from kvpool.client.plans import BlockRef
from kvpool.client.settings import make_config
from kvpool.client.state import EMPTY_RING_ASKS, ClientState, Query, Removed
from kvpool.errors import DeadlineExceededError, UnavailableError
from kvpool.proto.v1 import common_pb2, master_pb2

MEMBER = common_pb2.Member(
    member_id=7,
    node_id="node-a",
    incarnation=7,
    data_address="tcp://127.0.0.1:1",
    capacity_bytes=1 << 30,
    live=True,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def members(*listed: common_pb2.Member) -> master_pb2.GetMembersResponse:
    return master_pb2.GetMembersResponse(ring_version=1, members=list(listed))


def run(flow: Any, answers: list[Any], clock: Clock) -> tuple[Any, list[Step]]:
    """Drive ``flow``: each Ask takes the next answer (an exception is raised at the step),
    a Pause moves the clock, a Connect opens every member."""
    steps: list[Step] = []

    def perform(step: Step) -> Any:
        steps.append(step)
        if isinstance(step, Pause):
            clock.now += step.seconds
            return None
        if isinstance(step, Connect):
            return {m.node_id: "" for m in step.members}
        if isinstance(step, Ask):
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer
        return None

    return drive(flow, perform), steps


@pytest.fixture
def state() -> ClientState:
    return ClientState(make_config(["127.0.0.1:1"], timeout_s=2.0))


def asks(steps: list[Step]) -> list[str]:
    return [s.method for s in steps if isinstance(s, Ask)]


def test_a_put_asks_again_while_the_ring_is_empty_with_growing_pauses(state: ClientState) -> None:
    clock = Clock()
    flow = state.members_flow(True, clock() + 2.0, clock)
    _, steps = run(flow, [members(), members(), members(MEMBER)], clock)
    assert asks(steps) == ["GetMembers"] * 3
    assert [s.seconds for s in steps if isinstance(s, Pause)] == [0.02, 0.04]
    assert state.placement.has_ring
    assert not state.placement.ring_is_empty()


def test_a_put_stops_asking_after_the_last_try_or_at_the_deadline(state: ClientState) -> None:
    clock = Clock()
    _, steps = run(state.members_flow(True, clock() + 2.0, clock), [members()] * 9, clock)
    assert asks(steps) == ["GetMembers"] * EMPTY_RING_ASKS  # then the put fails: no nodes
    assert state.placement.ring_is_empty()

    clock = Clock()
    _, steps = run(state.members_flow(True, clock() + 0.01, clock), [members()] * 9, clock)
    assert asks(steps) == ["GetMembers"] * 2  # the pause was cut to the time left
    assert [s.seconds for s in steps if isinstance(s, Pause)] == [pytest.approx(0.01)]


def test_a_failed_refresh_raises_only_without_a_ring(state: ClientState) -> None:
    clock = Clock()
    with pytest.raises(DeadlineExceededError):
        run(
            state.members_flow(True, clock() + 2.0, clock),
            [DeadlineExceededError("no master answered")],
            clock,
        )
    run(state.members_flow(True, clock() + 2.0, clock), [members(MEMBER)], clock)
    state.placement.mark_stale(2)
    result, steps = run(
        state.members_flow(True, clock() + 2.0, clock), [UnavailableError("down")], clock
    )
    assert result is None
    assert asks(steps) == ["GetMembers"]


def test_a_reads_refresh_asks_once_and_a_failure_is_no_error(state: ClientState) -> None:
    clock = Clock()
    _, steps = run(state.members_flow(False, clock() + 2.0, clock), [UnavailableError("x")], clock)
    assert asks(steps) == ["GetMembers"]
    assert not state.placement.has_ring
    assert not state.placement.refresh_due(clock())  # not asked again at once
    _, steps = run(state.members_flow(False, clock() + 2.0, clock), [members()], clock)
    assert asks(steps) == ["GetMembers"]  # one ask even though the ring is empty


def test_a_warm_up_finds_the_leader_then_the_ring_then_every_node(state: ClientState) -> None:
    clock = Clock()
    warm, steps = run(state.warm_up_flow(True, 0.0, clock), ["leader", members(MEMBER)], clock)
    assert asks(steps) == ["Lookup", "GetMembers"]
    assert [m.node_id for s in steps if isinstance(s, Connect) for m in s.members] == ["node-a"]
    assert warm.ok
    assert warm.nodes == {"node-a": ""}

    warm, steps = run(state.warm_up_flow(False, 0.0, clock), ["leader", members(MEMBER)], clock)
    assert not any(isinstance(s, Connect) for s in steps)
    assert warm.nodes == {}


def test_a_warm_up_says_why_no_master_answered_and_does_not_raise(state: ClientState) -> None:
    clock = Clock()
    warm, steps = run(
        state.warm_up_flow(True, 0.0, clock), [DeadlineExceededError("no leader")], clock
    )
    assert asks(steps) == ["Lookup"]
    assert not warm.ok
    assert warm.masters == "DeadlineExceededError: no leader"


def test_a_query_chain_is_asked_in_turn_and_a_removal_deletes_its_replicas(
    state: ClientState,
) -> None:
    clock = Clock()
    ref = BlockRef(b"k", 5, 1, MemberInfo.from_proto(MEMBER))
    second: Query[Any] = Query("remove", "Remove", "second", lambda r: Removed(r, [ref]), 0, False)
    first: Query[Any] = Query("remove", "Lookup", "first", lambda _r: second, 0, False)
    answer, steps = run(state.ask_flow(first, clock() + 0.1, clock), ["one", "two"], clock)
    assert answer == "two"
    assert [(s.method, s.request) for s in steps if isinstance(s, Ask)] == [
        ("Lookup", "first"),
        ("Remove", "second"),
    ]
    (delete,) = [s for s in steps if isinstance(s, Delete)]
    assert delete.refs == [ref]
    assert delete.deadline == pytest.approx(clock() + 0.1)


def test_a_failed_ask_ends_the_query_with_its_error(state: ClientState) -> None:
    clock = Clock()
    query: Query[Any] = Query("sizes", "Lookup", "q", lambda r: r, [], False)
    with pytest.raises(UnavailableError):
        run(state.ask_flow(query, clock() + 1, clock), [UnavailableError("down")], clock)
