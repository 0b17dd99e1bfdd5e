"""Leader leases and pre-vote on PySyncObj: reads that see every acknowledged write.

PySyncObj answers reads from local state only (PYSYNCOBJ.md trap 2): a follower may not have
applied a commit yet, and a deposed leader (paused, or cut off) keeps believing it leads. A
lookup answered there misses a block that a put has already acknowledged to another client. So
lookups are answered by the leader only, and only while it holds a **lease**: proof that no
other master can have become leader (and so acknowledged a write this one has not applied).

The protocol, as extra message types on PySyncObj's own authenticated transport:

``kvpool_lease`` (leader → each follower, every ``renew_s``; ``term``, ``seq``)
    The leader keeps the time it sent each ``seq``.
``kvpool_lease_ack`` (follower → leader)
    Sent only by a follower that is in the same term and counts the sender as its leader.
    Before answering, the follower **promises** not to grant a vote or a pre-vote to anyone for
    ``promise_s`` from the moment it received the lease.
``kvpool_prevote`` / ``kvpool_prevote_ack`` (a would-be candidate → the others)
    A follower whose election timer expires first asks "would you vote for me at term+1?"
    without changing any term. A master grants it only if it is not the leader, holds no
    promise (it has not heard from a leader for ``promise_s``) and the asker's log is at least
    as up to date as its own. Only with a majority of grants does the real election start.
``kvpool_prevote_refused`` (a master already at or past the asked term → the asker)
    Carries the refuser's term; an asker behind it takes that term as a follower (Raft's rule
    for any higher term seen; etcd does the same on a refused pre-vote), so its next round asks
    for a term the refuser can grant. Without it a master stuck at a higher term — a candidate
    that cannot win, its log behind — refused every pre-vote of the master that could win,
    whose term never moved: no leader until the group changed (a cut-off leader's majority
    stayed leaderless in ``tests/chaos/test_harness.py``).
``kvpool_stale_append`` (a master at a higher term → a leader whose append it ignored)
    PySyncObj drops an append of an older term without a word, so a master stuck at a higher
    term while a leader leads (a candidate that lost its real vote: its pre-vote was granted,
    then the voters promised the leader) stayed out of the group for as long as that leader
    lasted, and the group ran one fault from an outage. It now answers such an append with its
    term, and the leader, hearing of a higher term, steps down as Raft's rule says (etcd answers
    the same way when pre-vote is on). The next election, at a term past the stuck master's,
    brings it back: the stuck master grants the former leader's pre-vote and real vote (its own
    log is behind), and the followers, still promised to the former leader, are told the new
    term by its first append. One election.

The lease: the leader holds it while a majority of the group (the leader included) acknowledged
leases sent at or after ``now - lease_s``. Why that is enough: a new leader needs votes from a
majority; any two majorities share a master ``V``; ``V`` acknowledged a lease sent at ``s`` and
promised, from its receipt at ``r >= s``, not to vote until ``r + promise_s``; the leader's lease
from that acknowledgement ended at ``s + lease_s < r + promise_s``. So no other leader exists —
and no write can be acknowledged elsewhere — while the lease is held. If the leader itself
votes for another master, PySyncObj makes it a follower first, and it stops answering. Times
are taken from ``CLOCK_BOOTTIME`` where the platform has it, which keeps running while a process
is paused or a machine suspended: a leader woken from a pause finds its lease expired.
``lease_s`` is ``LEASE_FRACTION`` of ``promise_s``, a margin for clock-rate differences between
hosts and the scheduling of the two processes.

Pre-vote also stops a master that was cut off (or paused) from forcing an election when it
returns: without it, its higher term deposes a working leader (PySyncObj has no pre-vote).

Not supported with leases: PySyncObj's leadership transfer (``transferLeadership``). Followers
holding a promise ignore the transfer target's vote request, so a transfer times out harmlessly
and the old leader keeps leading. kvpool never calls it.

The classes :class:`LeaderLease`, :class:`VotePromise` and :class:`PreVoteRound` are pure (time
is passed in); :class:`LeasedSyncObj` wires them into PySyncObj's tick and message handler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pysyncobj import SyncObj

LEASE_FRACTION = 0.75
LEASE = "kvpool_lease"
LEASE_ACK = "kvpool_lease_ack"
PREVOTE = "kvpool_prevote"
PREVOTE_ACK = "kvpool_prevote_ack"
PREVOTE_REFUSED = "kvpool_prevote_refused"
STALE_APPEND = "kvpool_stale_append"
_KEEP_SENT = 64  # lease sends remembered per term: acknowledgements of older ones are ignored

# PySyncObj's raft states (pysyncobj.syncobj._RAFT_STATE)
FOLLOWER, CANDIDATE, LEADER = 0, 1, 2


def lease_clock() -> Callable[[], float]:
    """A clock that keeps counting while the process is stopped or the machine suspended."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is None:  # not Linux: the monotonic clock (counts while stopped, not suspended)
        return time.monotonic
    return lambda: time.clock_gettime(boottime)


