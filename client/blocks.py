"""The client's data plane: block frames to and from store nodes.

Reads go replica after replica, in rounds: each round groups the keys still unread by the node
of their next replica, takes one pooled connection per node and pipelines that node's GETs on
it. A block counts as read only when the node answered OK, its header names the checksum the
index holds, and the bytes received hash to that checksum; anything else moves the key to its
next replica, and past the last replica the key is a miss with the strongest reason seen.

Writes send PUT frames to every target replica at once (grouped per node the same way),
PUBLISH after the commit, and DELETE after a remove (best effort).

A payload read into a caller's buffer is never written after the read returns: a request that
times out while receiving closes its connection (FrameConnection), and so does a read that is
cancelled.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvpool.checksum import block_checksum
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
from kvpool.proto.wire import MissReason, Op, Status
from kvpool.transports.tcp import ConnectionPool, FrameConnection, Response

_MISS_REASONS: dict[int, str] = {
    MissReason.ABSENT: "absent",
    MissReason.STAGED: "version_mismatch",
    MissReason.WRONG_VERSION: "version_mismatch",
    MissReason.EVICTED: "evicted",
    MissReason.SLOW_TIER: "slow_tier",
    MissReason.CORRUPT: "checksum_mismatch",  # the node found its copy bad and dropped it
}


@dataclass(slots=True, eq=False)
class ReadItem:
    """One key being read: its index entry, where the bytes go, what went wrong so far."""

    key: str
    key_bytes: bytes
    entry: common_pb2.BlockEntry
    sink: memoryview  # exactly entry.size_bytes long
    caller_buffer: bool  # the sink is the caller's memory (get_into)
    replicas: list[int]
    next: int = 0
    ok: bool = False
    max_tier: int = 0  # the slowest tier accepted (TierLevel; 0: any)
    tier: int = 0  # the tier that served it (TierLevel), once read
    reasons: list[str] = field(default_factory=list)
    errors: list[KVPoolError] = field(default_factory=list)

    def fail(self, reason: str, error: KVPoolError) -> None:
        self.reasons.append(reason)
        self.errors.append(error)

    @property
    def reason(self) -> str:
        return strongest_reason(self.reasons)

    def error(self) -> KVPoolError:
        """The typed error for strict callers, matching :attr:`reason`."""
        reason = self.reason
        if reason in self.reasons:
            return self.errors[self.reasons.index(reason)]
        return BlockMissError(f"block {self.key!r} has no replica to read", reason="node_down")


@dataclass(slots=True, eq=False)
class PutItem:
    """One block being put: its bytes, identity, targets, and the replicas that staged it."""

    key: str
    key_bytes: bytes
    payload: memoryview
    checksum: int
    write_id: int = 0
    targets: list[MemberInfo] = field(default_factory=list)
    acked: list[int] = field(default_factory=list)
    committed: bool = False
    error: KVPoolError | None = None

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


def new_write_ids(n: int) -> list[int]:
    """``n`` random non-zero 64-bit write ids (os.urandom: never derived from a seed)."""
    raw = os.urandom(8 * n)
    ids = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, 8 * n, 8)]
    return [w or new_write_ids(1)[0] for w in ids]


def _node_error(address: str, op: str, response: Response) -> KVPoolError:
    try:
        status = Status(response.status).name
    except ValueError:
        status = f"status {response.status}"
    text = response.message() or "no message"
    if response.status == Status.NO_SPACE:
        return NoSpaceError(f"{address}: {op}: no space ({text})")
    if response.status == Status.CHECKSUM_MISMATCH:
        return ChecksumMismatchError(f"{address}: {op}: the node saw another checksum ({text})")
    if response.status == Status.TOO_LARGE:
        return ValueTooLargeError(f"{address}: {op}: block above the node's limit ({text})")
    return TransportError(f"{address}: {op}: node answered {status}: {text}")


class DataPlane:
    """Frames to store nodes over pooled connections; ``on_node_failed`` hears of every member
    that could not be reached (placement may be out of date)."""

    def __init__(
        self, pool: ConnectionPool, on_node_failed: Callable[[int], None] | None = None
    ) -> None:
        self._pool = pool
        self._on_node_failed = on_node_failed or (lambda _mid: None)

    # --- reads ----------------------------------------------------------------------------

    async def read(
        self,
        items: list[ReadItem],
        members: Callable[[int], MemberInfo | None],
        deadline: float,
        on_retry: Callable[[int], None] | None = None,
    ) -> None:
        """Read every item from its replicas, in rounds, until read, out of replicas, or out of
        time. Sets ``item.ok`` or records why each replica failed."""
        loop = asyncio.get_running_loop()
        queue = [it for it in items if not it.ok and it.replicas]
        for it in items:
            if not it.replicas:
                it.fail(
                    "node_down",
                    UnavailableError(f"block {it.key!r}: the index names no live replica"),
                )
        while queue:
            remaining = deadline - loop.time()
            if remaining <= 0:
                for it in queue:
                    it.fail("timeout", DeadlineExceededError(f"get {it.key!r}: out of time"))
                return
            rounds_left = max(len(it.replicas) - it.next for it in queue)
            timeout_s = remaining / rounds_left
            groups: dict[str, list[tuple[ReadItem, MemberInfo]]] = {}
            for it in queue:
                member_id = it.replicas[it.next]
                it.next += 1
                member = members(member_id)
                if member is None:
                    it.fail(
                        "node_down",
                        UnavailableError(f"block {it.key!r}: member {member_id} is not live"),
                    )
                    continue
                groups.setdefault(member.data_address, []).append((it, member))
            await asyncio.gather(
                *(self._read_group(address, g, timeout_s) for address, g in groups.items())
            )
            queue = [it for it in queue if not it.ok and it.next < len(it.replicas)]
            if queue and on_retry is not None:
                on_retry(len(queue))

    async def _read_group(
        self, address: str, group: list[tuple[ReadItem, MemberInfo]], timeout_s: float
    ) -> None:
        conn = await self._connect(address, group[0][1], timeout_s, [it for it, _ in group])
        if conn is None:
            return
        await asyncio.gather(*(self._read_one(conn, it, m, timeout_s) for it, m in group))

    async def _read_one(
        self, conn: FrameConnection, it: ReadItem, member: MemberInfo, timeout_s: float
    ) -> None:
        entry = it.entry
        size = entry.size_bytes
        try:
            response = await conn.request(
                Op.GET,
                it.key_bytes,
                write_id=entry.write_id,
                flags=it.max_tier,
                sink=it.sink if size else None,
                timeout_s=timeout_s,
            )
        except asyncio.CancelledError:
            if it.caller_buffer:
                # The response may be landing in the caller's buffer: stop it for good.
                conn.abort("read cancelled")
            raise
        except DeadlineExceededError as e:
            it.fail("timeout", e)
            return
        except KVPoolError as e:
            it.fail("node_down", UnavailableError(f"get {it.key!r}: {e.message}"))
            self._on_node_failed(member.member_id)
            return
        status = response.status
        if status == Status.MISS:
            reason = _MISS_REASONS.get(response.header.flags, "absent")
            it.fail(reason, BlockMissError(f"{conn.address}: {it.key!r}: {reason}", reason=reason))
            return
        if status != Status.OK:
            it.fail("node_error", _node_error(conn.address, "GET", response))
            return
        if response.header.write_id not in (0, entry.write_id):
            reason = "version_mismatch"
            it.fail(
                reason,
                BlockMissError(
                    f"{conn.address}: {it.key!r}: node answered write id "
                    f"{response.header.write_id:#x} for {entry.write_id:#x}",
                    reason=reason,
                ),
            )
            return
        if response.header.payload_len != size or response.header.checksum != entry.checksum:
            it.fail(
                "checksum_mismatch",
                ChecksumMismatchError(
                    f"{conn.address}: {it.key!r}: node sent {response.header.payload_len} bytes "
                    f"with checksum {response.header.checksum:#x}; the index holds {size} bytes "
                    f"with checksum {entry.checksum:#x}"
                ),
            )
            return
        if block_checksum(it.sink) != entry.checksum:
            it.fail(
                "checksum_mismatch",
                ChecksumMismatchError(
                    f"{conn.address}: {it.key!r}: the bytes received do not hash to "
                    f"{entry.checksum:#x}"
                ),
            )
            return
        it.ok = True
        it.tier = response.header.flags

    # --- writes -------------------------------------------------------------------------------

    async def stage(self, items: list[PutItem], deadline: float) -> None:
        """PUT every item to each of its targets at once; ``item.acked`` lists the members
        that staged it, ``item.error`` the last failure."""
        loop = asyncio.get_running_loop()
        timeout_s = deadline - loop.time()
        if timeout_s <= 0:
            for it in items:
                it.error = DeadlineExceededError(f"put {it.key!r}: out of time before sending")
            return
        groups: dict[str, list[tuple[PutItem, MemberInfo]]] = {}
        for it in items:
            for member in it.targets:
                groups.setdefault(member.data_address, []).append((it, member))
        await asyncio.gather(
            *(self._stage_group(address, g, timeout_s) for address, g in groups.items())
        )

    async def _stage_group(
        self, address: str, group: list[tuple[PutItem, MemberInfo]], timeout_s: float
    ) -> None:
        conn = await self._connect(address, group[0][1], timeout_s, [it for it, _ in group])
        if conn is None:
            return
        await asyncio.gather(*(self._stage_one(conn, it, m, timeout_s) for it, m in group))

    async def _stage_one(
        self, conn: FrameConnection, it: PutItem, member: MemberInfo, timeout_s: float
    ) -> None:
        try:
            response = await conn.request(
                Op.PUT,
                it.key_bytes,
                write_id=it.write_id,
                checksum=it.checksum,
                payload=it.payload,
                timeout_s=timeout_s,
            )
        except DeadlineExceededError as e:
            it.error = e
            return
        except KVPoolError as e:
            it.error = UnavailableError(f"put {it.key!r}: {e.message}")
            self._on_node_failed(member.member_id)
            return
        if response.status == Status.OK:
            it.acked.append(member.member_id)
        else:
            it.error = _node_error(conn.address, "PUT", response)

    async def publish(self, refs: Iterable[BlockRef], deadline: float) -> None:
        """PUBLISH committed blocks to their replicas; failures are ignored (the node asks the
        index about staged blocks it holds too long)."""
        await self._send_all(Op.PUBLISH, refs, deadline)

    async def delete(self, refs: Iterable[BlockRef], deadline: float) -> None:
        """DELETE removed blocks from their replicas; failures are ignored (the index no longer
        points at them; the node reclaims them under pressure)."""
        await self._send_all(Op.DELETE, refs, deadline)

    async def _send_all(self, op: Op, refs: Iterable[BlockRef], deadline: float) -> None:
        loop = asyncio.get_running_loop()
        timeout_s = deadline - loop.time()
        if timeout_s <= 0:
            return
        groups: dict[str, list[BlockRef]] = {}
        for ref in refs:
            groups.setdefault(ref.member.data_address, []).append(ref)

        async def one(conn: FrameConnection, ref: BlockRef) -> None:
            try:
                await conn.request(
                    op,
                    ref.key_bytes,
                    write_id=ref.write_id,
                    version=ref.version,
                    timeout_s=timeout_s,
                )
            except KVPoolError:
                return

        async def group(address: str, group_refs: list[BlockRef]) -> None:
            try:
                conn = await self._pool.get(address, timeout_s=timeout_s)
            except KVPoolError:
                return
            await asyncio.gather(*(one(conn, ref) for ref in group_refs))

        await asyncio.gather(*(group(a, g) for a, g in groups.items()))

    # --- connections ----------------------------------------------------------------------

    async def _connect(
        self,
        address: str,
        member: MemberInfo,
        timeout_s: float,
        items: list[ReadItem] | list[PutItem],
    ) -> FrameConnection | None:
        try:
            return await self._pool.get(address, timeout_s=timeout_s)
        except KVPoolError as e:
            timed_out = isinstance(e, DeadlineExceededError)
            error: KVPoolError = e if timed_out else UnavailableError(e.message)
            for it in items:
                if isinstance(it, ReadItem):
                    it.fail("timeout" if timed_out else "node_down", error)
                else:
                    it.error = error
            self._on_node_failed(member.member_id)
            return None
