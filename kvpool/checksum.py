"""The block checksum: xxh3-64 over the block's bytes, computed once by the writer, stored in the
index, checked by the node on PUT and by the client on every read."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import xxhash

from kvpool.buffers import Parts, copy_bytes

SPLIT_COPY_BYTES = 4 * 1024 * 1024
"""A :func:`copy_checksum` of at least this many bytes is shared with a helper thread, in
:data:`SPLIT_CHUNK_BYTES` pieces: the caller's thread copies and hashes pieces from the front,
the helper copies pieces from the back, and the two meet (numpy's copy runs without the GIL;
the hash, one running state over the bytes in order, stays with the caller). A first read of a
4 MiB block out of a node's shared memory took 0.87x the time on a 2-vCPU VM; at 1 and 2 MiB
the helper's wake-up cost more than it saved (``docs/performance.md``, "A large read out of
shared memory in two halves")."""

SPLIT_CHUNK_BYTES = 2 * 1024 * 1024
"""The piece a split copy's threads take one at a time. A helper that wakes late takes fewer
pieces, or none: the caller never waits for a helper that has not started, only for the piece
it is copying. (Smaller pieces cost more than they share: each is a GIL hand-over between the
threads, and 512 KiB pieces made a 4 MiB copy 1.7x slower than 2 MiB ones.)"""

SPLIT_BACKOFF_COPIES = 32
"""After a split copy (or shared hashing, :func:`block_checksums`) whose caller waited for the
helper longer than it took to do its own pieces (the helper had no CPU: another process busy on
the other core, or the GIL held by another thread), this many are done by the caller alone. A
reader beside a busy process took ~1 ms for a 4 MiB split copy against ~0.27 ms alone
(``docs/performance.md``, "A split copy that never waits for a busy helper")."""


def block_checksum(data: Any) -> int:
    """xxh3-64 of a bytes-like object (bytes, bytearray, memoryview, contiguous numpy array), or
    of a :class:`~kvpool.buffers.Parts`' pieces joined (hashed piece by piece, the same value)."""
    if type(data) is Parts:
        h = xxhash.xxh3_64()
        for view in data.views:
            h.update(view)
        return int(h.intdigest())
    return int(xxhash.xxh3_64_intdigest(data))


def block_hasher() -> Any:
    """A running :func:`block_checksum`: ``update(piece)`` for each piece in order, then
    ``intdigest()`` is the checksum of the pieces joined."""
    return xxhash.xxh3_64()


