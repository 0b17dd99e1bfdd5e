"""What both data planes carry out, driven here step by step with a fake clock and fake nodes —
no socket, no thread, no event loop: a read round by round, hedges included
(:func:`kvpool.client.rounds.read_flow`), and a put's stage (:func:`~kvpool.client.rounds.
stage_flow`)."""

from __future__ import annotations

from kvpool.client.hedge import HedgePolicy
from kvpool.client.placement import MemberInfo
from kvpool.client.plans import NodeStage, PutItem, ReadItem
from kvpool.client.rounds import (
    AwaitReads,
    DropReads,
    NodeReads,
    PlaneRules,
    RoundFlow,
    SendPuts,
    SendReads,
    StageFlow,
    read_flow,
    stage_flow,
)
from kvpool.errors import DeadlineExceededError, TransportError, UnavailableError
from kvpool.proto.v1 import common_pb2
from kvpool.proto.wire import Header, Status

A = MemberInfo(1, "node-a", "tcp://a:1", 1 << 30)
B = MemberInfo(2, "node-b", "tcp://b:1", 1 << 30)
C = MemberInfo(3, "node-c", "tcp://c:1", 1 << 30)
LIVE = {1: A, 2: B, 3: C}
HEDGE = HedgePolicy(enabled=True, base_delay_s=0.01)


def item(key: str, replicas: list[int], size: int = 4) -> ReadItem:
    entry = common_pb2.BlockEntry(key=key, size_bytes=size, write_id=7)
    sink = memoryview(bytearray(size))
    return ReadItem(key, key.encode(), entry, sink=sink, caller_buffer=True, replicas=replicas)


class Nodes:
    """Fake nodes: a silent node never answers; any other answers every read at once, writing
    its name into the sink. Records each step the flow asked for."""

    def __init__(self, silent: set[str] | None = None) -> None:
        self.silent = silent or set()
        self.now = 0.0
        self.steps: list[str] = []
        self.dropped: list[NodeReads] = []
        self.slow: list[int] = []
        self.hedged: list[tuple[int, int]] = []
        self.retried: list[int] = []

    def clock(self) -> float:
        return self.now

    def _answer(self, reads: NodeReads) -> None:
        for it in reads.items:
            assert isinstance(it.sink, memoryview)
            it.sink[:] = reads.address[6:7].encode() * it.sink.nbytes
            it.ok = True

    def perform(self, step: SendReads | AwaitReads | DropReads) -> None:
        """What a data plane does with ``step``: its answer written on the step."""
        if isinstance(step, SendReads):
            sent = [
                NodeReads(a, g, m, step.deadline, step.clones) for a, (g, m) in step.groups.items()
            ]
            self.steps.append(
                "send "
                + ",".join(r.address[6] for r in sent)
                + (" clones" if step.clones else "")
                + (" wait" if step.wait else "")
            )
            if not step.wait:
                step.sent = sent
                return
            for r in sent:
                if r.address in self.silent:
                    for it in r.items:
                        it.fail("timeout", DeadlineExceededError("no answer"))
                else:
                    self._answer(r)
        elif isinstance(step, AwaitReads):
            done = [r for r in step.reads if r.address not in self.silent]
            if step.first:
                done = done[:1]
            for r in done:
                self._answer(r)
            if len(done) < len(step.reads) and not step.first:
                self.now = step.until  # the rest stay silent until then
            self.steps.append(f"await {len(step.reads)}" + (" first" if step.first else ""))
            step.done = done
        else:
            self.steps.append(f"drop {len(step.reads)}")
            self.dropped += step.reads

    def run(self, flow: RoundFlow) -> None:
        for step in flow:
            self.perform(step)

    def read(self, items: list[ReadItem], hedge: HedgePolicy = HEDGE) -> None:
        self.run(
            read_flow(
                items,
                LIVE.get,
                1.0,
                PlaneRules(
                    self.clock,
                    hedge,
                    on_slow=self.slow.append,
                    on_hedge=lambda sent, won: self.hedged.append((sent, won)),
                    on_retry=self.retried.append,
                ),
            )
        )


def values(items: list[ReadItem]) -> list[bytes]:
    return [bytes(it.sink) if it.ok and it.sink is not None else b"" for it in items]


def test_a_round_with_no_other_replica_is_sent_and_finished_in_one_step() -> None:
    nodes = Nodes()
    keys = [item("x", [1]), item("y", [2])]
    nodes.read(keys)
    assert nodes.steps == ["send a,b wait"]
    assert values(keys) == [b"aaaa", b"bbbb"]
    assert nodes.hedged == []


def test_a_key_that_failed_on_its_first_replica_goes_to_the_next_in_a_new_round() -> None:
    nodes = Nodes(silent={"tcp://a:1"})
    key = item("x", [1, 2])
    nodes.read([key], hedge=HedgePolicy(enabled=False))
    assert nodes.steps == ["send a wait", "send b wait"]
    assert values([key]) == [b"bbbb"]
    assert nodes.retried == [1]


