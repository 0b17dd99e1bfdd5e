"""Where each block's bytes live: GPU, CPU, SSD. Pure — it decides; the tier worker moves bytes.

Rules (each tier keeps its own high/low watermarks, default 85 % / 70 %):

- A PUT lands in CPU memory. When the CPU tier is above its high watermark, victims chosen by
  the tier's policy (S3-FIFO by default) leave it until it is back at the low watermark:
  a victim that has a copy on another tier just drops its CPU copy (free, nothing lost); any
  other is **demoted** to the SSD (batched into one large aligned write) when there is an SSD
  tier, and only dropped — reported to the index as evicted — when there is none or it is
  full of blocks it cannot let go.
- A block read from the SSD is **promoted** back to CPU on its second read there (its SSD copy
  stays, so a later eviction from CPU costs no write). A block read from CPU often enough
  (``gpu_promote_after_hits``) is copied up to the GPU tier when there is one; a GPU victim
  with no other copy is demoted to the SSD like a CPU one.
- The SSD tier is reclaimed a whole segment at a time, oldest first (segment FIFO), when it is
  above its high watermark; a segment holding a pinned block, a block being read or a write in
  flight is skipped, never rewritten under its reader.
- Never evicted: pinned blocks, copies leased to a reader or a job, staged blocks. Leases end
  when a read's bytes have left; nothing renews them, so eviction cannot be starved.
- A PUT that finds the CPU tier full while demotions are on their way is refused with
  NO_SPACE (retryable) rather than dropping blocks that fit on the SSD.

Every change a block's readers could notice — a new fastest tier — is queued as a
:class:`~kvpool.store_node.blocks.TierChange` for the index (a hint for cost-aware reads).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from kvpool.proto.wire import TierLevel
from kvpool.store_node.blocks import (
    Block,
    BlockId,
    BlockState,
    Copy,
    ReadOutcome,
    TierChange,
    TierCounters,
)
from kvpool.store_node.eviction import EvictionPolicy, S3FifoPolicy
from kvpool.store_node.jobs import CopyJob, Demotion, Job, ManifestJob, WriteJob
from kvpool.store_node.tiers import Tier
from kvpool.store_node.tiers.manifest import DropRecord, LandRecord, OpenRecord, Record
from kvpool.store_node.tiers.ssd import SsdTier

CPU, GPU, SSD = TierLevel.CPU, TierLevel.GPU, TierLevel.SSD
SSD_MAX_FAILURES = 3
"""Consecutive failed SSD writes after which demotions stop (the node goes on without them)."""
CLEAN_DROP_SCAN = 64
"""Most redundant copies dropped to make room for one allocation before giving up."""
REDUNDANT_REFUSALS = 256
"""Most candidates looked at (per drop) when searching for a copy that has another copy."""
EVICTION_REFUSALS = 4096
"""Most ineligible candidates (leased, pinned, moving) looked at per victim: they rotate away,
so the next round starts with others; a full scan of a large cache never happens per PUT."""


class Listing(Protocol):
    """Where committed blocks with a CPU copy are listed for same-host readers (the shared
    directory, :class:`kvpool.store_node.shm_server.Directory`): told when one is ready and
    before its CPU memory can be freed."""

    def add(self, copy: Copy) -> None: ...

    def remove(self, block: Block) -> None: ...


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """How blocks move between tiers (config ``promote_after_hits`` and friends)."""

    high_watermark: float = 0.85
    low_watermark: float = 0.70
    promote_after_hits: int = 2
    gpu_promote_after_hits: int = 4
    write_batch_bytes: int = 8 << 20


class TierManager:
    """The copies of every block on every tier; see the module doc. Not thread-safe."""

    def __init__(
        self,
        cpu: Tier,
        cpu_policy: EvictionPolicy,
        *,
        rules: TierPolicy,
        counters: dict[TierLevel, TierCounters],
        lookup: Callable[[BlockId], Block | None],
        lose: Callable[[Block, TierLevel], None],
        ssd: SsdTier | None = None,
        gpu: Tier | None = None,
        gpu_policy: EvictionPolicy | None = None,
        on_work: Callable[[], None] | None = None,
    ) -> None:
        self.rules = rules
        self.tiers: dict[TierLevel, Tier] = {CPU: cpu}
        self.policies: dict[TierLevel, EvictionPolicy] = {CPU: cpu_policy}
        if gpu is not None:
            self.tiers[GPU] = gpu
            self.policies[GPU] = gpu_policy if gpu_policy is not None else S3FifoPolicy()
        self.ssd = ssd
        if ssd is not None:
            self.tiers[SSD] = ssd
        self.ssd_enabled = ssd is not None
        self.ssd_failures = 0
        self.counters = counters
        self.on_work = on_work or (lambda: None)
        self._lookup = lookup
        self._lose = lose
        self._count: dict[TierLevel, int] = dict.fromkeys(self.tiers, 0)  # attached copies
        self._ssd_copies: dict[int, dict[int, Copy]] = {}  # segment -> offset -> copy
        self._seg_writers: dict[int, int] = {}  # segment -> write jobs in flight
        self._seg_lingering: dict[int, int] = {}  # segment -> detached copies still leased
        self._lingering: dict[tuple[TierLevel, int], Copy] = {}
        self._filling: dict[tuple[TierLevel, int], Copy] = {}
        self._leaving: dict[TierLevel, int] = dict.fromkeys(self.tiers, 0)
        self._planned: list[Copy] = []
        self._promoting: set[BlockId] = set()
        self._jobs: list[Job] = []
        self._manifest: list[Record] = []
        self._changes: OrderedDict[BlockId, TierChange] = OrderedDict()
        self.listing: Listing | None = None

    # --- placing received blocks --------------------------------------------------------------

    @property
    def cpu(self) -> Tier:
        return self.tiers[CPU]

    def alloc_received(self, block: Block) -> Copy | None:
        """CPU memory for a PUT's payload, attached to ``block``; None when there is no room
        now (everything left is staged, leased or pinned, or demotions are on their way)."""
        cpu = self.cpu
        offset = cpu.alloc(block.size_bytes)
        if offset is None:
            offset = self._drop_redundant(CPU, block.size_bytes)
        if offset is None and self.ssd_enabled:
            self.relieve(force_bytes=max(0, cpu.footprint(block.size_bytes) - self._leaving[CPU]))
            offset = cpu.alloc(block.size_bytes)
            if offset is None and self._leaving[CPU]:
                return None  # room is on its way to the SSD: the caller answers NO_SPACE
        if offset is None:
            low_target = int(self.rules.low_watermark * cpu.capacity_bytes)
            self._evict(CPU, max(cpu.footprint(block.size_bytes), cpu.used_bytes - low_target))
            offset = cpu.alloc(block.size_bytes)
        if offset is None:
            return None
        copy = Copy(block, CPU, offset, cpu.footprint(block.size_bytes))
        self._attach(copy)
        self.relieve()
        return copy

    def committed(self, block: Block) -> None:
        """A block became readable: its copies enter their tiers' policies."""
        for level, copy in block.copies.items():
            policy = self.policies.get(level)
            if policy is not None:
                policy.inserted(block.id, copy.footprint)
        cpu = block.copies.get(CPU)
        if self.listing is not None and cpu is not None and cpu.ready:
            self.listing.add(cpu)

    def leaving_bytes(self, level: TierLevel) -> int:
        return self._leaving.get(level, 0)

    # --- reads ----------------------------------------------------------------------------

    def lease_for_read(self, block: Block, max_level: TierLevel) -> tuple[Copy | None, Copy | None]:
        """The copy to serve ``block`` from (leased), and a CPU copy to fill from it when this
        read promotes the block; ``(None, None)`` when no copy is fast enough."""
        copy = block.fastest(max_level)
        if copy is None:
            return None, None
        copy.leases += 1
        block.hits += 1
        self.counters[copy.level].hits += 1
        policy = self.policies.get(copy.level)
        if policy is not None:
            policy.touched(block.id)
        promote = None
        if block.state is not BlockState.COMMITTED:
            return copy, None  # staged (see block_store): no promotion before its PUBLISH
        if copy.level is SSD:
            block.slow_hits += 1
            if block.slow_hits >= self.rules.promote_after_hits:
                promote = self._promotion(block, CPU)
        elif (
            copy.level is CPU
            and GPU in self.tiers
            and GPU not in block.copies
            and block.hits >= self.rules.gpu_promote_after_hits
        ):
            dest = self._promotion(block, GPU)
            if dest is not None:
                copy.leases += 1  # the copy job reads it
                self._queue(CopyJob(copy, dest))
        return copy, promote

    def mapped_reads(self, block: Block, reads: int) -> bool:
        """``reads`` reads of ``block``'s CPU copy that a same-host client made with no message
        (the shared directory) count as reads here; False when the copy has gone since."""
        if block.detached or CPU not in block.copies:
            return False
        block.hits += reads
        self.counters[CPU].hits += reads
        self.policies[CPU].touched(block.id)
        return True

    def finish_read(self, copy: Copy, promote: Copy | None, outcome: ReadOutcome) -> None:
        """A read of a non-CPU copy is done (its bytes are in a private buffer now, or not).
        CORRUPT: the bytes did not match the block's checksum — the copy is dropped."""
        block = copy.block
        self.release(copy)
        if outcome is ReadOutcome.CORRUPT:
            self.counters[copy.level].failures += 1
            if not copy.detached:
                if self._other_ready_copy(block, copy.level):
                    self._drop_copy(copy, evicted=False)
                else:
                    self._lose(block, copy.level)
        if promote is not None:
            self._end_promotion(promote, outcome is ReadOutcome.OK)

    def finish_copy(self, job: CopyJob, ok: bool) -> None:
        self.release(job.source)
        self._end_promotion(job.dest, ok)

    def release(self, copy: Copy) -> None:
        """A reader or job is done with a copy's bytes."""
        assert copy.leases > 0, "release of a copy that is not leased"
        copy.leases -= 1
        if copy.leases == 0 and copy.detached:
            del self._lingering[(copy.level, copy.offset)]
            if copy.level is SSD:
                seg = self.ssd_segment(copy.offset)
                self._seg_lingering[seg] -= 1
                if not self._seg_lingering[seg]:
                    del self._seg_lingering[seg]
            self._free(copy)

    # --- blocks leaving --------------------------------------------------------------------

    def detach_block(self, block: Block) -> None:
        """``block`` left the table: every copy leaves its tier now, or when its last lease
        ends. Copies still being filled are freed when their job ends."""
        for copy in list(block.copies.values()):
            self._detach(copy)
        self._changes.pop(block.id, None)

    def relieve(self, force_bytes: int = 0) -> None:
        """Bring every tier above its high watermark back to its low one (demotions planned
        as write jobs); ``force_bytes``: make at least that much leave the CPU tier."""
        if GPU in self.tiers:
            self._relieve(GPU, 0)
        self._relieve(CPU, force_bytes)
        if self.ssd is not None:
            ssd = self.ssd
            used = ssd.used_bytes
            if used > self.rules.high_watermark * ssd.capacity_bytes:
                self._reclaim_ssd(used - int(self.rules.low_watermark * ssd.capacity_bytes))
        if self._planned:
            self._build_write_jobs()

    def drain(self, level: TierLevel, need_bytes: int) -> None:
        """Make ``need_bytes`` of copies leave ``level`` now, as pressure would: redundant
        copies are dropped, the others demoted to the SSD when possible, else lost."""
        self._make_leave(level, need_bytes, demote=self.ssd_enabled)
        if self._planned:
            self._build_write_jobs()

    def evict(self, level: TierLevel, need_bytes: int) -> list[BlockId]:
        """Drop ``need_bytes`` of copies from ``level`` now (losing blocks with no other copy);
        the ids of the blocks lost."""
        return self._evict(level, need_bytes)

    def shed(self, count: int) -> list[BlockId]:
        """Drop the coldest blocks until ``count`` have left the node (the index is nearly
        full: ``index_shed``): the SSD's oldest segments first (its FIFO, as reclaim walks
        it), then the CPU's and the GPU's policies, as pressure would; a copy with another
        ready copy elsewhere is dropped and not counted. Pinned and leased blocks stay. The ids
        of the blocks lost."""
        lost: list[BlockId] = []
        if self.ssd is not None:
            self._shed_ssd(count, lost)
        for level in [level for level in (CPU, GPU) if level in self.policies]:
            while len(lost) < count and (block := self._coldest(level)) is not None:
                if self._drop_or_lose(block.copies[level]):
                    lost.append(block.id)
        return lost

    # --- the worker's side --------------------------------------------------------------------

    def take_jobs(self) -> list[Job]:
        """Work for the tier worker, in the order it must be done."""
        jobs: list[Job] = []
        if self._manifest:
            jobs.append(ManifestJob(self._manifest))
            self._manifest = []
        jobs.extend(self._jobs)
        self._jobs = []
        return jobs

    def finish_write(self, job: WriteJob, ok: bool) -> None:
        """A write job is done: attach the SSD copies (dropping the sources they replace), or
        on failure put everything back as it was."""
        assert self.ssd is not None
        self._seg_writers[job.segment] -= 1
        if not self._seg_writers[job.segment]:
            del self._seg_writers[job.segment]
        for item in job.items:
            source, dest = item.source, item.dest
            block = source.block
            del self._filling[(SSD, dest.offset)]
            self._leaving[source.level] -= source.footprint
            block.moving = False
            self.release(source)
            if ok and not block.detached:
                dest.ready = True
                self._attach(dest)
                self.counters[source.level].demotions += 1
                if not source.detached:
                    self._detach(source)
                self._note_level(block)
            elif ok:
                self._free_ssd(dest)  # written and recorded: record the drop
            else:
                self.ssd.free(dest.offset)
                if not source.detached and block.state is BlockState.COMMITTED:
                    self.policies[source.level].inserted(block.id, source.footprint)
        if ok:
            self.ssd_failures = 0
        else:
            self.counters[SSD].failures += 1
            self.ssd_failures += 1
            if self.ssd_failures >= SSD_MAX_FAILURES:
                self.ssd_enabled = False
        self.relieve()

    def take_tier_changes(self, limit: int) -> list[TierChange]:
        out: list[TierChange] = []
        while self._changes and len(out) < limit:
            out.append(self._changes.popitem(last=False)[1])
        return out

    @property
    def tier_changes_pending(self) -> int:
        return len(self._changes)

    # --- warm restart ---------------------------------------------------------------------

    def manifest_snapshot(self) -> list[Record]:
        """The manifest as it should read now (for compaction): every segment in use in the
        order it was opened, then every block on the SSD or being written there. A block whose
        write then fails keeps a record for bytes that never landed: the checksum check at
        start drops it, and its offset is never handed out again in that generation."""
        assert self.ssd is not None
        segments = self.ssd.segments
        in_use = list(segments.sealed_oldest_first())
        if segments.open_segment is not None:
            in_use.append(segments.open_segment)
        records: list[Record] = [OpenRecord(s, segments.generation(s)) for s in in_use]
        copies = [c for members in self._ssd_copies.values() for c in members.values()]
        copies += [c for (lv, _), c in self._filling.items() if lv is SSD]
        for copy in copies:
            b = copy.block
            seg = segments.segment_of(copy.offset)
            records.append(
                LandRecord(
                    seg, segments.generation(seg), copy.offset, b.size_bytes, b.checksum,
                    b.write_id, b.version, b.key,
                )
            )  # fmt: skip
        self._manifest.clear()  # drops queued so far are folded into the snapshot
        return records

    def restore_ssd_copy(self, block: Block, offset: int) -> None:
        """Attach an SSD copy found at start (already allocated in the segment allocator)."""
        assert self.ssd is not None
        copy = Copy(block, SSD, offset, self.ssd.footprint(block.size_bytes))
        self._attach(copy)

    # --- queries --------------------------------------------------------------------------

    def ssd_segment(self, offset: int) -> int:
        assert self.ssd is not None
        return self.ssd.segments.segment_of(offset)

    def copies_on(self, level: TierLevel) -> int:
        return self._count.get(level, 0)

    def lingering_bytes(self) -> int:
        return sum(c.block.size_bytes for c in self._lingering.values())

    def check_invariants(self, blocks: Iterable[Block]) -> None:
        footprint = dict.fromkeys(self.tiers, 0)
        count = dict.fromkeys(self.tiers, 0)
        policy_members = dict.fromkeys(self.policies, 0)
        for block in blocks:
            assert not block.detached
            for level, copy in block.copies.items():
                assert copy.level is level
                assert copy.block is block
                assert copy.ready
                assert not copy.detached
                footprint[level] += copy.footprint
                count[level] += 1
                policy = self.policies.get(level)
                if policy is not None and block.id in policy:
                    assert block.state is BlockState.COMMITTED
                    policy_members[level] += 1
                elif policy is not None and block.state is BlockState.COMMITTED:
                    assert block.moving, f"{block.id} is missing from the {level.name} policy"
                if level is SSD:
                    seg = self.ssd_segment(copy.offset)
                    assert self._ssd_copies[seg][copy.offset] is copy
        for (level, offset), copy in self._lingering.items():
            assert copy.detached
            assert copy.leases > 0
            assert copy.offset == offset
            footprint[level] += copy.footprint
        for (level, offset), copy in self._filling.items():
            assert not copy.ready
            assert copy.offset == offset
            footprint[level] += copy.footprint
        assert count == self._count, f"{count} != {self._count}"
        for level, policy in self.policies.items():
            assert len(policy) == policy_members[level], f"{level.name} policy out of step"
        for level, tier in self.tiers.items():
            if level is SSD:
                assert self.ssd is not None
                segments = self.ssd.segments
                segments.check_invariants()
                allocated = sum(segments.size_of(o) for s in self._ssd_copies.values() for o in s)
                allocated += sum(c.footprint for (lv, _), c in self._lingering.items() if lv is SSD)
                allocated += sum(c.footprint for (lv, _), c in self._filling.items() if lv is SSD)
                assert allocated == segments.live_bytes, f"{allocated} != {segments.live_bytes}"
            else:
                assert footprint[level] == tier.used_bytes, (
                    f"{level.name}: {footprint[level]} != {tier.used_bytes} used"
                )

    # --- internals: copies ------------------------------------------------------------------

    def _attach(self, copy: Copy) -> None:
        copy.block.copies[copy.level] = copy
        self._count[copy.level] += 1
        if copy.level is SSD:
            self._ssd_copies.setdefault(self.ssd_segment(copy.offset), {})[copy.offset] = copy

    def _detach(self, copy: Copy) -> None:
        """Take a copy off its block and tier bookkeeping; free it now or at its last lease."""
        block = copy.block
        if copy.level is CPU and self.listing is not None:
            self.listing.remove(block)
        if block.copies.get(copy.level) is copy:
            if not block.detached:
                del block.copies[copy.level]
            self._count[copy.level] -= 1
        policy = self.policies.get(copy.level)
        if policy is not None:
            policy.removed(block.id)
        if copy.level is SSD:
            seg = self.ssd_segment(copy.offset)
            members = self._ssd_copies[seg]
            del members[copy.offset]
            if not members:
                del self._ssd_copies[seg]
        copy.detached = True
        if copy.leases:
            self._lingering[(copy.level, copy.offset)] = copy
            if copy.level is SSD:
                seg = self.ssd_segment(copy.offset)
                self._seg_lingering[seg] = self._seg_lingering.get(seg, 0) + 1
        else:
            self._free(copy)

    def _free(self, copy: Copy) -> None:
        # A detached block keeps its copies listed for reads still holding it; once a copy's
        # memory is freed, unlist it: no read may find freed memory, and the block↔copy
        # reference cycle is broken, so the pair is freed by reference counting (the node
        # freezes long-lived objects out of the cyclic collector, kvpool.gctune).
        block = copy.block
        if block.copies.get(copy.level) is copy:
            del block.copies[copy.level]
        if copy.level is SSD:
            self._free_ssd(copy)
        else:
            self.tiers[copy.level].free(copy.offset)

    def _free_ssd(self, copy: Copy) -> None:
        """Free an SSD extent whose LAND record was written: record the drop too."""
        assert self.ssd is not None
        segments = self.ssd.segments
        seg = segments.segment_of(copy.offset)
        self._manifest.append(DropRecord(seg, segments.generation(seg), copy.offset))
        segments.free(copy.offset)
        self.on_work()

    def _drop_copy(self, copy: Copy, *, evicted: bool) -> None:
        if evicted:
            self.counters[copy.level].evictions += 1
        self._detach(copy)
        self._note_level(copy.block)

    def _other_ready_copy(self, block: Block, level: TierLevel) -> bool:
        return any(lv is not level and c.ready for lv, c in block.copies.items())

    def _note_level(self, block: Block) -> None:
        if block.state is not BlockState.COMMITTED or block.detached:
            return
        fastest = block.fastest()
        if fastest is None or fastest.level is block.level_reported:
            return
        block.level_reported = fastest.level
        self._changes[block.id] = TierChange(
            block.key, block.write_id, block.version, block.size_bytes, block.checksum,
            fastest.level,
        )  # fmt: skip
        self._changes.move_to_end(block.id)
        self.on_work()

    # --- internals: eviction and demotion -----------------------------------------------------

    def _evictable(self, block_id: BlockId, level: TierLevel) -> bool:
        block = self._lookup(block_id)
        if block is None or block.state is not BlockState.COMMITTED or block.pinned:
            return False
        if block.moving:
            return False
        copy = block.copies.get(level)
        return copy is not None and copy.ready and copy.leases == 0

    def _redundant(self, block_id: BlockId, level: TierLevel) -> bool:
        if not self._evictable(block_id, level):
            return False
        block = self._lookup(block_id)
        return block is not None and self._other_ready_copy(block, level)

    def _drop_redundant(self, level: TierLevel, size_bytes: int) -> int | None:
        """Drop copies on ``level`` that have another copy elsewhere until ``size_bytes`` can
        be allocated there; the offset, or None."""
        tier = self.tiers[level]
        policy = self.policies[level]
        for _ in range(CLEAN_DROP_SCAN):
            victim = policy.pop_victim(lambda b: self._redundant(b, level), REDUNDANT_REFUSALS)
            if victim is None:
                return None
            block = self._lookup(victim)
            assert block is not None
            self._drop_copy(block.copies[level], evicted=True)
            offset = tier.alloc(size_bytes)
            if offset is not None:
                return offset
        return None

    def _relieve(self, level: TierLevel, force_bytes: int) -> None:
        tier = self.tiers[level]
        capacity = tier.capacity_bytes
        effective = tier.used_bytes - self._leaving[level]
        need = 0
        if effective > self.rules.high_watermark * capacity:
            need = effective - int(self.rules.low_watermark * capacity)
        need = max(need, force_bytes)
        if need > 0:
            self._make_leave(level, need, demote=self.ssd_enabled)

    def _evict(self, level: TierLevel, need_bytes: int) -> list[BlockId]:
        return self._make_leave(level, need_bytes, demote=False)

    def _make_leave(self, level: TierLevel, need_bytes: int, *, demote: bool) -> list[BlockId]:
        """Walk ``level``'s policy until ``need_bytes`` are leaving; the ids of blocks lost."""
        lost: list[BlockId] = []
        while need_bytes > 0 and (block := self._coldest(level)) is not None:
            copy = block.copies[level]
            need_bytes -= copy.footprint
            if demote and self._fits_ssd(block) and not self._other_ready_copy(block, level):
                block.moving = True
                copy.leases += 1  # the write job reads it
                self._leaving[level] += copy.footprint
                self._planned.append(copy)
            elif self._drop_or_lose(copy):
                lost.append(block.id)
        return lost

    def _coldest(self, level: TierLevel) -> Block | None:
        """The next victim of ``level``'s policy that may leave now (None: none left)."""
        policy = self.policies[level]
        victim = policy.pop_victim(partial(self._evictable, level=level), EVICTION_REFUSALS)
        if victim is None:
            return None
        block = self._lookup(victim)
        assert block is not None
        return block

    def _fits_ssd(self, block: Block) -> bool:
        return self.ssd is not None and (
            self.ssd.footprint(block.size_bytes) <= self.ssd.segments.segment_bytes
        )

    def _build_write_jobs(self) -> None:
        assert self.ssd is not None
        ssd = self.ssd
        segments = ssd.segments
        job: WriteJob | None = None
        planned, self._planned = self._planned, []
        for source in planned:
            block = source.block
            offset = ssd.alloc(block.size_bytes)
            if offset is None:
                self._reclaim_ssd(ssd.footprint(block.size_bytes))
                offset = ssd.alloc(block.size_bytes)
            if offset is None:  # the SSD is full of blocks it cannot let go: drop this one
                block.moving = False
                self._leaving[source.level] -= source.footprint
                self.release(source)
                if not source.detached:
                    self.counters[source.level].evictions += 1
                    self._lose(block, source.level)
                continue
            dest = Copy(block, SSD, offset, ssd.footprint(block.size_bytes), ready=False)
            self._filling[(SSD, offset)] = dest
            seg = segments.segment_of(offset)
            if (
                job is None
                or job.segment != seg
                or job.start + job.length != offset
                or job.length + dest.footprint > self.rules.write_batch_bytes
            ):
                records: list[Record] = [
                    OpenRecord(o.segment, o.generation) for o in segments.take_opened()
                ]
                job = WriteJob(seg, segments.generation(seg), offset, 0, records=records)
                self._seg_writers[seg] = self._seg_writers.get(seg, 0) + 1
                self._queue(job)
            job.items.append(Demotion(source, dest))
            job.length += dest.footprint

    def _reclaim_ssd(self, need_bytes: int) -> None:
        """Free whole segments, oldest first, until ``need_bytes`` are free."""
        assert self.ssd is not None
        segments = self.ssd.segments
        for seg in segments.sealed_oldest_first():
            if need_bytes <= 0:
                break
            if self._seg_writers.get(seg) or self._seg_lingering.get(seg):
                continue
            members = list(self._ssd_copies.get(seg, {}).values())
            if any(c.leases or c.block.pinned for c in members):
                continue
            need_bytes -= segments.segment_bytes
            for copy in members:
                if not copy.detached:
                    self._drop_or_lose(copy)

    def _shed_ssd(self, count: int, lost: list[BlockId]) -> None:
        """:meth:`shed` on the SSD: copies of its oldest segments first (the open one last);
        none of a segment still being written."""
        assert self.ssd is not None
        segments = self.ssd.segments
        for seg in [*segments.sealed_oldest_first(), segments.open_segment]:
            if seg is None or self._seg_writers.get(seg) or self._seg_lingering.get(seg):
                continue
            for copy in list(self._ssd_copies.get(seg, {}).values()):
                if len(lost) >= count:
                    return
                if copy.detached or not copy.ready or copy.leases or copy.block.pinned:
                    continue
                if self._drop_or_lose(copy):
                    lost.append(copy.block.id)

    def _drop_or_lose(self, copy: Copy) -> bool:
        """Drop ``copy``; when it was its block's last ready copy the block is lost (counted,
        told to the index): True then."""
        block, level = copy.block, copy.level
        if self._other_ready_copy(block, level):
            self._drop_copy(copy, evicted=True)
            return False
        self.counters[level].evictions += 1
        self._lose(block, level)
        return True

    # --- internals: promotion -------------------------------------------------------------------

    def _promotion(self, block: Block, level: TierLevel) -> Copy | None:
        """A destination on ``level`` for a copy of ``block`` (not ready), or None."""
        if block.id in self._promoting or level in block.copies or block.moving:
            return None
        tier = self.tiers[level]
        offset = tier.alloc(block.size_bytes)
        if offset is None:
            offset = self._drop_redundant(level, block.size_bytes)
        if offset is None:
            return None
        dest = Copy(block, level, offset, tier.footprint(block.size_bytes), ready=False)
        self._filling[(level, offset)] = dest
        self._promoting.add(block.id)
        return dest

    def _end_promotion(self, dest: Copy, ok: bool) -> None:
        block = dest.block
        del self._filling[(dest.level, dest.offset)]
        self._promoting.discard(block.id)
        if ok and not block.detached and dest.level not in block.copies:
            dest.ready = True
            self._attach(dest)
            if block.state is BlockState.COMMITTED:
                self.policies[dest.level].inserted(block.id, dest.footprint)
                if dest.level is CPU and self.listing is not None:
                    self.listing.add(dest)
            self.counters[dest.level].promotions += 1
            block.slow_hits = 0
            self._note_level(block)
            self.relieve()
        else:
            self.tiers[dest.level].free(dest.offset)

    def _queue(self, job: Job) -> None:
        self._jobs.append(job)
        self.on_work()
