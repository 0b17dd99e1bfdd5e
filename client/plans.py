"""What the client sends to one node and how it judges the answers — no I/O.

Reads and writes are cut per node into frames (:class:`~kvpool.transports.calls.Call`) that a
shell sends over a connection and hands back answered: the event-loop data plane
(:mod:`kvpool.client.blocks`) awaits ``FrameConnection.exchange``, the synchronous client's fast
path (:mod:`kvpool.client.fastpath`) calls ``BlockingConnection.exchange`` in the caller's
thread. The judging is here, once:

* a block counts as read only when the node answered OK for exactly the write id the index
  holds, with the size and checksum the index holds, and the bytes received hash to it;
  anything else moves the key to its next replica, and past the last one the key is a miss
  with the strongest reason seen;
* a node that speaks MGET gets one frame for many keys (its answer: one table and the bytes of
  the hits, scattered into their buffers); over shared memory one SHM_GET says where each large
  block lies in the arena, the bytes are copied out here and the leases given back after
  (a lone small block comes inline on the node's unix socket); blocks the node lists in its
  shared directory are read with no frame at all (:func:`read_listed`);
* puts are PUT frames over TCP, or a reservation, a copy into the arena and a commit over
  shared memory.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from kvpool.buffers import Parts, copy_bytes
from kvpool.checksum import block_checksum, block_checksums, copy_checksum
from kvpool.client.placement import MemberInfo
from kvpool.client.stats import strongest_reason
from kvpool.errors import (
    BlockMissError,
    ChecksumMismatchError,
    DeadlineExceededError,
    KVPoolError,
    NoSpaceError,
    TransportError,
    UnavailableError,
    ValueTooLargeError,
)
from kvpool.proto.v1 import common_pb2
from kvpool.proto.wire import (
    MAX_TABLE_KEYS,
    MGET_RECORD,
    RESERVE_RECORD,
    SHM_RECORD,
    MissReason,
    Op,
    Status,
    TierLevel,
    encode_ids,
    encode_key_table,
)
from kvpool.transports.calls import Call, owned_bytes
from kvpool.transports.shm import Arena

MISS_REASONS: dict[int, str] = {
    MissReason.ABSENT: "absent",
    MissReason.STAGED: "version_mismatch",
    MissReason.WRONG_VERSION: "version_mismatch",
    MissReason.EVICTED: "evicted",
    MissReason.SLOW_TIER: "slow_tier",
    MissReason.CORRUPT: "checksum_mismatch",  # the node found its copy bad and dropped it
}
MGET_MAX_KEYS = 1024
"""Most keys in one MGET frame."""
MGET_MAX_BYTES = 64 << 20
"""Most block bytes asked for in one MGET frame (a larger batch takes several, pipelined)."""
SHM_GET_MIN_BYTES = 64 << 10
"""Over shared memory, smaller blocks are read with GET/MGET frames on the node's unix socket
(one round trip, the kernel copies the bytes); larger ones are leased and copied out of the
arena directly (the lease must be given back: one more message)."""
SHM_GET_BATCH = 8
"""A read of at least this many keys from one node over shared memory leases every block, small
ones too: the unix socket's buffer (~200 KiB) makes the node send an MGET's inline bytes in
pieces, each a wake-up of the reader, while one SHM_GET answers with a table and the release
is one posted message for the whole batch."""
SHM_PUT_MIN_BYTES = 64 << 10
"""Over shared memory, smaller blocks are put with a PUT frame (one round trip, the kernel
copies the bytes) rather than reserved, copied and committed (two round trips)."""

PUT_CHUNK_BYTES = 4 << 20
"""Payload per group of PUT frames that a blocking sender hashes then sends: small enough that
the next group's hashing overlaps the node reading this one out of the socket buffers (a few MiB
on loopback), large enough that the vectored writes stay few."""


class DirectEntry:
    """The index entry of a read by content (:func:`kvpool.client.ops.direct_entry`): the
    fields of a ``BlockEntry`` that a read uses, write id, size and checksum 0 until the node's
    answer fills them in. A plain object, made once per key read: a quarter of the cost of the
    protobuf message."""

    __slots__ = ("checksum", "found", "key", "replicas", "size_bytes", "tier", "write_id")

    def __init__(self, key: str, replicas: list[int]) -> None:
        self.key = key
        self.found = True
        self.replicas = replicas
        self.write_id = 0
        self.size_bytes = 0
        self.checksum = 0
        self.tier = 0


Entry = common_pb2.BlockEntry | DirectEntry
"""What a read goes by: the index's entry, or the stand-in of a read by content."""