@dataclass(frozen=True)
class LeaseTimes:
    """``promise_s``: how long a follower refuses votes after hearing from its leader;
    ``lease_s``: how long the leader counts on an acknowledged lease; ``renew_s``: how often
    it sends one."""

    promise_s: float
    lease_s: float
    renew_s: float

    @classmethod
    def for_election_timeout(cls, min_timeout_s: float, append_period_s: float) -> LeaseTimes:
        """Promises end just before the earliest election timer can fire, so pre-vote does not
        delay an election after a real leader failure."""
        promise_s = 0.9 * min_timeout_s
        return cls(promise_s, LEASE_FRACTION * promise_s, append_period_s)


def quorum(group_size: int) -> int:
    return group_size // 2 + 1


class LeaderLease:
    """The leader's side: which lease sends each follower acknowledged; until when the lease
    holds. Reset on every change of term or role."""

    def __init__(self, group_size: int, lease_s: float) -> None:
        self.group_size = group_size
        self.lease_s = lease_s
        self.term = -1
        self._sent: dict[int, float] = {}
        self._acked: dict[str, float] = {}  # follower -> latest acknowledged send time
        self.seq = 0
        self.until = float("-inf")

    def reset(self, term: int) -> None:
        self.term = term
        self._sent.clear()
        self._acked.clear()
        self.until = float("-inf") if self.group_size > 1 else float("inf")

    def sent(self, seq: int, now: float) -> None:
        self._sent[seq] = now
        if len(self._sent) > _KEEP_SENT:
            del self._sent[min(self._sent)]

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def acked(self, follower: str, term: int, seq: int) -> None:
        if term != self.term:
            return
        sent_at = self._sent.get(seq)
        if sent_at is None or sent_at <= self._acked.get(follower, float("-inf")):
            return
        self._acked[follower] = sent_at
        needed = quorum(self.group_size) - 1  # the leader counts itself
        if needed <= 0 or len(self._acked) < needed:
            return
        nth = sorted(self._acked.values(), reverse=True)[needed - 1]
        self.until = max(self.until, nth + self.lease_s)

    def held(self, now: float) -> bool:
        return now < self.until


class VotePromise:
    """A follower's side: no vote and no pre-vote for anyone until ``until``."""

    def __init__(self, promise_s: float) -> None:
        self.promise_s = promise_s
        self.until = float("-inf")

    def heard_from_leader(self, now: float) -> None:
        self.until = max(self.until, now + self.promise_s)

    def binding(self, now: float) -> bool:
        return now < self.until


def log_at_least_as_new(
    their_last_term: int, their_last_index: int, my_last_term: int, my_last_index: int
) -> bool:
    """Raft's election restriction: the candidate's log is at least as up to date as ours."""
    if their_last_term != my_last_term:
        return their_last_term > my_last_term
    return their_last_index >= my_last_index


def grant_pre_vote(
    *,
    state: int,
    promise_binding: bool,
    my_term: int,
    their_term: int,
    their_last_term: int,
    their_last_index: int,
    my_last_term: int,
    my_last_index: int,
) -> bool:
    """Would this master vote for the asker at ``their_term``? Nothing changes either way."""
    if state == LEADER or promise_binding or their_term <= my_term:
        return False
    return log_at_least_as_new(their_last_term, their_last_index, my_last_term, my_last_index)


def refusal_term(my_term: int, their_term: int) -> int | None:
    """What a master that refused a pre-vote tells the asker: its own term when it is at or
    past the asked one (the asker is behind: it takes the term, see the module doc), else
    nothing."""
    return my_term if my_term >= their_term else None


def takes_term(state: int, my_term: int, refused_at: int) -> bool:
    """Whether a would-be candidate takes the term a refusal named: any higher term, unless it
    leads (a leader hears of higher terms from its followers' answers, as PySyncObj does)."""
    return state != LEADER and refused_at > my_term


