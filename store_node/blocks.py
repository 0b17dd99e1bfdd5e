"""The store node's block records and the results its pure core hands out.

A :class:`Block` is one ``(key, write id)`` held by the node; its bytes live in one or more
:class:`Copy` — at most one per tier. Blocks are immutable once received, so copies never go
stale: a block demoted to SSD and promoted back keeps its SSD copy (a later eviction from CPU is
then free), and a reader may be served from any copy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpool.proto.wire import MissReason, Status, TierLevel

BlockId = tuple[str, int]
"""A block's identity on a node: (key, write id)."""


class BlockState(enum.Enum):
    RECEIVING = "receiving"
    STAGED = "staged"
    COMMITTED = "committed"


@dataclass(slots=True, eq=False)
class Copy:
    """A block's bytes on one tier. ``leases`` counts readers and copy jobs using the bytes:
    a leased copy is never freed or overwritten; a copy that leaves while leased is
    ``detached`` and its memory is freed when the last lease ends. ``ready`` is False while a
    job is still filling it (then nobody reads it)."""

    block: Block
    level: TierLevel
    offset: int
    footprint: int
    leases: int = 0
    ready: bool = True
    detached: bool = False


@dataclass(slots=True, eq=False)
class Block:
    key: str
    write_id: int
    size_bytes: int
    checksum: int
    state: BlockState = BlockState.RECEIVING
    version: int = 0
    staged_at: float = 0.0
    pinned: bool = False
    detached: bool = False  # out of the table (deleted, replaced, evicted)
    copies: dict[TierLevel, Copy] = field(default_factory=dict)  # ready copies, by tier
    moving: bool = False  # a demotion of its last fast copy is in flight
    hits: int = 0  # reads served
    slow_hits: int = 0  # reads served from a tier slower than CPU since it was last promoted
    level_reported: TierLevel = TierLevel.CPU  # the tier hint the index was last given
    claimed_version: int = 0  # what its PUBLISH claimed: orders staged writes, never published

    @property
    def id(self) -> BlockId:
        return (self.key, self.write_id)

    @property
    def offset(self) -> int:
        """Offset of the CPU copy (blocks are received into CPU memory)."""
        return self.copies[TierLevel.CPU].offset

    def fastest(self, max_level: TierLevel = TierLevel.ANY) -> Copy | None:
        """The ready copy a read should use: CPU first (sent from where it lies), then GPU,
        then SSD; only tiers no slower than ``max_level`` (ANY: all)."""
        for level in (TierLevel.CPU, TierLevel.GPU, TierLevel.SSD):
            if max_level and level > max_level:
                continue
            copy = self.copies.get(level)
            if copy is not None and copy.ready:
                return copy
        return None


class ReadOutcome(enum.Enum):
    """How a read of a slow-tier copy ended."""

    OK = "ok"  # bytes in the private buffer, checked
    CORRUPT = "corrupt"  # the bytes did not match the checksum (or could not be read)
    ABANDONED = "abandoned"  # the read did not happen (cancelled, no worker)


@dataclass(frozen=True, slots=True)
class PutVerdict:
    """What to do with a PUT's payload: receive it into ``block`` (status OK with a block),
    discard it and answer ``status`` (with ``message`` for errors)."""

    status: Status
    block: Block | None = None
    message: str = ""


@dataclass(frozen=True, slots=True)
class ReadResult:
    """A GET's answer. On OK ``copy`` is leased: release it (``BlockStore.release``) once the
    bytes have left. A copy on CPU is sent from where it lies; any other is read first
    (``BlockStore.finish_read``), and ``promote`` is then a CPU copy to fill with the bytes."""

    status: Status
    reason: MissReason = MissReason.ABSENT
    block: Block | None = None
    copy: Copy | None = None
    promote: Copy | None = None

    @property
    def level(self) -> TierLevel:
        return self.copy.level if self.copy is not None else TierLevel.ANY


@dataclass(frozen=True, slots=True)
class StagedBlock:
    key: str
    write_id: int
    age_s: float


@dataclass(frozen=True, slots=True)
class TierChange:
    """A committed block now lives on ``level`` (its fastest copy): a tier hint for the index."""

    key: str
    write_id: int
    version: int
    size_bytes: int
    checksum: int
    level: TierLevel


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    evictions: int = 0  # copies dropped under pressure
    demotions: int = 0  # copies written to a slower tier on the way out
    promotions: int = 0  # copies made here from a slower tier
    failures: int = 0  # I/O errors


@dataclass(slots=True)
class Counters:
    puts: int = 0
    put_bytes: int = 0
    hits: int = 0
    get_bytes: int = 0
    directory_reads: int = 0  # hits same-host clients made through the shared directory
    misses: dict[MissReason, int] = field(default_factory=lambda: dict.fromkeys(MissReason, 0))
    evictions: int = 0  # blocks lost to pressure (their last copy went)
    shed: int = 0  # of those, dropped because the index was nearly full (index_shed)
    no_space: int = 0
    too_large: int = 0
    checksum_mismatches: int = 0
    publishes: int = 0
    receipt_publishes: int = 0  # of those, settled by the commit's receipt with no Lookup
    superseded: int = 0
    deletes: int = 0
    reaped: int = 0
    missing_reported: int = 0  # replicas the index named that this node never received
    dropped_reports: int = 0
    bad_frames: int = 0
    tiers: dict[TierLevel, TierCounters] = field(
        default_factory=lambda: {lv: TierCounters() for lv in TierLevel if lv}
    )


@dataclass(frozen=True, slots=True)
class TierStats:
    level: TierLevel
    name: str
    detail: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    fragmentation: float
    hits: int
    evictions: int
    demotions: int
    promotions: int


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
    tiers: tuple[TierStats, ...] = ()

    @property
    def misses_total(self) -> int:
        return sum(self.misses.values())