class ReadItem:
    """One key being read: its index entry, where the bytes go, what went wrong so far."""

    __slots__ = (
        "_errors",
        "_reasons",
        "caller_buffer",
        "entry",
        "from_cache",
        "key",
        "key_bytes",
        "max_tier",
        "next",
        "ok",
        "replicas",
        "sink",
        "tier",
        "value",
    )

    def __init__(
        self,
        key: str,
        key_bytes: bytes,
        entry: Entry,
        *,
        sink: memoryview | Parts | None,
        caller_buffer: bool,
        replicas: list[int],
        max_tier: int = 0,
        from_cache: bool = False,
    ) -> None:
        self.key = key
        self.key_bytes = key_bytes
        self.entry = entry
        self.sink = sink  # exactly entry.size_bytes long; None: the caller wants bytes
        self.caller_buffer = caller_buffer  # the sink is the caller's memory (get_into)
        self.replicas = replicas
        self.next = 0
        self.ok = False
        self.max_tier = max_tier  # the slowest tier accepted (TierLevel; 0: any)
        self.tier = 0  # the tier that served it (TierLevel), once read
        self.value: bytes | None = None  # the bytes, when read without a sink
        self.from_cache = from_cache  # the entry came from the lookup cache
        self._reasons: list[str] | None = None
        self._errors: list[KVPoolError] | None = None

    @property
    def reasons(self) -> list[str]:
        return self._reasons or []

    @property
    def errors(self) -> list[KVPoolError]:
        """The error behind each of :attr:`reasons`."""
        return self._errors or []

    def fail(self, reason: str, error: KVPoolError) -> None:
        if self._reasons is None or self._errors is None:
            self._reasons, self._errors = [], []
        self._reasons.append(reason)
        self._errors.append(error)

    @property
    def reason(self) -> str:
        return strongest_reason(self.reasons)

    def error(self) -> KVPoolError:
        """The typed error for strict callers, matching :attr:`reason`."""
        reason = self.reason
        if self._reasons and self._errors and reason in self._reasons:
            return self._errors[self._reasons.index(reason)]
        return BlockMissError(f"block {self.key!r} has no replica to read", reason="node_down")

    def result(self) -> bytes:
        """The bytes read (a hit)."""
        if self.value is not None:
            return self.value
        assert self.sink is not None
        return bytes(self.sink)


@dataclass(slots=True, eq=False)
class PutItem:
    """One block being put: its bytes, identity, targets, and the replicas that staged it."""

    key: str
    key_bytes: bytes
    payload: memoryview | Parts
    write_id: int = 0
    targets: list[MemberInfo] = field(default_factory=list)
    acked: list[int] = field(default_factory=list)
    committed: bool = False
    error: KVPoolError | None = None
    _checksum: int | None = None

    @property
    def checksum(self) -> int:
        """xxh3-64 of the bytes, computed when first needed: a batch sent over TCP hashes
        each group of blocks just before sending it, while the node reads the group before
        (:meth:`NodeStage.chunks`); one reserved in a node's shared memory, all of them at
        once, with a helper thread (:func:`make_checksums`)."""
        if self._checksum is None:
            self._checksum = block_checksum(self.payload)
        return self._checksum

    def restart(self, write_id: int, targets: list[MemberInfo]) -> None:
        """A new attempt: a fresh write id (never reused), new targets, nothing acked."""
        self.write_id = write_id
        self.targets = targets
        self.acked = []
        self.committed = False
        self.error = None


