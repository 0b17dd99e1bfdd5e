"""Leases and pre-vote inside real PySyncObj groups: three members in this process on loopback,
with a switch that drops every message between one member and the others (a partition).

What a user would notice without these guards: a master cut off for a while comes back with a
higher term and deposes a healthy leader (an election, writes pause); a leader cut off keeps
answering lookups from its old copy while the others elect a new one and acknowledge writes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pysyncobj import SyncObj, SyncObjConf

from kvpool.launcher.placement import free_port
from kvpool.raft_master.lease import CANDIDATE, LEADER, LeasedSyncObj, LeaseTimes
from kvpool.raft_master.replication import ELECTION_COUNTS

pytestmark = pytest.mark.integration

MIN_TIMEOUT_S, MAX_TIMEOUT_S, APPEND_S = 0.3, 0.6, 0.05


class Cut:
    """Members whose messages are dropped, both ways."""

    def __init__(self) -> None:
        self.members: set[str] = set()

    def drops(self, receiver: str, sender: str) -> bool:
        return bool(self.members) and ((receiver in self.members) != (sender in self.members))


def _drop_or_pass(obj: Any, node: Any, message: Any, deliver: Any) -> None:
    if obj.cut.drops(obj.me, str(node.id)):
        return
    deliver(node, message)


class CuttableLeased(LeasedSyncObj):
    def __init__(self, me: str, others: list[str], cut: Cut, **kwargs: Any) -> None:
        self.me, self.cut = me, cut
        self.stick_at: int | None = None  # a term to jump to as a candidate, on the Raft thread
        super().__init__(me, others, **kwargs)

    def _onTick(self, timeToWait: float = 0.0) -> None:  # noqa: N803 - PySyncObj's names
        term, self.stick_at = self.stick_at, None
        if term is not None:  # what a candidate that lost its real vote is left with
            self._SyncObj__setCurrentTerm(term, None)
            self._SyncObj__setState(CANDIDATE)
            self._SyncObj__raftLeader = None
        super()._onTick(timeToWait)

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:
        _drop_or_pass(self, node, message, super()._SyncObj__onMessageReceived)


class CuttablePlain(SyncObj):  # type: ignore[misc]
    def __init__(self, me: str, others: list[str], cut: Cut, **kwargs: Any) -> None:
        self.me, self.cut = me, cut
        super().__init__(me, others, **kwargs)

    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:
        _drop_or_pass(self, node, message, super()._SyncObj__onMessageReceived)


def conf() -> SyncObjConf:
    return SyncObjConf(
        password="lease-test",
        autoTick=True,
        autoTickPeriod=0.01,
        appendEntriesUseBatch=False,
        raftMinTimeout=MIN_TIMEOUT_S,
        raftMaxTimeout=MAX_TIMEOUT_S,
        appendEntriesPeriod=APPEND_S,
        leaderFallbackTimeout=2.0,
        connectionTimeout=1.0,
        connectionRetryTime=0.2,
        dynamicMembershipChange=False,
    )


def make_group(leased: bool) -> tuple[list[Any], Cut]:
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    cut = Cut()
    members: list[Any] = []
    for me in addresses:
        others = [a for a in addresses if a != me]
        if leased:
            times = LeaseTimes.for_election_timeout(MIN_TIMEOUT_S, APPEND_S)
            members.append(CuttableLeased(me, others, cut, times=times, conf=conf()))
        else:
            members.append(CuttablePlain(me, others, cut, conf=conf()))
    return members, cut


@pytest.fixture
def groups() -> Iterator[list[list[Any]]]:
    made: list[list[Any]] = []
    try:
        yield made
    finally:
        for group in made:
            for member in group:
                member.destroy_synchronous()


def wait_leader(members: list[Any], timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leaders = [m for m in members if m._isLeader()]
        if len(leaders) == 1 and all(m._getLeader() is not None for m in members):
            return leaders[0]
        time.sleep(0.02)
    raise AssertionError("no single leader in time")


def cut_a_follower_then_heal(members: list[Any], cut: Cut) -> tuple[Any, int, Any, int]:
    leader = wait_leader(members)
    time.sleep(0.5)
    term = leader.raftCurrentTerm
    follower = next(m for m in members if m is not leader)
    cut.members = {follower.me}
    time.sleep(2.0)  # several election timeouts on the cut member
    cut.members = set()
    time.sleep(1.5)
    return leader, term, follower, wait_leader(members).raftCurrentTerm


def test_a_follower_cut_off_does_not_depose_the_leader_when_it_returns(
    groups: list[list[Any]],
) -> None:
    members, cut = make_group(leased=True)
    groups.append(members)
    leader, term, follower, term_after = cut_a_follower_then_heal(members, cut)
    assert leader._isLeader()
    assert term_after == term  # no election happened
    assert follower.raftCurrentTerm == term
    assert follower.prevotes_started >= 2  # it kept asking, and was refused


def test_without_pre_vote_the_returning_follower_forces_an_election(
    groups: list[list[Any]],
) -> None:
    """The guard above is what prevents it: PySyncObj alone elects again."""
    members, cut = make_group(leased=False)
    groups.append(members)
    _, term, _, term_after = cut_a_follower_then_heal(members, cut)
    assert term_after > term


def test_a_leader_cut_off_loses_its_lease_before_anyone_else_leads(
    groups: list[list[Any]],
) -> None:
    members, cut = make_group(leased=True)
    groups.append(members)
    old = wait_leader(members)
    time.sleep(0.5)
    assert old.lease_held()
    last_held = [time.monotonic()]
    new_leader_at: list[float] = []
    stop = threading.Event()

    def watch() -> None:  # sample both facts as often as the GIL allows
        while not stop.is_set():
            now = time.monotonic()
            if old.lease_held():
                last_held[0] = now
            if not new_leader_at and any(m._isLeader() for m in members if m is not old):
                new_leader_at.append(now)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    cut.members = {old.me}
    try:
        deadline = time.monotonic() + 10
        while not new_leader_at and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        watcher.join()
    assert new_leader_at, "the majority elected no leader"
    assert last_held[0] < new_leader_at[0]
    assert old._SyncObj__raftState == LEADER or not old.lease_held()
    new = next(m for m in members if m is not old and m._isLeader())
    time.sleep(0.3)
    assert new.lease_held()  # the majority side serves reads again
    assert not old.lease_held()
    cut.members = set()
    wait_leader(members)
    assert not old._isLeader()
    print(f"\nold lease last held {new_leader_at[0] - last_held[0]:.3f}s before the new leader")


def test_a_master_stuck_at_a_higher_term_rejoins_the_group(groups: list[list[Any]]) -> None:
    """A candidate that lost its real vote is left at a term above the leader's. PySyncObj
    ignores the leader's appends of the older term without a word: it stayed out of the group
    for as long as that leader led (one more fault, an outage). It now tells the leader its
    term; the leader steps down and the next election, at a term past the stuck one, takes all
    three in again."""
    members, _ = make_group(leased=True)
    groups.append(members)
    leader = wait_leader(members)
    time.sleep(0.5)
    stuck = next(m for m in members if m is not leader)
    term = leader.raftCurrentTerm
    stuck.stick_at = term + 3
    started = time.monotonic()
    deadline = started + 10
    while time.monotonic() < deadline:
        if stuck.raftCurrentTerm >= term + 3 and stuck._getLeader() is not None:
            break
        time.sleep(0.02)
    new = wait_leader(members)
    # The others learn the new term from the new leader's first append: a tick or so later.
    while time.monotonic() < deadline:
        if len({(m.raftCurrentTerm, m._getLeader()) for m in members}) == 1:
            break
        time.sleep(0.02)
    print(f"\nrejoined {time.monotonic() - started:.3f}s after it was stuck")
    assert {m.raftCurrentTerm for m in members} == {new.raftCurrentTerm}
    assert new.raftCurrentTerm > term + 3
    assert all(m._getLeader() == new._getLeader() for m in members)
    assert stuck.stale_appends_answered >= 1
    assert leader.stepped_down == 1
    # What a master's metrics export (kvpool_raft_*_total) are these very counters.
    assert all(isinstance(getattr(leader, name), int) for name in ELECTION_COUNTS)
    time.sleep(1.0)  # and it stays settled: no further election
    assert wait_leader(members) is new
    assert {m.raftCurrentTerm for m in members} == {new.raftCurrentTerm}
