"""Commands replicated through the Raft log, their results, and their durable encoding.

Every mutation of the block index is one of these frozen dataclasses. They travel through the
Raft log as ``kvpool.v1.RaftCommand`` protobuf bytes (proto/v1/raft.proto) with
``format_version`` = :data:`FORMAT_VERSION`, never as pickled Python objects, so that a journal
written by one release replays in the next and adding a command never renumbers anything.

Each command carries a ``request_id`` (16 bytes from the client; the master makes one for its own
commands): the index applies a request id once and answers a repeat with the stored result.

Results are frozen dataclasses too. The index keeps the results of recent requests (for
exactly-once retries) in a compact byte form, :func:`encode_result` / :func:`decode_result`.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from typing import TypeAlias, assert_never, cast

from google.protobuf.message import DecodeError

from kvpool.errors import MalformedRequestError
from kvpool.proto.v1 import master_pb2, raft_pb2

FORMAT_VERSION = 1
"""The interpretation of ``RaftCommand`` this release writes and applies."""

PUT_COMMITTED = int(master_pb2.PUT_STATUS_COMMITTED)
PUT_NO_LIVE_REPLICA = int(master_pb2.PUT_STATUS_NO_LIVE_REPLICA)


class CommandDecodeError(MalformedRequestError):
    """A replicated command could not be decoded (garbage bytes or an unknown format version)."""


# --- commands ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PutItem:
    """One staged block to commit: the client wrote ``write_id`` to ``replicas`` (member ids)."""

    key: str
    write_id: int
    size_bytes: int
    checksum: int
    replicas: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CommitPuts:
    """Make staged blocks visible; rejected whole when ``ring_version`` is stale."""

    request_id: bytes
    ring_version: int
    entries: tuple[PutItem, ...]


@dataclass(frozen=True, slots=True)
class RemoveKeys:
    """Remove keys from the index, and up to ``limit`` keys that start with one of
    ``prefixes`` ("" matches every key): a namespace- or cluster-wide removal in steps."""

    request_id: bytes
    keys: tuple[str, ...]
    prefixes: tuple[str, ...] = ()
    limit: int = 0


@dataclass(frozen=True, slots=True)
class DropReplicas:
    """A member no longer holds these blocks (``write_id`` 0 = whichever write is indexed)."""

    request_id: bytes
    member_id: int
    blocks: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class RegisterMember:
    """A store node (re)joins; a new incarnation gets a new member id."""

    request_id: bytes
    node_id: str
    incarnation: int
    data_address: str
    admin_address: str
    capacity_bytes: int
    zone: str


@dataclass(frozen=True, slots=True)
class MarkMemberDown:
    """A member is gone (``heartbeat_timeout``, ``left``…): its replicas stop being served."""

    request_id: bytes
    member_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class RegisterMaster:
    """A master announces the gRPC address behind its Raft address (for NOT_LEADER redirects)."""

    request_id: bytes
    raft_address: str
    grpc_address: str


@dataclass(frozen=True, slots=True)
class ClaimedBlock:
    """A block a member says it holds: exactly this write, on this tier (common.proto Tier)."""

    key: str
    write_id: int
    version: int
    size_bytes: int
    checksum: int
    tier: int


@dataclass(frozen=True, slots=True)
class ClaimReplicas:
    """A member states blocks it holds. Entries that name exactly that write get the tier as
    their hint; with ``restore`` (a warm restart), the member is also added as a replica."""

    request_id: bytes
    member_id: int
    restore: bool
    blocks: tuple[ClaimedBlock, ...]


@dataclass(frozen=True, slots=True)
class ReplicaChange:
    """Add ``add_member`` and/or remove ``remove_member`` (0: none) as replicas of ``key``,
    only while the entry holds exactly ``write_id``."""

    key: str
    write_id: int
    add_member: int = 0
    remove_member: int = 0


@dataclass(frozen=True, slots=True)
class ChangeReplicas:
    """Replica moves decided by the leader: a copy made (hot, pin, repair, drain), a dead or
    draining replica replaced, an extra replica released after cooling."""

    request_id: bytes
    changes: tuple[ReplicaChange, ...]


@dataclass(frozen=True, slots=True)
class SetPins:
    """Pin keys at ``replicas`` copies (0: unpin). ``quota_bytes`` bounds sum(size * replicas)
    over pinned keys (0: unbounded); it travels in the command so every master decides alike."""

    request_id: bytes
    keys: tuple[str, ...]
    replicas: int
    quota_bytes: int


@dataclass(frozen=True, slots=True)
class SetDraining:
    """Mark a live member draining (``draining=True``: no new replica goes to it; the leader
    moves its blocks off, then declares it left) or clear the mark."""

    request_id: bytes
    member_id: int
    draining: bool


@dataclass(frozen=True, slots=True)
class Batch:
    """Several commands in one Raft entry (group commit); each keeps its request id and result.

    A batch never nests another batch."""

    request_id: bytes
    commands: tuple[SimpleCommand, ...]


SimpleCommand: TypeAlias = (
    CommitPuts
    | RemoveKeys
    | DropReplicas
    | RegisterMember
    | MarkMemberDown
    | RegisterMaster
    | ClaimReplicas
    | ChangeReplicas
    | SetPins
    | SetDraining
)
Command: TypeAlias = SimpleCommand | Batch


# --- results ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PutOutcome:
    status: int  # PUT_COMMITTED or PUT_NO_LIVE_REPLICA
    version: int
    replicas: tuple[int, ...]  # the replicas kept (members not live dropped)
    superseded_write_id: int = 0  # the write this one replaced, 0 when the key had none
    superseded_replicas: tuple[int, ...] = ()  # where the index had that write


@dataclass(frozen=True, slots=True)
class CommitPutsResult:
    outcomes: tuple[PutOutcome, ...]
    revision: int
    ring_version: int
    stale_ring: bool = False


@dataclass(frozen=True, slots=True)
class RemovedBlock:
    key: str
    write_id: int
    replicas: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RemoveKeysResult:
    removed: tuple[bool, ...]
    blocks: tuple[RemovedBlock, ...]
    revision: int
    prefix_removed: int = 0
    more: bool = False


@dataclass(frozen=True, slots=True)
class DropReplicasResult:
    dropped: int
    revision: int


@dataclass(frozen=True, slots=True)
class RegisterMemberResult:
    member_id: int
    ring_version: int


@dataclass(frozen=True, slots=True)
class MarkMemberDownResult:
    changed: bool
    ring_version: int


@dataclass(frozen=True, slots=True)
class RegisterMasterResult:
    revision: int


@dataclass(frozen=True, slots=True)
class ClaimReplicasResult:
    accepted: tuple[bool, ...]  # per block: the entry names this member for it now
    revision: int


@dataclass(frozen=True, slots=True)
class ChangeReplicasResult:
    applied: tuple[bool, ...]  # per change: the entry changed as asked
    revision: int


PIN_OK = int(master_pb2.PIN_STATUS_OK)
PIN_ABSENT = int(master_pb2.PIN_STATUS_ABSENT)
PIN_QUOTA_EXCEEDED = int(master_pb2.PIN_STATUS_QUOTA_EXCEEDED)


@dataclass(frozen=True, slots=True)
class SetPinsResult:
    statuses: tuple[int, ...]  # per key: PIN_OK, PIN_ABSENT or PIN_QUOTA_EXCEEDED
    pinned_bytes: int
    revision: int


@dataclass(frozen=True, slots=True)
class SetDrainingResult:
    found: bool  # the member is live (the mark is now as asked)
    changed: bool  # the mark was not already as asked
    ring_version: int


@dataclass(frozen=True, slots=True)
class BatchResult:
    results: tuple[Result, ...]


@dataclass(frozen=True, slots=True)
class ErrorResult:
    """The entry could not be applied (undecodable, invalid); the index did not change."""

    message: str


Result: TypeAlias = (
    CommitPutsResult
    | RemoveKeysResult
    | DropReplicasResult
    | RegisterMemberResult
    | MarkMemberDownResult
    | RegisterMasterResult
    | ClaimReplicasResult
    | ChangeReplicasResult
    | SetPinsResult
    | SetDrainingResult
    | BatchResult
    | ErrorResult
)


# --- command encoding -------------------------------------------------------------------------


def encode(command: Command) -> bytes:
    """The command as ``RaftCommand`` bytes (deterministic serialisation)."""
    return _to_proto(command).SerializeToString(deterministic=True)


def decode(data: bytes) -> Command:
    """Parse ``RaftCommand`` bytes; raises :class:`CommandDecodeError` on anything unexpected."""
    msg = raft_pb2.RaftCommand()
    try:
        msg.ParseFromString(data)
    except (DecodeError, TypeError, ValueError) as e:
        raise CommandDecodeError(f"undecodable replicated command: {e}") from None
    return _from_proto(msg, nested=False)


def _to_proto(command: Command) -> raft_pb2.RaftCommand:
    msg = raft_pb2.RaftCommand(format_version=FORMAT_VERSION, request_id=command.request_id)
    if isinstance(command, CommitPuts):
        msg.commit_puts.SetInParent()  # an empty body must still select its oneof case
        msg.commit_puts.ring_version = command.ring_version
        entries = msg.commit_puts.entries
        for e in command.entries:
            entries.add(
                key=e.key,
                write_id=e.write_id,
                size_bytes=e.size_bytes,
                checksum=e.checksum,
                replicas=e.replicas,
            )
    elif isinstance(command, RemoveKeys):
        msg.remove_keys.SetInParent()
        msg.remove_keys.keys.extend(command.keys)
        msg.remove_keys.prefixes.extend(command.prefixes)
        msg.remove_keys.limit = command.limit
    elif isinstance(command, DropReplicas):
        msg.drop_replicas.SetInParent()
        msg.drop_replicas.member_id = command.member_id
        blocks = msg.drop_replicas.blocks
        for key, write_id in command.blocks:
            blocks.add(key=key, write_id=write_id)
    elif isinstance(command, RegisterMember):
        r = msg.register_member
        r.SetInParent()
        r.node_id = command.node_id
        r.incarnation = command.incarnation
        r.data_address = command.data_address
        r.admin_address = command.admin_address
        r.capacity_bytes = command.capacity_bytes
        r.zone = command.zone
    elif isinstance(command, MarkMemberDown):
        msg.mark_member_down.SetInParent()
        msg.mark_member_down.member_id = command.member_id
        msg.mark_member_down.reason = command.reason
    elif isinstance(command, RegisterMaster):
        msg.register_master.SetInParent()
        msg.register_master.raft_address = command.raft_address
        msg.register_master.grpc_address = command.grpc_address
    elif isinstance(command, ClaimReplicas):
        cr = msg.claim_replicas
        cr.SetInParent()
        cr.member_id = command.member_id
        cr.restore = command.restore
        for b in command.blocks:
            cr.blocks.add(
                key=b.key,
                write_id=b.write_id,
                version=b.version,
                size_bytes=b.size_bytes,
                checksum=b.checksum,
                tier=b.tier,
            )
    elif isinstance(command, ChangeReplicas):
        msg.change_replicas.SetInParent()
        for c in command.changes:
            msg.change_replicas.changes.add(
                key=c.key,
                write_id=c.write_id,
                add_member=c.add_member,
                remove_member=c.remove_member,
            )
    elif isinstance(command, SetPins):
        msg.set_pins.SetInParent()
        msg.set_pins.keys.extend(command.keys)
        msg.set_pins.replicas = command.replicas
        msg.set_pins.quota_bytes = command.quota_bytes
    elif isinstance(command, SetDraining):
        msg.set_draining.SetInParent()
        msg.set_draining.member_id = command.member_id
        msg.set_draining.draining = command.draining
    elif isinstance(command, Batch):
        msg.batch.SetInParent()
        for sub in command.commands:
            if isinstance(cast(object, sub), Batch):
                raise ValueError("a Batch must not contain a Batch")
            msg.batch.commands.append(_to_proto(sub))
    else:
        assert_never(command)
    return msg


def _from_proto(msg: raft_pb2.RaftCommand, *, nested: bool) -> Command:
    if msg.format_version != FORMAT_VERSION:
        raise CommandDecodeError(
            f"replicated command has format version {msg.format_version}; "
            f"this master applies version {FORMAT_VERSION}"
        )
    rid = bytes(msg.request_id)
    kind = msg.WhichOneof("body")
    if kind == "commit_puts":
        cp = msg.commit_puts
        return CommitPuts(
            rid,
            cp.ring_version,
            tuple(
                PutItem(e.key, e.write_id, e.size_bytes, e.checksum, tuple(e.replicas))
                for e in cp.entries
            ),
        )
    if kind == "remove_keys":
        rk = msg.remove_keys
        return RemoveKeys(rid, tuple(rk.keys), tuple(rk.prefixes), rk.limit)
    if kind == "drop_replicas":
        dr = msg.drop_replicas
        return DropReplicas(rid, dr.member_id, tuple((b.key, b.write_id) for b in dr.blocks))
    if kind == "register_member":
        r = msg.register_member
        return RegisterMember(
            rid, r.node_id, r.incarnation, r.data_address, r.admin_address, r.capacity_bytes, r.zone
        )
    if kind == "mark_member_down":
        return MarkMemberDown(rid, msg.mark_member_down.member_id, msg.mark_member_down.reason)
    if kind == "register_master":
        rm = msg.register_master
        return RegisterMaster(rid, rm.raft_address, rm.grpc_address)
    if kind == "claim_replicas":
        cr = msg.claim_replicas
        return ClaimReplicas(
            rid,
            cr.member_id,
            cr.restore,
            tuple(
                ClaimedBlock(b.key, b.write_id, b.version, b.size_bytes, b.checksum, int(b.tier))
                for b in cr.blocks
            ),
        )
    if kind == "change_replicas":
        return ChangeReplicas(
            rid,
            tuple(
                ReplicaChange(c.key, c.write_id, c.add_member, c.remove_member)
                for c in msg.change_replicas.changes
            ),
        )
    if kind == "set_pins":
        sp = msg.set_pins
        return SetPins(rid, tuple(sp.keys), sp.replicas, sp.quota_bytes)
    if kind == "set_draining":
        return SetDraining(rid, msg.set_draining.member_id, msg.set_draining.draining)
    if kind == "batch":
        if nested:
            raise CommandDecodeError("a Batch must not contain a Batch")
        subs: list[SimpleCommand] = []
        for sub_msg in msg.batch.commands:
            sub = _from_proto(sub_msg, nested=True)
            assert not isinstance(sub, Batch)
            subs.append(sub)
        return Batch(rid, tuple(subs))
    raise CommandDecodeError("replicated command has no body (unknown command kind?)")


# --- compact result encoding (the dedupe table) ---------------------------------------------

_TAG_COMMIT_PUTS = 1
_TAG_REMOVE_KEYS = 2
_TAG_DROP_REPLICAS = 3
_TAG_REGISTER_MEMBER = 4
_TAG_MARK_MEMBER_DOWN = 5
_TAG_REGISTER_MASTER = 6
_TAG_CLAIM_REPLICAS = 7
_TAG_CHANGE_REPLICAS = 8
_TAG_SET_PINS = 9
_TAG_SET_DRAINING = 10
_TAG_COMMIT_PUTS_PACKED = 11
_TAG_REMOVE_KEYS_PACKED = 12
_PUTS_HEAD = struct.Struct("<QQ?I")  # revision, ring version, stale ring, outcomes
_REMOVE_HEAD = struct.Struct("<QQ?II")  # revision, prefix removed, more, keys, blocks
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_LITTLE_ENDIAN = sys.byteorder == "little"
_U32_U64 = struct.Struct("<IQ")
_BOOL_U64 = struct.Struct("<?Q")
_U64 = struct.Struct("<Q")
_U64_U64 = struct.Struct("<QQ")
_BOOL_BOOL_U64 = struct.Struct("<??Q")


def _array_bytes(code: str, values: Iterable[int]) -> bytes:
    """``values`` as little-endian ``array(code)`` items (OverflowError when one does not fit)."""
    packed = array(code, values)
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _take_array(code: str, data: bytes, at: int, count: int) -> tuple[list[int], int]:
    """``count`` little-endian ``array(code)`` items of ``data`` from ``at``, and the offset
    after them."""
    taken = array(code)
    end = at + taken.itemsize * count
    if end > len(data):
        raise ValueError("a stored result is cut short")
    taken.frombytes(data[at:end])
    if not _LITTLE_ENDIAN:
        taken.byteswap()
    return taken.tolist(), end


def _runs(flat: list[int], counts: bytes) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    at = 0
    for n in counts:
        out.append(tuple(flat[at : at + n]))
        at += n
    return out


def _pack_commit_puts(result: CommitPutsResult) -> bytes:
    """Columns of fixed-width little-endian fields: ~5x faster than the protobuf form for a
    large batch, which every master stores for every commit it applies (ValueError or
    OverflowError where a value does not fit: the caller stores the protobuf form then)."""
    outs = result.outcomes
    replicas = [o.replicas for o in outs]
    superseded = [o.superseded_replicas for o in outs]
    head = _PUTS_HEAD.pack(result.revision, result.ring_version, result.stale_ring, len(outs))
    return b"".join(
        (
            bytes((_TAG_COMMIT_PUTS_PACKED,)),
            head,
            bytes([o.status for o in outs]),
            _array_bytes("Q", [o.version for o in outs]),
            _array_bytes("Q", [o.superseded_write_id for o in outs]),
            bytes(map(len, replicas)),
            _array_bytes("Q", chain.from_iterable(replicas)),
            bytes(map(len, superseded)),
            _array_bytes("Q", chain.from_iterable(superseded)),
        )
    )


def _unpack_commit_puts(body: bytes) -> CommitPutsResult:
    revision, ring_version, stale_ring, n = _PUTS_HEAD.unpack_from(body)
    at = _PUTS_HEAD.size
    statuses = body[at : at + n]
    versions, at = _take_array("Q", body, at + n, n)
    superseded_ids, at = _take_array("Q", body, at, n)
    replica_counts = body[at : at + n]
    flat, at = _take_array("Q", body, at + n, sum(replica_counts))
    superseded_counts = body[at : at + n]
    superseded_flat, at = _take_array("Q", body, at + n, sum(superseded_counts))
    if at != len(body) or len(statuses) != n:
        raise ValueError("a stored CommitPuts result has trailing or missing bytes")
    outcomes = tuple(
        map(
            PutOutcome,
            statuses,
            versions,
            _runs(flat, replica_counts),
            superseded_ids,
            _runs(superseded_flat, superseded_counts),
        )
    )
    return CommitPutsResult(outcomes, revision, ring_version, stale_ring)


def _pack_remove_keys(result: RemoveKeysResult) -> bytes:
    """As :func:`_pack_commit_puts`, for a removal's result."""
    blocks = result.blocks
    keys = [b.key.encode("utf-8") for b in blocks]
    replicas = [b.replicas for b in blocks]
    head = _REMOVE_HEAD.pack(
        result.revision, result.prefix_removed, result.more, len(result.removed), len(blocks)
    )
    return b"".join(
        (
            bytes((_TAG_REMOVE_KEYS_PACKED,)),
            head,
            bytes(result.removed),
            _array_bytes("Q", [b.write_id for b in blocks]),
            _array_bytes(_U32, map(len, keys)),
            b"".join(keys),
            bytes(map(len, replicas)),
            _array_bytes("Q", chain.from_iterable(replicas)),
        )
    )