@dataclass(frozen=True, slots=True)
class BlockRef:
    """A committed block on one member: enough to PUBLISH or DELETE it."""

    key_bytes: bytes
    write_id: int
    version: int
    member: MemberInfo
    receipt: int = 0
    """The index's signature of (key, write id, version), sent in the PUBLISH frame's checksum
    field (:mod:`kvpool.receipts`): the node publishes without asking the index. 0: none."""


@dataclass(frozen=True, slots=True)
class BlockLocation:
    """Where the index has a key's block (:meth:`kvpool.Client.locate`): a hint, as of the
    lookup; a read still checks the bytes against ``checksum``."""

    key: str
    size_bytes: int
    version: int
    checksum: int
    tier: str
    """The fastest tier a replica last reported ("gpu", "cpu", "ssd"), or "" when none has
    reported a change since the put (a put lands in a node's CPU memory)."""
    replicas: tuple[MemberInfo, ...]
    """The live members holding it, in the index's order (a replica on a member declared
    down is left out)."""
    pinned: bool = False

    @classmethod
    def from_entry(
        cls, entry: common_pb2.BlockEntry, members: dict[int, MemberInfo]
    ) -> BlockLocation:
        try:
            tier = TierLevel(entry.tier).name.lower() if entry.tier else ""
        except ValueError:  # a tier a newer master knows and this client does not
            tier = ""
        return cls(
            key=entry.key,
            size_bytes=int(entry.size_bytes),
            version=int(entry.version),
            checksum=int(entry.checksum),
            tier=tier,
            replicas=tuple(members[m] for m in entry.replicas if m in members),
            pinned=bool(entry.pinned),
        )


def new_write_ids(n: int) -> list[int]:
    """``n`` random non-zero 64-bit write ids (os.urandom: never derived from a seed)."""
    raw = os.urandom(8 * n)
    ids = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, 8 * n, 8)]
    return [w or new_write_ids(1)[0] for w in ids]


def node_error(address: str, op: str, status: int, text: str) -> KVPoolError:
    """The typed error for a node's error status."""
    try:
        name = Status(status).name
    except ValueError:
        name = f"status {status}"
    text = text or "no message"
    if status == Status.NO_SPACE:
        return NoSpaceError(f"{address}: {op}: no space ({text})")
    if status == Status.CHECKSUM_MISMATCH:
        return ChecksumMismatchError(f"{address}: {op}: the node saw another checksum ({text})")
    if status == Status.TOO_LARGE:
        return ValueTooLargeError(f"{address}: {op}: block above the node's limit ({text})")
    return TransportError(f"{address}: {op}: node answered {name}: {text}")


def transport_failure(error: KVPoolError) -> tuple[str, KVPoolError]:
    """How a failed exchange with a node counts for a read: timeout, or node_down."""
    if isinstance(error, DeadlineExceededError):
        return "timeout", error
    return "node_down", UnavailableError(error.message)


# --- judging one answer -------------------------------------------------------------------------


def judge(
    it: ReadItem,
    address: str,
    answer: tuple[int, ...],
    data: memoryview | Parts | None,
    message: str = "",
    *,
    digest: int | None = None,
) -> None:
    """Judge one node's answer for ``it`` — ``answer`` is (status, flags, write id, size,
    checksum), as an MGET record — : a hit sets ``it.ok``, anything else records why. An entry
    of write id 0 is a direct read (:func:`kvpool.client.ops.direct_entry`): the node names the
    write, its size (the caller's buffer's, when one was given) and the checksum the bytes
    must hash to; a hit fills the entry in with them. ``digest``: the bytes' checksum, when
    the transport took it as they landed (:func:`~kvpool.transports.calls.hash_landed`)."""
    status, flags, write_id, size, checksum = answer[:5]
    entry = it.entry
    if status == Status.MISS:
        reason = MISS_REASONS.get(flags, "absent")
        it.fail(reason, BlockMissError(f"{address}: {it.key!r}: {reason}", reason=reason))
        return
    if status != Status.OK:
        it.fail("node_error", node_error(address, "GET", status, message))
        return
    if not entry.write_id:
        _judge_direct(it, address, answer, data, digest=digest)
        return
    if write_id not in (0, entry.write_id):
        it.fail(
            "version_mismatch",
            BlockMissError(
                f"{address}: {it.key!r}: node answered write id {write_id:#x} for "
                f"{entry.write_id:#x}",
                reason="version_mismatch",
            ),
        )
        return
    if size != entry.size_bytes or checksum != entry.checksum:
        it.fail(
            "checksum_mismatch",
            ChecksumMismatchError(
                f"{address}: {it.key!r}: node sent {size} bytes with checksum {checksum:#x}; "
                f"the index holds {entry.size_bytes} bytes with checksum {entry.checksum:#x}"
            ),
        )
        return
    _take(it, address, data, size=size, checksum=checksum, flags=flags, digest=digest)


