"""Failure detection: the leader decides with its own monotonic clock, the log records it.

:class:`FailureDetector` is pure (fed heartbeats, leadership changes and the live member ids,
asked which members are silent for longer than ``node_timeout_s``, measured from the later of
their last heartbeat and the start of this leadership, so a new leader gives every node a full
timeout to find it). :class:`FailureLoop` is the thin async shell on the leader: every ~0.25 s it
proposes ``MarkMemberDown(member, "heartbeat_timeout")`` for expired members and purges dead
members' replicas with ``DropReplicas`` commands of at most :data:`PURGE_CHUNK_KEYS` keys read
from the reverse index — once a member has been dead for ``restore_grace_s`` on this leader's
clock: a node that restarts with its SSD tier claims its blocks back (``ClaimReplicas`` with
restore), which needs the entries to still be there, and not while the replica loop is still
re-replicating that member's blocks (``hold_purge``: repair reads each block's pre-loss replica
count from them). Lookups never name a dead member, so the grace costs memory, never a wrong
answer.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvpool.errors import KVPoolError
from kvpool.logs import get_logger
from kvpool.raft_master.commands import DropReplicas, MarkMemberDown, MarkMemberDownResult
from kvpool.raft_master.index import BlockIndex
from kvpool.raft_master.replication import Replicator

PURGE_CHUNK_KEYS = 5000
"""Most keys one DropReplicas command of a purge names."""
LOOP_PERIOD_S = 0.25
_PURGE_BUDGET_S = 0.2  # most time one loop iteration spends purging


class FailureDetector:
    """Which live members have been silent for ``node_timeout_s``. Pure: no clock of its own."""

    def __init__(self, node_timeout_s: float) -> None:
        self.node_timeout_s = node_timeout_s
        self._leader_since: float | None = None
        self._last_seen: dict[int, float] = {}  # silence is measured from here
        self._heard: dict[int, float] = {}  # real heartbeats only (for status)

    @property
    def leading(self) -> bool:
        return self._leader_since is not None

    def became_leader(self, now: float) -> None:
        self._leader_since = now
        self._last_seen.clear()
        self._heard.clear()

    def lost_leadership(self) -> None:
        self._leader_since = None
        self._last_seen.clear()
        self._heard.clear()

    def heartbeat(self, member_id: int, now: float) -> None:
        previous = self._last_seen.get(member_id)
        if previous is None or now > previous:
            self._last_seen[member_id] = now
        if now > self._heard.get(member_id, float("-inf")):
            self._heard[member_id] = now

    def members(self, live_ids: Iterable[int], now: float | None = None) -> None:
        """The live members now; a member seen for the first time counts as heard from at
        ``now`` (when given), members no longer live are forgotten."""
        live = list(live_ids)
        keep = dict.fromkeys(live)
        for member_id in [m for m in self._last_seen if m not in keep]:
            del self._last_seen[member_id]
            self._heard.pop(member_id, None)
        if now is not None:
            for member_id in live:
                self._last_seen.setdefault(member_id, now)
        else:
            for member_id in live:
                self._last_seen.setdefault(member_id, float("-inf"))

    def forget(self, member_id: int) -> None:
        self._last_seen.pop(member_id, None)
        self._heard.pop(member_id, None)

    def last_seen_age(self, member_id: int, now: float) -> float | None:
        """Seconds since this leader last received a heartbeat from the member, or None."""
        heard = self._heard.get(member_id)
        return None if heard is None else max(0.0, now - heard)

    def expired(self, now: float) -> list[int]:
        """Members silent for ``node_timeout_s`` since max(last heartbeat, leadership start);
        nothing while not leading."""
        if self._leader_since is None:
            return []
        out = []
        for member_id, seen in self._last_seen.items():
            if now - max(seen, self._leader_since) >= self.node_timeout_s:
                out.append(member_id)
        return sorted(out)


class FailureLoop:
    """The leader-only shell around :class:`FailureDetector`: declares silent members down and
    purges dead members' replicas in chunks."""

    def __init__(
        self,
        replicator: Replicator,
        detector: FailureDetector,
        *,
        commit_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        established: Callable[[], bool] | None = None,
        logger: Any = None,
        period_s: float = LOOP_PERIOD_S,
        restore_grace_s: float = 0.0,
        hold_purge: Callable[[int], bool] | None = None,
    ) -> None:
        self._replicator = replicator
        self._established = established or replicator.is_ready
        self._detector = detector
        self._commit_timeout_s = commit_timeout_s
        self._clock = clock
        self._log = logger or get_logger("kvpool.raft_master.failure")
        self._period_s = period_s
        self._restore_grace_s = restore_grace_s
        self._hold_purge = hold_purge or (lambda member_id: False)
        self._dead_since: dict[int, float] = {}  # dead member -> when this leader saw it so
        self.declared_down: list[int] = []  # member ids this loop declared down (tests, stats)
        self._term: int | None = None  # the term of the leadership the detector measures

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except KVPoolError as e:  # no quorum, leadership lost mid-way: try again later
                self._log.info("failure_check_deferred", error=e.message)
            except Exception:
                self._log.exception("failure_check_failed")
            await asyncio.sleep(self._period_s)

    async def step(self) -> None:
        now = self._clock()
        if not self._replicator.leads():  # lost, or a lease lapsed: time it anew when back
            if self._detector.leading:
                self._detector.lost_leadership()
            self._term = None
            self._dead_since.clear()
            return
        term = self._replicator.term()
        if term != self._term:  # a new leadership, even if lost and regained between steps
            self._detector.became_leader(now)
            self._term = term
            self._dead_since.clear()
        if not self._established():
            return  # not caught up with the log yet: the member table may be stale
        live = self._replicator.read(lambda ix: [m.member_id for m in ix.live_members()])
        self._detector.members(live, now)
        for member_id in self._detector.expired(now):
            await self._declare_down(member_id)
        await self._purge(now)

    async def _declare_down(self, member_id: int) -> None:
        record = self._replicator.read(lambda ix: ix.member(member_id))
        result = await self._replicator.propose(
            MarkMemberDown(os.urandom(16), member_id, "heartbeat_timeout"),
            self._commit_timeout_s,
        )
        self._detector.forget(member_id)
        if isinstance(result, MarkMemberDownResult) and result.changed:
            self.declared_down.append(member_id)
            self._log.warning(
                "node_declared_down",
                node=record.node_id if record else "?",
                member_id=member_id,
                reason="heartbeat_timeout",
                timeout_s=self._detector.node_timeout_s,
                ring_version=result.ring_version,
            )

    async def _purge(self, started: float) -> None:
        """Drop dead members' replicas from the entries, a chunk per command, within a budget."""

        dead = self._replicator.read(lambda ix: ix.dead_members_with_keys())
        self._dead_since = {m: self._dead_since.get(m, started) for m in dead}
        due = {
            m
            for m, since in self._dead_since.items()
            if started - since >= self._restore_grace_s and not self._hold_purge(m)
        }

        def next_chunk(ix: BlockIndex) -> tuple[int, list[str]] | None:
            for member_id in ix.dead_members_with_keys():
                if member_id in due:
                    return member_id, ix.member_keys(member_id, PURGE_CHUNK_KEYS)
            return None

        while self._clock() - started < _PURGE_BUDGET_S and self._replicator.is_leader():
            chunk = self._replicator.read(next_chunk)
            if chunk is None:
                return
            member_id, keys = chunk
            await self._replicator.propose(
                DropReplicas(os.urandom(16), member_id, tuple((k, 0) for k in keys)),
                self._commit_timeout_s,
            )
            self._log.info("replicas_purged", member_id=member_id, keys=len(keys))
