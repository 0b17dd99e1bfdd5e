"""The block table of a store node: pure bookkeeping, no I/O, no clock of its own.

A block is identified by ``(key, write_id)`` and lives in one of three states:

``receiving``  memory reserved for a PUT whose payload is still arriving (invisible)
``staged``     payload in and checksum verified, not yet published: readable by exact write id
``committed``  published with the index's version: readable by exact write id

A staged block is served to a read that names its exact write id: readers learn write ids only
from the index, which names only committed writes, so such a block is committed and merely
waiting for its PUBLISH — which the writer sends without waiting, and which a read on another
connection may overtake. Only for ``staged_read_window_s`` (1 s) after it was staged, though:
a PUBLISH that never came (a broken link) leaves the block staged while newer writes of the key
are published, and a reader whose cached entry still names it would read a replaced value for
the entry's lifetime. After the window it misses (STAGED) until the index confirms it.

At most one committed block per key: publishing version V replaces a lower committed version
and loses against a higher one. A block's bytes live in one or more tiers (GPU, CPU, SSD), as
decided by the :class:`~kvpool.store_node.tier_manager.TierManager`. A read *leases* the copy
it is served from; a leased copy is never evicted, and a deleted or replaced block leaves the
table at once (so nobody else can find it) but keeps its memory until the last lease ends — the
bytes under a reader never change. Eviction takes only committed, unpinned, unleased blocks;
staged blocks are reaped by the node's staged reaper. Blocks lost to pressure (and forcibly
reaped ones) are queued for reporting to the index; so are tier changes, as hints.

Everything here is synchronous and deterministic given the injected clock: the data server
(one asyncio loop) drives it, the tier worker performs the I/O it asks for.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvpool.checksum import block_checksum
from kvpool.proto.wire import MissReason, Status, TierLevel
from kvpool.store_node.blocks import (
    Block,
    BlockId,
    BlockState,
    Copy,
    Counters,
    PutVerdict,
    ReadOutcome,
    ReadResult,
    StagedBlock,
    StoreStats,
    TierChange,
    TierStats,
)
from kvpool.store_node.eviction import EvictionPolicy
from kvpool.store_node.jobs import CopyJob, Job, WriteJob
from kvpool.store_node.tier_manager import TierManager, TierPolicy
from kvpool.store_node.tiers import TIER_NAMES, Tier
from kvpool.store_node.tiers.cpu import CpuTier
from kvpool.store_node.tiers.ssd import SsdTier

__all__ = [
    "Block",
    "BlockState",
    "BlockStore",
    "PutVerdict",
    "ReadOutcome",
    "ReadResult",
    "StagedBlock",
    "StoreStats",
]

STAGED_READ_WINDOW_S = 1.0
"""How long after staging a block is served before its PUBLISH (see the module doc)."""

RECENT_EVICTIONS = 8192
"""How many evicted block ids are remembered, to answer MISS EVICTED rather than ABSENT."""
MISSING_SUSPECTS = 4096
"""How many (key, write id) pairs a read missed and this node never held are remembered, to be
checked against the index later (:meth:`BlockStore.expired_suspects`)."""
EVICTION_BACKLOG = 262_144
"""Most evictions waiting to be reported; beyond it the oldest are forgotten (the index then
points at a block we lack until it is read: a miss, never a wrong read)."""


class BlockStore:
    """The block table over a node's tiers. Not thread-safe: one event loop drives it."""

    def __init__(
        self,
        tier: CpuTier,
        policy: EvictionPolicy,
        *,
        max_block_size: int,
        clock: Callable[[], float],
        high_watermark: float = 0.85,
        low_watermark: float = 0.70,
        recent_evictions: int = RECENT_EVICTIONS,
        eviction_backlog: int = EVICTION_BACKLOG,
        ssd: SsdTier | None = None,
        gpu: Tier | None = None,
        gpu_policy: EvictionPolicy | None = None,
        promote_after_hits: int = 2,
        gpu_promote_after_hits: int = 4,
        write_batch_bytes: int = 8 << 20,
        on_work: Callable[[], None] | None = None,
        max_receiving_bytes: int | None = None,
        staged_read_window_s: float = STAGED_READ_WINDOW_S,
    ) -> None:
        """``max_receiving_bytes``: most CPU-tier bytes PUTs still arriving may hold together
        (default: half the tier; ``put_memory_fraction``); one PUT alone is always considered."""
        if not 0 < low_watermark < high_watermark <= 1:
            raise ValueError("need 0 < low_watermark < high_watermark <= 1")
        self.tier = tier
        self.policy = policy
        self.staged_read_window_s = staged_read_window_s
        self._reads: dict[str, int] = {}  # key -> reads since take_read_counts (hot blocks)
        self.max_block_size = max_block_size
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.counters = Counters()
        self._clock = clock
        self._blocks: dict[BlockId, Block] = {}
        self._by_key: dict[str, dict[int, None]] = {}  # key -> write ids held (any state)
        self._committed: dict[str, int] = {}  # key -> its one committed write id
        self._staged: dict[BlockId, None] = {}  # in staging order = staged_at order
        self._recent: OrderedDict[BlockId, None] = OrderedDict()
        self._recent_cap = recent_evictions
        self._suspects: OrderedDict[BlockId, float] = OrderedDict()  # -> first missed at
        self._to_report: OrderedDict[BlockId, None] = OrderedDict()
        self._backlog_cap = eviction_backlog
        self.max_receiving_bytes = (
            max_receiving_bytes if max_receiving_bytes is not None else tier.capacity_bytes // 2
        )
        self.receiving_bytes = 0  # CPU footprint of RECEIVING blocks (reservations)
        self.staged_bytes = 0  # CPU footprint of STAGED blocks (never evicted)
        self.tiers = TierManager(
            tier,
            policy,
            rules=TierPolicy(
                high_watermark=high_watermark,
                low_watermark=low_watermark,
                promote_after_hits=promote_after_hits,
                gpu_promote_after_hits=gpu_promote_after_hits,
                write_batch_bytes=write_batch_bytes,
            ),
            counters=self.counters.tiers,
            lookup=self._blocks.get,
            lose=self._lose,
            ssd=ssd,
            gpu=gpu,
            gpu_policy=gpu_policy,
            on_work=on_work,
        )

    # --- PUT ------------------------------------------------------------------------------------

    def reserve(self, key: str, write_id: int, size_bytes: int, checksum: int) -> PutVerdict:
        """Decide a PUT before its payload is read: room for it (evicting or demoting if
        needed) or not."""
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
        footprint = self.tier.footprint(size_bytes)
        if self.receiving_bytes and self.receiving_bytes + footprint > self.max_receiving_bytes:
            self.counters.no_space += 1
            return PutVerdict(
                Status.NO_SPACE,
                message=f"no room for {size_bytes} bytes: PUTs still arriving hold "
                f"{self.receiving_bytes} bytes, at most {self.max_receiving_bytes} may be "
                "(put_memory_fraction); retry shortly",
            )
        if self.receiving_bytes + self.staged_bytes + footprint > self.tier.capacity_bytes:
            # Nothing evictable could make room: evict nothing (a refused PUT loses no block).
            self.counters.no_space += 1
            return PutVerdict(
                Status.NO_SPACE,
                message=f"no room for {size_bytes} bytes: {self.receiving_bytes} bytes of the "
                f"CPU tier are reserved by PUTs still arriving and {self.staged_bytes} are "
                "staged; retry shortly",
            )
        block = Block(key, write_id, size_bytes, checksum)
        copy = self.tiers.alloc_received(block)
        if copy is None:
            self.counters.no_space += 1
            leaving = self.tiers.leaving_bytes(TierLevel.CPU)
            why = (
                f"{leaving} bytes are on their way to the SSD tier; retry shortly"
                if leaving
                else "used by blocks that cannot be evicted now (staged, leased, pinned) or "
                "too fragmented"
            )
            return PutVerdict(
                Status.NO_SPACE,
                message=f"no room for {size_bytes} bytes: {self.tier.used_bytes} of "
                f"{self.tier.capacity_bytes} bytes of the CPU tier in use, {why}",
            )
        self._blocks[block.id] = block
        self._by_key.setdefault(key, {})[write_id] = None
        self.receiving_bytes += footprint
        return PutVerdict(Status.OK, block)

    def view(self, block: Block) -> memoryview:
        """The block's bytes in the CPU tier (write the payload here; send it from here)."""
        copy = block.copies[TierLevel.CPU]
        return self.tier.view(copy.offset, block.size_bytes)

    def view_copy(self, copy: Copy) -> memoryview:
        """A CPU copy's bytes (valid while it is leased, even after it left its block)."""
        assert copy.level is TierLevel.CPU, "only CPU copies are sent from where they lie"
        return self.tier.view(copy.offset, copy.block.size_bytes)

    def finish_put(self, block: Block) -> Status:
        """The payload is in: verify it and stage the block (OK) or free it
        (CHECKSUM_MISMATCH)."""
        if self._blocks.get(block.id) is not block or block.state is not BlockState.RECEIVING:
            return Status.INTERNAL  # aborted meanwhile; the caller answers an error
        if block_checksum(self.view(block)) != block.checksum:
            self.counters.checksum_mismatches += 1
            self._remove(block)
            return Status.CHECKSUM_MISMATCH
        footprint = self.tier.footprint(block.size_bytes)
        self.receiving_bytes -= footprint
        self.staged_bytes += footprint
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
        if not self._make_current(block, version):
            return ReadResult(Status.MISS, MissReason.WRONG_VERSION)
        del self._staged[block.id]
        self.staged_bytes -= self.tier.footprint(block.size_bytes)
        block.state = BlockState.COMMITTED
        block.version = version
        self._committed[key] = write_id
        self.tiers.committed(block)
        self.counters.publishes += 1
        return ReadResult(Status.OK)

    def retire_older(self, key: str, write_id: int, claimed_version: int) -> bool:
        """A PUBLISH of ``write_id`` claims ``claimed_version``: the key's committed block, if
        it is another write with a lower version, leaves the table now (reported to the index
        as gone), so that a reader holding a stale entry misses rather than reads the value the
        new write replaces, while the index is asked about the new one. The claim is only the
        sender's word: the worst a false one can do is this miss (a lost block), never a wrong
        or poisoned read — the new block is published only with the index's version."""
        incoming = self._blocks.get((key, write_id))
        if incoming is not None and incoming.state is BlockState.STAGED:
            incoming.claimed_version = max(incoming.claimed_version, claimed_version)
        older = []
        for other_id in self._by_key.get(key, ()):
            if other_id == write_id:
                continue
            other = self._blocks[(key, other_id)]
            if (other.state is BlockState.COMMITTED and other.version < claimed_version) or (
                other.state is BlockState.STAGED and 0 < other.claimed_version < claimed_version
            ):  # a staged write whose own PUBLISH could not be confirmed yet counts too
                older.append(other)
        for other in older:
            self._remove(other, report=True)
            self.counters.superseded += 1
        return bool(older)

    def claimed_newer(self, key: str, write_id: int, version: int) -> bool:
        """Whether another staged write of ``key`` here has a PUBLISH claiming a version
        above ``version`` (unconfirmed: a receipt for ``version`` does not settle which of the
        two is current, the index does)."""
        return any(
            other_id != write_id
            and (other := self._blocks[(key, other_id)]).state is BlockState.STAGED
            and other.claimed_version > version
            for other_id in self._by_key.get(key, ())
        )

    def _readable(self, block: Block) -> bool:
        """Committed; or staged within the read window and not behind another write of the key
        that is published here (committed, or its PUBLISH arrived claiming a version), unless
        its own PUBLISH claims a higher version. A staged block's own version is unknown until
        its PUBLISH comes: any doubt is a miss (see the module doc)."""
        if block.state is BlockState.COMMITTED:
            return True
        if block.state is not BlockState.STAGED:
            return False
        if self._clock() - block.staged_at > self.staged_read_window_s:
            return False
        others = self._by_key.get(block.key, ())
        if len(others) == 1:
            return True
        mine = block.claimed_version
        for write_id in others:
            if write_id == block.write_id:
                continue
            other = self._blocks[(block.key, write_id)]
            theirs = other.version if other.state is BlockState.COMMITTED else other.claimed_version
            if theirs and (not mine or theirs > mine):
                return False
        return True

    def get(self, key: str, write_id: int, max_level: TierLevel = TierLevel.ANY) -> ReadResult:
        """The staged or committed block with exactly this write id, its copy leased (release
        it when the bytes have left), or a miss with its reason. Never another write's bytes. A copy
        only on tiers slower than ``max_level`` is a MISS SLOW_TIER. Write id 0 names the key's
        committed block, whichever write it is (a *direct read*: see :meth:`resolve`)."""
        if not write_id:
            write_id = self.resolve(key)
        block = self._blocks.get((key, write_id))
        if block is not None and self._readable(block):
            copy, promote = self.tiers.lease_for_read(block, max_level)
            if copy is not None:
                self.counters.hits += 1
                self._reads[key] = self._reads.get(key, 0) + 1
                self.counters.get_bytes += block.size_bytes
                return ReadResult(Status.OK, block=block, copy=copy, promote=promote)
            reason = MissReason.SLOW_TIER
        elif block is not None:
            reason = MissReason.STAGED
        else:
            block_id = (key, write_id)
            recent = block_id in self._recent
            if key in self._by_key:
                reason = MissReason.WRONG_VERSION
            else:
                reason = MissReason.EVICTED if recent else MissReason.ABSENT
            if write_id and not recent:
                self._suspect(block_id)
        self.counters.misses[reason] += 1
        return ReadResult(Status.MISS, reason)

    def _suspect(self, block_id: BlockId) -> None:
        """A read named a write this node does not hold and did not evict lately: remembered
        (first time only, at most MISSING_SUSPECTS) so that, if the index still names it here
        long after, it is reported gone (:meth:`expired_suspects`)."""
        suspects = self._suspects
        if block_id not in suspects:
            suspects[block_id] = self._clock()
            if len(suspects) > MISSING_SUSPECTS:
                suspects.popitem(last=False)

    def expired_suspects(self, now: float, age_s: float, limit: int) -> list[BlockId]:
        """Up to ``limit`` writes a read missed at least ``age_s`` ago that this node still
        does not hold, oldest first; each is taken (checked once). A write a put commits
        before its bytes arrive (the client's commit overlaps the stage) may miss a read in
        between; one still absent after any put's deadline never arrives."""
        out: list[BlockId] = []
        suspects = self._suspects
        while suspects and len(out) < limit:
            block_id, first = next(iter(suspects.items()))
            if now - first < age_s:
                break
            del suspects[block_id]
            if block_id not in self._blocks:
                out.append(block_id)
        return out

    def report_missing(self, key: str, write_id: int) -> bool:
        """The index names this write on this node, which does not hold it: report it gone, as
        an eviction is (the index drops the replica only while it names that write). False
        when it is held after all."""
        block_id = (key, write_id)
        if block_id in self._blocks:
            return False
        self._report(block_id)
        self.counters.missing_reported += 1
        return True

    def _report(self, block_id: BlockId) -> None:
        """Queue ``block_id`` to be reported to the index as gone (at most the backlog cap:
        beyond it the oldest is forgotten)."""
        self._to_report[block_id] = None
        if len(self._to_report) > self._backlog_cap:
            self._to_report.popitem(last=False)
            self.counters.dropped_reports += 1

    def get_in_memory(
        self, key: str, write_id: int, max_level: TierLevel = TierLevel.ANY
    ) -> tuple[Status, int, Copy | None]:
        """:meth:`get` for a read that can only send bytes from where they lie (MGET): the
        block's CPU copy, leased — ``(OK, CPU, copy)`` —; ``(DEFERRED, 0, None)``
        when its fastest acceptable copy is on another tier (to be read with a single GET);
        else the miss :meth:`get` gives. One table lookup for the common case."""
        if not write_id:
            write_id = self.resolve(key)
        block = self._blocks.get((key, write_id))
        if block is not None and self._readable(block):
            cpu = block.copies.get(TierLevel.CPU)
            if not (cpu is not None and cpu.ready):
                fastest = block.fastest(max_level)
                if fastest is not None:
                    return Status.DEFERRED, 0, None
            elif not max_level or max_level >= TierLevel.CPU:
                copy, _promote = self.tiers.lease_for_read(block, max_level)
                assert copy is cpu  # CPU first
                assert _promote is None  # a CPU read promotes no copy into CPU
                self.counters.hits += 1
                self._reads[key] = self._reads.get(key, 0) + 1
                self.counters.get_bytes += block.size_bytes
                return Status.OK, TierLevel.CPU, cpu
        result = self.get(key, write_id, max_level)
        if result.copy is not None:  # not reached: a leased non-CPU copy would be DEFERRED
            self.finish_read(result, ReadOutcome.ABANDONED)
            return Status.DEFERRED, 0, None
        return result.status, result.reason, None

    def resolve(self, key: str) -> int:
        """The write id a direct read of ``key`` gets (write id 0: a client that reads a key
        naming its content without asking the index), or 0 for none: the key's committed
        block — one the index confirmed to this node (:mod:`~kvpool.store_node.publish_check`)
        —, else a staged one whose PUBLISH has come (its writer's commit was acknowledged: a
        client publishes only what the index committed) while the node is still asking the
        index, within the staged read window (:meth:`_readable`). Never a staged block with no
        PUBLISH: its commit is unknown. A key naming its content means the same bytes in every
        committed write, so whichever write is held is the right value; the reader checks the
        bytes against the checksum recorded at PUT, which the writer's commit gave the index
        too."""
        committed = self._committed.get(key, 0)
        if committed:
            return committed
        for write_id in self._by_key.get(key, ()):
            block = self._blocks[(key, write_id)]
            if block.state is BlockState.STAGED and block.claimed_version and self._readable(block):
                return write_id
        return 0

    def mapped_reads(self, block: Block, reads: int) -> None:
        """Reads a same-host client made of ``block`` through the shared directory, with no
        message (:mod:`kvpool.transports.directory`): hits as any other."""
        if self.tiers.mapped_reads(block, reads):
            self.counters.hits += reads
            self.counters.directory_reads += reads
            self.counters.get_bytes += reads * block.size_bytes
            self._reads[block.key] = self._reads.get(block.key, 0) + reads

    def take_read_counts(self, limit: int) -> list[tuple[str, int]]:
        """The ``limit`` keys read most since the last call, with their reads; resets."""
        reads, self._reads = self._reads, {}
        if len(reads) <= limit:
            return list(reads.items())
        # The same as sorting them all and keeping ``limit`` (ties in first-read order), but
        # O(n log limit) on the node's event loop: a heartbeat may follow 50k keys read (a sort
        # took ~9 ms there, this ~2 ms).
        return heapq.nlargest(limit, reads.items(), key=lambda kv: kv[1])

    def finish_read(self, result: ReadResult, outcome: ReadOutcome) -> None:
        """A read of a copy that is not sent from where it lies (SSD, GPU) is over: its lease
        ends, its promotion (if any) lands when the bytes were good. CORRUPT: the bytes did
        not match the checksum — the copy is dropped (the block too, if it was the last)."""
        assert result.copy is not None
        self.tiers.finish_read(result.copy, result.promote, outcome)
        if outcome is ReadOutcome.CORRUPT:
            self.counters.checksum_mismatches += 1

    def release(self, target: Block | Copy) -> None:
        """A reader is done with the bytes (the transport let go of them). A :class:`Block`
        stands for its CPU copy, as :meth:`get` leases it for blocks that are in memory."""
        copy = target if isinstance(target, Copy) else target.copies[TierLevel.CPU]
        self.tiers.release(copy)

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

    # --- eviction and tier work ---------------------------------------------------------------

    def evict_if_needed(self) -> None:
        """Above a tier's high watermark, make blocks leave it down to its low watermark."""
        self.tiers.relieve()

    def shed(self, count: int) -> int:
        """Drop up to ``count`` of the coldest blocks (the index asked: it is nearly full);
        each is reported to the index as evicted. How many left."""
        lost = len(self.tiers.shed(count)) if count > 0 else 0
        self.counters.shed += lost
        return lost

    def take_jobs(self) -> list[Job]:
        return self.tiers.take_jobs()

    def finish_write(self, job: WriteJob, ok: bool) -> None:
        self.tiers.finish_write(job, ok)

    def finish_copy(self, job: CopyJob, ok: bool) -> None:
        self.tiers.finish_copy(job, ok)

    def take_evicted(self, limit: int) -> list[BlockId]:
        """Up to ``limit`` blocks to report to the index as gone, oldest first."""
        out: list[BlockId] = []
        while self._to_report and len(out) < limit:
            out.append(self._to_report.popitem(last=False)[0])
        return out

    def take_tier_changes(self, limit: int) -> list[TierChange]:
        """Up to ``limit`` tier hints for the index (coalesced per block)."""
        return self.tiers.take_tier_changes(limit)

    @property
    def evictions_pending(self) -> int:
        return len(self._to_report)

    # --- staged reaping, re-registration and warm restart -------------------------------------

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
        self._suspects.clear()
        self.tiers.take_tier_changes(len(victims) + 1)
        return len(victims)

    def restore(
        self, *, key: str, write_id: int, version: int, size_bytes: int, checksum: int, offset: int
    ) -> bool:
        """A committed block found on the SSD at start (its extent already restored in the
        segment allocator). A key held twice keeps its higher version; False when this one
        lost (its SSD extent is freed)."""
        block = Block(key, write_id, size_bytes, checksum, BlockState.COMMITTED, version)
        block.level_reported = TierLevel.SSD
        self.tiers.restore_ssd_copy(block, offset)
        self._blocks[block.id] = block
        self._by_key.setdefault(key, {})[write_id] = None
        if not self._make_current(block, version):
            return False
        self._committed[key] = write_id
        self.tiers.committed(block)
        return True

    def committed_blocks(self) -> Iterator[Block]:
        """Every committed block (for claims to the index)."""
        for key, write_id in self._committed.items():
            yield self._blocks[(key, write_id)]

    # --- stats --------------------------------------------------------------------------------

    def tier_stats(self) -> tuple[TierStats, ...]:
        out = []
        for level in (TierLevel.CPU, TierLevel.GPU, TierLevel.SSD):
            tier = self.tiers.tiers.get(level)
            if tier is None:
                continue
            c = self.counters.tiers[level]
            out.append(
                TierStats(
                    level=level,
                    name=TIER_NAMES[level],
                    detail=tier.detail,
                    capacity_bytes=tier.capacity_bytes,
                    used_bytes=tier.used_bytes,
                    blocks=self.tiers.copies_on(level),
                    fragmentation=tier.fragmentation(),
                    hits=c.hits,
                    evictions=c.evictions,
                    demotions=c.demotions,
                    promotions=c.promotions,
                )
            )
        return tuple(out)

    def stats(self) -> StoreStats:
        return StoreStats(
            capacity_bytes=self.tier.capacity_bytes,
            used_bytes=self.tier.used_bytes,
            blocks=len(self._blocks),
            staged=len(self._staged),
            committed=len(self._committed),
            leased_bytes_lingering=self.tiers.lingering_bytes(),
            high_watermark=self.high_watermark,
            low_watermark=self.low_watermark,
            hits=self.counters.hits,
            misses={r.name.lower(): n for r, n in self.counters.misses.items()},
            evictions=self.counters.evictions,
            puts=self.counters.puts,
            bad_frames=self.counters.bad_frames,
            tiers=self.tier_stats(),
        )

    def state_of(self, key: str, write_id: int) -> BlockState | None:
        block = self._blocks.get((key, write_id))
        return block.state if block is not None else None

    def block(self, key: str, write_id: int) -> Block | None:
        return self._blocks.get((key, write_id))

    # --- internals ------------------------------------------------------------------------------

    def _make_current(self, block: Block, version: int) -> bool:
        """Make room for ``block`` as its key's committed block: the current one goes if it is
        older; if it is newer, ``block`` goes (False)."""
        current_id = self._committed.get(block.key)
        if current_id is None:
            return True
        current = self._blocks[(block.key, current_id)]
        self.counters.superseded += 1
        if current.version >= version:
            self._remove(block)  # the incoming write lost: drop it, keep the newer one
            return False
        self._remove(current)
        return True

    def _lose(self, block: Block, level: TierLevel) -> None:
        """Pressure took the block's last copy (on ``level``): it is gone; tell the index."""
        self._remove(block, evicted=True)

    def _remove(self, block: Block, *, evicted: bool = False, report: bool | None = None) -> None:
        """Take a block out of the table; its copies go now or when their last lease ends."""
        block_id = block.id
        del self._blocks[block_id]
        write_ids = self._by_key[block.key]
        del write_ids[block.write_id]
        if not write_ids:
            del self._by_key[block.key]
        if self._committed.get(block.key) == block.write_id:
            del self._committed[block.key]
        if block.state is BlockState.STAGED:
            del self._staged[block_id]
            self.staged_bytes -= self.tier.footprint(block.size_bytes)
        elif block.state is BlockState.RECEIVING:
            self.receiving_bytes -= self.tier.footprint(block.size_bytes)
        block.detached = True
        self.tiers.detach_block(block)
        if evicted:
            self.counters.evictions += 1
            self._recent[block_id] = None
            if len(self._recent) > self._recent_cap:
                self._recent.popitem(last=False)
        if report is None:
            report = evicted
        if report:
            self._report(block_id)

    def check_invariants(self) -> None:
        """Raise AssertionError unless the table is consistent (tests, debugging)."""
        for block_id, block in self._blocks.items():
            assert block.id == block_id
            assert not block.detached
            assert block.write_id in self._by_key[block.key]
            assert (self._committed.get(block.key) == block.write_id) == (
                block.state is BlockState.COMMITTED
            ), f"committed map disagrees for {block_id}"
            assert (block_id in self._staged) == (block.state is BlockState.STAGED)
            assert block.copies, f"{block_id} has no copy"
        assert sum(len(ids) for ids in self._by_key.values()) == len(self._blocks)
        for state, counted in (
            (BlockState.RECEIVING, self.receiving_bytes),
            (BlockState.STAGED, self.staged_bytes),
        ):
            held = sum(
                self.tier.footprint(b.size_bytes) for b in self._blocks.values() if b.state is state
            )
            assert held == counted, f"{state.name}: {held} bytes held, {counted} counted"
        self.tiers.check_invariants(self._blocks.values())
