"""Which master a call asks (kvpool/mastercall.py MasterRouting): the leader first, redirects
followed, and a master that just failed left out while others can answer — a paused leader
costs a writer one attempt, not one per retry until the others have elected a new one."""

from __future__ import annotations

import pytest

from kvpool import mastercall
from kvpool.errors import NotLeaderError
from kvpool.mastercall import MasterRouting

A, B, C = "a:1", "b:1", "c:1"


@pytest.fixture
def clock() -> list[float]:
    return [100.0]


def routing_at(clock: list[float], addresses: list[str]) -> MasterRouting:
    return MasterRouting(addresses, clock=lambda: clock[0])


def test_the_leader_is_asked_first_once_a_redirect_named_it(clock: list[float]) -> None:
    routing = routing_at(clock, [A, B, C])
    assert sorted(routing.order()) == [A, B, C]
    assert routing.not_leader(B, NotLeaderError("not me", leader=C))
    assert routing.order()[0] == C


def test_a_master_that_failed_is_left_out_for_a_while(clock: list[float]) -> None:
    routing = routing_at(clock, [A, B, C])
    routing.not_leader(B, NotLeaderError("not me", leader=A))
    routing.failed(A, slow=True)  # the leader paused: the call to it timed out
    assert A not in routing.order()
    # A follower that has not seen the election yet still names it: not followed.
    assert not routing.not_leader(B, NotLeaderError("not me", leader=A))
    assert routing.leader is None
    clock[0] += mastercall.FAILED_HOLD_S
    assert A in routing.order()
    assert routing.not_leader(B, NotLeaderError("not me", leader=A))


def test_when_every_master_failed_lately_all_are_asked(clock: list[float]) -> None:
    routing = routing_at(clock, [A, B])
    routing.failed(A, slow=True)
    routing.failed(B, slow=True)
    assert sorted(routing.order()) == [A, B]
    routing.succeeded(A, leader_only=True)
    assert routing.order() == [A]


def test_a_master_that_answered_an_error_is_asked_again_at_once(clock: list[float]) -> None:
    routing = routing_at(clock, [A, B])
    routing.not_leader(B, NotLeaderError("not me", leader=A))
    routing.failed(A)  # e.g. the leader has no read lease yet: it answered, retry it
    assert A in routing.order()
    assert routing.not_leader(B, NotLeaderError("not me", leader=A))


def test_a_refused_rpc_port_is_learned_again() -> None:
    routing = MasterRouting([A])
    routing.learn_rpc(A, "a:9")
    routing.forget_rpc(A, "a:8")  # another port than the one learned: kept
    assert routing.rpc_of(A) == "a:9"
    routing.forget_rpc(A, "a:9")
    assert routing.rpc_of(A) is None