def stale_append_answer(my_term: int, their_term: int) -> int | None:
    """What a master answers an append of ``their_term``: its own term when that is higher
    (the sender leads an older term: PySyncObj ignores the append), else nothing."""
    return my_term if my_term > their_term else None


def steps_down(my_term: int, told: int) -> bool:
    """Whether a master told of ``told`` by a master that ignored its append takes that term
    as a follower: any higher term, a leader's too (Raft's rule for a higher term seen)."""
    return told > my_term


class PreVoteRound:
    """One would-be candidate's round of pre-votes for ``term``."""

    def __init__(self, term: int, group_size: int) -> None:
        self.term = term
        self.needed = quorum(group_size)
        self.granted: set[str] = set()

    def grant(self, voter: str, term: int) -> bool:
        """Count a grant; True once a majority (this master included) said yes."""
        if term == self.term:
            self.granted.add(voter)
        return len(self.granted) + 1 >= self.needed


class CommitQuietSyncObj(SyncObj):  # type: ignore[misc]
    """PySyncObj's SyncObj without the extra round of appends after each commit.

    PySyncObj's leader, having applied newly committed entries, sends every follower an append
    at once only to tell it the new commit index (``__applyLogEntries`` returns "send now").
    Every put then costs each follower two appends and the leader four messages out and four
    in, each pickled, encrypted, decrypted and unpickled on a Raft thread that shares the GIL
    with the event loop. The followers learn the commit index anyway from the next append —
    the next write's, or the heartbeat within ``raft_append_period_s`` — and nothing waits for
    them to apply it: with leases, lookups are answered by the leaseholder only (so only
    :class:`LeasedSyncObj` builds on this; without leases followers answer lookups and must
    apply at once), a new leader commits what it holds after its own no-op entry (Raft's rule),
    and readiness compares what a master applied with the commit index it was told. What a
    follower shows (``kvpool status`` asked of it) may lag the leader by one heartbeat.
    Measured in ``docs/performance.md`` ("One put, half the Raft messages")."""

    def _SyncObj__applyLogEntries(self) -> bool:  # noqa: N802 - PySyncObj's name
        super()._SyncObj__applyLogEntries()
        return False  # the commit index travels with the next append


