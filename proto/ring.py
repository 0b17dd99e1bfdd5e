"""Consistent-hash placement of blocks on store nodes: a ring of virtual nodes, MurmurHash3.

Part of the wire contract because every client must place a key the same way. Pure and
deterministic: the same members give the same ring in any process on any machine (mmh3, never
Python's ``hash()``).

* Each member owns ``vnodes_for(capacity)`` points on a 64-bit ring, hashed from its *node id*
  (not its member id), so a node that restarts lands on the same points and a join or leave moves
  only the keys between its points and their predecessors.
* Points are weighted by capacity: one per ``BYTES_PER_VNODE``, clamped to
  [MIN_VNODES, MAX_VNODES].
* ``place(key, n)`` walks clockwise from the key's hash and returns the first ``n`` distinct
  members; with zones, distinct zones are preferred before a zone is used twice.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

import mmh3

MIN_VNODES = 32
MAX_VNODES = 4096
BYTES_PER_VNODE = 16 * 2**20  # 64 points per GiB of capacity


@dataclass(frozen=True, slots=True)
class RingMember:
    member_id: int
    node_id: str
    capacity_bytes: int
    zone: str = ""


def vnodes_for(capacity_bytes: int) -> int:
    return max(MIN_VNODES, min(MAX_VNODES, capacity_bytes // BYTES_PER_VNODE))


def key_hash(key: str | bytes) -> int:
    """The 64-bit ring position of a key."""
    raw = key.encode("utf-8") if isinstance(key, str) else key
    return int(mmh3.hash64(raw, 0, signed=False)[0])


class HashRing:
    """An immutable ring over a set of members; build a new one when membership changes."""

    def __init__(self, members: Iterable[RingMember], version: int = 0) -> None:
        self.version = version
        self.members: dict[int, RingMember] = {}
        points: list[tuple[int, int]] = []
        for m in sorted(members, key=lambda m: m.member_id):
            if m.member_id in self.members:
                raise ValueError(f"member {m.member_id} listed twice")
            self.members[m.member_id] = m
            for i in range(vnodes_for(m.capacity_bytes)):
                points.append((key_hash(f"{m.node_id}#{i}"), m.member_id))
        points.sort()
        self._hashes = [h for h, _ in points]
        self._owners = [o for _, o in points]

    def __len__(self) -> int:
        return len(self.members)

    def place(self, key: str | bytes, n: int = 1) -> list[int]:
        """The member ids that should hold ``key``: up to ``n`` distinct ones, primary first."""
        if n < 1 or not self._owners:
            return []
        want = min(n, len(self.members))
        start = bisect.bisect_left(self._hashes, key_hash(key))
        if want == 1:  # the first owner in ring order: no zone is used yet
            return [self._owners[start % len(self._owners)]]
        chosen: list[int] = []
        zones_used: set[str] = set()
        deferred: list[int] = []  # members whose zone is already used, kept in ring order
        total = len(self._owners)
        for step in range(total):
            owner = self._owners[(start + step) % total]
            if owner in chosen or owner in deferred:
                continue
            zone = self.members[owner].zone
            if zone and zone in zones_used:
                deferred.append(owner)
                continue
            chosen.append(owner)
            if zone:
                zones_used.add(zone)
            if len(chosen) == want:
                return chosen
        # Fewer zones than replicas: fill up with same-zone members in ring order.
        chosen.extend(deferred[: want - len(chosen)])
        return chosen