def copy_checksum(dest: memoryview | Parts, src: memoryview | Parts) -> int:
    """``copy_bytes(dest, src)``, then the checksum of ``dest`` as copied: the hash vouches for
    exactly the bytes the caller is handed, whatever happens to ``src`` meanwhile (a node's
    shared memory, reused once the block is evicted). Large flat copies are shared with a helper
    thread (:data:`SPLIT_COPY_BYTES`); the value is the same either way."""
    n = src.nbytes
    if n >= SPLIT_COPY_BYTES and _flat(dest) and _flat(src) and dest.nbytes == n:
        count = -(-n // SPLIT_CHUNK_BYTES)
        h = xxhash.xxh3_64()

        def mine(i: int) -> None:  # the caller's pieces, from the front: copied and hashed
            to, frm = _piece(dest, src, i)  # type: ignore[arg-type]
            copy_bytes(to, frm)
            h.update(to)

        def theirs(i: int) -> None:
            copy_bytes(*_piece(dest, src, i))  # type: ignore[arg-type]

        done = _shared(count, mine, theirs)
        if done is not None:
            for i in range(done, count):  # the helper's pieces, all copied
                h.update(_piece(dest, src, i)[0])  # type: ignore[arg-type]
            return int(h.intdigest())
    copy_bytes(dest, src)
    return block_checksum(dest)


SHARED_HASH_MIN_BYTES = 256 * 1024
"""In :func:`block_checksums`, blocks at least this large are hashed with the helper thread's
help: below it, handing a block over costs about what hashing it here does."""


def block_checksums(blocks: list[memoryview | Parts]) -> list[int]:
    """:func:`block_checksum` of each block. When two or more are at least
    :data:`SHARED_HASH_MIN_BYTES`, those are shared with the helper thread as a split copy's
    pieces are (the caller hashes from the front, the helper from the back): xxhash's ``update``
    runs without the GIL, so the two hash at once. The checksums a shared-memory reservation of
    32 x 1 MiB lists took 0.6x the time of one thread (``docs/performance.md``, "A batch's
    checksums made by two threads"). The values are the same either way."""
    sums = [0] * len(blocks)
    big = [i for i, b in enumerate(blocks) if b.nbytes >= SHARED_HASH_MIN_BYTES]
    if len(big) >= 2:

        def one(k: int) -> None:
            sums[big[k]] = _hash_unlocked(blocks[big[k]])

        if _shared(len(big), one, one) is not None:
            for i, b in enumerate(blocks):
                if b.nbytes < SHARED_HASH_MIN_BYTES:
                    sums[i] = block_checksum(b)
            return sums
    return [block_checksum(b) for b in blocks]


def _hash_unlocked(data: Any) -> int:
    """:func:`block_checksum`, with the GIL released while hashing: xxhash's ``update`` releases
    it (every version we claim); its one-shot digest does only from 4.1, and only above 64 KiB."""
    if type(data) is Parts:
        return block_checksum(data)
    h = xxhash.xxh3_64()
    h.update(data)
    return int(h.intdigest())


def _shared(count: int, mine: Callable[[int], None], theirs: Callable[[int], None]) -> int | None:
    """Pieces ``[0, count)`` done with the helper thread (:meth:`_Helper.share`): how many were
    the caller's. None when they were not shared — another thread's share is running, or the
    helper is being left out after one that made the caller wait (:data:`SPLIT_BACKOFF_COPIES`)
    — and the caller does them alone."""
    helper = _helper()
    if not helper.busy.acquire(blocking=False):
        return None
    try:
        if helper.skip:
            helper.skip -= 1
            return None
        return helper.share(count, mine, theirs)
    finally:
        helper.busy.release()


def _flat(view: memoryview | Parts) -> bool:
    return type(view) is memoryview and view.ndim == 1 and view.itemsize == 1


class _Helper:
    """One daemon thread sharing the pieces of one job at a time (``busy``): a split
    :func:`copy_checksum`, or the blocks of :func:`block_checksums`; idle, it waits on a
    semaphore. Pieces ``[_next, _end)`` are unclaimed: the caller takes ``_next``, the helper
    ``_end - 1``, each under ``_cond``. ``skip``: jobs left to do without the helper
    (:data:`SPLIT_BACKOFF_COPIES`)."""

    def __init__(self, *, start: bool = True) -> None:
        self.busy = threading.Lock()
        self.skip = 0
        self._cond = threading.Condition(threading.Lock())
        self._go = threading.Semaphore(0)
        self._work: Callable[[int], None] | None = None
        self._next = self._end = 0
        self._working = 0  # pieces the helper has claimed and not finished
        self._error: BaseException | None = None
        if start:
            threading.Thread(target=self._run, name="kvpool-copy", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._go.acquire()  # a release per job; one woken late finds nothing left
            while self._help():
                pass

    def _help(self) -> bool:
        """Do the last unclaimed piece of the current job; False when none is left."""
        with self._cond:
            if self._next >= self._end or self._work is None:
                return False
            self._end -= 1
            piece, work = self._end, self._work
            self._working += 1
        try:
            work(piece)
        except BaseException as e:  # handed to the caller, which raises it
            self._error = e
        del work  # no reference to the caller's buffers once its job is over
        with self._cond:
            self._working -= 1
            if not self._working:
                self._cond.notify()
        return True

    def share(self, count: int, mine: Callable[[int], None], theirs: Callable[[int], None]) -> int:
        """Pieces ``[0, count)``: ``mine(i)`` in this thread from the front, in order,
        ``theirs(i)`` on the helper from the back; how many were the caller's (``[0, n)``; the
        helper did the rest). The caller holds ``busy``. Returns only once every piece the
        helper claimed is done, whatever fails, so nothing touches the caller's buffers after
        the call; the helper's error is raised here."""
        with self._cond:
            self._work, self._next, self._end, self._error = theirs, 0, count, None
        self._go.release()
        done = 0  # pieces [0, done) done here
        start = time.perf_counter()
        try:
            while True:
                with self._cond:
                    if self._next >= self._end:
                        break
                    self._next += 1
                mine(done)
                done += 1
        finally:
            own = time.perf_counter() - start
            with self._cond:
                self._end = self._next  # nothing more is claimed
                while self._working:
                    self._cond.wait()
                self._work = None
            if time.perf_counter() - start > 2 * own:
                self.skip = SPLIT_BACKOFF_COPIES
        if self._error is not None:
            raise self._error
        return done


def _piece(dest: memoryview, src: memoryview, i: int) -> tuple[memoryview, memoryview]:
    """Piece ``i`` of a split copy: (its destination, its source)."""
    lo = i * SPLIT_CHUNK_BYTES
    hi = min(lo + SPLIT_CHUNK_BYTES, src.nbytes)
    return dest[lo:hi], src[lo:hi]


_HELPER: _Helper | None = None
_HELPER_LOCK = threading.Lock()


def _helper() -> _Helper:
    global _HELPER
    if _HELPER is None:
        with _HELPER_LOCK:
            if _HELPER is None:
                _HELPER = _Helper()
    return _HELPER


def _forget_helper() -> None:
    """A forked child has no helper thread (only the forking thread survives a fork)."""
    global _HELPER, _HELPER_LOCK
    _HELPER, _HELPER_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_helper)
