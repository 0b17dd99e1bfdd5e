"""The block table of a store node: pure bookkeeping over a tier, no I/O, no clock of its own.

A block is identified by ``(key, write_id)`` and lives in one of three states:

``receiving``  memory reserved for a PUT whose payload is still arriving (invisible)
``staged``     payload in and checksum verified, not yet published (invisible to reads)
``committed``  published with the index's version: readable by exact write id

At most one committed block per key: publishing version V replaces a lower committed version
and loses against a higher one. A block being read is *leased*; a leased block is never evicted,
and a deleted or replaced one leaves the table at once (so nobody else can find it) but keeps its
memory until the last lease ends — the bytes under a reader never change. Eviction takes only
committed, unpinned, unleased blocks; staged blocks are reaped by the node's staged reaper.
Evicted (and forcibly reaped) blocks are queued for reporting to the index.

Everything here is synchronous and deterministic given the injected clock: the data server
(one asyncio loop) drives it and performs the I/O.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.checksum import block_checksum
from kvpool.proto.wire import MissReason, Status
from kvpool.store_node.cpu_tier import Tier
from kvpool.store_node.eviction import BlockId, EvictionPolicy

RECENT_EVICTIONS = 8192
"""How many evicted block ids are remembered, to answer MISS EVICTED rather than ABSENT."""
EVICTION_BACKLOG = 262_144
"""Most evictions waiting to be reported; beyond it the oldest are forgotten (the index then
points at a block we lack until it is read: a miss, never a wrong read)."""


class BlockState(enum.Enum):
    RECEIVING = "receiving"
    STAGED = "staged"
    COMMITTED = "committed"


@dataclass(slots=True, eq=False)
class Block:
    key: str
    write_id: int
    offset: int
    size_bytes: int
    checksum: int
    state: BlockState = BlockState.RECEIVING
    version: int = 0
    staged_at: float = 0.0
    leases: int = 0
    pinned: bool = False
    detached: bool = False  # out of the table; memory freed when the last lease ends

    @property
    def id(self) -> BlockId:
        return (self.key, self.write_id)


@dataclass(frozen=True, slots=True)
class PutVerdict:
    """What to do with a PUT's payload: receive it into ``block`` (status OK with a block),
    discard it and answer ``status`` (with ``message`` for errors)."""

    status: Status
    block: Block | None = None
    message: str = ""


@dataclass(frozen=True, slots=True)
class ReadResult:
    """A GET's answer. On OK ``block`` is leased: call :meth:`BlockStore.release` once the
    bytes have left."""

    status: Status
    reason: MissReason = MissReason.ABSENT
    block: Block | None = None


@dataclass(frozen=True, slots=True)
class StagedBlock:
    key: str
    write_id: int
    age_s: float


@dataclass(slots=True)
class Counters:
    puts: int = 0
    put_bytes: int = 0
    hits: int = 0
    get_bytes: int = 0
    misses: dict[MissReason, int] = field(default_factory=lambda: dict.fromkeys(MissReason, 0))
    evictions: int = 0
    no_space: int = 0
    too_large: int = 0
    checksum_mismatches: int = 0
    publishes: int = 0
    superseded: int = 0
    deletes: int = 0
    reaped: int = 0
    dropped_reports: int = 0
    bad_frames: int = 0


@dataclass(frozen=True, slots=True)
class StoreStats:
    capacity_bytes: int
    used_bytes: int
    blocks: int
    staged: int
    committed: int
    leased_bytes_lingering: int
    high_watermark: float
    low_watermark: float
    hits: int
    misses: dict[str, int]
    evictions: int
    puts: int
    bad_frames: int

    @property
    def misses_total(self) -> int:
        return sum(self.misses.values())


class BlockStore:
    """The block table over one tier. Not thread-safe: one event loop drives it."""

    def __init__(
        self,
        tier: Tier,
        policy: EvictionPolicy,
        *,
        max_block_size: int,
        clock: Callable[[], float],
        high_watermark: float = 0.85,
        low_watermark: float = 0.70,
        recent_evictions: int = RECENT_EVICTIONS,
        eviction_backlog: int = EVICTION_BACKLOG,
    ) -> None:
        if not 0 < low_watermark < high_watermark <= 1:
            raise ValueError("need 0 < low_watermark < high_watermark <= 1")
        self.tier = tier
        self.policy = policy
        self.max_block_size = max_block_size
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.counters = Counters()
        self._clock = clock
        self._blocks: dict[BlockId, Block] = {}
        self._by_key: dict[str, dict[int, None]] = {}  # key -> write ids held (any state)
        self._committed: dict[str, int] = {}  # key -> its one committed write id
        self._staged: dict[BlockId, None] = {}  # in staging order = staged_at order
        self._lingering: dict[int, Block] = {}  # offset -> detached block still leased
        self._recent: OrderedDict[BlockId, None] = OrderedDict()
        self._recent_cap = recent_evictions
        self._to_report: OrderedDict[BlockId, None] = OrderedDict()
        self._backlog_cap = eviction_backlog

    # --- PUT ------------------------------------------------------------------------------------

    def reserve(self, key: str, write_id: int, size_bytes: int, checksum: int) -> PutVerdict:
        """Decide a PUT before its payload is read: room for it (evicting if needed) or not."""
        if write_id == 0:
            return PutVerdict(Status.BAD_REQUEST, message="write id 0 is reserved")
        if not key:
            return PutVerdict(Status.BAD_REQUEST, message="empty key")
        if size_bytes > self.max_block_size:
            self.counters.too_large += 1
            return PutVerdict(
                Status.TOO_LARGE,
                message=f"block of {size_bytes} bytes is above this node's limit of "
                f"{self.max_block_size} bytes",
            )
        existing = self._blocks.get((key, write_id))
        if existing is not None:
            if existing.state is BlockState.RECEIVING:
                return PutVerdict(
                    Status.BAD_REQUEST, message="a PUT of this write id is already in progress"
                )
            if existing.size_bytes == size_bytes and existing.checksum == checksum:
                return PutVerdict(Status.OK)  # a retried PUT: already held, discard the copy
            return PutVerdict(
                Status.BAD_REQUEST, message="write id already used for other bytes of this key"
            )
        offset = self.tier.alloc(size_bytes)
        if offset is None:
            low_target = int(self.low_watermark * self.tier.capacity_bytes)
            self._evict(max(self.tier.footprint(size_bytes), self.tier.used_bytes - low_target))
            offset = self.tier.alloc(size_bytes)
            if offset is None:
                self.counters.no_space += 1
                return PutVerdict(
                    Status.NO_SPACE,
                    message=f"no room for {size_bytes} bytes: {self.tier.used_bytes} of "
                    f"{self.tier.capacity_bytes} bytes used by blocks that cannot be evicted "
                    "now (staged, leased, pinned) or too fragmented",
                )
        block = Block(key, write_id, offset, size_bytes, checksum)
        self._blocks[block.id] = block
        self._by_key.setdefault(key, {})[write_id] = None
        self.evict_if_needed()
        return PutVerdict(Status.OK, block)

    def view(self, block: Block) -> memoryview:
        """The block's bytes in the tier (write the payload here; send it from here)."""
        return self.tier.view(block.offset, block.size_bytes)

    def finish_put(self, block: Block) -> Status:
        """The payload is in: verify it and stage the block (OK) or free it
        (CHECKSUM_MISMATCH)."""
        if self._blocks.get(block.id) is not block or block.state is not BlockState.RECEIVING:
            return Status.INTERNAL  # aborted meanwhile; the caller answers an error
        if block_checksum(self.view(block)) != block.checksum:
            self.counters.checksum_mismatches += 1
            self._remove(block)
            return Status.CHECKSUM_MISMATCH
        block.state = BlockState.STAGED
        block.staged_at = self._clock()
        self._staged[block.id] = None
        self.counters.puts += 1
        self.counters.put_bytes += block.size_bytes
        return Status.OK

    def abort_put(self, block: Block) -> None:
        """A PUT's payload will never complete (its connection dropped): free the reservation."""
        if self._blocks.get(block.id) is block and block.state is BlockState.RECEIVING:
            self._remove(block)

    # --- PUBLISH, GET, DELETE -----------------------------------------------------------------

    def publish(self, key: str, write_id: int, version: int) -> ReadResult:
        """Staged → committed with ``version``. OK, MISS ABSENT (unknown write id) or MISS
        WRONG_VERSION (a higher version of the key is held; the incoming block is dropped)."""
        block = self._blocks.get((key, write_id))
        if block is None or block.state is BlockState.RECEIVING:
            return ReadResult(Status.MISS, MissReason.ABSENT)
        if block.state is BlockState.COMMITTED:
            return ReadResult(Status.OK)  # idempotent re-publish
        current_id = self._committed.get(key)
        if current_id is not None:
            current = self._blocks[(key, current_id)]
            self.counters.superseded += 1
            if current.version >= version:
                self._remove(block)  # the incoming write lost: drop it, keep the newer one
                return ReadResult(Status.MISS, MissReason.WRONG_VERSION)
            self._remove(current)
        del self._staged[block.id]
        block.state = BlockState.COMMITTED
        block.version = version
        self._committed[key] = write_id
        self.policy.inserted(block.id)
        self.counters.publishes += 1
        return ReadResult(Status.OK)

    def get(self, key: str, write_id: int) -> ReadResult:
        """The committed block with exactly this write id, leased (release it when sent), or
        a miss with its reason. Never another write's bytes."""
        block = self._blocks.get((key, write_id))
        if block is not None and block.state is BlockState.COMMITTED:
            block.leases += 1
            self.policy.touched(block.id)
            self.counters.hits += 1
            self.counters.get_bytes += block.size_bytes
            return ReadResult(Status.OK, block=block)
        if block is not None:
            reason = MissReason.STAGED
        elif key in self._by_key:
            reason = MissReason.WRONG_VERSION
        elif (key, write_id) in self._recent:
            reason = MissReason.EVICTED
        else:
            reason = MissReason.ABSENT
        self.counters.misses[reason] += 1
        return ReadResult(Status.MISS, reason)

    def release(self, block: Block) -> None:
        """A reader is done with the block's bytes (the transport let go of them)."""
        assert block.leases > 0, "release of a block that is not leased"
        block.leases -= 1
        if block.leases == 0 and block.detached:
            del self._lingering[block.offset]
            self.tier.free(block.offset)

    def delete(self, key: str, write_id: int) -> bool:
        """Drop the staged or committed block (write id 0: every block of the key). A block
        still being received is left alone: its PUT happened after this delete."""
        ids = list(self._by_key.get(key, ())) if write_id == 0 else [write_id]
        targets = [
            b
            for w in ids
            if (b := self._blocks.get((key, w))) is not None and b.state is not BlockState.RECEIVING
        ]
        for block in targets:
            self._remove(block)
        self.counters.deletes += len(targets)
        return bool(targets)

    def set_pinned(self, key: str, write_id: int, pinned: bool) -> bool:
        """Exempt a block from eviction (or not). False when no such block is held."""
        block = self._blocks.get((key, write_id))
        if block is None:
            return False
        block.pinned = pinned
        return True

    # --- eviction ----------------------------------------------------------------------------

    def evict_if_needed(self) -> list[BlockId]:
        """Above the high watermark, evict committed blocks down to the low watermark."""
        capacity = self.tier.capacity_bytes
        used = self.tier.used_bytes
        if used <= self.high_watermark * capacity:
            return []
        return self._evict(used - int(self.low_watermark * capacity))

    def _evict(self, need_bytes: int) -> list[BlockId]:
        if need_bytes <= 0:
            return []
        chosen: list[Block] = []
        freed = 0
        for block_id in self.policy.victims():  # advise...
            block = self._blocks.get(block_id)
            if (
                block is None
                or block.state is not BlockState.COMMITTED
                or block.pinned
                or block.leases
            ):
                continue
            chosen.append(block)
            freed += self.tier.footprint(block.size_bytes)
            if freed >= need_bytes:
                break
        for block in chosen:  # ...then act
            self._remove(block, evicted=True)
        return [block.id for block in chosen]

    def take_evicted(self, limit: int) -> list[BlockId]:
        """Up to ``limit`` blocks to report to the index as gone, oldest first."""
        out: list[BlockId] = []
        while self._to_report and len(out) < limit:
            out.append(self._to_report.popitem(last=False)[0])
        return out

    @property
    def evictions_pending(self) -> int:
        return len(self._to_report)

    # --- staged reaping and re-registration ------------------------------------------------

    def expired_staged(self, now: float, ttl_s: float, limit: int) -> list[StagedBlock]:
        """Staged blocks older than ``ttl_s``, oldest first."""
        out: list[StagedBlock] = []
        for block_id in self._staged:
            block = self._blocks[block_id]
            age = now - block.staged_at
            if age < ttl_s or len(out) >= limit:
                break
            out.append(StagedBlock(block.key, block.write_id, age))
        return out

    def reap(self, key: str, write_id: int, *, report: bool) -> bool:
        """Free a block that is still staged. ``report``: the index might reference it, so
        tell it the block is gone."""
        block = self._blocks.get((key, write_id))
        if block is None or block.state is not BlockState.STAGED:
            return False
        self._remove(block, report=report)
        self.counters.reaped += 1
        return True

    def drop_all(self) -> int:
        """Forget every staged and committed block (the index declared this node down: nothing
        references them any more). Returns how many were dropped."""
        victims = [b for b in self._blocks.values() if b.state is not BlockState.RECEIVING]
        for block in victims:
            self._remove(block)
        self._to_report.clear()
        return len(victims)

    # --- stats --------------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        return StoreStats(
            capacity_bytes=self.tier.capacity_bytes,
            used_bytes=self.tier.used_bytes,
            blocks=len(self._blocks),
            staged=len(self._staged),
            committed=len(self._committed),
            leased_bytes_lingering=sum(b.size_bytes for b in self._lingering.values()),
            high_watermark=self.high_watermark,
            low_watermark=self.low_watermark,
            hits=self.counters.hits,
            misses={r.name.lower(): n for r, n in self.counters.misses.items()},
            evictions=self.counters.evictions,
            puts=self.counters.puts,
            bad_frames=self.counters.bad_frames,
        )

    def state_of(self, key: str, write_id: int) -> BlockState | None:
        block = self._blocks.get((key, write_id))
        return block.state if block is not None else None

    # --- internals ------------------------------------------------------------------------------

    def _remove(self, block: Block, *, evicted: bool = False, report: bool | None = None) -> None:
        """Take a block out of the table; free its memory now or when its last lease ends."""
        block_id = block.id
        del self._blocks[block_id]
        write_ids = self._by_key[block.key]
        del write_ids[block.write_id]
        if not write_ids:
            del self._by_key[block.key]
        if block.state is BlockState.COMMITTED:
            del self._committed[block.key]
            self.policy.removed(block_id)
        elif block.state is BlockState.STAGED:
            del self._staged[block_id]
        if block.leases:
            block.detached = True
            self._lingering[block.offset] = block
        else:
            self.tier.free(block.offset)
        if evicted:
            self.counters.evictions += 1
            self._recent[block_id] = None
            if len(self._recent) > self._recent_cap:
                self._recent.popitem(last=False)
        if report is None:
            report = evicted
        if report:
            self._to_report[block_id] = None
            if len(self._to_report) > self._backlog_cap:
                self._to_report.popitem(last=False)
                self.counters.dropped_reports += 1

    def check_invariants(self) -> None:
        """Raise AssertionError unless the table is consistent (tests, debugging)."""
        footprint = 0
        for block_id, block in self._blocks.items():
            assert block.id == block_id
            assert not block.detached
            assert block.write_id in self._by_key[block.key]
            assert (self._committed.get(block.key) == block.write_id) == (
                block.state is BlockState.COMMITTED
            ), f"committed map disagrees for {block_id}"
            assert (block_id in self._staged) == (block.state is BlockState.STAGED)
            footprint += self.tier.footprint(block.size_bytes)
        for offset, block in self._lingering.items():
            assert block.detached
            assert block.leases > 0
            assert block.offset == offset
            footprint += self.tier.footprint(block.size_bytes)
        assert sum(len(ids) for ids in self._by_key.values()) == len(self._blocks)
        assert len(self.policy) == len(self._committed)
        assert footprint == self.tier.used_bytes, f"{footprint} != {self.tier.used_bytes} used"
