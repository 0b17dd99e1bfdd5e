"""What both data planes decide around their I/O (:mod:`kvpool.client.rounds`, and the hedge's
give-up in :func:`kvpool.client.hedge.fail_unanswered`): given the items and what happened,
which keys go where, and what each key records."""

from __future__ import annotations

import pytest

from kvpool.client.hedge import fail_unanswered
from kvpool.client.placement import MemberInfo
from kvpool.client.plans import PutItem, ReadItem
from kvpool.client.rounds import (
    next_round,
    out_of_time,
    put_groups,
    read_failed_node,
    read_queue,
    rounds_left,
    silent_node,
    still_unread,
    unreached_puts,
    unreached_reads,
)
from kvpool.errors import DeadlineExceededError, KVPoolError, TransportError, UnavailableError
from kvpool.proto.v1 import common_pb2
from kvpool.proto.wire import Op
from kvpool.transports.calls import Call

A = MemberInfo(1, "node-a", "tcp://a:1", 1 << 30)
B = MemberInfo(2, "node-b", "tcp://b:1", 1 << 30)
LIVE = {1: A, 2: B}


def item(key: str, replicas: list[int]) -> ReadItem:
    entry = common_pb2.BlockEntry(key=key, size_bytes=4, write_id=7)
    return ReadItem(key, key.encode(), entry, sink=None, caller_buffer=False, replicas=replicas)


def put(key: str, *targets: MemberInfo) -> PutItem:
    return PutItem(key, key.encode(), memoryview(b"data"), write_id=7, targets=list(targets))


def test_a_key_with_no_live_replica_is_not_queued_and_fails_as_node_down() -> None:
    placed, unplaced, done = item("a", [1]), item("b", []), item("c", [1])
    done.ok = True
    assert read_queue([placed, unplaced, done]) == [placed]
    assert unplaced.reasons == ["node_down"]
    assert "names no live replica" in str(unplaced.errors[0])
    assert placed.reasons == done.reasons == []


def test_out_of_time_fails_every_queued_key_as_a_timeout() -> None:
    queue = [item("a", [1]), item("b", [1, 2])]
    out_of_time(queue)
    assert [it.reasons for it in queue] == [["timeout"], ["timeout"]]
    assert all(isinstance(it.errors[0], DeadlineExceededError) for it in queue)


def test_the_time_left_is_shared_over_the_most_replicas_still_to_try() -> None:
    one, three = item("a", [1]), item("b", [1, 2, 3])
    three.next = 1
    assert rounds_left([one, three]) == 2


def test_a_read_by_content_keeps_a_round_of_time_for_the_lookup_it_falls_back_to() -> None:
    direct = item("a", [1])
    direct.entry.write_id = 0  # read by content: the node names the write
    assert rounds_left([direct]) == 2, "a paused node gets half the time, not all of it"
    assert rounds_left([direct, item("b", [1, 2, 3])]) == 3


def test_a_round_groups_keys_by_the_node_of_their_next_replica() -> None:
    first_a, first_b, second_a = item("x", [1, 2]), item("y", [2]), item("z", [2, 1])
    second_a.next = 1
    gone = item("w", [9])
    groups = next_round([first_a, first_b, second_a, gone], LIVE.get)
    assert groups == {"tcp://a:1": ([first_a, second_a], A), "tcp://b:1": ([first_b], B)}
    assert [it.next for it in (first_a, first_b, second_a, gone)] == [1, 1, 2, 1]
    assert gone.reasons == ["node_down"]
    assert "member 9 is not live" in str(gone.errors[0])


def test_after_a_round_the_unread_keys_with_a_replica_left_go_again() -> None:
    read, again, spent = item("a", [1, 2]), item("b", [1, 2]), item("c", [1])
    for it in (read, again, spent):
        it.next = 1
    read.ok = True
    heard: list[int] = []
    assert still_unread([read, again, spent], heard.append) == [again]
    assert heard == [1]
    assert still_unread([read], heard.append) == []
    assert heard == [1]  # nothing to retry: nobody is told
    assert still_unread([again], None) == [again]


