"""Where a client puts blocks: a cached membership and its consistent-hash ring.

Pure and deterministic (no sockets, no clock: the caller passes ``now_s``); a lock makes it
safe to share between the engine threads of a synchronous client. Each driver asks
:meth:`Placement.needs_refresh`, fetches ``GetMembers`` when told to, and feeds the answer back
with :meth:`Placement.update`. Signals that the cache is out of date:

* a response that names a newer ring version (``observe_ring_version``),
* a commit refused with ``stale_ring`` (``mark_stale``),
* a node that failed a data-plane request (``node_failed``; at most one refresh per
  ``min_refresh_interval_s`` for this cause, so a node that the index has not declared down yet
  does not cost one GetMembers per put).

A member being drained (``draining`` in GetMembers) is left out of the ring: no new put is placed
on it. It stays among the members, so the replicas a lookup names on it are still read.

A node that failed is also *suspect* for ``suspect_s``: reads try its replicas last
(:meth:`Placement.read_order`), so a node that died and is not yet declared down costs little.

And it is *held back* (a circuit breaker): for ``retry_s`` after it failed, the client sends it
nothing (:meth:`Placement.sendable`) — a read of a block held only there misses at once, a put
goes to the next member on the ring (:meth:`Placement.targets`) — then one request, the probe;
its answer (:meth:`Placement.node_answered`) ends the hold, its failure starts another. A node
that is stopped or wedged (a long GC pause, a frozen VM, a full disk's stalled writes) but not
yet declared down by the masters then costs each client one deadline per ``retry_s``, not one
per call that touches it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvpool.errors import NoNodesError
from kvpool.proto.ring import HashRing, RingMember
from kvpool.proto.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """A store-node incarnation as the client needs it."""

    member_id: int
    node_id: str
    data_address: str
    capacity_bytes: int
    zone: str = ""
    incarnation: int = 0
    draining: bool = False  # readable; takes no new puts (left out of the placement ring)

    @classmethod
    def from_proto(cls, m: common_pb2.Member) -> MemberInfo:
        return cls(
            member_id=m.member_id,
            node_id=m.node_id,
            data_address=m.data_address,
            capacity_bytes=m.capacity_bytes,
            zone=m.zone,
            incarnation=m.incarnation,
            draining=m.draining,
        )

    def ring_member(self) -> RingMember:
        return RingMember(
            member_id=self.member_id,
            node_id=self.node_id,
            capacity_bytes=self.capacity_bytes,
            zone=self.zone,
        )


class Placement:
    """The client's view of the live members and the ring built over the ones that take puts
    (not draining)."""

    def __init__(
        self,
        *,
        min_refresh_interval_s: float = 0.5,
        suspect_s: float = 2.0,
        retry_s: float = 1.0,
        is_local: Callable[[str], bool] | None = None,
        on_hold: Callable[[int], None] | None = None,
    ) -> None:
        self._on_hold = on_hold
        self.is_local: Callable[[str], bool] = is_local or (lambda address: False)
        self._min_refresh_interval_s = min_refresh_interval_s
        self._suspect_s = suspect_s
        self._suspect_until: dict[int, float] = {}
        self._retry_s = retry_s
        self._held: dict[int, float] = {}  # member -> when it may be sent its next probe
        self._ring: HashRing | None = None
        self._members: dict[int, MemberInfo] = {}
        self._stale = True
        self._newest_seen = 0
        self._last_refresh_s = -math.inf
        self._lock = threading.Lock()

    # --- queries ------------------------------------------------------------------------------

    @property
    def ring_version(self) -> int | None:
        """The version of the cached ring, or None before the first update."""
        return self._ring.version if self._ring is not None else None

    @property
    def has_ring(self) -> bool:
        return self._ring is not None

    def needs_refresh(self) -> bool:
        """No ring yet, a stale one, or one with no node that takes puts (nodes may have
        registered since: ask again rather than fail the put)."""
        ring = self._ring
        return ring is None or self._stale or not len(ring)

    def refresh_due(self, now_s: float) -> bool:
        """:meth:`needs_refresh`, and no refresh was asked for in the last
        ``min_refresh_interval_s``: how often a read that could go straight to a node asks
        for the membership (it reads through the index meanwhile)."""
        return self.needs_refresh() and now_s - self._last_refresh_s >= self._min_refresh_interval_s

    def refresh_tried(self, now_s: float) -> None:
        """A membership refresh was asked for at ``now_s`` (answered or not)."""
        self._last_refresh_s = max(self._last_refresh_s, now_s)

    def ring_is_empty(self) -> bool:
        """A ring is loaded and names no node that takes puts (none registered yet as the
        answering master knew, or all draining)."""
        ring = self._ring
        return ring is not None and not len(ring)

    def member(self, member_id: int) -> MemberInfo | None:
        return self._members.get(member_id)

    @property
    def members(self) -> list[MemberInfo]:
        return list(self._members.values())

    def place(self, key: bytes, replicas: int) -> list[MemberInfo]:
        """Up to ``replicas`` distinct members for ``key``, primary first.

        NoNodesError when the ring is empty (or was never loaded).
        """
        with self._lock:
            ring, members = self._ring, self._members
        if ring is None or not len(ring):
            draining = sum(m.draining for m in members.values())
            raise NoNodesError(
                "no live store node is registered with the masters"
                + (f" that takes puts ({draining} draining)" if draining else "")
            )
        return [members[mid] for mid in ring.place(key, replicas)]

    def place_ids(self, key: bytes, replicas: int) -> list[int]:
        """:meth:`place`'s member ids (a read by content needs no more)."""
        ring = self._ring
        if ring is not None and len(ring):
            return ring.place(key, replicas)
        return [m.member_id for m in self.place(key, replicas)]  # raises NoNodesError

    def targets(self, key: bytes, replicas: int, now_s: float) -> list[MemberInfo]:
        """Where a put of ``key`` goes: :meth:`place`'s members, each one held back
        (:meth:`sendable`) replaced by the next member on the ring that is not — as many as
        there are; held-back ones fill the rest (a put that cannot be placed elsewhere still
        tries them). NoNodesError as :meth:`place`."""
        if not self._held:
            return self.place(key, replicas)
        ring, held = self._ring, self._held
        everyone = self.place(key, len(ring) if ring is not None else replicas)
        ready = [m for m in everyone if held.get(m.member_id, -math.inf) <= now_s]
        if len(ready) < replicas:  # too few left: every one that is, then the held ones
            ready += [m for m in everyone if held.get(m.member_id, -math.inf) > now_s]
        chosen = ready[:replicas]
        for m in chosen:
            self.sendable(m.member_id, now_s)  # a held one chosen is its probe
        return chosen

    def sendable(self, member_id: int, now_s: float) -> bool:
        """Whether to send this member a request now: yes, unless it failed one less than
        ``retry_s`` ago and has not answered since; once that time is up, yes for one request
        (the probe; the next one is due ``retry_s`` later)."""
        if member_id not in self._held:
            return True
        with self._lock:
            due = self._held.get(member_id)
            if due is None:
                return True
            if now_s < due:
                return False
            self._held[member_id] = now_s + self._retry_s
            return True

    @property
    def held(self) -> dict[int, float]:
        """The members held back now (and when each may be probed): the one dict, for the
        planes' quick ``member_id in held`` (a request sent to a held member is a probe, given
        only :data:`~kvpool.client.rounds.PROBE_WAIT_S`). Read it, never change it."""
        return self._held

    def node_answered(self, member_id: int) -> None:
        """This member answered a request: it is no longer held back."""
        if member_id in self._held:
            with self._lock:
                self._held.pop(member_id, None)

    def read_order(self, replicas: Sequence[int], now_s: float, start: int = 0) -> list[int]:
        """The order to try ``replicas`` in: members that failed recently last; before them,
        replicas on this host (``is_local``: read through shared memory) first; the rest
        rotated by ``start`` (callers pick it at random to spread reads of a hot block over
        its replicas)."""
        n = len(replicas)
        if n <= 1:
            return list(replicas)
        start %= n
        rotated = [*replicas[start:], *replicas[:start]]
        local = self.is_local
        members = self._members

        def rank(m: int) -> tuple[bool, bool]:
            suspect = self._suspect_until.get(m, -math.inf) > now_s
            info = members.get(m)
            return suspect, not (info is not None and local(info.data_address))

        return sorted(rotated, key=rank)

    # --- events -------------------------------------------------------------------------------

    def update(self, members: Iterable[MemberInfo], ring_version: int, now_s: float) -> bool:
        """Install a GetMembers answer. An answer older than the cached ring is ignored (a
        concurrent refresh got a newer one). Returns True when the ring was replaced."""
        fresh = {m.member_id: m for m in members}
        with self._lock:
            self._last_refresh_s = now_s
            current = self.ring_version
            if current is not None and ring_version < current:
                return False
            self._newest_seen = max(self._newest_seen, ring_version)
            # Still stale when someone already reported a newer version than this answer's.
            self._stale = ring_version < self._newest_seen
            if current == ring_version and self._ring is not None and fresh == self._members:
                return False
            placeable = (m.ring_member() for m in fresh.values() if not m.draining)
            ring = HashRing(placeable, ring_version)
            self._ring, self._members = ring, fresh
            for gone in [m for m in self._held if m not in fresh]:
                del self._held[gone]  # in place: :attr:`held` is handed out
            return True

    def observe_ring_version(self, ring_version: int) -> None:
        """A master response named this ring version; a newer one than ours makes us stale."""
        self._newest_seen = max(self._newest_seen, ring_version)
        current = self.ring_version
        if current is not None and ring_version > current:
            self._stale = True

    def mark_stale(self, ring_version: int = 0) -> None:
        """The index refused our ring (stale_ring): refresh before placing again."""
        self.observe_ring_version(ring_version)
        self._stale = True

    def node_slow(self, member_id: int, now_s: float) -> None:
        """A read from this member was slow enough to be hedged: read its replicas last for
        ``suspect_s`` (no membership refresh: a slow node is still a member)."""
        with self._lock:
            self._suspect_until[member_id] = now_s + self._suspect_s

    def node_failed(self, member_id: int, now_s: float) -> None:
        """A data-plane request to this member failed (could not connect, a broken connection,
        or no answer at all in the time it had): it may have left the ring; held back for
        ``retry_s`` (0: never)."""
        newly = False
        with self._lock:
            self._suspect_until[member_id] = now_s + self._suspect_s
            if len(self._suspect_until) > 4 * max(16, len(self._members)):
                self._suspect_until = {m: t for m, t in self._suspect_until.items() if t > now_s}
            if self._retry_s > 0:
                newly = member_id not in self._held
                self._held[member_id] = now_s + self._retry_s
        if newly and self._on_hold is not None:
            self._on_hold(member_id)
        if member_id not in self._members:
            return
        if now_s - self._last_refresh_s >= self._min_refresh_interval_s:
            self._stale = True