def _take(
    it: ReadItem,
    address: str,
    data: memoryview | Parts | None,
    *,
    size: int,
    checksum: int,
    flags: int,
    digest: int | None = None,
) -> bool:
    """The bytes of a hit whose answer was judged right: they must be ``size`` bytes hashing
    to ``checksum`` (``digest``, when already taken); then they are the item's value (a hit,
    on tier ``flags``)."""
    if data is None and size == 0:
        data = memoryview(b"")
    if data is None or data.nbytes != size:
        it.fail("node_down", UnavailableError(f"{address}: {it.key!r}: payload not received"))
        return False
    if (block_checksum(data) if digest is None else digest) != checksum:
        it.fail(
            "checksum_mismatch",
            ChecksumMismatchError(
                f"{address}: {it.key!r}: the bytes received do not hash to {checksum:#x}"
            ),
        )
        return False
    if it.sink is None:
        it.value = owned_bytes(data)
    elif data is not it.sink:
        copy_bytes(it.sink, data)
    it.ok = True
    it.tier = flags
    return True


def _judge_direct(
    it: ReadItem,
    address: str,
    answer: tuple[int, ...],
    data: memoryview | Parts | None,
    *,
    digest: int | None,
) -> None:
    """:func:`judge` of an OK answer to a direct read."""
    _status, flags, write_id, size, checksum = answer[:5]
    entry = it.entry
    if not write_id or (entry.size_bytes and size != entry.size_bytes):
        it.fail(
            "version_mismatch",
            BlockMissError(
                f"{address}: {it.key!r}: read by content, the node answered write id "
                f"{write_id:#x} of {size} bytes (expected {entry.size_bytes or 'any size'})",
                reason="version_mismatch",
            ),
        )
        return
    if _take(it, address, data, size=size, checksum=checksum, flags=flags, digest=digest):
        entry.write_id, entry.size_bytes, entry.checksum = write_id, size, checksum


# --- reads with no message: the node's shared directory ---------------------------------------


def read_listed(
    items: list[ReadItem], arena: Arena, content: Callable[[str], bool] | None = None
) -> list[ReadItem]:
    """Read the items the node's shared directory lists (:mod:`kvpool.transports.directory`)
    straight out of its arena: copied into the item's buffer (or new bytes), then hashed — a hit
    only when the copy hashes to the checksum listed and the listing is the write the item's
    entry names (any write, for a read by content or of a key that names its content; the size
    of the caller's buffer, when it gave one). Returns the items left to read through the node:
    not listed, or a copy that did not check (its memory reused meanwhile). The directory lists
    only committed blocks in memory.

    A read through an entry from the lookup cache goes to the node: the entry may name a write
    that a newer put has replaced, and the node drops the replaced write as it reads the new
    one's PUBLISH, in order with the reads it serves — a stopped node cannot, and its directory
    stays readable for up to a second. A read by content wants any write of the key; a read
    through an entry the index just gave names the newest. So does a read through a cached
    entry of a key that names its content (``content``: the client's ``direct_reads``): every
    write of it holds the same bytes, so no write of it is a replaced value — a client reading
    back the blocks it put itself reads them here, as another client would by content."""
    directory = arena.directory
    assert directory is not None
    rest: list[ReadItem] = []
    for it in items:
        entry = it.entry
        exact = entry.write_id  # the write named must be the one listed
        if exact and it.from_cache:
            if content is None or not content(it.key):
                rest.append(it)
                continue
            exact = 0
        if it.max_tier == TierLevel.GPU:
            rest.append(it)
            continue
        found = directory.find(it.key_bytes)
        if (
            found is None
            or (exact and found.write_id != exact)
            or (entry.write_id and found.checksum != entry.checksum)
            or (entry.size_bytes and found.size != entry.size_bytes)
        ):
            rest.append(it)
            continue
        try:
            extent = arena.extent(found.offset, found.size)
        except KVPoolError:  # a listing outside the arena: the node is asked
            rest.append(it)
            continue
        if it.sink is not None:
            data = it.sink
            digest = copy_checksum(data, extent)
        else:
            data = memoryview(bytes(extent))
            digest = block_checksum(data)
        if digest != found.checksum:
            rest.append(it)
            continue
        if it.sink is None:
            it.value = owned_bytes(data)
        if not entry.write_id:
            entry.write_id, entry.size_bytes, entry.checksum = (
                found.write_id,
                found.size,
                found.checksum,
            )
        it.ok = True
        it.tier = TierLevel.CPU
        directory.count_read(found.slot)
    return rest