@pytest.mark.parametrize(
    ("error", "reason", "kind"),
    [
        (DeadlineExceededError("tcp://a:1: connect timed out"), "timeout", DeadlineExceededError),
        (TransportError("tcp://a:1: connect failed"), "node_down", UnavailableError),
    ],
)
def test_a_node_that_cannot_be_reached_fails_its_reads_by_why(
    error: KVPoolError, reason: str, kind: type[KVPoolError]
) -> None:
    group = [item("a", [1]), item("b", [1])]
    unreached_reads(group, error)
    assert [it.reasons for it in group] == [[reason], [reason]]
    assert all(type(it.errors[0]) is kind for it in group)


def test_a_put_goes_to_each_of_its_targets_grouped_by_node() -> None:
    x, y = put("x", A, B), put("y", B)
    assert put_groups([x, y], 1.0) == {"tcp://a:1": [(x, A)], "tcp://b:1": [(x, B), (y, B)]}
    assert x.error is None


def test_a_put_with_no_time_left_sends_nothing_and_fails_each_block() -> None:
    x, y = put("x", A), put("y", B)
    assert put_groups([x, y], 0.0) == {}
    assert isinstance(x.error, DeadlineExceededError)
    assert isinstance(y.error, DeadlineExceededError)
    assert "out of time before sending" in str(x.error)


def test_a_node_that_cannot_be_reached_fails_its_puts_by_why() -> None:
    x, y = put("x", A), put("y", A)
    late = DeadlineExceededError("tcp://a:1: connect timed out")
    unreached_puts([(x, A), (y, A)], late)
    assert x.error is late
    assert y.error is late
    z = put("z", B)
    unreached_puts([(z, B)], TransportError("tcp://b:1: connect failed: refused"))
    assert type(z.error) is UnavailableError
    assert "connect failed: refused" in str(z.error)


def test_keys_a_slow_node_never_answered_fail_as_a_timeout_there() -> None:
    answered, silent = item("a", [1, 2]), item("b", [1, 2])
    answered.ok = True  # by the hedge
    fail_unanswered([answered, silent], "tcp://a:1")
    assert answered.reasons == []
    assert silent.reasons == ["timeout"]
    assert str(silent.errors[0]).startswith("tcp://a:1: 'b': no answer (hedged)")


def test_a_held_node_is_asked_once_a_round_and_its_keys_go_on_to_their_next_replica() -> None:
    asked: list[int] = []

    def sendable(member_id: int) -> bool:
        asked.append(member_id)
        return member_id != 1

    only_a, a_then_b, b = item("x", [1]), item("y", [1, 2]), item("z", [2])
    groups = next_round([only_a, a_then_b, b], LIVE.get, sendable)
    assert sorted(asked) == [1, 2]  # once per member, not per key
    assert list(groups) == ["tcp://b:1"]
    assert groups["tcp://b:1"][0] == [b]
    assert only_a.reasons == a_then_b.reasons == ["node_down"]
    assert "failed a request moments ago" in str(only_a.errors[0])
    assert still_unread([only_a, a_then_b, b], None) == [a_then_b]  # B, next round
    assert next_round([a_then_b], LIVE.get, sendable)["tcp://b:1"][0] == [a_then_b]


def test_only_a_read_left_wholly_unanswered_for_a_while_says_the_node_stopped() -> None:
    late = DeadlineExceededError("no answer in time")
    calls = [Call(Op.GET, b"k"), Call(Op.GET, b"l")]
    assert silent_node(late, calls, waited_s=0.5)
    assert not silent_node(late, calls, waited_s=0.01)  # the call's time was nearly spent
    assert not silent_node(TransportError("reset"), calls, waited_s=0.5)
    assert read_failed_node(TransportError("reset"), calls, waited_s=0.0)  # any other failure
    assert read_failed_node(late, calls, waited_s=0.5)
    assert not read_failed_node(late, calls, waited_s=0.01)
    calls[1].header = object()  # type: ignore[assignment]  # one answer begun: a slow node
    assert not silent_node(late, calls, waited_s=0.5)
