"""check_read_after_ack on hand-made histories: a get invoked after another process's put was
acknowledged finds it (or newer), or misses for a reason that excuses it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kvpool.chaos import check_read_after_ack
from kvpool.chaos.final_state import FaultWindow, FinalState, NodeState, logged_evictions
from kvpool.chaos.history import CheckContext, CheckResult, History, KeyResult, Op
from kvpool.chaos.values import ValueId
from tests.unit.test_check_lost import put, remove


def get(
    p: int, i: int, key: str, t0: float, t1: float, *, read: ValueId | None = None, miss: str = ""
) -> Op:
    r = KeyResult(key, "ok", read=read, miss=miss if read is None else "")
    return Op(p, i, "get", "ok", t0, t1, 0.0, (r,))


def batch_get(p: int, i: int, key: str, t0: float, t1: float) -> Op:
    return Op(p, i, "batch_get", "ok", t0, t1, 0.0, (KeyResult(key, "ok"),))


def run(
    ops: Sequence[Op],
    faults: Sequence[FaultWindow] = (),
    final: FinalState | None = None,
    evicted: frozenset[int] = frozenset(),
) -> CheckResult:
    context = CheckContext(faults=faults, final_state=final, evicted_members=evicted)
    return check_read_after_ack.check(History(ops), context)


def test_reads_of_the_acknowledged_value_or_a_newer_one_pass() -> None:
    ops = [
        put(1, 1, "a", 1.0, 2.0, version=5),
        get(2, 1, "a", 2.1, 2.2, read=ValueId(1, 1)),
        put(3, 1, "a", 2.5, 3.0, version=7),  # concurrent with the next get
        get(2, 2, "a", 2.6, 2.7, read=ValueId(3, 1)),
        get(2, 3, "a", 2.8, 2.9, read=ValueId(1, 1)),  # the newer put is not acknowledged yet
        get(2, 4, "b", 0.5, 0.6, miss="absent"),  # nothing acknowledged before: not judged
    ]
    result = run(ops)
    assert result.ok, result.details
    assert result.counters["judged"] == 3
    assert result.counters["found"] == 3


def test_a_miss_right_after_another_process_was_acknowledged_fails() -> None:
    ops = [put(1, 1, "a", 1.0, 2.0, version=5), get(2, 1, "a", 2.001, 2.01, miss="absent")]
    result = run(ops)
    assert not result.ok
    assert result.counters["lost"] == 1
    assert "missed (absent)" in result.details[0]
    assert "p1#1 put" in result.details[0]


def test_an_older_value_after_a_newer_acknowledgement_is_stale() -> None:
    ops = [
        put(1, 1, "a", 1.0, 2.0, version=5),
        put(3, 1, "a", 3.0, 4.0, version=9),
        get(2, 1, "a", 4.5, 4.6, read=ValueId(1, 1)),
    ]
    result = run(ops)
    assert not result.ok
    assert result.counters["stale"] == 1
    assert "older value" in result.details[0]


def test_misses_with_a_reason_are_excused() -> None:
    ops = [
        put(1, 1, "a", 1.0, 2.0, version=5),
        get(2, 1, "a", 2.1, 2.2, miss="node_down"),  # the bytes were unreachable
        put(1, 2, "b", 1.0, 2.0, version=6),
        remove(3, 1, "b", 2.5, 2.6),
        get(2, 2, "b", 2.7, 2.8, miss="absent"),
        put(1, 3, "c", 1.0, 2.0, version=7, members=(2,)),
        get(2, 3, "c", 5.0, 5.1, miss="absent"),
        put(1, 4, "d", 1.0, 2.0, version=8),
        put(3, 2, "d", 2.5, 9.0, out="unknown"),
        get(2, 4, "d", 3.0, 3.1, miss="absent"),
        batch_get(2, 5, "a", 3.0, 3.1),
    ]
    killed = FaultWindow("kill", ("node-2",), 4.0, 6.0)
    result = run(ops, faults=[killed])
    assert result.ok, result.details
    counters = result.counters
    assert (counters["unavailable"], counters["removed"], counters["node_fault"]) == (1, 1, 1)
    assert counters["superseded_uncertain"] == 1
    assert counters["unjudged_batch"] == 1


def test_a_fault_on_another_node_excuses_nothing() -> None:
    ops = [put(1, 1, "a", 1.0, 2.0, version=5), get(2, 1, "a", 5.0, 5.1, miss="absent")]
    result = run(ops, faults=[FaultWindow("kill", ("node-2",), 3.0, 4.0)])
    assert not result.ok


def test_a_node_that_evicted_excuses_a_miss() -> None:
    ops = [put(1, 1, "a", 1.0, 2.0, version=5), get(2, 1, "a", 5.0, 5.1, miss="evicted")]
    state = FinalState(t=9.0, nodes=[NodeState(1, "node-1", 11, evictions_total=3)])
    result = run(ops, final=state)
    assert result.ok, result.details
    assert result.counters["possibly_evicted"] == 1


def test_an_eviction_by_a_member_a_restart_replaced_excuses_a_miss(tmp_path: Path) -> None:
    # node-1 evicted as member 1, was killed and came back as member 3: the final state knows
    # only member 3 (no eviction yet), the node's log tells of member 1's (a minute-long chaos
    # run with a full SSD failed on 56 such misses)
    log = tmp_path / "node-1.log"
    lines = [
        {"event": "node_registered", "member_id": 1},
        {"event": "blocks_evicted", "count": 13, "member_id": 1},
        {"event": "node_registered", "member_id": 3},
    ]
    log.write_text("\n".join(json.dumps(e) for e in lines) + "\nnot json\n")
    evicted = logged_evictions([str(log), str(tmp_path / "missing.log")])
    assert evicted == {1}
    ops = [put(1, 1, "a", 1.0, 2.0, version=5), get(2, 1, "a", 5.0, 5.1, miss="absent")]
    state = FinalState(t=9.0, nodes=[NodeState(3, "node-1", 12, evictions_total=0)])
    assert not run(ops, final=state).ok
    result = run(ops, final=state, evicted=evicted)
    assert result.ok, result.details
    assert result.counters["possibly_evicted"] == 1


def test_an_older_value_left_on_a_node_the_newer_write_never_reached_is_counted_apart() -> None:
    ops = [
        put(1, 1, "a", 1.0, 2.0, version=5, members=(1,)),
        put(3, 1, "a", 3.0, 4.0, version=9, members=(2,)),  # placed elsewhere
        get(2, 1, "a", 4.5, 4.6, read=ValueId(1, 1)),
    ]
    result = run(ops)
    assert result.ok, result.details
    assert result.counters["stale_orphan"] == 1
    assert "known limit" in result.summary


def test_an_older_value_on_a_node_faulted_meanwhile_is_counted_apart() -> None:
    ops = [
        put(1, 1, "a", 1.0, 2.0, version=5, members=(1,)),
        put(3, 1, "a", 3.0, 4.0, version=9, members=(1,)),  # same node: it replaces the old one
        get(2, 1, "a", 4.5, 4.6, read=ValueId(1, 1)),
    ]
    assert not run(ops).ok  # no fault: the old copy should have been gone
    cut = FaultWindow("link", ("node-1",), 3.5, 6.0)
    result = run(ops, faults=[cut])
    assert result.ok, result.details
    assert result.counters["stale_node_fault"] == 1
