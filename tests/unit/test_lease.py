"""The pure parts of leader leases and pre-vote (raft_master/lease.py): given these events,
expect these decisions. The safety argument they implement is in the module docstring; the
model check at the end replays it over random schedules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.raft_master.lease import (
    CANDIDATE,
    FOLLOWER,
    LEADER,
    LeaderLease,
    LeasedSyncObj,
    LeaseTimes,
    PreVoteRound,
    VotePromise,
    grant_pre_vote,
    log_at_least_as_new,
    missing_internals,
    quorum,
    refusal_term,
    stale_append_answer,
    steps_down,
    takes_term,
)


def test_quorum_is_a_strict_majority() -> None:
    assert [quorum(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]


def test_the_lease_is_shorter_than_the_promise_and_ends_before_any_election_timer() -> None:
    times = LeaseTimes.for_election_timeout(0.4, 0.05)
    assert times.lease_s < times.promise_s < 0.4
    assert times.renew_s == 0.05


def test_a_lease_holds_from_the_send_time_of_a_majority_acknowledgement() -> None:
    lease = LeaderLease(3, lease_s=0.3)
    lease.reset(term=5)
    assert not lease.held(0.0)
    lease.sent(1, now=10.0)
    assert not lease.held(10.0)  # sent, not acknowledged
    lease.acked("b", term=5, seq=1)  # the leader and b: 2 of 3
    assert lease.held(10.29)
    assert not lease.held(10.3)  # counted from the send, not from the acknowledgement


def test_five_masters_need_two_followers() -> None:
    lease = LeaderLease(5, lease_s=0.3)
    lease.reset(term=1)
    lease.sent(1, now=1.0)
    lease.sent(2, now=2.0)
    lease.acked("b", term=1, seq=2)
    assert not lease.held(2.0)
    lease.acked("c", term=1, seq=1)  # the second-best acknowledgement decides: sent at 1.0
    assert lease.held(1.29)
    assert not lease.held(1.31)
    lease.acked("c", term=1, seq=2)
    assert lease.held(2.29)


def test_acknowledgements_of_another_term_or_unknown_sends_are_ignored() -> None:
    lease = LeaderLease(3, lease_s=0.3)
    lease.reset(term=2)
    lease.sent(1, now=1.0)
    lease.acked("b", term=1, seq=1)
    lease.acked("b", term=2, seq=99)
    assert not lease.held(1.0)
    lease.reset(term=3)  # a new term forgets every send and acknowledgement
    lease.acked("b", term=3, seq=1)
    assert not lease.held(1.0)


def test_an_older_acknowledgement_never_shortens_the_lease() -> None:
    lease = LeaderLease(3, lease_s=0.3)
    lease.reset(term=1)
    lease.sent(1, now=1.0)
    lease.sent(2, now=2.0)
    lease.acked("b", term=1, seq=2)
    lease.acked("b", term=1, seq=1)  # late and older: no effect
    assert lease.held(2.2)


def test_only_recent_sends_are_remembered() -> None:
    lease = LeaderLease(3, lease_s=0.3)
    lease.reset(term=1)
    for seq in range(1, 200):
        lease.sent(seq, now=float(seq))
    lease.acked("b", term=1, seq=1)  # long forgotten
    assert not lease.held(1.0)
    lease.acked("b", term=1, seq=199)
    assert lease.held(199.0)


def test_a_group_of_one_always_holds_its_lease() -> None:
    lease = LeaderLease(1, lease_s=0.3)
    lease.reset(term=1)
    assert lease.held(1e9)


def test_a_promise_binds_from_the_last_message_of_the_leader() -> None:
    promise = VotePromise(0.36)
    assert not promise.binding(0.0)
    promise.heard_from_leader(1.0)
    promise.heard_from_leader(0.5)  # an earlier time never shortens it
    assert promise.binding(1.35)
    assert not promise.binding(1.36)


def test_raft_log_comparison() -> None:
    assert log_at_least_as_new(3, 1, 2, 100)
    assert not log_at_least_as_new(2, 100, 3, 1)
    assert log_at_least_as_new(3, 10, 3, 10)
    assert not log_at_least_as_new(3, 9, 3, 10)


def pre_vote(**overrides: object) -> bool:
    args: dict[str, object] = {
        "state": FOLLOWER,
        "promise_binding": False,
        "my_term": 4,
        "their_term": 5,
        "their_last_term": 4,
        "their_last_index": 10,
        "my_last_term": 4,
        "my_last_index": 10,
    }
    args.update(overrides)
    return grant_pre_vote(**args)  # type: ignore[arg-type]


def test_pre_votes_are_granted_only_without_a_leader_and_to_a_log_as_new() -> None:
    assert pre_vote()
    assert pre_vote(state=CANDIDATE)
    assert not pre_vote(state=LEADER)
    assert not pre_vote(promise_binding=True)  # heard from a leader lately
    assert not pre_vote(their_term=4)  # not ahead of this master's term
    assert not pre_vote(their_last_index=9)
    assert not pre_vote(their_last_term=3, their_last_index=50)


def test_a_master_stuck_at_a_higher_term_no_longer_blocks_the_one_that_can_win() -> None:
    """Three masters, the leader cut off. The other two: A, a candidate at term 2 whose log is
    behind (it never caught up), and B, a follower still at term 1 with the whole log. A cannot
    win (B refuses a log older than its own); B asks for term 2, which A, already there,
    refuses. Told A's term, B takes it, asks for term 3 and is granted: a leader again."""
    a_term, a_log = 2, (1, 1)  # term, (last log term, last log index)
    b_term, b_log = 1, (1, 6)

    def a_grants(asked: int) -> bool:
        """A's answer to B's pre-vote for term ``asked``."""
        return pre_vote(
            state=CANDIDATE,
            my_term=a_term,
            their_term=asked,
            their_last_term=b_log[0],
            their_last_index=b_log[1],
            my_last_term=a_log[0],
            my_last_index=a_log[1],
        )

    # B's pre-vote for term 2: refused by A (not ahead of A's term), with A's term.
    asked = b_term + 1
    assert not a_grants(asked)
    told = refusal_term(a_term, asked)
    assert told == 2
    assert takes_term(FOLLOWER, b_term, told)
    b_term = told
    # B's next round, for term 3: granted by A; with B's own, a majority of three.
    asked = b_term + 1
    assert a_grants(asked)
    assert PreVoteRound(term=asked, group_size=3).grant("A", term=asked)
    # And A's own pre-votes stay refused by B (its log is behind), with nothing to tell it.
    assert not pre_vote(
        state=FOLLOWER,
        my_term=b_term,
        their_term=a_term + 1,
        their_last_term=a_log[0],
        their_last_index=a_log[1],
        my_last_term=b_log[0],
        my_last_index=b_log[1],
    )
    assert refusal_term(b_term, a_term + 1) is None


