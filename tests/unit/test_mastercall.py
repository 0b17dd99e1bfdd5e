"""A call to the master group (kvpool/mastercall.py), with no sockets. The retry policy
(CallPlan): given how each attempt went, which master is asked next and for how long, when a
redirect is followed, when the caller backs off, and which error it gets when it gives up. Each
attempt (MasterCall): over a master's frame RPC port or gRPC, the port learned first, and how
the answers read."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from kvpool import mastercall, tracing
from kvpool.errors import (
    DeadlineExceededError,
    InternalError,
    InvalidArgumentError,
    KVPoolError,
    NotCaughtUpError,
    NotLeaderError,
    TransportError,
    UnauthenticatedError,
    UnavailableError,
)
from kvpool.mastercall import (
    READ_PORT_HOLD_S,
    Ask,
    Backoff,
    CallGrpc,
    CallPlan,
    CallRpcPort,
    GiveUp,
    Io,
    MasterCall,
    MasterRouting,
    Step,
    Wait,
)
from kvpool.proto.v1 import master_pb2
from kvpool.proto.wire import Header, Op, Status

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


# --- one attempt: the frame RPC port or gRPC (MasterCall) -------------------------------------

RPC_A, RPC_B = "a:2", "b:2"
LOOKUP = master_pb2.LookupRequest(keys=["k"])
FOUND = master_pb2.LookupResponse(revision=7)


class Masters:
    """Masters as a driver sees them: ``grpc``/``rpc`` map (address or RPC port, method) to a
    response, an error, or (on a port) a ``(status, payload)`` answer frame; each call takes
    ``took_s`` of the clock; every Io performed is kept in ``ios``."""

    def __init__(self, clock: Clock, took_s: float = 0.1) -> None:
        self.clock = clock
        self.took_s = took_s
        self.grpc: dict[tuple[str, str], Any] = {}
        self.rpc: dict[tuple[str, str], Any] = {}
        self.ios: list[Io] = []

    def perform(self, io: Io) -> Any:
        self.ios.append(io)
        if isinstance(io, Wait):
            self.clock.now += io.delay_s
            return None
        self.clock.now += self.took_s
        if isinstance(io, CallGrpc):
            answer = self.grpc[io.address, io.method]
        else:
            answer = self.rpc[io.rpc, bytes(io.call.key).decode()]
            if isinstance(answer, tuple):  # a frame: (status, payload)
                io.call.header = Header(op=Op.RPC, status=answer[0])
                io.call.data = memoryview(answer[1])
                return None
        if isinstance(answer, KVPoolError):
            raise answer
        if isinstance(io, CallRpcPort):
            io.call.header = Header(op=Op.RPC, status=Status.OK)
            io.call.data = memoryview(answer.SerializeToString())
            return None
        return answer

    def call(self, routing: MasterRouting, method: str = "Lookup", request: Any = LOOKUP) -> Any:
        """Drive one call as MasterClient.call does; its response (or its error, raised)."""
        plan = CallPlan(
            routing,
            method,
            deadline=self.clock.now + 2.0,
            attempt_timeout_s=ATTEMPT_S,
            backoff=Backoff(rng=random.Random(7)),
        )
        call = MasterCall(plan, request, self.clock)
        result: Any = None
        while (io := call.next(result)) is not None:
            try:
                result = self.perform(io)
            except KVPoolError as e:
                result = e
        return call.response


def where(ios: list[Io]) -> list[str]:
    """Where each call went: a master's gRPC address or its RPC port."""
    return [
        io.address if isinstance(io, CallGrpc) else io.rpc for io in ios if not isinstance(io, Wait)
    ]


def known_ports(clock: Clock) -> MasterRouting:
    """Masters A and B, both RPC ports known, A the leader."""
    routing = MasterRouting([A, B], clock=clock)
    routing.learn_rpc(A, RPC_A)
    routing.learn_rpc(B, RPC_B)
    routing.leader = A
    return routing


def members(rpc: str) -> master_pb2.GetMembersResponse:
    return master_pb2.GetMembersResponse(ring_version=3, rpc_address=rpc)


def test_a_port_is_learned_first_and_the_call_goes_there_with_the_time_left(
    clock: Clock,
) -> None:
    masters = Masters(clock, took_s=0.25)
    masters.grpc[A, "GetMembers"] = members(RPC_A)
    masters.rpc[RPC_A, "Lookup"] = FOUND
    routing = MasterRouting([A], clock=clock)
    assert masters.call(routing) == FOUND
    learn, lookup = masters.ios
    assert learn == CallGrpc(A, "GetMembers", master_pb2.GetMembersRequest(), ATTEMPT_S)
    assert isinstance(lookup, CallRpcPort)
    assert lookup.rpc == RPC_A
    assert lookup.timeout_s == pytest.approx(ATTEMPT_S - 0.25)  # the learning took its part
    assert lookup.call.op == Op.RPC
    assert lookup.call.version == 750_000  # the time the master may take, in µs
    assert master_pb2.LookupRequest.FromString(bytes(lookup.call.payload)) == LOOKUP
    assert routing.rpc_of(A) == RPC_A
    assert routing.leader == A  # a lookup answered there names the leader
    # Known now: the next call goes straight to the port, with the whole attempt.
    masters.ios.clear()
    assert masters.call(routing) == FOUND
    (again,) = masters.ios
    assert isinstance(again, CallRpcPort)
    assert again.timeout_s == ATTEMPT_S


