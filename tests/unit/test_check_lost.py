"""check_lost on hand-made histories and final states: every acknowledged put is still known to
the index, unless removed, superseded, evicted or gone with all its replicas' nodes."""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.chaos import check_lost
from kvpool.chaos.final_state import FaultWindow, FinalState, IndexEntry, NodeState, fault_windows
from kvpool.chaos.history import (
    CheckContext,
    CheckResult,
    History,
    KeyResult,
    Op,
    Outcome,
    Receipt,
)
from kvpool.chaos.values import ValueId

N1 = NodeState(1, "node-1", 11)
N2 = NodeState(2, "node-2", 22)


def put(
    p: int,
    i: int,
    key: str,
    t0: float,
    t1: float,
    *,
    version: int = 0,
    members: Sequence[int] = (1,),
    out: Outcome = "ok",
) -> Op:
    nodes = tuple(f"node-{m}" for m in members)
    receipt = Receipt(version, 1000 + version, version, nodes, tuple(members)) if version else None
    r = KeyResult(key, out, written=ValueId(p, i), receipt=receipt)
    return Op(p, i, "put", out, t0, t1, 0.0, (r,))


def remove(p: int, i: int, key: str, t0: float, t1: float, out: Outcome = "ok") -> Op:
    r = KeyResult(key, out, removed=True if out == "ok" else None)
    return Op(p, i, "remove", out, t0, t1, 0.0, (r,))


def final(
    entries: dict[str, IndexEntry | None],
    nodes: Sequence[NodeState] = (N1, N2),
    *,
    nodes_known: bool = True,
) -> FinalState:
    return FinalState(t=100.0, nodes=list(nodes), nodes_known=nodes_known, entries=entries)


def run(
    ops: Sequence[Op], state: FinalState | None, faults: Sequence[FaultWindow] = ()
) -> CheckResult:
    return check_lost.check(History(ops), CheckContext(final_state=state, faults=faults))


# --- histories that pass ------------------------------------------------------------------------


def test_puts_kept_at_their_version_or_a_newer_one_pass() -> None:
    ops = [
        put(1, 1, "a", 1.0, 2.0, version=5),
        put(1, 2, "b", 1.0, 2.0, version=6),
        put(2, 1, "b", 3.0, 4.0, version=9),
    ]
    state = final({"a": IndexEntry(5, 1005, (1,)), "b": IndexEntry(9, 1009, (1,))})
    result = run(ops, state)
    assert result.ok, result.details
    assert result.counters["acknowledged"] == 3
    assert result.counters["kept"] == 3


def test_a_put_removed_afterwards_is_excused() -> None:
    ops = [put(1, 1, "a", 1.0, 2.0, version=5), remove(2, 1, "a", 3.0, 3.5, "unknown")]
    result = run(ops, final({"a": None}))
    assert result.ok, result.details
    assert result.counters["removed"] == 1


def test_a_remove_concurrent_with_the_put_excuses_it() -> None:
    ops = [remove(2, 1, "a", 0.5, 1.5), put(1, 1, "a", 1.0, 2.0, version=5)]
    result = run(ops, final({"a": None}))
    assert result.ok, result.details


def test_a_put_whose_replicas_all_left_the_node_table_is_excused() -> None:
    ops = [put(1, 1, "a", 1.0, 2.0, version=5, members=(1, 2))]
    result = run(ops, final({"a": None}, nodes=[NodeState(3, "node-1", 33)]))
    assert result.ok, result.details
    assert result.counters["node_lost"] == 1


def test_without_a_node_table_faults_after_the_put_excuse_it() -> None:
    ops = [put(1, 1, "a", 1.0, 2.0, version=5)]
    faults = [FaultWindow("kill", ("node-1",), 2.5, None, "node-kill")]
    result = run(ops, final({"a": None}, nodes=[], nodes_known=False), faults)
    assert result.ok, result.details
    assert result.counters["node_lost"] == 1


def test_a_put_superseded_by_a_newer_acknowledged_put_is_excused() -> None:
    # b's newer put went to node 2, which died; that put is excused with its node, and the
    # older put is superseded by it (the index never had to keep it).
    ops = [
        put(1, 1, "b", 1.0, 2.0, version=5, members=(1,)),
        put(2, 1, "b", 3.0, 4.0, version=8, members=(2,)),
    ]
    result = run(ops, final({"b": None}, nodes=[N1]))
    assert result.ok, result.details
    assert result.counters["superseded"] == 1
    assert result.counters["node_lost"] == 1


def test_a_put_maybe_superseded_by_a_put_of_unknown_fate_is_counted_apart() -> None:
    ops = [put(1, 1, "b", 1.0, 2.0, version=5), put(2, 1, "b", 0.5, 3.0, out="unknown")]
    result = run(ops, final({"b": None}))
    assert result.ok, result.details
    assert result.counters["superseded_uncertain"] == 1