def test_only_a_term_ahead_is_told_and_taken() -> None:
    assert refusal_term(my_term=5, their_term=5) == 5  # already there: the asker is behind
    assert refusal_term(my_term=7, their_term=5) == 7
    assert refusal_term(my_term=4, their_term=5) is None  # refused for another reason
    assert takes_term(FOLLOWER, my_term=4, refused_at=5)
    assert takes_term(CANDIDATE, my_term=4, refused_at=5)
    assert not takes_term(FOLLOWER, my_term=5, refused_at=5)
    assert not takes_term(LEADER, my_term=4, refused_at=5)


def test_an_append_of_an_older_term_is_answered_and_its_leader_steps_down() -> None:
    """A master stuck at term 5 while a leader leads term 2 answers the leader's append with
    its term, and the leader takes it as a follower; no other append is answered, and no
    lower or equal term is taken."""
    assert stale_append_answer(my_term=5, their_term=2) == 5
    assert stale_append_answer(my_term=2, their_term=2) is None  # the leader's own term
    assert stale_append_answer(my_term=2, their_term=3) is None  # a newer leader: followed
    assert steps_down(my_term=2, told=5)
    assert not steps_down(my_term=5, told=5)
    assert not steps_down(my_term=6, told=5)  # a late answer from before our own election