def test_a_getmembers_call_keeps_the_answer_that_taught_the_port(clock: Clock) -> None:
    masters = Masters(clock)
    masters.grpc[A, "GetMembers"] = members(RPC_A)
    routing = MasterRouting([A], clock=clock)
    assert masters.call(routing, "GetMembers", master_pb2.GetMembersRequest()) == members(RPC_A)
    assert len(masters.ios) == 1
    assert routing.rpc_of(A) == RPC_A


@pytest.mark.parametrize(
    "answer",
    [
        members(""),
        InternalError("unimplemented"),
        members("127.0.0.1:notaport"),
        members("127.0.0.1:99999"),
        members("noport"),
    ],
    ids=["no port", "cannot say", "a port that is not a number", "out of range", "no colon"],
)
def test_a_master_without_a_port_is_called_over_grpc(clock: Clock, answer: Any) -> None:
    masters = Masters(clock, took_s=0.25)
    masters.grpc[A, "GetMembers"] = answer
    masters.grpc[A, "Lookup"] = FOUND
    routing = MasterRouting([A], clock=clock)
    assert masters.call(routing) == FOUND
    lookup = masters.ios[1]
    assert isinstance(lookup, CallGrpc)
    assert (lookup.address, lookup.method, lookup.request) == (A, "Lookup", LOOKUP)
    assert lookup.timeout_s == pytest.approx(ATTEMPT_S - 0.25)
    assert routing.rpc_of(A) == ""  # and from now on, without asking again
    masters.ios.clear()
    masters.call(routing)
    assert masters.ios == [CallGrpc(A, "Lookup", LOOKUP, ATTEMPT_S)]


def test_a_call_the_port_does_not_serve_goes_over_grpc_without_learning(clock: Clock) -> None:
    masters = Masters(clock)
    request = master_pb2.PinRequest()
    masters.grpc[A, "Pin"] = master_pb2.PinResponse()
    routing = MasterRouting([A], clock=clock)
    assert masters.call(routing, "Pin", request) == master_pb2.PinResponse()
    assert masters.ios == [CallGrpc(A, "Pin", request, ATTEMPT_S)]
    assert routing.rpc_of(A) is None


def test_a_master_down_while_learning_is_left_for_the_next(clock: Clock) -> None:
    masters = Masters(clock)
    masters.grpc[A, "GetMembers"] = UnavailableError("a: connection refused")
    masters.grpc[B, "GetMembers"] = members(RPC_B)
    masters.rpc[RPC_B, "Lookup"] = FOUND
    routing = MasterRouting([A, B], clock=clock)
    routing.leader = A
    assert masters.call(routing) == FOUND
    assert where(masters.ios) == [A, B, RPC_B]
    assert routing.rpc_of(A) is None  # nothing learned: asked again next time
    assert routing.leader == B


def test_a_port_that_drops_the_call_is_forgotten_and_the_next_master_asked(
    clock: Clock,
) -> None:
    masters = Masters(clock)
    masters.rpc[RPC_A, "Lookup"] = TransportError("a:2: connection reset")
    masters.rpc[RPC_B, "Lookup"] = FOUND
    routing = known_ports(clock)
    assert masters.call(routing) == FOUND
    assert routing.rpc_of(A) is None  # a restarted master listens on another port
    assert routing.rpc_of(B) == RPC_B


def test_an_answer_that_does_not_decode_moves_on_to_the_next_master(clock: Clock) -> None:
    """A frame whose body is not the response (garbled on the way): that master failed this
    attempt, typed (not a protobuf error out of the client), and the next one answers."""
    masters = Masters(clock)
    masters.rpc[RPC_A, "Lookup"] = (Status.OK, b"\xff\xff\xff not a LookupResponse")
    masters.rpc[RPC_B, "Lookup"] = FOUND
    routing = known_ports(clock)
    assert masters.call(routing) == FOUND
    assert where(masters.ios) == [RPC_A, RPC_B]


def test_every_port_dropping_the_call_gives_up_with_the_port_named(clock: Clock) -> None:
    masters = Masters(clock)
    masters.rpc[RPC_A, "Lookup"] = TransportError("a:2: connection reset")
    masters.grpc[A, "GetMembers"] = members(RPC_A)
    routing = MasterRouting([A], clock=clock)
    routing.learn_rpc(A, RPC_A)
    with pytest.raises(DeadlineExceededError, match="over its RPC port a:2: a:2: connection"):
        masters.call(routing)
    assert any(isinstance(io, Wait) for io in masters.ios)


def test_a_port_call_that_timed_out_keeps_the_port(clock: Clock) -> None:
    masters = Masters(clock)
    masters.rpc[RPC_A, "Lookup"] = DeadlineExceededError("a:2: no answer")
    masters.rpc[RPC_B, "Lookup"] = FOUND
    routing = known_ports(clock)
    assert masters.call(routing) == FOUND
    assert routing.rpc_of(A) == RPC_A  # slow, not gone
    assert A not in routing.order()  # held as a master that took the whole attempt