# --- reads from one node ------------------------------------------------------------------------


class NodeRead:
    """The reads of a group of keys from one node: the frames to send, then the judging."""

    def __init__(
        self,
        address: str,
        items: list[ReadItem],
        *,
        mget: bool,
        arena: Arena | None,
        direct: bool = True,
    ) -> None:
        """``direct``: the node reads a key by its content (write id 0; HELLO's ``direct``);
        a direct read of a node that does not fails here, unsent (it is looked up then)."""
        if not direct and any(not it.entry.write_id for it in items):
            for it in items:
                if not it.entry.write_id:
                    it.fail(
                        "node_error",
                        UnavailableError(f"{address}: this node reads no key by its content"),
                    )
            items = [it for it in items if it.entry.write_id]
        self.address = address
        self.items = items
        self.arena = arena
        self.sent_at = 0.0  # when the plane sent :attr:`calls` (its clock)
        self.calls: list[Call] = []
        self._groups: list[list[ReadItem]] = []
        self.followups: list[Call] = []  # single GETs for blocks the node deferred
        self._deferred: list[ReadItem] = []
        self.releases: list[int] = []  # shared-memory leases to give back
        inline = items
        if arena is not None:
            if len(items) >= SHM_GET_BATCH:
                mapped, inline = items, []
            else:
                mapped = [it for it in items if it.entry.size_bytes >= SHM_GET_MIN_BYTES]
                inline = [it for it in items if it.entry.size_bytes < SHM_GET_MIN_BYTES]
            for chunk in _chunks(mapped, MAX_TABLE_KEYS, 0):
                self._add(_table_call(Op.SHM_GET, chunk, SHM_RECORD, sinks=False), chunk)
        if mget and len(inline) > 1:
            for chunk in _chunks(inline, MGET_MAX_KEYS, MGET_MAX_BYTES):
                self._add(_table_call(Op.MGET, chunk, MGET_RECORD, sinks=True), chunk)
        else:
            for it in inline:
                self._add(_get_call(it), [it])

    def _add(self, call: Call, group: list[ReadItem]) -> None:
        self.calls.append(call)
        self._groups.append(group)

    def fail_all(self, error: KVPoolError) -> None:
        reason, err = transport_failure(error)
        for it in self.items:
            if not it.ok:
                it.fail(reason, err)

    def judge(self) -> None:
        """Judge the answers to :attr:`calls`; fills :attr:`followups` and :attr:`releases`."""
        for call, group in zip(self.calls, self._groups, strict=True):
            if call.error is not None or call.header is None:
                error = call.error or TransportError(f"{self.address}: no answer")
                for it in group:
                    it.fail("node_error", UnavailableError(str(error)))
                continue
            if call.table is None:
                it = group[0]
                digest = call.digests[0] if call.digests else None  # hashed as it landed
                judge(it, self.address, _answer(call), call.data, call.message(), digest=digest)
                continue
            if call.status != Status.OK or len(call.records) != len(group):
                for it in group:
                    it.fail(
                        "node_error",
                        node_error(self.address, Op(call.op).name, call.status, call.message()),
                    )
                continue
            if call.op == Op.SHM_GET:
                self._judge_shm(call, group)
            else:
                self._judge_mget(call, group)
        for it in self._deferred:
            self.followups.append(_get_call(it))

    def _judge_mget(self, call: Call, group: list[ReadItem]) -> None:
        datas = call.sinks or [None] * len(group)
        digests = call.digests or [None] * len(group)  # hashed as they landed, where taken
        for record, data, digest, it in zip(call.records, datas, digests, group, strict=True):
            status = record[0]
            if status == Status.DEFERRED:
                self._deferred.append(it)
                continue
            entry = it.entry
            # The common case inline (a hit, exactly as the index has it); the rest in judge().
            if (
                status == Status.OK
                and data is not None
                and record[2] == entry.write_id
                and record[3] == entry.size_bytes
                and record[4] == entry.checksum
                and (block_checksum(data) if digest is None else digest) == record[4]
            ):
                if it.sink is None:
                    it.value = owned_bytes(data)
                elif data is not it.sink:
                    copy_bytes(it.sink, data)
                it.ok = True
                it.tier = record[1]
            else:
                judge(it, self.address, record, data, digest=digest)

    def _judge_shm(self, call: Call, group: list[ReadItem]) -> None:
        arena = self.arena
        assert arena is not None
        for record, it in zip(call.records, group, strict=True):
            status, _flags, _write_id, size, _checksum, offset, lease = record
            if status == Status.DEFERRED:
                self._deferred.append(it)
                continue
            if status != Status.OK:
                judge(it, self.address, record, None)
                continue
            self.releases.append(lease)
            if size != it.entry.size_bytes:
                judge(it, self.address, record, None)
                continue
            try:
                extent = arena.extent(offset, size)
            except KVPoolError as e:
                it.fail("node_error", e)
                continue
            # Copy first, hash the copy: the caller gets exactly the bytes that were checked
            # (without a buffer: that copy is the new bytes object, taken as the value).
            if it.sink is not None:
                digest = copy_checksum(it.sink, extent)
                judge(it, self.address, record, it.sink, digest=digest)
            else:
                judge(it, self.address, record, memoryview(bytes(extent)))

    def release_call(self) -> Call | None:
        """The SHM_RELEASE for every lease handed out (sent without waiting for an answer)."""
        if not self.releases:
            return None
        leases, self.releases = self.releases, []
        return Call(Op.SHM_RELEASE, payload=encode_ids(leases))

    def judge_followups(self) -> None:
        for call, it in zip(self.followups, self._deferred, strict=True):
            h = call.header
            if isinstance(call.error, KVPoolError):
                it.fail(*transport_failure(call.error))
                continue
            if call.error is not None or h is None:
                it.fail("node_error", UnavailableError(str(call.error or "no answer")))
                continue
            judge(it, self.address, _answer(call), call.data, call.message())


