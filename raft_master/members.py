"""The block index's member table and the commands that change it.

:class:`MemberTable` is a base of :class:`~kvpool.raft_master.index.BlockIndex` (split out to
keep that module small): the members (member id → :class:`MemberRecord`), node id → current
member id, and member id → the keys the entries list on it. Pure and deterministic like the
rest of the index: applied on every master alike.

A member's life: registered live → (optionally) *draining* → down (declared dead, left, or
drained) → forgotten once no entry lists it. A draining member stays live: lookups keep naming
its replicas, so reads reach them; but no new replica goes to it (a put's replica on it is
dropped from the commit, a ``ChangeReplicas`` adding it is refused), so once the leader's
replica loop has moved its blocks off it holds nothing and can be declared left
(``MarkMemberDown`` with reason ``"drained"``, which the index refuses while it holds keys).
Setting or clearing the mark changes the ring clients place puts by: it bumps ``ring_version``.

A drained node's process may keep running after it left; its next heartbeat finds it unknown and
it registers again with the same incarnation (one per process start). The table remembers each
drained node id → incarnation (insertion-ordered, at most :data:`DRAINED_MEMORY`, oldest
forgotten first) and refuses that registration (``RegisterMemberResult.member_id`` 0,
:data:`REFUSED_DRAINED`); only a new incarnation — the process restarted — joins again, and it
clears the record.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from kvpool.errors import NodeDrainedError
from kvpool.raft_master.commands import (
    MarkMemberDown,
    MarkMemberDownResult,
    RegisterMember,
    RegisterMemberResult,
    SetDraining,
    SetDrainingResult,
)
from kvpool.raft_master.records import MemberRecord

DRAINED = "drained"
"""The ``MarkMemberDown`` reason of a member that a drain emptied."""

DRAINED_MEMORY = 1024
"""Most drained node incarnations remembered; the oldest is forgotten first."""

REFUSED_DRAINED = 0
"""``RegisterMemberResult.member_id`` of a registration refused because that node incarnation
was drained (member ids start at 1)."""


def check_registered(result: RegisterMemberResult, node_id: str, incarnation: int) -> None:
    """Raise :class:`NodeDrainedError` when the index refused a registration as drained."""
    if result.member_id == REFUSED_DRAINED:
        raise NodeDrainedError(
            f"node {node_id!r} (incarnation {incarnation:#x}) was drained and left the "
            "cluster; restart its process to rejoin"
        )


def member_tuple(rec: MemberRecord) -> tuple[Any, ...]:
    """A member as a snapshot stores it. The draining flag is written only when set, so a
    snapshot without a draining member keeps the 8-field layout earlier releases read."""
    head = (
        rec.member_id,
        rec.node_id,
        rec.incarnation,
        rec.data_address,
        rec.admin_address,
        rec.capacity_bytes,
        rec.zone,
        rec.live,
    )
    return (*head, True) if rec.draining else head


def member_from_tuple(t: Iterable[Any]) -> MemberRecord:
    """Inverse of :func:`member_tuple`; an 8-field tuple (before draining) is not draining."""
    return MemberRecord(*t)


class MemberTable:
    """Member state and commands; :class:`BlockIndex` holds the attributes declared here."""

    _members: dict[int, MemberRecord]
    _member_of_node: dict[str, int]
    _member_keys: dict[int, dict[str, None]]
    _drained: dict[str, int]
    _next_member_id: int
    _revision: int
    _ring_version: int

    # --- commands ---------------------------------------------------------------------------

    def _register_member(self, cmd: RegisterMember) -> RegisterMemberResult:
        drained = self._drained.get(cmd.node_id)
        if drained is not None:
            if drained == cmd.incarnation:  # the drained process itself: it must restart
                return RegisterMemberResult(REFUSED_DRAINED, self._ring_version)
            del self._drained[cmd.node_id]  # restarted: a new incarnation joins
        existing_id = self._member_of_node.get(cmd.node_id)
        existing = self._members.get(existing_id) if existing_id is not None else None
        if existing is not None and existing.live and existing.incarnation == cmd.incarnation:
            return RegisterMemberResult(existing.member_id, self._ring_version)
        draining = False
        if existing is not None and existing.live:
            draining = existing.draining  # a node restarted mid-drain: the drain carries on
            self._members[existing.member_id] = replace(existing, live=False, draining=False)
            self._forget_if_dead(existing.member_id)
        member_id = self._next_member_id
        self._next_member_id += 1
        self._members[member_id] = MemberRecord(
            member_id,
            cmd.node_id,
            cmd.incarnation,
            cmd.data_address,
            cmd.admin_address,
            cmd.capacity_bytes,
            cmd.zone,
            live=True,
            draining=draining,
        )
        self._member_keys[member_id] = {}
        self._member_of_node[cmd.node_id] = member_id
        self._ring_version += 1
        self._revision += 1
        return RegisterMemberResult(member_id, self._ring_version)

    def _mark_member_down(self, cmd: MarkMemberDown) -> MarkMemberDownResult:
        rec = self._members.get(cmd.member_id)
        if rec is None or not rec.live:
            return MarkMemberDownResult(False, self._ring_version)
        if cmd.reason == DRAINED and self._member_keys.get(cmd.member_id):
            # a drain declares a member left only once it holds nothing: never lose a block
            return MarkMemberDownResult(False, self._ring_version)
        self._members[cmd.member_id] = replace(rec, live=False, draining=False)
        self._forget_if_dead(cmd.member_id)
        if cmd.reason == DRAINED:
            self._remember_drained(rec.node_id, rec.incarnation)
        self._ring_version += 1
        self._revision += 1
        return MarkMemberDownResult(True, self._ring_version)

    def _remember_drained(self, node_id: str, incarnation: int) -> None:
        self._drained.pop(node_id, None)  # re-inserted: the newest
        self._drained[node_id] = incarnation
        while len(self._drained) > DRAINED_MEMORY:
            del self._drained[next(iter(self._drained))]

    def _set_draining(self, cmd: SetDraining) -> SetDrainingResult:
        rec = self._members.get(cmd.member_id)
        if rec is None or not rec.live:
            return SetDrainingResult(False, False, self._ring_version)
        if rec.draining == cmd.draining:
            return SetDrainingResult(True, False, self._ring_version)
        self._members[cmd.member_id] = replace(rec, draining=cmd.draining)
        self._ring_version += 1
        self._revision += 1
        return SetDrainingResult(True, True, self._ring_version)

    # --- helpers for the other commands -----------------------------------------------------

    def _is_live(self, member_id: int) -> bool:
        rec = self._members.get(member_id)
        return rec is not None and rec.live

    def _takes_new_replicas(self, member_id: int) -> bool:
        """Live and not draining: a new replica may be committed to it."""
        rec = self._members.get(member_id)
        return rec is not None and rec.live and not rec.draining

    def _placeable_replicas(self, replicas: Iterable[int]) -> tuple[int, ...]:
        """``replicas`` in order, without repeats, members that take no new replica dropped."""
        kept: list[int] = []
        for m in replicas:
            if self._takes_new_replicas(m) and m not in kept:
                kept.append(m)
        return tuple(kept)

    def _unlink(self, member_id: int, key: str) -> None:
        """Forget that ``member_id`` holds ``key``; forget a dead member left holding nothing."""
        keys = self._member_keys.get(member_id)
        if keys is None:
            return
        keys.pop(key, None)
        if not keys:
            self._forget_if_dead(member_id)

    def _forget_if_dead(self, member_id: int) -> bool:
        rec = self._members.get(member_id)
        if rec is None or rec.live or self._member_keys.get(member_id):
            return False
        del self._members[member_id]
        self._member_keys.pop(member_id, None)
        if self._member_of_node.get(rec.node_id) == member_id:
            del self._member_of_node[rec.node_id]
        return True

    # --- reads ------------------------------------------------------------------------------

    def member(self, member_id: int) -> MemberRecord | None:
        return self._members.get(member_id)

    def live_members(self) -> list[MemberRecord]:
        """Every live member, draining ones included (they still serve reads)."""
        return [m for m in self._members.values() if m.live]

    def draining_members(self) -> list[int]:
        """Live members marked draining, by member id."""
        return [m for m, rec in self._members.items() if rec.live and rec.draining]

    def member_of_node(self, node_id: str) -> int | None:
        return self._member_of_node.get(node_id)

    def drained_incarnation(self, node_id: str) -> int | None:
        """The incarnation of ``node_id`` that was drained and may not register again."""
        return self._drained.get(node_id)

    def member_keys(self, member_id: int, limit: int) -> list[str]:
        """Up to ``limit`` keys the index lists on ``member_id``, oldest first."""
        out: list[str] = []
        for key in self._member_keys.get(member_id, {}):
            if len(out) >= limit:
                break
            out.append(key)
        return out

    def holds_keys(self, member_id: int) -> bool:
        return bool(self._member_keys.get(member_id))

    def dead_members_with_keys(self) -> list[int]:
        """Members declared down whose replicas are still to be purged from the entries."""
        return [m for m, keys in self._member_keys.items() if keys and not self._members[m].live]

    def check_member_invariants(self) -> None:
        for m, rec in self._members.items():
            assert rec.member_id == m
            assert m < self._next_member_id
            assert m in self._member_keys
            if not rec.live:
                assert self._member_keys[m], f"dead member {m} without keys not forgotten"
                assert not rec.draining, f"dead member {m} still marked draining"
            else:
                assert self._member_of_node.get(rec.node_id) == m, f"live member {m} unmapped"
        for node_id, m in self._member_of_node.items():
            assert self._members[m].node_id == node_id
        assert len(self._drained) <= DRAINED_MEMORY
        for node_id, incarnation in self._drained.items():
            now = self._members.get(self._member_of_node.get(node_id, 0))
            assert now is None or not now.live or now.incarnation != incarnation, (
                f"drained incarnation of {node_id!r} is live again"
            )