class LeasedSyncObj(CommitQuietSyncObj):
    """PySyncObj's SyncObj with leader leases and pre-vote (see the module docstring).

    It overrides two of SyncObj's methods, ``_onTick`` and its message handler (name-mangled
    ``_SyncObj__onMessageReceived``), and reads a few private attributes; :func:`check_internals`
    verifies at start that the installed PySyncObj has them."""

    _SyncObj__raftElectionDeadline: float  # PySyncObj's, written by the pre-vote too

    def __init__(
        self,
        self_node: str,
        other_nodes: Iterable[str],
        *,
        times: LeaseTimes,
        clock: Callable[[], float] | None = None,
        **kwargs: Any,
    ) -> None:
        others = list(other_nodes)
        # PySyncObj starts its tick thread inside __init__: everything it uses is set first.
        self.lease_times = times
        self._lease_clock = clock or lease_clock()
        self.lease = LeaderLease(len(others) + 1, times.lease_s)
        self.promise = VotePromise(times.promise_s)
        self._prevote: PreVoteRound | None = None
        self._prevote_won = -1  # the term a pre-vote round was won for
        self._next_renew = 0.0
        self._lease_state = (-1, -1)  # (role, term) the lease was reset for
        self.prevotes_started = 0
        self.votes_refused = 0
        self.stale_appends_answered = 0
        self.stepped_down = 0  # times a stale-append answer made this leader a follower
        super().__init__(self_node, others, **kwargs)

    # read by other threads

    def lease_held(self) -> bool:
        """Leader now, every entry of earlier terms applied here (PySyncObj's no-op entry of
        this term is applied), and a majority acknowledged a recent lease in this term."""
        noop = self._SyncObj__noopIDx
        return bool(
            self._SyncObj__raftState == LEADER
            and self.lease.term == self._SyncObj__raftCurrentTerm
            and noop is not None
            and self._SyncObj__raftLastApplied >= noop
            and self.lease.held(self._lease_clock())
        )

    def ticks_on_messages(self) -> bool:
        """Whether a Raft message received should be followed by a tick at once (Raft ticked on
        the event loop, :mod:`kvpool.raft_master.loop_tick`): not while a follower.

        A follower answers an append inside the message's handler; what its tick would then do
        waits for the next timed tick (a tenth of the tick period, 5 ms by default) without
        anything waiting for it: apply entries the commit index newly covers (with leases
        nothing reads a follower's index, see :class:`CommitQuietSyncObj`), check its election
        timer (reset by that very append), forward commands (kvpool proposes on the leader only).
        Ticked at once, that work ran right after the follower's acknowledgement, on one of the
        two vCPUs the leader needed next to take it and answer the put: one 4 KiB put p50 0.91x
        (three alternating pairs of ``scripts/put_cpu.py``), each follower's CPU per put 0.83x.
        A candidate and a leader tick at once as before: votes, acknowledgements and the
        commit index are theirs to act on."""
        return bool(self._SyncObj__raftState != FOLLOWER)

    # the tick (the Raft thread)

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N802, N803 - PySyncObj's names
        self._before_tick()
        super()._onTick(timeToWait)
        self._after_tick()

    def _before_tick(self) -> None:
        """Turn an expired election timer into a pre-vote round, unless one was just won.

        A master bound by its own promise waits for it to end first: it would vote for itself,
        and its vote is one of those the leader's lease counts on."""
        if self._SyncObj__raftState == LEADER or self._SyncObj__selfNode is None:
            return
        others = self._SyncObj__otherNodes
        if not others or self._SyncObj__transferInProgress:
            return
        if self._SyncObj__raftElectionDeadline >= time.monotonic():
            return
        if not self._SyncObj__connectedToAnyone():
            return
        left_s = self.promise.until - self._lease_clock()
        if left_s > 0:  # this master promised a leader its vote: not even its own, yet
            self._SyncObj__raftElectionDeadline = time.monotonic() + left_s
            return
        term = self._SyncObj__raftCurrentTerm
        if self._prevote_won == term + 1:
            self._prevote_won = -1
            return  # let PySyncObj start the real election in this tick
        self._SyncObj__raftElectionDeadline = (
            time.monotonic() + self._SyncObj__generateRaftTimeout()
        )
        self._prevote = PreVoteRound(term + 1, len(others) + 1)
        self.prevotes_started += 1
        message = {
            "type": PREVOTE,
            "term": term + 1,
            "last_log_index": self._SyncObj__getCurrentLogIndex(),
            "last_log_term": self._SyncObj__getCurrentLogTerm(),
        }
        for node in others:
            self._SyncObj__transport.send(node, message)

    def _after_tick(self) -> None:
        state, term = self._SyncObj__raftState, self._SyncObj__raftCurrentTerm
        if (state, term) != self._lease_state:
            self._lease_state = (state, term)
            self.lease.reset(term)
        if state != LEADER:
            return
        now = self._lease_clock()
        if now < self._next_renew:
            return
        self._next_renew = now + self.lease_times.renew_s
        seq = self.lease.next_seq()
        self.lease.sent(seq, now)
        message = {"type": LEASE, "term": term, "seq": seq}
        for node in self._SyncObj__otherNodes:
            self._SyncObj__transport.send(node, message)

    # messages (the Raft thread)

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:  # noqa: N802
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == LEASE:
            self._on_lease(node, message)
        elif kind == LEASE_ACK:
            if self._SyncObj__raftState == LEADER:
                self.lease.acked(str(node.id), int(message["term"]), int(message["seq"]))
        elif kind == PREVOTE:
            self._on_prevote(node, message)
        elif kind == PREVOTE_ACK:
            self._on_prevote_ack(node, message)
        elif kind == PREVOTE_REFUSED:
            self._on_prevote_refused(message)
        elif kind == STALE_APPEND:
            self._on_stale_append(message)
        elif kind == "request_vote" and self.promise.binding(self._lease_clock()):
            self.votes_refused += 1  # promised: no term change, no vote
        else:
            if kind == "append_entries":
                self._answer_if_stale(node, message)
            super()._SyncObj__onMessageReceived(node, message)
            if kind == "append_entries" and self._heard_from_leader(node, message):
                self.promise.heard_from_leader(self._lease_clock())

    def _heard_from_leader(self, node: Any, message: dict[str, Any]) -> bool:
        return bool(
            self._SyncObj__raftState == FOLLOWER
            and self._SyncObj__raftLeader == node
            and message.get("term") == self._SyncObj__raftCurrentTerm
        )

    def _on_lease(self, node: Any, message: dict[str, Any]) -> None:
        if not self._heard_from_leader(node, message):
            return
        self.promise.heard_from_leader(self._lease_clock())
        self._SyncObj__transport.send(
            node, {"type": LEASE_ACK, "term": message["term"], "seq": message["seq"]}
        )

    def _on_prevote(self, node: Any, message: dict[str, Any]) -> None:
        granted = grant_pre_vote(
            state=self._SyncObj__raftState,
            promise_binding=self.promise.binding(self._lease_clock()),
            my_term=self._SyncObj__raftCurrentTerm,
            their_term=int(message["term"]),
            their_last_term=int(message["last_log_term"]),
            their_last_index=int(message["last_log_index"]),
            my_last_term=self._SyncObj__getCurrentLogTerm(),
            my_last_index=self._SyncObj__getCurrentLogIndex(),
        )
        if granted:
            self._SyncObj__transport.send(node, {"type": PREVOTE_ACK, "term": message["term"]})
        else:
            term = refusal_term(self._SyncObj__raftCurrentTerm, int(message["term"]))
            if term is not None:
                self._SyncObj__transport.send(node, {"type": PREVOTE_REFUSED, "term": term})

    def _on_prevote_refused(self, message: dict[str, Any]) -> None:
        """A master at a higher term refused our pre-vote: take its term, as a follower."""
        term = int(message["term"])
        if takes_term(self._SyncObj__raftState, self._SyncObj__raftCurrentTerm, term):
            self._follow(term)

    def _answer_if_stale(self, node: Any, message: dict[str, Any]) -> None:
        term = stale_append_answer(self._SyncObj__raftCurrentTerm, int(message["term"]))
        if term is not None:
            self.stale_appends_answered += 1
            self._SyncObj__transport.send(node, {"type": STALE_APPEND, "term": term})

    def _on_stale_append(self, message: dict[str, Any]) -> None:
        """A master ignored our append, being at a higher term: step down to that term."""
        term = int(message["term"])
        if steps_down(self._SyncObj__raftCurrentTerm, term):
            self.stepped_down += int(self._SyncObj__raftState == LEADER)
            self._follow(term)

    def _follow(self, term: int) -> None:
        """Take a higher ``term`` as a follower with no leader and no vote given, as PySyncObj
        does on a vote request of a higher term."""
        self._prevote = None
        self._SyncObj__setCurrentTerm(term, None)
        self._SyncObj__setState(FOLLOWER)
        self._SyncObj__raftLeader = None

    def _on_prevote_ack(self, node: Any, message: dict[str, Any]) -> None:
        round_ = self._prevote
        if round_ is None or self._SyncObj__raftState == LEADER:
            return
        if round_.term != self._SyncObj__raftCurrentTerm + 1:
            self._prevote = None  # the term moved on meanwhile
            return
        if round_.grant(str(node.id), int(message["term"])):
            self._prevote = None
            self._prevote_won = round_.term
            self._SyncObj__raftElectionDeadline = 0  # the next tick starts the election