def test_a_put_on_a_node_that_evicted_is_possibly_evicted() -> None:
    evicting = NodeState(1, "node-1", 11, evictions_total=3)
    ops = [put(1, 1, "a", 1.0, 2.0, version=5, members=(1,))]
    result = run(ops, final({"a": None}, nodes=[evicting, N2]))
    assert result.ok, result.details
    assert result.counters["possibly_evicted"] == 1
    assert "1 possibly evicted" in result.summary


def test_unacknowledged_puts_are_not_checked() -> None:
    ops = [put(1, 1, "a", 1.0, 3.0, out="unknown"), put(1, 2, "a", 4.0, 4.1, out="fail")]
    result = run(ops, final({"a": None}))
    assert result.ok
    assert result.counters["acknowledged"] == 0


def test_without_a_final_state_the_check_is_skipped() -> None:
    result = run([put(1, 1, "a", 1.0, 2.0, version=5)], None)
    assert result.ok
    assert result.skipped


def test_a_key_no_master_answered_for_is_unverified_not_lost() -> None:
    state = final({})
    state.unresolved = ["a"]
    result = run([put(1, 1, "a", 1.0, 2.0, version=5)], state)
    assert result.ok
    assert result.counters["unverified"] == 1


# --- histories that must fail ------------------------------------------------------------------


def test_an_acknowledged_put_the_index_forgot_is_lost() -> None:
    ops = [put(1, 1, "a", 1.0, 2.0, version=5, members=(1, 2))]
    result = run(ops, final({"a": None}))
    assert not result.ok
    assert result.counters["lost"] == 1
    assert "no longer knows the key" in result.details[0]
    assert "node-1,node-2" in result.details[0]


def test_one_surviving_replica_is_enough_to_call_it_lost() -> None:
    ops = [put(1, 1, "a", 1.0, 2.0, version=5, members=(1, 2))]
    result = run(ops, final({"a": None}, nodes=[N2]))  # member 1 is gone, member 2 is live
    assert not result.ok


def test_a_remove_that_completed_before_the_put_does_not_excuse_it() -> None:
    ops = [remove(2, 1, "a", 0.1, 0.5), put(1, 1, "a", 1.0, 2.0, version=5)]
    result = run(ops, final({"a": None}))
    assert not result.ok


def test_a_failed_remove_does_not_excuse_it() -> None:
    ops = [put(1, 1, "a", 1.0, 2.0, version=5), remove(2, 1, "a", 3.0, 3.1, "fail")]
    result = run(ops, final({"a": None}))
    assert not result.ok


def test_an_older_put_does_not_supersede_a_newer_one() -> None:
    ops = [put(2, 1, "a", 0.1, 0.5, version=3), put(1, 1, "a", 1.0, 2.0, version=5)]
    result = run(ops, final({"a": None}))
    assert not result.ok
    assert result.counters["lost"] == 1  # the newer one; the older is superseded by it
    assert result.counters["superseded"] == 1
    assert "(version 5)" in result.details[0]


def test_faults_that_ended_before_the_put_do_not_excuse_it() -> None:
    ops = [put(1, 1, "a", 5.0, 6.0, version=5)]
    faults = [FaultWindow("pause", ("node-1",), 1.0, 2.0)]
    result = run(ops, final({"a": None}, nodes=[], nodes_known=False), faults)
    assert not result.ok


def test_an_index_that_went_back_to_an_older_version_fails() -> None:
    ops = [put(1, 1, "a", 1.0, 2.0, version=3), put(1, 2, "a", 3.0, 4.0, version=7)]
    result = run(ops, final({"a": IndexEntry(3, 1003, (1,))}))
    assert not result.ok
    assert "went back to the older version 3" in result.details[0]


def test_another_write_under_the_acknowledged_version_fails() -> None:
    ops = [put(1, 1, "a", 1.0, 2.0, version=5)]
    result = run(ops, final({"a": IndexEntry(5, 999, (1,))}))
    assert not result.ok
    assert "same version" in result.details[0]


def test_fault_windows_pair_each_inject_with_its_heal() -> None:
    steps = [
        {"seq": 1, "phase": "inject", "fault": "node-kill", "kind": "kill", "targets": ["node-1"],
         "monotonic_s": 10.0, "outcome": "ok"},
        {"seq": 2, "phase": "inject", "fault": "leader-pause", "kind": "pause",
         "targets": ["master-2"], "monotonic_s": 11.0, "outcome": "skipped"},
        {"seq": 3, "phase": "inject", "fault": "node-cut", "kind": "partition",
         "targets": ["node-2"], "monotonic_s": 12.0, "outcome": "ok"},
        {"seq": 4, "phase": "heal", "kind": "kill", "targets": ["node-1"], "monotonic_s": 15.0,
         "outcome": "ok", "heals": 1},
    ]  # fmt: skip
    windows = fault_windows(iter(steps))
    assert windows == [
        FaultWindow("kill", ("node-1",), 10.0, 15.0, "node-kill"),
        FaultWindow("partition", ("node-2",), 12.0, None, "node-cut"),
    ]
    assert windows[0].affects_after("node-1", 14.0)
    assert not windows[0].affects_after("node-1", 15.5)
    assert not windows[0].affects_after("node-2", 1.0)
    assert windows[1].affects_after("node-2", 1000.0)