def _answer(call: Call) -> tuple[int, ...]:
    h = call.header
    assert h is not None
    return (h.status, h.flags, h.write_id, h.payload_len, h.checksum)


def _get_call(it: ReadItem) -> Call:
    size = it.entry.size_bytes
    return Call(
        Op.GET,
        it.key_bytes,
        write_id=it.entry.write_id,
        flags=it.max_tier,
        sink=it.sink if size and it.sink is not None else None,
        expect=size if it.entry.write_id else -1,
    )


def _table_call(op: Op, chunk: list[ReadItem], record: struct.Struct, *, sinks: bool) -> Call:
    payload = encode_key_table([(it.key_bytes, it.entry.write_id, 0, 0) for it in chunk])
    return Call(
        op,
        payload=payload,
        flags=chunk[0].max_tier,
        table=record,
        sinks=[it.sink for it in chunk] if sinks else [None] * len(chunk),
        expects=[it.entry.size_bytes if it.entry.write_id else -1 for it in chunk],
    )


def _chunks(items: list[ReadItem], max_keys: int, max_bytes: int) -> list[list[ReadItem]]:
    out: list[list[ReadItem]] = []
    current: list[ReadItem] = []
    size = 0
    for it in items:
        n = it.entry.size_bytes
        if current and (len(current) >= max_keys or (max_bytes and size + n > max_bytes)):
            out.append(current)
            current, size = [], 0
        current.append(it)
        size += n
    if current:
        out.append(current)
    return out