def _unpack_remove_keys(body: bytes) -> RemoveKeysResult:
    revision, prefix_removed, more, n_removed, n = _REMOVE_HEAD.unpack_from(body)
    at = _REMOVE_HEAD.size
    removed = tuple(map(bool, body[at : at + n_removed]))
    write_ids, at = _take_array("Q", body, at + n_removed, n)
    key_lengths, at = _take_array(_U32, body, at, n)
    keys = []
    for length in key_lengths:
        keys.append(body[at : at + length].decode("utf-8"))
        at += length
    replica_counts = body[at : at + n]
    flat, at = _take_array("Q", body, at + n, sum(replica_counts))
    if at != len(body) or len(removed) != n_removed:
        raise ValueError("a stored Remove result has trailing or missing bytes")
    blocks = tuple(map(RemovedBlock, keys, write_ids, _runs(flat, replica_counts)))
    return RemoveKeysResult(removed, blocks, revision, prefix_removed, more)


def encode_result(result: Result) -> bytes:
    """A stored form of a simple command's result (batches and errors are never stored)."""
    if isinstance(result, CommitPutsResult):
        try:
            return _pack_commit_puts(result)
        except (ValueError, OverflowError):
            pass  # a value past the packed form's fields: the protobuf form below
        resp = master_pb2.CommitPutsResponse(
            revision=result.revision,
            stale_ring=result.stale_ring,
            ring_version=result.ring_version,
        )
        for o in result.outcomes:
            resp.results.add(
                status=o.status,
                version=o.version,
                replicas=o.replicas,
                superseded_write_id=o.superseded_write_id,
                superseded_replicas=o.superseded_replicas,
            )
        return bytes([_TAG_COMMIT_PUTS]) + resp.SerializeToString(deterministic=True)
    if isinstance(result, RemoveKeysResult):
        try:
            return _pack_remove_keys(result)
        except (ValueError, OverflowError):
            pass
        rr = master_pb2.RemoveResponse(
            removed=result.removed,
            revision=result.revision,
            prefix_removed=result.prefix_removed,
            more=result.more,
        )
        for b in result.blocks:
            rr.blocks.add(key=b.key, write_id=b.write_id, replicas=b.replicas)
        return bytes([_TAG_REMOVE_KEYS]) + rr.SerializeToString(deterministic=True)
    if isinstance(result, DropReplicasResult):
        return bytes([_TAG_DROP_REPLICAS]) + _U32_U64.pack(result.dropped, result.revision)
    if isinstance(result, RegisterMemberResult):
        return bytes([_TAG_REGISTER_MEMBER]) + _U32_U64.pack(result.member_id, result.ring_version)
    if isinstance(result, MarkMemberDownResult):
        return bytes([_TAG_MARK_MEMBER_DOWN]) + _BOOL_U64.pack(result.changed, result.ring_version)
    if isinstance(result, RegisterMasterResult):
        return bytes([_TAG_REGISTER_MASTER]) + _U64.pack(result.revision)
    if isinstance(result, ClaimReplicasResult):
        bits = bytearray((len(result.accepted) + 7) // 8)
        for i, ok in enumerate(result.accepted):
            if ok:
                bits[i // 8] |= 1 << (i % 8)
        head = _U32_U64.pack(len(result.accepted), result.revision)
        return bytes([_TAG_CLAIM_REPLICAS]) + head + bytes(bits)
    if isinstance(result, ChangeReplicasResult):
        head = _U32_U64.pack(len(result.applied), result.revision)
        return bytes([_TAG_CHANGE_REPLICAS]) + head + bytes(result.applied)
    if isinstance(result, SetPinsResult):
        head = _U64_U64.pack(result.pinned_bytes, result.revision)
        return bytes([_TAG_SET_PINS]) + head + bytes(result.statuses)
    if isinstance(result, SetDrainingResult):
        body = _BOOL_BOOL_U64.pack(result.found, result.changed, result.ring_version)
        return bytes([_TAG_SET_DRAINING]) + body
    raise TypeError(f"{type(result).__name__} is not stored")


def decode_result(data: bytes) -> Result:
    tag, body = data[0], data[1:]
    if tag == _TAG_COMMIT_PUTS_PACKED:
        return _unpack_commit_puts(body)
    if tag == _TAG_REMOVE_KEYS_PACKED:
        return _unpack_remove_keys(body)
    if tag == _TAG_COMMIT_PUTS:
        resp = master_pb2.CommitPutsResponse.FromString(body)
        return CommitPutsResult(
            tuple(
                PutOutcome(
                    int(r.status),
                    r.version,
                    tuple(r.replicas),
                    r.superseded_write_id,
                    tuple(r.superseded_replicas),
                )
                for r in resp.results
            ),
            resp.revision,
            resp.ring_version,
            resp.stale_ring,
        )
    if tag == _TAG_REMOVE_KEYS:
        rr = master_pb2.RemoveResponse.FromString(body)
        return RemoveKeysResult(
            tuple(rr.removed),
            tuple(RemovedBlock(b.key, b.write_id, tuple(b.replicas)) for b in rr.blocks),
            rr.revision,
            rr.prefix_removed,
            rr.more,
        )
    if tag == _TAG_DROP_REPLICAS:
        dropped, revision = _U32_U64.unpack(body)
        return DropReplicasResult(dropped, revision)
    if tag == _TAG_REGISTER_MEMBER:
        member_id, ring_version = _U32_U64.unpack(body)
        return RegisterMemberResult(member_id, ring_version)
    if tag == _TAG_MARK_MEMBER_DOWN:
        changed, ring_version = _BOOL_U64.unpack(body)
        return MarkMemberDownResult(changed, ring_version)
    if tag == _TAG_REGISTER_MASTER:
        (revision,) = _U64.unpack(body)
        return RegisterMasterResult(revision)
    if tag == _TAG_CLAIM_REPLICAS:
        count, revision = _U32_U64.unpack_from(body)
        bits = body[_U32_U64.size :]
        accepted = tuple(bool(bits[i // 8] >> (i % 8) & 1) for i in range(count))
        return ClaimReplicasResult(accepted, revision)
    if tag == _TAG_CHANGE_REPLICAS:
        count, revision = _U32_U64.unpack_from(body)
        flags = body[_U32_U64.size : _U32_U64.size + count]
        return ChangeReplicasResult(tuple(bool(b) for b in flags), revision)
    if tag == _TAG_SET_PINS:
        pinned_bytes, revision = _U64_U64.unpack_from(body)
        return SetPinsResult(tuple(body[_U64_U64.size :]), pinned_bytes, revision)
    if tag == _TAG_SET_DRAINING:
        found, changed, ring_version = _BOOL_BOOL_U64.unpack(body)
        return SetDrainingResult(found, changed, ring_version)
    raise ValueError(f"unknown stored result tag {tag}")