def test_only_a_follower_leaves_its_tick_to_the_timer_after_a_message() -> None:
    """Ticked on the event loop, a follower's Raft events ask for no tick (it answers appends in
    the message's handler; applying waits for the timer); a candidate counts votes and a leader
    acknowledgements at once."""
    member = LeasedSyncObj.__new__(LeasedSyncObj)  # the state alone: no sockets, no Raft thread
    ticks = {}
    for state in (FOLLOWER, CANDIDATE, LEADER):
        member._SyncObj__raftState = state
        ticks[state] = member.ticks_on_messages()
    assert ticks == {FOLLOWER: False, CANDIDATE: True, LEADER: True}


def test_a_pre_vote_round_needs_a_majority_with_the_asker() -> None:
    three = PreVoteRound(term=7, group_size=3)
    assert not three.grant("b", term=6)  # another round's answer
    assert three.grant("b", term=7)
    five = PreVoteRound(term=7, group_size=5)
    assert not five.grant("b", term=7)
    assert not five.grant("b", term=7)  # the same voter twice counts once
    assert five.grant("c", term=7)


def test_the_installed_pysyncobj_has_what_leases_build_on() -> None:
    assert missing_internals() == []


# --- the safety argument, checked over random schedules -------------------------------------


@st.composite
def schedules(draw: st.DrawFn) -> tuple[int, list[tuple[str, int, float]]]:
    """Events over time for one old leader (member 0) of a group: lease messages it sends,
    acknowledgements that arrive after a delay, and a would-be new leader's vote requests."""
    n = draw(st.sampled_from([3, 5]))
    events: list[tuple[str, int, float]] = []
    t = 0.0
    for _ in range(draw(st.integers(1, 25))):
        t += draw(st.floats(0.0, 0.2))
        kind = draw(st.sampled_from(["lease", "vote"]))
        member = draw(st.integers(1, n - 1))
        delay = draw(st.floats(0.0, 0.5))
        events.append((kind, member, t + (delay if kind == "lease" else 0.0)))
        if kind == "lease":
            events.append(("sent", member, t))
    return n, events


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_no_new_leader_can_be_elected_while_the_old_one_holds_its_lease(
    schedule: tuple[int, list[tuple[str, int, float]]],
) -> None:
    """Each follower promises on receipt; a vote request at time t is granted by those whose
    promise no longer binds. If a majority (counting the candidate, member n-1 here, which is
    bound by its own promise too) grants, a new leader exists from t: the old leader's lease
    must have ended by then."""
    n, events = schedule
    times = LeaseTimes.for_election_timeout(0.4, 0.05)
    lease = LeaderLease(n, times.lease_s)
    lease.reset(term=1)
    promises = {m: VotePromise(times.promise_s) for m in range(1, n)}
    seq_of: dict[tuple[int, float], int] = {}
    seq = 0
    for kind, member, at in sorted(events, key=lambda e: (e[2], e[0] != "sent")):
        if kind == "sent":
            seq += 1
            seq_of[(member, at)] = seq
            lease.sent(seq, at)
        elif kind == "lease":
            sent_at = max(s for (m, s) in seq_of if m == member and s <= at)
            promises[member].heard_from_leader(at)
            lease.acked(str(member), 1, seq_of[(member, sent_at)])
        else:
            granted = [m for m, p in promises.items() if not p.binding(at)]
            if len(granted) >= quorum(n):  # the old leader is not among the voters
                assert not lease.held(at), (at, lease.until)


def test_the_schedule_model_can_see_a_violation() -> None:
    """The check above is not vacuous: a lease as long as the promise would break it."""
    lease = LeaderLease(3, lease_s=1.0)
    lease.reset(term=1)
    promise = VotePromise(0.36)
    lease.sent(1, 0.0)
    promise.heard_from_leader(0.0)
    lease.acked("1", 1, 1)
    at = 0.5
    assert not promise.binding(at)
    with pytest.raises(AssertionError):
        assert not lease.held(at)