# --- writes to one node -------------------------------------------------------------------------


def make_checksums(items: list[PutItem]) -> None:
    """Every item's checksum, made now: those not made yet, all at once with the helper
    thread's help (:func:`~kvpool.checksum.block_checksums`) — for the checksums a
    shared-memory reservation lists. (Over TCP each group of frames is hashed in the caller's
    thread while the node reads the group before: a helper hashing ahead there took CPU from
    the node on a 2-vCPU machine; ``docs/performance.md``, "A batch's checksums made by two
    threads".)"""
    missing = [it for it in items if it._checksum is None]
    for it, checksum in zip(missing, block_checksums([it.payload for it in missing]), strict=True):
        it._checksum = checksum


class NodeStage:
    """The PUTs of a group of blocks to one node: PUT frames over TCP; over shared memory, for
    blocks of at least :data:`SHM_PUT_MIN_BYTES`, a reservation, the copies into the arena,
    then the commit (two exchanges; a smaller block goes as a PUT frame on the same socket:
    one round trip beats two for a few KiB)."""

    def __init__(self, address: str, group: list[tuple[PutItem, MemberInfo]], arena: Arena | None):
        self.address = address
        self.group = group
        self.arena = arena
        self.commit: Call | None = None  # shared memory: the second exchange
        self._reserved: list[tuple[PutItem, MemberInfo]] = []
        large = arena is not None and (lambda it: it.payload.nbytes >= SHM_PUT_MIN_BYTES)
        self._inline = [(it, m) for it, m in group if not (large and large(it))]
        self._copied = [(it, m) for it, m in group if large and large(it)]
        self.calls: list[Call] = []
        """The calls made so far, in sending order (all of them once :meth:`chunks` is
        through)."""

    @property
    def reserves(self) -> bool:
        """Whether blocks go through the arena: the node has every byte only once the copies
        are made and the commit (:attr:`commit`) is sent, not with the first exchange."""
        return bool(self._copied)

    def chunks(self, chunk_bytes: int = PUT_CHUNK_BYTES) -> Iterator[list[Call]]:
        """The calls in sending order, about ``chunk_bytes`` of payload at a time: a group's
        PUT frames (and their blocks' checksums) are made only when it is asked for, so that
        a sender in the caller's thread hashes the next group while the node reads this one."""
        group: list[Call] = []
        size = 0
        for it, _ in self._inline:
            group.append(
                Call(
                    Op.PUT,
                    it.key_bytes,
                    write_id=it.write_id,
                    checksum=it.checksum,
                    payload=it.payload,
                )
            )
            size += it.payload.nbytes
            if size >= chunk_bytes:
                self.calls.extend(group)
                yield group
                group, size = [], 0
        if self._copied:
            make_checksums([it for it, _ in self._copied])
            records = [
                (it.key_bytes, it.write_id, it.payload.nbytes, it.checksum)
                for it, _ in self._copied
            ]
            group.append(
                Call(
                    Op.SHM_RESERVE,
                    payload=encode_key_table(records),
                    table=RESERVE_RECORD,
                    sinks=[None] * len(records),
                )
            )
        if group:
            self.calls.extend(group)
            yield group

    def all_calls(self) -> list[Call]:
        """Every call, made at once (a sender that queues them all before any is sent)."""
        for _ in self.chunks():
            pass
        return self.calls

    def fail_all(self, error: KVPoolError, on_node_failed: Callable[[int], None]) -> None:
        failed = error if isinstance(error, DeadlineExceededError) else None
        for it, _member in self.group:
            it.error = failed or UnavailableError(f"put {it.key!r}: {error.message}")
        if failed is None and self.group:
            on_node_failed(self.group[0][1].member_id)

    def judge(self) -> None:
        """Judge the first exchange (PUT answers, and the reservations: the copies are made
        here and :attr:`commit` is set)."""
        for call, (it, member) in zip(self.calls, self._inline, strict=False):
            self._ack(it, member, call, call.status, "PUT")
        if not self._copied:
            return
        call = self.calls[-1]
        if call.error is not None or call.status != Status.OK:
            error = call.error or node_error(
                self.address, "SHM_RESERVE", call.status, call.message()
            )
            for it, _ in self._copied:
                it.error = error if isinstance(error, KVPoolError) else TransportError(str(error))
            return
        arena = self.arena
        assert arena is not None
        ids: list[int] = []
        for (status, _flags, offset, reservation), (it, member) in zip(
            call.records, self._copied, strict=True
        ):
            if status != Status.OK:
                it.error = node_error(self.address, "PUT", status, "")
            elif reservation == 0:  # this very write is already held there
                it.acked.append(member.member_id)
            else:
                try:
                    copy_bytes(arena.extent(offset, it.payload.nbytes), it.payload)
                except KVPoolError as e:
                    it.error = e  # never committed: the reservation ends with the connection
                    continue
                ids.append(reservation)
                self._reserved.append((it, member))
        if ids:
            self.commit = Call(
                Op.SHM_COMMIT,
                payload=encode_ids(ids),
                table=RESERVE_RECORD,
                sinks=[None] * len(ids),
            )

    def judge_commit(self) -> None:
        call = self.commit
        if call is None:
            return
        if call.error is not None or call.status != Status.OK:
            for it, _ in self._reserved:
                it.error = UnavailableError(
                    f"{self.address}: SHM_COMMIT failed: {call.error or call.message()}"
                )
            return
        for (status, _flags, _offset, _rid), (it, member) in zip(
            call.records, self._reserved, strict=True
        ):
            self._ack(it, member, None, status, "SHM_COMMIT")

    def _ack(
        self, it: PutItem, member: MemberInfo, call: Call | None, status: int, op: str
    ) -> None:
        if call is not None and call.error is not None:
            error = call.error
            it.error = error if isinstance(error, KVPoolError) else TransportError(str(error))
        elif status == Status.OK:
            it.acked.append(member.member_id)
        else:
            it.error = node_error(self.address, op, status, call.message() if call else "")


