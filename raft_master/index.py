"""The block index: a pure, deterministic state machine replicated by Raft.

``BlockIndex.apply(command) -> result`` is the only way the state changes. It never reads a
clock, draws a random number, does I/O or starts a thread, and it never iterates a ``set`` of
strings (string hashing differs per process): the same commands give the same state on every
master, dict insertion order included.

State:

- ``entries``: key → one packed ``bytes`` record (:mod:`kvpool.raft_master.records`: version,
  write id, size, checksum, pinned, then the replicas as u32 member ids).
- members: member id (u32, from a counter starting at 1) → :class:`MemberRecord`; node id →
  current member id; member id → its keys (a ``dict[str, None]``, insertion-ordered, so a dead
  member's replicas can be purged in chunks).
- pins: key → replica count wanted (the entry's ``pinned`` flag mirrors it; a pin outlives an
  overwrite of its key and ends with the key's removal).
- drained: node id → the incarnation a drain declared left, refused if it registers again
  (bounded, oldest forgotten: :mod:`kvpool.raft_master.members`).
- masters: Raft address → gRPC address (for NOT_LEADER redirects).
- ``revision``: +1 per committed put entry and per other command that changed something;
  versions are drawn from it, so they increase strictly per key and globally.
- ``ring_version``: +1 per membership change (a member registered, down, or marked draining or
  no longer draining: :mod:`kvpool.raft_master.members`).
- dedupe: request id → stored result, bounded, oldest forgotten first.

Reads (``lookup``, ``prefix_match``…) never return a replica on a member that is not live, and
report a key whose replicas are all down as not found. A draining member is live: its replicas
are read, but no new replica is committed to it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, assert_never, cast

from kvpool.raft_master.commands import (
    PIN_ABSENT,
    PIN_OK,
    PIN_QUOTA_EXCEEDED,
    PUT_COMMITTED,
    PUT_NO_LIVE_REPLICA,
    Batch,
    BatchResult,
    ChangeReplicas,
    ChangeReplicasResult,
    ClaimReplicas,
    ClaimReplicasResult,
    CommandDecodeError,
    CommitPuts,
    CommitPutsResult,
    DropReplicas,
    DropReplicasResult,
    ErrorResult,
    MarkMemberDown,
    PutOutcome,
    RegisterMaster,
    RegisterMasterResult,
    RegisterMember,
    RemovedBlock,
    RemoveKeys,
    RemoveKeysResult,
    Result,
    SetDraining,
    SetPins,
    SetPinsResult,
    SimpleCommand,
    decode,
    decode_result,
    encode_result,
)
from kvpool.raft_master.members import MemberTable, member_from_tuple, member_tuple
from kvpool.raft_master.records import (
    RECORD_HEAD,
    STATE_FORMAT,
    BlockView,
    IndexSnapshot,
    IndexStatus,
    MemberRecord,
    pack_record,
    record_replicas,
    record_tier,
    restore_snapshot_v1,
    unpack_record,
    with_tier,
)

__all__ = [
    "STATE_FORMAT",
    "BlockIndex",
    "BlockView",
    "IndexSnapshot",
    "IndexStatus",
    "MemberRecord",
    "pack_record",
    "record_replicas",
    "restore_snapshot_v1",
    "unpack_record",
]

PREFIX_REMOVE_LIMIT = 4096
"""Most keys one prefix removal takes out of the index (RemoveRequest.limit 0)."""
_DEDUPE_OVERHEAD_BYTES = 64  # per stored result: key bytes object + OrderedDict node


class BlockIndex(MemberTable):
    """The replicated block index. Not thread-safe: the replication layer holds a lock around
    ``apply`` and around each read."""

    def __init__(self, *, dedupe_capacity: int = 65536, dedupe_max_bytes: int = 64 << 20) -> None:
        if dedupe_capacity < 1 or dedupe_max_bytes < 1:
            raise ValueError("dedupe limits must be positive")
        self._dedupe_capacity = dedupe_capacity
        self._dedupe_max_bytes = dedupe_max_bytes
        self._entries: dict[str, bytes] = {}
        self._members: dict[int, MemberRecord] = {}
        self._member_of_node: dict[str, int] = {}
        self._member_keys: dict[int, dict[str, None]] = {}
        self._drained: dict[str, int] = {}
        self._masters: dict[str, str] = {}
        self._pins: dict[str, int] = {}
        self._revision = 0
        self._ring_version = 0
        self._next_member_id = 1
        self._dedupe: OrderedDict[bytes, bytes] = OrderedDict()
        self._dedupe_bytes = 0
        self._all_live: tuple[int, int, bool] | None = None  # (ring version, members, answer)

    # --- applying commands ----------------------------------------------------------------

    def apply_encoded(self, data: bytes) -> Result:
        """Apply one Raft log entry. Undecodable bytes change nothing and give an ErrorResult."""
        try:
            command = decode(data)
        except CommandDecodeError as e:
            return ErrorResult(e.message)
        return self.apply(command)

    def apply(self, command: SimpleCommand | Batch) -> Result:
        if isinstance(command, Batch):
            results: list[Result] = []
            for sub in command.commands:
                if isinstance(cast(object, sub), Batch):  # decode() never builds one
                    results.append(ErrorResult("a Batch must not contain a Batch"))
                else:
                    results.append(self._apply_once(sub))
            return BatchResult(tuple(results))
        return self._apply_once(command)

    def _apply_once(self, command: SimpleCommand) -> Result:
        rid = command.request_id
        if rid:
            stored = self._dedupe.get(rid)
            if stored is not None:
                return decode_result(stored)
        result = self._dispatch(command)
        if rid and not isinstance(result, ErrorResult):
            if isinstance(result, CommitPutsResult) and result.stale_ring:
                return result  # nothing applied; a retry is stale again (ring versions only grow)
            self._remember(rid, encode_result(result))
        return result

    def _dispatch(self, command: SimpleCommand) -> Result:
        if isinstance(command, CommitPuts):
            return self._commit_puts(command)
        if isinstance(command, RemoveKeys):
            return self._remove_keys(command)
        if isinstance(command, DropReplicas):
            return self._drop_replicas(command)
        if isinstance(command, RegisterMember):
            return self._register_member(command)
        if isinstance(command, MarkMemberDown):
            return self._mark_member_down(command)
        if isinstance(command, RegisterMaster):
            return self._register_master(command)
        if isinstance(command, ClaimReplicas):
            return self._claim_replicas(command)
        if isinstance(command, ChangeReplicas):
            return self._change_replicas(command)
        if isinstance(command, SetPins):
            return self._set_pins(command)
        if isinstance(command, SetDraining):
            return self._set_draining(command)
        assert_never(command)

    def _remember(self, request_id: bytes, stored: bytes) -> None:
        self._dedupe[request_id] = stored
        self._dedupe_bytes += len(stored) + len(request_id) + _DEDUPE_OVERHEAD_BYTES
        while len(self._dedupe) > self._dedupe_capacity or (
            self._dedupe_bytes > self._dedupe_max_bytes and len(self._dedupe) > 1
        ):
            old_rid, old = self._dedupe.popitem(last=False)
            self._dedupe_bytes -= len(old) + len(old_rid) + _DEDUPE_OVERHEAD_BYTES

    def _commit_puts(self, cmd: CommitPuts) -> CommitPutsResult:
        if cmd.ring_version < self._ring_version:
            return CommitPutsResult((), self._revision, self._ring_version, stale_ring=True)
        outcomes: list[PutOutcome] = []
        for item in cmd.entries:
            kept = self._placeable_replicas(item.replicas)  # not down, not draining
            if not kept:
                outcomes.append(PutOutcome(PUT_NO_LIVE_REPLICA, 0, ()))
                continue
            self._revision += 1
            version = self._revision
            old = self._entries.get(item.key)
            superseded_write_id = 0
            superseded_on: tuple[int, ...] = ()
            if old is not None:
                _, old_write_id, _, _, _, superseded_on = unpack_record(old)
                for m in superseded_on:
                    self._unlink(m, item.key)
                if old_write_id != item.write_id:
                    superseded_write_id = old_write_id
                else:
                    superseded_on = ()
            self._entries[item.key] = pack_record(
                version,
                item.write_id,
                item.size_bytes,
                item.checksum,
                kept,
                pinned=item.key in self._pins,
            )
            for m in kept:
                self._member_keys[m][item.key] = None
            outcomes.append(
                PutOutcome(PUT_COMMITTED, version, kept, superseded_write_id, superseded_on)
            )
        return CommitPutsResult(tuple(outcomes), self._revision, self._ring_version)

    def _remove_keys(self, cmd: RemoveKeys) -> RemoveKeysResult:
        removed: list[bool] = []
        blocks: list[RemovedBlock] = []
        for key in cmd.keys:
            block = self._remove_entry(key)
            removed.append(block is not None)
            if block is not None:
                blocks.append(block)
        prefix_removed, more = 0, False
        if cmd.prefixes:
            # The entries' order is the order of the log that built them, the same on every
            # master (snapshots keep it), so every master removes the same keys.
            limit = cmd.limit or PREFIX_REMOVE_LIMIT
            matching = (k for k in self._entries if k.startswith(cmd.prefixes))
            for key in list(itertools.islice(matching, limit + 1)):
                if prefix_removed == limit:
                    more = True
                    break
                block = self._remove_entry(key)
                assert block is not None
                blocks.append(block)
                prefix_removed += 1
        if blocks:
            self._revision += 1
        return RemoveKeysResult(tuple(removed), tuple(blocks), self._revision, prefix_removed, more)

    def _remove_entry(self, key: str) -> RemovedBlock | None:
        record = self._entries.pop(key, None)
        if record is None:
            return None
        _, write_id, _, _, _, replicas = unpack_record(record)
        for m in replicas:
            self._unlink(m, key)
        self._pins.pop(key, None)
        return RemovedBlock(key, write_id, replicas)

    def _drop_replicas(self, cmd: DropReplicas) -> DropReplicasResult:
        member_id = cmd.member_id
        dropped = 0
        for key, write_id in cmd.blocks:
            record = self._entries.get(key)
            if record is None:
                continue
            version, indexed_write_id, size_bytes, checksum, pinned, replicas = unpack_record(
                record
            )
            if (write_id and write_id != indexed_write_id) or member_id not in replicas:
                continue
            rest = tuple(m for m in replicas if m != member_id)
            if rest:
                self._entries[key] = pack_record(
                    version,
                    indexed_write_id,
                    size_bytes,
                    checksum,
                    rest,
                    pinned=pinned,
                    tier=record_tier(record),
                )
            else:
                del self._entries[key]
                self._pins.pop(key, None)
            self._unlink(member_id, key)
            dropped += 1
        forgotten = self._forget_if_dead(member_id)
        if dropped or forgotten:
            self._revision += 1
        return DropReplicasResult(dropped, self._revision)

    def _claim_replicas(self, cmd: ClaimReplicas) -> ClaimReplicasResult:
        """Tier hints, and (restore) replicas of a member that proves it holds exactly the
        indexed write. Never creates an entry: a key removed or overwritten meanwhile stays
        so, and the member drops what was refused."""
        member_id = cmd.member_id
        rec = self._members.get(member_id)
        live = rec is not None and rec.live
        accepted: list[bool] = []
        changed = False
        for item in cmd.blocks:
            record = self._entries.get(item.key) if live else None
            if record is None:
                accepted.append(False)
                continue
            version, write_id, size_bytes, checksum, pinned, replicas = unpack_record(record)
            if (write_id, version, size_bytes, checksum) != (
                item.write_id,
                item.version,
                item.size_bytes,
                item.checksum,
            ):
                accepted.append(False)
                continue
            if member_id not in replicas:
                if not cmd.restore:
                    accepted.append(False)
                    continue
                record = pack_record(
                    version,
                    write_id,
                    size_bytes,
                    checksum,
                    (*replicas, member_id),
                    pinned=pinned,
                    tier=record_tier(record),
                )
                self._member_keys[member_id][item.key] = None
                changed = True
            if record_tier(record) != item.tier:
                record = with_tier(record, item.tier)
                changed = True
            self._entries[item.key] = record
            accepted.append(True)
        if changed:
            self._revision += 1
        return ClaimReplicasResult(tuple(accepted), self._revision)

    def _change_replicas(self, cmd: ChangeReplicas) -> ChangeReplicasResult:
        """Each change applies only to exactly its write id; an added member must be live and
        new to the entry; a removal never leaves the entry without a live replica."""
        applied: list[bool] = []
        for ch in cmd.changes:
            record = self._entries.get(ch.key)
            if record is None or (not ch.add_member and not ch.remove_member):
                applied.append(False)
                continue
            version, write_id, size_bytes, checksum, pinned, replicas = unpack_record(record)
            if write_id != ch.write_id:
                applied.append(False)
                continue
            rest = list(replicas)
            if ch.remove_member:
                if ch.remove_member not in rest:
                    applied.append(False)
                    continue
                rest.remove(ch.remove_member)
            if ch.add_member:
                if not self._takes_new_replicas(ch.add_member) or ch.add_member in rest:
                    applied.append(False)
                    continue
                rest.append(ch.add_member)
            if not any(self._is_live(m) for m in rest):
                applied.append(False)
                continue
            self._entries[ch.key] = pack_record(
                version,
                write_id,
                size_bytes,
                checksum,
                rest,
                pinned=pinned,
                tier=record_tier(record),
            )
            if ch.add_member:
                self._member_keys[ch.add_member][ch.key] = None
            if ch.remove_member:
                self._unlink(ch.remove_member, ch.key)
            applied.append(True)
        if any(applied):
            self._revision += 1
        return ChangeReplicasResult(tuple(applied), self._revision)

    def pinned_bytes(self) -> int:
        """sum(size * replicas wanted) over pinned keys."""
        total = 0
        for key, n in self._pins.items():
            record = self._entries.get(key)
            if record is not None:
                total += unpack_record(record)[2] * n
        return total

    def _set_pins(self, cmd: SetPins) -> SetPinsResult:
        statuses: list[int] = []
        used = self.pinned_bytes()
        changed = False
        for key in cmd.keys:
            record = self._entries.get(key)
            if record is None:
                statuses.append(PIN_ABSENT)
                continue
            size_bytes = unpack_record(record)[2]
            before = self._pins.get(key, 0)
            after_used = used - size_bytes * before + size_bytes * cmd.replicas
            if cmd.replicas > before and cmd.quota_bytes and after_used > cmd.quota_bytes:
                statuses.append(PIN_QUOTA_EXCEEDED)
                continue
            used = after_used
            if cmd.replicas:
                self._pins[key] = cmd.replicas
            else:
                self._pins.pop(key, None)
            version, write_id, size_bytes, checksum, pinned, replicas = unpack_record(record)
            if pinned != bool(cmd.replicas) or before != cmd.replicas:
                changed = True
                self._entries[key] = pack_record(
                    version,
                    write_id,
                    size_bytes,
                    checksum,
                    replicas,
                    pinned=bool(cmd.replicas),
                    tier=record_tier(record),
                )
            statuses.append(PIN_OK)
        if changed:
            self._revision += 1
        return SetPinsResult(tuple(statuses), used, self._revision)

    def pins(self) -> dict[str, int]:
        """key → replicas wanted, for every pinned key (a copy)."""
        return dict(self._pins)

    def entry_record(self, key: str) -> bytes | None:
        """The packed record of ``key`` (every listed member, live or not), or None."""
        return self._entries.get(key)

    def _register_master(self, cmd: RegisterMaster) -> RegisterMasterResult:
        if self._masters.get(cmd.raft_address) != cmd.grpc_address:
            self._masters[cmd.raft_address] = cmd.grpc_address
            self._revision += 1
        return RegisterMasterResult(self._revision)

    # --- reads --------------------------------------------------------------------------------

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def ring_version(self) -> int:
        return self._ring_version

    def lookup(self, keys: Iterable[str]) -> list[BlockView | None]:
        """One answer per key: the entry with its live replicas, or None (absent, or every
        replica is on a member that is down)."""
        out: list[BlockView | None] = []
        append = out.append
        entries = self._entries
        live_one = self._liveness()
        for key in keys:
            record = entries.get(key)
            if record is None:
                append(None)
                continue
            version, write_id, size_bytes, checksum, pinned, replicas = unpack_record(record)
            live: tuple[int, ...]
            if len(replicas) == 1:
                live = replicas if live_one(replicas[0]) else ()
            else:
                live = tuple(m for m in replicas if live_one(m))
            if not live:
                append(None)
                continue
            tier = record_tier(record)
            append(BlockView(key, version, write_id, size_bytes, checksum, live, pinned, tier))
        return out

    def prefix_match(self, keys: Iterable[str]) -> int:
        """Length of the leading run of keys present with at least one live replica."""
        return len(self.present(keys, leading=True))

    def present(self, keys: Iterable[str], *, leading: bool = False) -> list[bool]:
        """Per key: present with at least one live replica (what :meth:`lookup` finds);
        ``leading``: up to the first key that is not."""
        entries = self._entries
        if self._every_member_live():
            # Every record names at least one member, and a member leaves the table only once
            # it holds no key (check_member_invariants): with none of them down, an entry is a
            # hit. The common case, one C-level pass.
            if not leading:
                return list(map(entries.__contains__, keys))
            return list(itertools.takewhile(bool, map(entries.__contains__, keys)))
        live_one = self._liveness()
        # A record's tail (its replica ids, and a tier byte) -> any of them live: the keys of
        # a batch mostly share a few replica sets, each decoded once.
        held: dict[bytes, bool] = {}
        out: list[bool] = []
        append = out.append
        for key in keys:
            record = entries.get(key)
            if record is None:
                hit = False
            else:
                tail = record[RECORD_HEAD:]
                known = held.get(tail)
                if known is None:
                    known = held[tail] = any(map(live_one, record_replicas(record)))
                hit = known
            if leading and not hit:
                break
            append(hit)
        return out

    def _every_member_live(self) -> bool:
        """No member in the table is down (then every entry has a live replica)."""
        known = self._all_live
        if known is not None and known[0] == self._ring_version and known[1] == len(self._members):
            return known[2]
        # A member goes down only with a new ring version; one is forgotten (the table
        # shrinks) only once down. So the answer holds while both stay as they were.
        live = all(m.live for m in self._members.values())
        self._all_live = (self._ring_version, len(self._members), live)
        return live

    def _liveness(self) -> Callable[[int], bool]:
        """``member id -> live`` for one read of many keys: each member asked once."""
        members = self._members
        is_live: dict[int, bool] = {}

        def live_one(member_id: int) -> bool:
            live = is_live.get(member_id)
            if live is None:
                rec = members.get(member_id)
                live = is_live[member_id] = rec is not None and rec.live
            return live

        return live_one

    def masters(self) -> dict[str, str]:
        return dict(self._masters)

    def master_grpc_address(self, raft_address: str) -> str | None:
        return self._masters.get(raft_address)

    def status(self) -> IndexStatus:
        live = sum(1 for m in self._members.values() if m.live)
        return IndexStatus(
            entries=len(self._entries),
            revision=self._revision,
            ring_version=self._ring_version,
            members=len(self._members),
            live_members=live,
            dedupe_entries=len(self._dedupe),
        )

    def __len__(self) -> int:
        return len(self._entries)

    def member_block_count(self, member_id: int) -> int:
        """How many entries name ``member_id`` among their replicas."""
        return len(self._member_keys.get(member_id, ()))

    # --- snapshots ------------------------------------------------------------------------------

    def export_state(self) -> dict[str, Any]:
        """The state as plain Python containers for a Raft snapshot.

        Shares (does not copy) the big dicts: PySyncObj calls this on the Raft thread right
        before forking a child that pickles it, so it must be cheap; nothing mutates the index
        between the call and the fork."""
        return {
            "format": STATE_FORMAT,
            "entries": self._entries,
            "members": [member_tuple(m) for m in self._members.values()],
            "member_of_node": self._member_of_node,
            "member_keys": self._member_keys,
            "drained": self._drained,
            "masters": self._masters,
            "pins": self._pins,
            "revision": self._revision,
            "ring_version": self._ring_version,
            "next_member_id": self._next_member_id,
            "dedupe": self._dedupe,
        }

    @classmethod
    def import_state(
        cls,
        state: dict[str, Any],
        *,
        dedupe_capacity: int = 65536,
        dedupe_max_bytes: int = 64 << 20,
    ) -> BlockIndex:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"index snapshot has format {state.get('format')!r}; this master reads "
                f"format {STATE_FORMAT}"
            )
        index = cls(dedupe_capacity=dedupe_capacity, dedupe_max_bytes=dedupe_max_bytes)
        index._entries = state["entries"]
        index._members = {t[0]: member_from_tuple(t) for t in state["members"]}
        index._member_of_node = state["member_of_node"]
        index._member_keys = state["member_keys"]
        index._drained = state.get("drained", {})  # absent in snapshots written before it
        index._masters = state["masters"]
        index._pins = state.get("pins", {})  # absent in snapshots written before pins
        index._revision = state["revision"]
        index._ring_version = state["ring_version"]
        index._next_member_id = state["next_member_id"]
        dedupe: OrderedDict[bytes, bytes] = OrderedDict(state["dedupe"])
        index._dedupe = dedupe
        index._dedupe_bytes = sum(
            len(k) + len(v) + _DEDUPE_OVERHEAD_BYTES for k, v in dedupe.items()
        )
        return index

    def canonical_state(self) -> tuple[Any, ...]:
        """Everything replicated, insertion order included: two indexes fed the same commands
        give equal values (tests, divergence checks)."""
        return (
            list(self._entries.items()),
            list(self._members.items()),
            list(self._member_of_node.items()),
            [(m, list(keys)) for m, keys in self._member_keys.items()],
            list(self._drained.items()),
            list(self._masters.items()),
            list(self._pins.items()),
            self._revision,
            self._ring_version,
            self._next_member_id,
            list(self._dedupe.items()),
        )

    def check_invariants(self) -> None:
        """Raise AssertionError when the state is inconsistent (tests call it after each step)."""
        for key, record in self._entries.items():
            replicas = record_replicas(record)
            assert replicas, f"{key!r} has no replica"
            assert len(set(replicas)) == len(replicas), f"{key!r} lists a replica twice"
            for m in replicas:
                assert m in self._members, f"{key!r} names unknown member {m}"
                assert key in self._member_keys[m], f"reverse index lacks {key!r} on {m}"
        for m, keys in self._member_keys.items():
            assert m in self._members, f"reverse index names unknown member {m}"
            for key in keys:
                held = self._entries.get(key)
                assert held is not None, f"reverse index names absent key {key!r}"
                assert m in record_replicas(held), f"{key!r} does not list member {m}"
        self.check_member_invariants()
        assert len(self._dedupe) <= self._dedupe_capacity
        for key, n in self._pins.items():
            assert n >= 1, f"pin of {key!r} wants {n} replicas"
            held = self._entries.get(key)
            assert held is not None, f"pin names absent key {key!r}"
            assert unpack_record(held)[4], f"pinned {key!r} lacks its pinned flag"
