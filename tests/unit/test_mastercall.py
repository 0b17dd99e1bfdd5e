"""The retry policy of a call to the master group (kvpool/mastercall.py CallPlan), with no
sockets: given how each attempt went, which master is asked next and for how long, when a
redirect is followed, when the caller backs off, and which error it gets when it gives up."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvpool import mastercall
from kvpool.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    KVPoolError,
    NotCaughtUpError,
    NotLeaderError,
    UnauthenticatedError,
    UnavailableError,
)
from kvpool.mastercall import Ask, Backoff, CallPlan, GiveUp, MasterRouting, Step, Wait

A, B, C = "a:1", "b:1", "c:1"
ATTEMPT_S = 1.0

Answer = Callable[[str, float], tuple[float, KVPoolError | None]]
"""A master's answer to an attempt (its address, the attempt's timeout): how long it took and
the error it raised (None: it answered)."""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def plan_for(
    clock: Clock,
    addresses: list[str],
    *,
    method: str = "CommitPuts",
    budget_s: float = 5.0,
    routing: MasterRouting | None = None,
) -> CallPlan:
    return CallPlan(
        routing or MasterRouting(addresses, clock=clock),
        method,
        deadline=clock.now + budget_s,
        attempt_timeout_s=ATTEMPT_S,
        backoff=Backoff(rng=random.Random(7)),
    )


def drive(plan: CallPlan, clock: Clock, answer: Answer) -> tuple[list[Step], GiveUp | str]:
    """Perform the plan's steps as a driver does, time passing as ``answer`` says; the steps
    taken and the outcome: the master that answered, or the :class:`GiveUp`."""
    steps: list[Step] = []
    step = plan.new_round(clock.now)
    while True:
        steps.append(step)
        if isinstance(step, GiveUp):
            return steps, step
        if isinstance(step, Wait):
            assert step.delay_s >= 0
            clock.now += step.delay_s
            step = plan.new_round(clock.now)
            continue
        assert 0 < step.timeout_s <= ATTEMPT_S
        took_s, error = answer(step.address, step.timeout_s)
        clock.now += min(took_s, step.timeout_s)
        if error is None:
            plan.answered()
            return steps, step.address
        step = plan.failed(error, clock.now)


def asked(steps: list[Step]) -> list[str]:
    return [s.address for s in steps if isinstance(s, Ask)]


def test_the_first_attempt_goes_to_the_known_leader_and_a_lookup_confirms_it(
    clock: Clock,
) -> None:
    routing = MasterRouting([A, B, C], clock=clock)
    routing.leader = B
    plan = plan_for(clock, [], method="Lookup", routing=routing)
    assert plan.new_round(clock.now) == Ask(B, ATTEMPT_S)
    plan.answered()
    assert routing.leader == B


def test_an_answer_any_master_may_give_does_not_name_the_leader(clock: Clock) -> None:
    routing = MasterRouting([A], clock=clock)
    plan = plan_for(clock, [], method="GetMembers", routing=routing)
    assert plan.new_round(clock.now) == Ask(A, ATTEMPT_S)
    plan.answered()
    assert routing.leader is None


def test_a_miss_moves_on_to_the_next_master_at_once(clock: Clock) -> None:
    plan = plan_for(clock, [A, B, C])
    first = plan.new_round(clock.now)
    assert isinstance(first, Ask)
    second = plan.failed(UnavailableError("refused"), clock.now)
    assert isinstance(second, Ask)
    assert second.address != first.address


def test_a_redirect_is_followed_at_once_with_the_leader_first(clock: Clock) -> None:
    routing = MasterRouting([A, B, C], clock=clock)
    plan = plan_for(clock, [], routing=routing)
    first = plan.new_round(clock.now)
    assert isinstance(first, Ask)
    leader = next(a for a in (A, B, C) if a != first.address)
    step = plan.failed(NotLeaderError("not me", leader=leader), clock.now)
    assert step == Ask(leader, ATTEMPT_S)
    assert routing.leader == leader


def test_every_fourth_redirect_backs_off(clock: Clock) -> None:
    """Masters that name each other during an election do not make a busy loop."""
    routing = MasterRouting([A, B], clock=clock)
    plan = plan_for(clock, [], routing=routing)
    step = plan.new_round(clock.now)
    kinds = []
    for _ in range(8):
        assert isinstance(step, Ask)
        other = B if step.address == A else A
        step = plan.failed(NotLeaderError("not me", leader=other), clock.now)
        kinds.append(type(step))
        if isinstance(step, Wait):
            step = plan.new_round(clock.now)
    assert kinds == [Ask, Ask, Ask, Wait, Ask, Ask, Ask, Wait]


def test_a_not_leader_naming_nobody_moves_on_without_a_redirect(clock: Clock) -> None:
    routing = MasterRouting([A, B], clock=clock)
    routing.leader = A
    plan = plan_for(clock, [], routing=routing)
    assert plan.new_round(clock.now) == Ask(A, ATTEMPT_S)
    assert plan.failed(NotLeaderError("no leader yet"), clock.now) == Ask(B, ATTEMPT_S)
    assert routing.leader is None


def test_a_round_with_no_answer_backs_off_then_asks_every_master_again(clock: Clock) -> None:
    plan = plan_for(clock, [A, B])
    plan.new_round(clock.now)
    plan.failed(NotCaughtUpError("applying"), clock.now)
    wait = plan.failed(UnavailableError("no lease yet"), clock.now)
    assert isinstance(wait, Wait)
    assert 0 <= wait.delay_s <= Backoff().base_s
    clock.now += wait.delay_s
    again = [plan.new_round(clock.now), plan.failed(UnavailableError("x"), clock.now)]
    # Masters that answered an error are not held: both are asked again.
    assert sorted(s.address for s in again if isinstance(s, Ask)) == [A, B]


def test_a_paused_master_costs_one_attempt_then_is_left_out(clock: Clock) -> None:
    """The leader paused: its attempt takes the whole attempt timeout, not the whole budget,
    and later rounds ask the others while they elect a new leader."""
    routing = MasterRouting([A, B, C], clock=clock)
    routing.leader = A
    elected = [False]

    def answer(address: str, timeout_s: float) -> tuple[float, KVPoolError | None]:
        if address == A:
            return timeout_s, DeadlineExceededError(f"{address}: timed out")
        if not elected[0]:
            elected[0] = address == C  # C wins after it has been asked once
            # The followers have not heard of the election yet: they name the paused one.
            return 0.001, NotLeaderError("not me", leader=A)
        return 0.001, None if address == C else NotLeaderError("not me", leader=C)

    plan = plan_for(clock, [], method="Lookup", routing=routing, budget_s=10.0)
    steps, outcome = drive(plan, clock, answer)
    assert outcome == C
    assert asked(steps).count(A) == 1
    assert steps[0] == Ask(A, ATTEMPT_S)
    assert routing.leader == C


def test_an_attempt_never_runs_past_the_deadline(clock: Clock) -> None:
    plan = plan_for(clock, [A, B], budget_s=1.5)
    first = plan.new_round(clock.now)
    assert isinstance(first, Ask)
    assert first.timeout_s == ATTEMPT_S
    clock.now += ATTEMPT_S
    step = plan.failed(DeadlineExceededError("timed out"), clock.now)
    assert isinstance(step, Ask)
    assert step.timeout_s == pytest.approx(0.5)


def test_every_master_down_gives_up_at_the_deadline_with_the_last_error(clock: Clock) -> None:
    def down(address: str, timeout_s: float) -> tuple[float, KVPoolError | None]:
        return 0.01, UnavailableError(f"{address}: connection refused")

    start = clock.now
    steps, outcome = drive(plan_for(clock, [A, B, C], budget_s=2.0), clock, down)
    assert isinstance(outcome, GiveUp)
    assert isinstance(outcome.error, DeadlineExceededError)
    assert "Master.CommitPuts: no master answered in time" in outcome.error.message
    assert "connection refused" in outcome.error.message
    assert clock.now == pytest.approx(start + 2.0)  # the waits end at the deadline, not past
    assert set(asked(steps)) == {A, B, C}
    assert any(isinstance(s, Wait) for s in steps)


def test_no_time_left_gives_up_without_asking(clock: Clock) -> None:
    step = plan_for(clock, [A], budget_s=0.0).new_round(clock.now)
    assert isinstance(step, GiveUp)
    assert isinstance(step.error, DeadlineExceededError)
    assert "last error" not in step.error.message


@pytest.mark.parametrize(
    "error", [UnauthenticatedError("bad token"), InvalidArgumentError("bad request")]
)
def test_an_error_retrying_cannot_help_gives_up_at_once(clock: Clock, error: KVPoolError) -> None:
    routing = MasterRouting([A, B], clock=clock)
    routing.leader = A
    plan = plan_for(clock, [], routing=routing)
    plan.new_round(clock.now)
    assert plan.failed(error, clock.now) == GiveUp(error)
    assert routing.leader == A  # not the master's fault
    assert routing.order()[0] == A


def test_a_timed_out_master_is_held_for_the_hold_time_only(clock: Clock) -> None:
    routing = MasterRouting([A, B], clock=clock)
    plan = plan_for(clock, [], routing=routing)
    first = plan.new_round(clock.now)
    assert isinstance(first, Ask)
    clock.now += ATTEMPT_S
    plan.failed(DeadlineExceededError("timed out"), clock.now)
    assert first.address not in routing.order()
    clock.now += mastercall.FAILED_HOLD_S
    assert first.address in routing.order()