def refs_by_node(refs: Iterable[BlockRef]) -> dict[str, list[BlockRef]]:
    """``refs`` grouped by their member's data address."""
    groups: dict[str, list[BlockRef]] = {}
    for ref in refs:
        groups.setdefault(ref.member.data_address, []).append(ref)
    return groups


def ref_calls(op: Op, refs: list[BlockRef]) -> list[Call]:
    """PUBLISH or DELETE frames for committed or removed blocks."""
    return [
        Call(op, r.key_bytes, write_id=r.write_id, version=r.version, checksum=r.receipt)
        for r in refs
    ]


def ref_rounds(op: Op, refs: list[BlockRef], wait: bool) -> tuple[list[Call], list[Call]]:
    """The frames of a PUBLISH or DELETE round to one node: those sent without waiting for
    their answers, and those whose answers are waited for. Not ``wait``: all posted. A DELETE
    waited for: its own answers (the node deletes as it reads the frame). A PUBLISH waited for
    is posted with a PING behind it on the same connection, and the PING is waited for: a
    node handles a PUBLISH as it reads it — the write it replaces there leaves the table, and
    the new block becomes readable by content (``BlockStore.retire_older``) — but answers it
    only once the index has confirmed the write (a Lookup on the leader,
    ``store_node/publish_check.py``). A put that replaces a write on a node needs the former,
    not the latter: a round trip to the node instead of one through it to the leader, and not
    a whole deadline when that node cannot reach the masters."""
    calls = ref_calls(op, refs)
    if not wait:
        return calls, []
    if op is Op.PUBLISH:
        return calls, [Call(Op.PING)]
    return [], calls