_INTERNALS = (
    "_SyncObj__raftState",
    "_SyncObj__raftCurrentTerm",
    "_SyncObj__raftElectionDeadline",
    "_SyncObj__raftLeader",
    "_SyncObj__otherNodes",
    "_SyncObj__selfNode",
    "_SyncObj__transport",
    "_SyncObj__transferInProgress",
    "_SyncObj__noopIDx",
    "_SyncObj__raftLastApplied",
)
_METHODS = (
    "_onTick",
    "_SyncObj__applyLogEntries",
    "_SyncObj__onMessageReceived",
    "_SyncObj__connectedToAnyone",
    "_SyncObj__generateRaftTimeout",
    "_SyncObj__getCurrentLogIndex",
    "_SyncObj__getCurrentLogTerm",
    "_SyncObj__setCurrentTerm",
    "_SyncObj__setState",
)


def missing_internals(syncobj: SyncObj | None = None) -> list[str]:
    """What :class:`LeasedSyncObj` relies on that the installed PySyncObj lacks: its methods
    (checked on the class) and, given a constructed ``syncobj``, its private attributes."""
    missing = [name for name in _METHODS if not callable(getattr(SyncObj, name, None))]
    if syncobj is not None:
        missing += [name for name in _INTERNALS if not hasattr(syncobj, name)]
    return missing
