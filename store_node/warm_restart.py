"""Warm restart: find the SSD tier's blocks again after the node restarts.

1. :func:`recover_ssd` (blocking, at start, before the node serves): replay the manifest,
   read every block it names back from the data file — a segment's blocks in one large read —
   and keep those whose bytes match their checksum; restore the segment allocator; rewrite the
   manifest with exactly what was kept.
2. :func:`restore_into` puts the kept blocks into the block store as committed blocks with an
   SSD copy (a key found twice keeps its higher version).
3. Once registered, the node claims them from the index (``ClaimReplicas`` with ``restore``,
   see :mod:`~kvpool.store_node.registration`): the index adds the new member as a replica of
   every entry that still names exactly that write (write id, version, size, checksum), and the
   node drops the blocks it refused — removed or overwritten while the node was away.

Nothing unverified is ever served: a block whose bytes do not check out is dropped here, and
every later read from the SSD is checked again.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field

from kvpool.checksum import block_checksum
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.tiers.manifest import LandRecord, OpenRecord, Record, replay
from kvpool.store_node.tiers.ssd import SsdTier, aligned_buffer

VERIFY_THREADS = 4


@dataclass(slots=True)
class Recovery:
    """What a warm restart found."""

    layout_ok: bool = True  # False: the files were for another size/segment layout
    blocks: list[LandRecord] = field(default_factory=list)  # verified, in FIFO order
    corrupt: int = 0  # named by the manifest but the bytes did not check out
    torn_bytes: int = 0  # unreadable tail of the manifest (a crash mid-append)
    manifest_records: int = 0
    seconds: float = 0.0
    verified_bytes: int = 0


def _verify_segment(ssd: SsdTier, records: list[LandRecord]) -> list[bool]:
    """Read one segment's blocks (one aligned read over their span) and check each."""
    segments = ssd.segments
    start = min(r.offset for r in records)
    end = max(r.offset + segments.footprint(r.size_bytes) for r in records)
    buf = aligned_buffer(end - start)
    view = memoryview(buf)
    try:
        ssd.read_aligned(start, view[: end - start])
        return [
            block_checksum(view[r.offset - start : r.offset - start + r.size_bytes]) == r.checksum
            for r in records
        ]
    except OSError:
        return [False] * len(records)
    finally:
        view.release()
        buf.close()


def recover_ssd(ssd: SsdTier, threads: int = VERIFY_THREADS) -> Recovery:
    """Replay, verify, restore the allocator, compact the manifest. Blocking (start-up)."""
    started = time.perf_counter()
    segments = ssd.segments
    state = replay(ssd.manifest.read(), segments.segment_bytes, segments.capacity_bytes)
    out = Recovery(
        layout_ok=state.layout_ok, torn_bytes=state.torn_bytes, manifest_records=state.records
    )
    by_segment = [(seg, sorted(state.live.get(seg, {}).values(), key=lambda r: r.offset))
                  for seg in state.order]  # fmt: skip
    by_segment = [(seg, recs) for seg, recs in by_segment if recs]
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        verdicts = list(pool.map(lambda item: _verify_segment(ssd, item[1]), by_segment))
    kept: list[tuple[int, int, list[tuple[int, int]]]] = []
    for (seg, recs), oks in zip(by_segment, verdicts, strict=True):
        good = [r for r, ok in zip(recs, oks, strict=True) if ok]
        out.corrupt += len(recs) - len(good)
        if good:
            kept.append((seg, state.generations[seg], [(r.offset, r.size_bytes) for r in good]))
            out.blocks.extend(good)
            out.verified_bytes += sum(r.size_bytes for r in good)
    segments.restore(kept)
    records: list[Record] = [OpenRecord(seg, gen) for seg, gen, _ in kept]
    records.extend(out.blocks)
    ssd.manifest.rewrite(records)
    out.seconds = time.perf_counter() - started
    return out


def restore_into(store: BlockStore, recovery: Recovery) -> int:
    """Put the recovered blocks into the store (committed, on the SSD); returns how many are
    held (a key found twice keeps its higher version)."""
    for r in recovery.blocks:
        store.restore(
            key=r.key,
            write_id=r.write_id,
            version=r.version,
            size_bytes=r.size_bytes,
            checksum=r.checksum,
            offset=r.offset,
        )
    return store.stats().committed
