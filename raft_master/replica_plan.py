"""Replica planning: which copies to make and which replicas to release. Pure and deterministic.

The leader's replica loop (:mod:`kvpool.raft_master.replica_loop`) reads the index, asks these
functions what to do, performs the copies node to node and commits the results as
``ChangeReplicas`` commands.

Placement follows the consistent-hash ring (:class:`kvpool.proto.ring.HashRing`): a block's new
replicas are the first members in its ring order that do not hold it yet, members in a zone no
holder uses first (anti-affinity; nodes without a zone label count as distinct domains). The
ring order of a key only changes around the joining or leaving member's points, so a join or
leave moves the fewest blocks.

A block's target count is the largest of: the replicas its entry lists (its put count, dead and
draining members included, so a lost replica is replaced), its pin, and the hot-block count
while it is hot — capped by the members able to take a copy.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvpool.proto.ring import HashRing, RingMember


@dataclass(frozen=True, slots=True)
class BlockReplicas:
    """One entry as the planner sees it: every member it lists, live or not."""

    key: str
    write_id: int
    version: int
    size_bytes: int
    checksum: int
    listed: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CopyTask:
    """Copy ``key``'s exact write from ``source`` to ``target``; the commit also removes
    ``replaces`` (a dead or draining member; 0 = none)."""

    block: BlockReplicas
    source: int
    target: int
    replaces: int
    reason: str  # "repair" | "drain" | "hot" | "pin"


@dataclass(frozen=True, slots=True)
class ReleaseTask:
    """Remove ``member`` as a replica of exactly ``write_id`` of ``key``."""

    key: str
    write_id: int
    member: int
    reason: str  # "cooled" | "drain"


class TokenBucket:
    """A rate limit: ``rate_per_s`` units per second, at most ``burst`` saved up. A rate of 0
    means unlimited. Pure: the caller passes the time."""

    def __init__(self, rate_per_s: float, burst: float, now: float = 0.0) -> None:
        if rate_per_s < 0 or burst < 0:
            raise ValueError("rate and burst must not be negative")
        self.rate_per_s = rate_per_s
        self.burst = max(burst, 1.0)
        self._tokens = self.burst
        self._t = now

    def _refill(self, now: float) -> None:
        if now > self._t:
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate_per_s)
            self._t = now

    def take(self, amount: float, now: float) -> bool:
        """Spend ``amount`` if available now. A single amount above the burst is allowed
        once the bucket is full (it then runs into debt), so a large block is never stuck."""
        if self.rate_per_s == 0:
            return True
        self._refill(now)
        if self._tokens >= amount or self._tokens >= self.burst:
            self._tokens -= amount
            return True
        return False


def ring_of(members: Sequence[RingMember], version: int = 0) -> HashRing:
    return HashRing(members, version)


def choose_targets(
    ring: HashRing, key: str, holders: Collection[int], count: int, exclude: Collection[int] = ()
) -> list[int]:
    """Up to ``count`` members for new replicas of ``key``: ring order, members not holding it
    and not excluded, a zone unused by the holders (and by earlier picks) first."""
    if count <= 0:
        return []
    order = ring.place(key, len(ring))
    zones = {ring.members[m].zone for m in holders if m in ring.members}
    zones.discard("")
    chosen: list[int] = []
    deferred: list[int] = []
    for m in order:
        if m in holders or m in exclude:
            continue
        zone = ring.members[m].zone
        if zone and zone in zones:
            deferred.append(m)
            continue
        chosen.append(m)
        if zone:
            zones.add(zone)
        if len(chosen) == count:
            return chosen
    return chosen + deferred[: count - len(chosen)]


def plan_block(
    block: BlockReplicas,
    ring: HashRing,
    *,
    target: int,
    draining: Collection[int] = (),
    reason: str = "repair",
) -> tuple[list[CopyTask], list[ReleaseTask]]:
    """The copies that bring ``block`` to ``target`` replicas on live, non-draining members
    (the ring's members are the live ones), each replacing a dead or draining member while
    there is one; and the draining replicas that can simply be released because enough
    others hold the block."""
    live = ring.members
    holders = [m for m in block.listed if m in live and m not in draining]
    leaving = [m for m in block.listed if m in live and m in draining]
    dead = [m for m in block.listed if m not in live]
    able = sum(1 for m in live if m not in draining)
    want = min(target, able)
    sources = holders or leaving
    copies: list[CopyTask] = []
    releases: list[ReleaseTask] = []
    if not sources:
        return copies, releases  # nothing left to copy from: lost
    missing = want - len(holders)
    if missing > 0:
        targets = choose_targets(ring, block.key, block.listed, missing, exclude=draining)
        replaceable = dead + leaving
        for i, t in enumerate(targets):
            replaces = replaceable[i] if i < len(replaceable) else 0
            why = "drain" if replaces in leaving else reason
            copies.append(CopyTask(block, sources[i % len(sources)], t, replaces, why))
    if len(holders) >= max(want, 1):
        for m in leaving:
            releases.append(ReleaseTask(block.key, block.write_id, m, "drain"))
    return copies, releases


def plan_cooling(
    block: BlockReplicas, live: Collection[int], added: Sequence[int], keep: int
) -> list[ReleaseTask]:
    """Release the replicas added while ``block`` was hot (``added``, newest last), newest
    first, while more than ``keep`` (at least 1) live replicas remain."""
    holders = [m for m in block.listed if m in live]
    out: list[ReleaseTask] = []
    for m in reversed(added):
        if len(holders) <= max(keep, 1):
            break
        if m in holders:
            holders.remove(m)
            out.append(ReleaseTask(block.key, block.write_id, m, "cooled"))
    return out