def test_a_silent_node_is_hedged_and_its_first_reads_stopped_before_the_clones_settle() -> None:
    nodes = Nodes(silent={"tcp://a:1"})
    slow, fast = item("x", [1, 2]), item("y", [3, 2])
    nodes.read([slow, fast])
    # Both nodes are asked; only C answers within the hedge delay; A's key is sent to B as a
    # clone; B answers; A's read is stopped; the clone's bytes are copied into x's buffer.
    assert nodes.steps == ["send a,c", "await 2", "send b clones", "await 2 first", "drop 1"]
    assert values([slow, fast]) == [b"bbbb", b"cccc"]
    assert [r.address for r in nodes.dropped] == ["tcp://a:1"]
    assert nodes.slow == [1]
    assert nodes.hedged == [(1, 0), (0, 1)]
    assert slow.reasons == []
    assert nodes.dropped[0].items == [slow]


def test_a_slow_node_whose_keys_have_no_replica_elsewhere_is_waited_for_then_given_up() -> None:
    # Each key's next replica is the other node, whose own read in this round is silent too:
    # a hedge there would wait as well. The round is waited out, then its reads are stopped;
    # the last round tries the other replicas (silent too), with nothing left to hedge to.
    nodes = Nodes(silent={"tcp://a:1", "tcp://b:1"})
    x, y = item("x", [1, 2]), item("y", [2, 1])
    nodes.read([x, y])
    assert nodes.hedged == []
    assert nodes.steps == ["send a,b", "await 2", "await 2", "drop 2", "send b,a wait"]
    assert nodes.retried == [2]
    assert x.reasons[0] == y.reasons[0] == "timeout"
    assert str(x.errors[0]) == "tcp://a:1: 'x': no answer in the round's time"


def test_out_of_time_a_read_fails_every_key_as_a_timeout_and_sends_nothing() -> None:
    nodes = Nodes()
    nodes.now = 2.0  # past the deadline of 1.0
    key = item("x", [1, 2])
    nodes.read([key])
    assert nodes.steps == []
    assert key.reasons == ["timeout"]


def test_a_round_that_answers_within_the_hedge_delay_sends_no_clone() -> None:
    nodes = Nodes()
    keys = [item("x", [1, 2]), item("y", [2, 3])]
    nodes.read(keys)
    assert nodes.steps == ["send a,b", "await 2"]
    assert values(keys) == [b"aaaa", b"bbbb"]
    assert nodes.hedged == []
    assert nodes.dropped == []


# --- a put's stage -------------------------------------------------------------------------------


class StagingNodes:
    """Fake nodes for a put's stage: each answers every PUT with ``status`` (by address), or
    cannot be reached (``unreachable``), or stays silent (``silent``: the exchange times out
    after ``waited_s``)."""

    def __init__(self, *, unreachable: str = "", silent: str = "", waited_s: float = 0.5) -> None:
        self.unreachable, self.silent, self.waited_s = unreachable, silent, waited_s
        self.failed: list[int] = []
        self.answered: list[int] = []
        self.steps: list[str] = []

    def rules(self, now: float = 0.0) -> PlaneRules:
        return PlaneRules(
            lambda: now, HEDGE, on_failed=self.failed.append, on_answered=self.answered.append
        )

    def run(self, flow: StageFlow) -> None:
        for step in flow:
            assert isinstance(step, SendPuts)
            self.steps.append("send " + ",".join(p.address[6] for p in step.puts))
            for put in step.puts:
                if put.address == self.unreachable:
                    put.error = TransportError(f"{put.address}: connect failed: refused")
                    continue
                put.plan = NodeStage(put.address, put.group, None)
                put.plan.all_calls()
                if put.address == self.silent:
                    put.error = DeadlineExceededError(f"{put.address}: no answer in time")
                    put.waited_s = self.waited_s
                    continue
                for call in put.plan.calls:
                    call.header = Header(op=call.op, status=Status.OK)


def put(key: str, *targets: MemberInfo) -> PutItem:
    return PutItem(key, key.encode(), memoryview(b"data"), write_id=7, targets=list(targets))


def test_a_put_is_staged_on_every_target_at_once_and_acked_by_those_that_answered() -> None:
    nodes = StagingNodes(unreachable="tcp://b:1")
    x, y = put("x", A, B), put("y", C)
    nodes.run(stage_flow([x, y], 1.0, nodes.rules()))
    assert nodes.steps == ["send a,b,c"]  # one step: every node at once
    assert x.acked == [1]
    assert y.acked == [3]
    assert isinstance(x.error, UnavailableError)  # B's, kept beside A's ack
    assert "connect failed" in str(x.error)
    assert nodes.failed == [2]
    assert nodes.answered == [1, 3]


def test_a_node_silent_for_a_while_is_reported_failed_a_briefly_late_one_is_not() -> None:
    for waited_s, failed in ((0.5, [1]), (0.01, [])):
        nodes = StagingNodes(silent="tcp://a:1", waited_s=waited_s)
        x = put("x", A)
        nodes.run(stage_flow([x], 1.0, nodes.rules()))
        assert x.acked == []
        assert isinstance(x.error, DeadlineExceededError)
        assert nodes.failed == failed
        assert nodes.answered == []


def test_a_put_with_no_time_left_sends_nothing() -> None:
    nodes = StagingNodes()
    x = put("x", A)
    nodes.run(stage_flow([x], 1.0, nodes.rules(now=2.0)))
    assert nodes.steps == []
    assert isinstance(x.error, DeadlineExceededError)
