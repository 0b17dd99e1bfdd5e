"""The tier worker: the thin async shell that moves bytes between tiers for the block store.

The block store (pure) decides and queues jobs; this worker runs them on threads and feeds the
results back on the event loop:

- **Writes** (demotions to the SSD) and manifest records run on one writer thread, in the
  order they were queued: a write job gathers its blocks into an aligned staging buffer (a CPU
  block is copied from shared memory, a GPU block from the device), writes the extent with one
  ``pwritev``, then appends the blocks' LAND records — bytes first, record second.
- **Reads** of copies that cannot be sent from where they lie (SSD, GPU) run on a small pool:
  ``preadv`` (O_DIRECT) or a device copy into a pooled, page-aligned bounce buffer, checked
  against the block's checksum (a bad copy is dropped, never sent), copied into the promotion
  target when the read promotes the block. The lease on the source copy ends when the bytes
  are in the bounce buffer; the buffer goes back to the pool when the transport let go of it.
- **Copies** between memory tiers (CPU → GPU promotions) run on the same pool.
- The manifest is compacted (rewritten from the store's state) when dead records pile up.

Every failure is reported back as ``ok=False``; a job never raises into the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import mmap
import time
from collections.abc import Callable
from typing import Any

from kvpool.checksum import block_checksum
from kvpool.logs import get_logger
from kvpool.proto.wire import TierLevel
from kvpool.store_node.block_store import BlockStore, ReadOutcome, ReadResult
from kvpool.store_node.jobs import CopyJob, Job, ManifestJob, WriteJob
from kvpool.store_node.tiers.manifest import LandRecord
from kvpool.store_node.tiers.segments import SSD_ALIGNMENT_BYTES
from kvpool.store_node.tiers.ssd import aligned_buffer

READ_THREADS = 4
BOUNCE_CACHE_BYTES = 64 << 20
"""Most bytes of idle bounce buffers kept for reuse."""
COMPACT_MIN_RECORDS = 4096
"""The manifest is compacted once it holds this many records and four times the live ones."""
STOP_TIMEOUT_S = 10.0


class WorkerStoppedError(RuntimeError):
    """The tier worker is stopping: no more reads."""


class BouncePool:
    """Page-aligned buffers by power-of-two size class, reused. Event-loop thread only."""

    def __init__(self, max_cached_bytes: int = BOUNCE_CACHE_BYTES) -> None:
        self._free: dict[int, list[mmap.mmap]] = {}
        self._cached = 0
        self._max = max_cached_bytes
        self.allocated = 0

    @staticmethod
    def size_class(size_bytes: int) -> int:
        size = max(SSD_ALIGNMENT_BYTES, size_bytes)
        return 1 << (size - 1).bit_length()

    def get(self, size_bytes: int) -> mmap.mmap:
        cls = self.size_class(size_bytes)
        free = self._free.get(cls)
        if free:
            self._cached -= cls
            return free.pop()
        self.allocated += 1
        return aligned_buffer(cls)

    def put(self, buf: mmap.mmap) -> None:
        cls = len(buf)
        if self._cached + cls > self._max:
            buf.close()
            return
        self._free.setdefault(cls, []).append(buf)
        self._cached += cls

    def close(self) -> None:
        for bufs in self._free.values():
            for buf in bufs:
                buf.close()
        self._free.clear()
        self._cached = 0


class TierWorker:
    """Runs the block store's jobs and slow-tier reads; see the module doc."""

    def __init__(
        self,
        store: BlockStore,
        *,
        read_threads: int = READ_THREADS,
        log: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.log = log if log is not None else get_logger("kvpool.node.tiers")
        self._clock = clock
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-ssd-w")
        self._readers = concurrent.futures.ThreadPoolExecutor(
            read_threads, thread_name_prefix="kvpool-tier-r"
        )
        self.bounce = BouncePool()
        self._staging: mmap.mmap | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_scheduled = False
        self._in_flight: set[asyncio.Future[Any]] = set()
        self._stopping = False
        self.write_seconds = 0.0
        self.written_bytes = 0
        self.compactions = 0
        store.tiers.on_work = self.wake

    # --- driving ----------------------------------------------------------------------------

    def start(self) -> None:
        """Bind to the running loop and run whatever is queued already."""
        self._loop = asyncio.get_running_loop()
        self.wake()

    def wake(self) -> None:
        """The store queued work: drain it on the next loop iteration (once per batch)."""
        if self._loop is None or self._drain_scheduled or self._stopping:
            return
        self._drain_scheduled = True
        self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        for job in self.store.take_jobs():
            self._submit(job)
        self._maybe_compact()

    def _submit(self, job: Job) -> None:
        loop = self._loop
        assert loop is not None
        future: asyncio.Future[Any]
        if isinstance(job, WriteJob):
            future = loop.run_in_executor(self._writer, self._write, job)
            future.add_done_callback(lambda f: self._write_done(job, f))
        elif isinstance(job, ManifestJob):
            future = loop.run_in_executor(self._writer, self._append, job)
            future.add_done_callback(self._manifest_done)
        else:
            future = loop.run_in_executor(self._readers, self._copy, job)
            future.add_done_callback(lambda f: self._copy_done(job, f))
        self._track(future)

    def _track(self, future: asyncio.Future[Any]) -> None:
        self._in_flight.add(future)
        future.add_done_callback(self._in_flight.discard)

    @property
    def busy(self) -> bool:
        return bool(self._in_flight) or self._drain_scheduled

    async def idle(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """Wait until no job is queued or running (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self.busy:
            if time.monotonic() > deadline:
                return False
            if self._in_flight:
                await asyncio.wait(list(self._in_flight), timeout=0.05)
            else:
                await asyncio.sleep(0)
        return True

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Let queued and running jobs finish (bounded), then stop the threads."""
        await self.idle(timeout_s)
        self._stopping = True
        self._writer.shutdown(wait=True, cancel_futures=True)
        self._readers.shutdown(wait=True, cancel_futures=True)
        ssd = self.store.tiers.ssd
        if ssd is not None:
            ssd.manifest_close()
        self.bounce.close()
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def run_blocking(self) -> int:
        """Run every queued job now, in this thread, and finish each in the store — until
        none is left (tests and tools without an event loop). Returns how many ran."""
        ran = 0
        while jobs := self.store.take_jobs():
            for job in jobs:
                ran += 1
                if isinstance(job, WriteJob):
                    try:
                        self._write(job)
                        ok = True
                    except OSError:
                        ok = False
                    self.store.finish_write(job, ok)
                elif isinstance(job, ManifestJob):
                    self._append(job)
                else:
                    try:
                        self._copy(job)
                        ok = True
                    except Exception:
                        ok = False
                    self.store.finish_copy(job, ok)
        return ran

    def read_blocking(self, result: ReadResult) -> bytes | None:
        """:meth:`read` without a loop: the checked bytes, or None when the copy was bad."""
        assert result.block is not None
        buf = self.bounce.get(result.block.size_bytes)
        ok = self._read(result, buf)
        self.store.finish_read(result, ReadOutcome.OK if ok else ReadOutcome.CORRUPT)
        data = bytes(buf[: result.block.size_bytes]) if ok else None
        self.bounce.put(buf)
        return data

    # --- reads --------------------------------------------------------------------------------

    async def read(self, result: ReadResult) -> tuple[mmap.mmap | None, int]:
        """Read a leased non-CPU copy into a bounce buffer, checked; then end the read in the
        store. Returns ``(buffer, size)``, buffer None when the copy was bad (dropped). Give
        the buffer back with :meth:`release_buffer` once sent. WorkerStoppedError when the
        worker is stopping (the lease is given back; nothing was read)."""
        assert result.copy is not None
        assert result.block is not None
        loop = asyncio.get_running_loop()
        size = result.block.size_bytes
        buf = self.bounce.get(size)
        try:
            future = loop.run_in_executor(self._readers, self._read, result, buf)
        except RuntimeError:  # the worker is stopping: nothing is read
            self.store.finish_read(result, ReadOutcome.ABANDONED)
            self.bounce.put(buf)
            raise WorkerStoppedError("the node is stopping") from None
        self._track(future)
        try:
            ok = await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda f: self._late_read(result, buf, f))
            raise
        except Exception:  # the executor is shut down: nothing was read
            self.store.finish_read(result, ReadOutcome.ABANDONED)
            self.bounce.put(buf)
            raise WorkerStoppedError("the node is stopping") from None
        self.store.finish_read(result, ReadOutcome.OK if ok else ReadOutcome.CORRUPT)
        if not ok:
            self.bounce.put(buf)
            return None, size
        return buf, size

    def release_buffer(self, buf: mmap.mmap) -> None:
        self.bounce.put(buf)

    def _late_read(self, result: ReadResult, buf: mmap.mmap, future: asyncio.Future[bool]) -> None:
        if future.cancelled() or future.exception() is not None:
            outcome = ReadOutcome.ABANDONED
        else:
            outcome = ReadOutcome.OK if future.result() else ReadOutcome.CORRUPT
        self.store.finish_read(result, outcome)
        self.bounce.put(buf)

    def _read(self, result: ReadResult, buf: mmap.mmap) -> bool:
        """Worker thread: the copy's bytes into ``buf``; checked; into the promotion target."""
        copy, block, promote = result.copy, result.block, result.promote
        assert copy is not None
        assert block is not None
        size = block.size_bytes
        tiers = self.store.tiers.tiers
        view = memoryview(buf)
        try:
            if copy.level is TierLevel.SSD:
                ssd = self.store.tiers.ssd
                assert ssd is not None
                ssd.read_aligned(copy.offset, view[: copy.footprint])
            else:
                tiers[copy.level].read_into(copy.offset, view[:size])
            if block_checksum(view[:size]) != block.checksum:
                self.log.error(
                    "tier_copy_corrupt",
                    tier=copy.level.name.lower(),
                    key=block.key[:128],
                    offset=copy.offset,
                )
                return False
            if promote is not None:
                tiers[promote.level].write_from(promote.offset, view[:size])
        except Exception as e:  # an I/O error: the copy cannot be trusted
            self.log.error("tier_read_failed", tier=copy.level.name.lower(), error=str(e))
            return False
        finally:
            view.release()
        return True

    # --- writes -------------------------------------------------------------------------------

    def _staging_for(self, length: int) -> mmap.mmap:
        batch = self.store.tiers.rules.write_batch_bytes
        if length > batch:
            return aligned_buffer(length)
        if self._staging is None:
            self._staging = aligned_buffer(batch)
        return self._staging

    def _write(self, job: WriteJob) -> float:
        """Writer thread: gather, write, record. Returns the seconds the write took."""
        ssd = self.store.tiers.ssd
        assert ssd is not None
        tiers = self.store.tiers.tiers
        if job.records:
            ssd.manifest.append(job.records)
        staging = self._staging_for(job.length)
        view = memoryview(staging)[: job.length]
        try:
            for item in job.items:
                source, dest = item.source, item.dest
                rel = dest.offset - job.start
                size = source.block.size_bytes
                tiers[source.level].read_into(source.offset, view[rel : rel + size])
            started = time.perf_counter()
            ssd.write_extent(job.start, view)
            elapsed = time.perf_counter() - started
        finally:
            view.release()
            if staging is not self._staging:
                with contextlib.suppress(BufferError):
                    staging.close()
        ssd.manifest.append(
            LandRecord(
                job.segment,
                job.generation,
                item.dest.offset,
                item.source.block.size_bytes,
                item.source.block.checksum,
                item.source.block.write_id,
                item.source.block.version,
                item.source.block.key,
            )
            for item in job.items
        )
        return elapsed

    def _write_done(self, job: WriteJob, future: asyncio.Future[float]) -> None:
        ok = not future.cancelled() and future.exception() is None
        if ok:
            self.write_seconds += future.result()
            self.written_bytes += job.length
        else:
            error = "cancelled" if future.cancelled() else str(future.exception())
            self.log.error("ssd_write_failed", offset=job.start, bytes=job.length, error=error)
        enabled = self.store.tiers.ssd_enabled
        self.store.finish_write(job, ok)
        if enabled and not self.store.tiers.ssd_enabled:
            self.log.error("ssd_tier_disabled", reason="repeated write failures")

    def _append(self, job: ManifestJob) -> None:
        ssd = self.store.tiers.ssd
        assert ssd is not None
        ssd.manifest.append(job.records)

    def _manifest_done(self, future: asyncio.Future[None]) -> None:
        if future.cancelled() or future.exception() is not None:
            error = "cancelled" if future.cancelled() else str(future.exception())
            self.log.warning("manifest_append_failed", error=error)

    def _maybe_compact(self) -> None:
        ssd = self.store.tiers.ssd
        if ssd is None or self._stopping:
            return
        live = self.store.tiers.copies_on(TierLevel.SSD) + ssd.segments.segment_count
        if ssd.manifest.records < max(COMPACT_MIN_RECORDS, 4 * live):
            return
        records = self.store.tiers.manifest_snapshot()
        ssd.manifest.records = len(records)  # counted now: no second compaction is queued
        assert self._loop is not None
        future = self._loop.run_in_executor(self._writer, ssd.manifest.rewrite, records)
        future.add_done_callback(self._manifest_done)
        self._track(future)
        self.compactions += 1

    # --- copies between memory tiers ----------------------------------------------------------

    def _copy(self, job: CopyJob) -> None:
        tiers = self.store.tiers.tiers
        size = job.source.block.size_bytes
        buf = bytearray(size)
        view = memoryview(buf)
        tiers[job.source.level].read_into(job.source.offset, view)
        tiers[job.dest.level].write_from(job.dest.offset, view)

    def _copy_done(self, job: CopyJob, future: asyncio.Future[None]) -> None:
        ok = not future.cancelled() and future.exception() is None
        if not ok:
            error = "cancelled" if future.cancelled() else str(future.exception())
            self.log.warning("tier_copy_failed", tier=job.dest.level.name.lower(), error=error)
        self.store.finish_copy(job, ok)
