"""The SSD tier: one preallocated data file, large aligned writes, positional reads, a manifest.

Layout under ``ssd_cache_path``: ``data.kvp`` (the space, preallocated to ``ssd_cache_size``
with ``posix_fallocate`` so that writes never extend the file), ``manifest.kvp`` (see
:mod:`.manifest`) and ``lock`` (an exclusive ``flock``: two nodes on one directory would
overwrite each other's blocks).

I/O: the data file is opened with ``O_DIRECT`` when the filesystem accepts it (checked at start
by an aligned read; tmpfs and some overlay filesystems refuse it) so that block bytes do not
also fill the page cache; otherwise buffered I/O is used and the node says so. Writes are whole
extents of the :class:`~kvpool.store_node.tiers.segments.SegmentAllocator` (4 KiB-aligned, many
blocks at once) from an aligned staging buffer; reads are ``preadv`` into an aligned bounce
buffer (direct) or into any destination (buffered, then ``POSIX_FADV_DONTNEED``).

Every method that touches the files blocks: the tier worker calls them from its threads. The
allocation methods are pure bookkeeping and run on the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import shutil
from pathlib import Path

from kvpool.proto.wire import TierLevel
from kvpool.store_node.tiers.manifest import ManifestFile
from kvpool.store_node.tiers.segments import SSD_ALIGNMENT_BYTES, SegmentAllocator

DATA_FILE = "data.kvp"
MANIFEST_FILE = "manifest.kvp"
LOCK_FILE = "lock"


class SsdTierError(Exception):
    """The SSD tier cannot be set up as configured; the message says why."""


def aligned_buffer(size_bytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory of ``size_bytes`` rounded up to the SSD alignment."""
    size = max(SSD_ALIGNMENT_BYTES, -(-size_bytes // SSD_ALIGNMENT_BYTES) * SSD_ALIGNMENT_BYTES)
    return mmap.mmap(-1, size)


def allocated_bytes(path: Path) -> int:
    """Bytes the filesystem has allocated to ``path`` (0 when it does not exist)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def check_free_space(directory: Path, capacity_bytes: int) -> str | None:
    """Why ``capacity_bytes`` cannot be preallocated under ``directory`` (None when it can):
    the data file's existing allocation counts as available."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    available = usage.free + allocated_bytes(directory / DATA_FILE)
    if capacity_bytes > available:
        return (
            f"ssd_cache_size: {capacity_bytes} bytes is above the free space of the filesystem "
            f"holding {directory} ({available} bytes available, counting this tier's existing "
            "data file); lower ssd_cache_size or free some space"
        )
    return None


class SsdTier:
    """The SSD tier's files and its segment allocator."""

    level = TierLevel.SSD

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        segment_bytes: int,
        *,
        direct_io: bool = True,
        name: str = "ssd",
    ) -> None:
        self._name = name
        self.dir = Path(path)
        self._lock_fd = -1
        if segment_bytes <= 0:
            raise SsdTierError(f"ssd_segment_size: must be positive, not {segment_bytes}")
        capacity = capacity_bytes // segment_bytes * segment_bytes
        problem = check_free_space(self.dir, capacity)
        if problem:
            raise SsdTierError(problem)
        try:
            self.segments = SegmentAllocator(capacity_bytes, segment_bytes)
        except ValueError as e:
            raise SsdTierError(f"ssd_cache_size/ssd_segment_size: {e}") from e
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SsdTierError(f"ssd_cache_path: cannot create {self.dir}: {e}") from e
        self._lock_fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lock_fd)
            raise SsdTierError(
                f"ssd_cache_path: {self.dir} is in use by another kvpool node (lock held)"
            ) from e
        self.data_path = self.dir / DATA_FILE
        self._fd = -1
        self._direct_fd: int | None = None
        try:
            self._fd = os.open(self.data_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            size = os.fstat(self._fd).st_size
            if size > capacity:
                os.ftruncate(self._fd, capacity)
            if allocated_bytes(self.data_path) < capacity:
                os.posix_fallocate(self._fd, 0, capacity)
        except OSError as e:
            self.close()
            raise SsdTierError(
                f"ssd_cache_path: cannot preallocate {capacity} bytes in {self.data_path}: {e}"
            ) from e
        self.direct_reason = "disabled by ssd_direct_io = false"
        if direct_io:
            self._direct_fd, self.direct_reason = self._open_direct()
        self.manifest = ManifestFile(self.dir / MANIFEST_FILE, segment_bytes, capacity)

    def _open_direct(self) -> tuple[int | None, str]:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None, "O_DIRECT is not available on this platform"
        try:
            fd = os.open(self.data_path, os.O_RDWR | os.O_CLOEXEC | flag)
        except OSError as e:
            return None, f"the filesystem refuses O_DIRECT ({e.strerror})"
        probe = aligned_buffer(SSD_ALIGNMENT_BYTES)
        try:
            os.preadv(fd, [probe], 0)
        except OSError as e:
            os.close(fd)
            return None, f"an aligned O_DIRECT read failed ({e.strerror})"
        finally:
            probe.close()
        return fd, "O_DIRECT"

    # --- the Tier shape ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def direct_io(self) -> bool:
        return self._direct_fd is not None

    @property
    def detail(self) -> str:
        mode = "O_DIRECT" if self.direct_io else f"buffered I/O: {self.direct_reason}"
        return f"{self.data_path} ({mode})"

    @property
    def capacity_bytes(self) -> int:
        return self.segments.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.segments.used_bytes

    def footprint(self, size_bytes: int) -> int:
        return self.segments.footprint(size_bytes)

    def alloc(self, size_bytes: int) -> int | None:
        return self.segments.alloc(size_bytes)

    def free(self, offset: int) -> None:
        self.segments.free(offset)

    def fragmentation(self) -> float:
        return self.segments.fragmentation()

    # --- I/O (blocking) -------------------------------------------------------------------

    def read_into(self, offset: int, dest: memoryview) -> None:
        """Read ``len(dest)`` bytes at ``offset`` into any destination (buffered I/O, the
        pages dropped from the page cache afterwards)."""
        _pread_full(self._fd, dest, offset)
        with contextlib.suppress(OSError):
            os.posix_fadvise(self._fd, offset, len(dest), os.POSIX_FADV_DONTNEED)

    def read_aligned(self, offset: int, buffer: memoryview | mmap.mmap) -> None:
        """Fill an aligned ``buffer`` (from :func:`aligned_buffer`, length a multiple of 4 KiB)
        from the 4 KiB-aligned ``offset``: O_DIRECT when available."""
        if self._direct_fd is None:
            self.read_into(offset, memoryview(buffer))
            return
        _pread_full(self._direct_fd, memoryview(buffer), offset)

    def write_extent(self, offset: int, buffer: memoryview | mmap.mmap) -> None:
        """Write an aligned extent (aligned ``offset``, aligned buffer and length)."""
        view = memoryview(buffer)
        fd = self._direct_fd if self._direct_fd is not None else self._fd
        done = 0
        while done < len(view):
            n = os.pwritev(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"short write at {offset + done} in {self.data_path}")
            done += n

    def write_from(self, offset: int, src: memoryview) -> None:
        """Write ``src`` at ``offset`` (any alignment: buffered I/O)."""
        done = 0
        while done < len(src):
            done += os.pwritev(self._fd, [src[done:]], offset + done)

    def sync(self) -> None:
        os.fdatasync(self._fd)

    def close(self) -> bool:
        self.manifest_close()
        for fd in (self._direct_fd, self._fd if self._fd >= 0 else None):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._direct_fd = None
        self._fd = -1
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1
        return True

    def manifest_close(self) -> None:
        manifest = getattr(self, "manifest", None)
        if manifest is not None:
            manifest.close()


def _pread_full(fd: int, dest: memoryview, offset: int) -> None:
    done = 0
    while done < len(dest):
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read at {offset + done}")
        done += n