def test_refused_credentials_on_the_port_give_up_at_once(clock: Clock) -> None:
    masters = Masters(clock)
    refused = UnauthenticatedError("wrong cluster token")
    masters.rpc[RPC_A, "Lookup"] = refused
    routing = MasterRouting([A, B], clock=clock)
    routing.learn_rpc(A, RPC_A)
    routing.leader = A
    with pytest.raises(UnauthenticatedError) as raised:
        masters.call(routing)
    assert raised.value is refused
    assert len(masters.ios) == 1
    assert routing.rpc_of(A) == RPC_A


def test_an_error_answered_on_the_port_is_the_typed_error(clock: Clock) -> None:
    """A follower answers NOT_LEADER on its port too: the call follows to the leader."""
    masters = Masters(clock)
    doc = {"code": "NOT_LEADER", "message": "not me", "leader": B}
    masters.rpc[RPC_A, "Lookup"] = (Status.RPC_ERROR, json.dumps(doc).encode())
    masters.rpc[RPC_B, "Lookup"] = FOUND
    routing = known_ports(clock)
    assert masters.call(routing) == FOUND
    assert routing.leader == B
    assert routing.rpc_of(A) == RPC_A


def test_a_port_that_does_not_know_the_call_is_not_used_again(clock: Clock) -> None:
    masters = Masters(clock)
    masters.rpc[RPC_A, "Lookup"] = (Status.BAD_REQUEST, b"unknown op")
    masters.grpc[A, "Lookup"] = FOUND
    routing = MasterRouting([A], clock=clock)
    routing.learn_rpc(A, RPC_A)
    assert masters.call(routing) == FOUND
    assert routing.rpc_of(A) == ""
    assert isinstance(masters.ios[-1], CallGrpc)


# --- the read port ----------------------------------------------------------------------------

READ_A = "a:3"
COMMIT = master_pb2.CommitPutsRequest(request_id=b"r" * 16)


def test_reads_go_to_the_read_port_the_master_offers_and_writes_to_its_rpc_port(
    clock: Clock,
) -> None:
    masters = Masters(clock)
    masters.grpc[A, "GetMembers"] = master_pb2.GetMembersResponse(
        rpc_address=RPC_A, read_address=READ_A
    )
    masters.rpc[READ_A, "Lookup"] = FOUND
    masters.rpc[READ_A, "PrefixMatch"] = master_pb2.PrefixMatchResponse(matched=1)
    masters.rpc[RPC_A, "CommitPuts"] = master_pb2.CommitPutsResponse()
    routing = MasterRouting([A], clock=clock)
    assert masters.call(routing) == FOUND
    prefix = master_pb2.PrefixMatchRequest(keys=["k"])
    assert masters.call(routing, "PrefixMatch", prefix).matched == 1
    assert masters.call(routing, "CommitPuts", COMMIT) == master_pb2.CommitPutsResponse()
    assert where(masters.ios) == [A, READ_A, READ_A, RPC_A]
    assert (routing.rpc_of(A), routing.read_of(A)) == (RPC_A, READ_A)


def test_a_read_port_that_drops_the_call_is_left_for_a_while_and_the_rpc_port_serves_the_reads(
    clock: Clock,
) -> None:
    masters = Masters(clock)
    masters.rpc[READ_A, "Lookup"] = TransportError("a:3: connection reset")
    masters.rpc[RPC_A, "Lookup"] = FOUND
    routing = MasterRouting([A], clock=clock)
    routing.learn_rpc(A, RPC_A, READ_A)
    routing.leader = A
    assert masters.call(routing) == FOUND
    assert where(masters.ios)[0] == READ_A
    assert where(masters.ios)[-1] == RPC_A
    assert (routing.rpc_of(A), routing.read_of(A)) == (RPC_A, "")  # the RPC port stays
    masters.ios.clear()
    clock.now += READ_PORT_HOLD_S - 1
    assert masters.call(routing) == FOUND
    assert where(masters.ios) == [RPC_A]  # still left
    # Then tried again (it may have been full for a moment: read_threads), and used.
    clock.now += 1
    assert routing.read_of(A) == READ_A
    masters.rpc[READ_A, "Lookup"] = FOUND
    masters.ios.clear()
    assert masters.call(routing) == FOUND
    assert where(masters.ios) == [READ_A]
    # A master that offers no read port (an older one): the reads stay on its RPC port.
    routing.learn_rpc(A, RPC_A)
    assert routing.read_of(A) == ""


def test_a_traced_read_goes_to_the_rpc_port(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing.STATE, "enabled", True)
    masters = Masters(clock)
    masters.rpc[RPC_A, "Lookup"] = FOUND
    routing = MasterRouting([A], clock=clock)
    routing.learn_rpc(A, RPC_A, READ_A)
    assert masters.call(routing) == FOUND
    assert where(masters.ios) == [RPC_A]  # the read port's threads make no spans
