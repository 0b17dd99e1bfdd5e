"""The block checksum: xxh3-64 over the block's bytes, computed once by the writer, stored in the
index, checked by the node on PUT and by the client on every read."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import xxhash

from kvpool.buffers import Parts, copy_bytes

SPLIT_COPY_BYTES = 4 * 1024 * 1024
"""A :func:`copy_checksum` of at least this many bytes is shared with a helper thread, in
:data:`SPLIT_CHUNK_BYTES` pieces: the caller's thread copies and hashes pieces from the front,
the helper copies pieces from the back, and the two meet (xxhash holds the GIL; numpy's copy
does not). A first read of a 4 MiB block out of a node's shared memory took 0.87x the time on a
2-vCPU VM; at 1 and 2 MiB the helper's wake-up cost more than it saved (``docs/performance.md``,
"A large read out of shared memory in two halves")."""

SPLIT_CHUNK_BYTES = 2 * 1024 * 1024
"""The piece a split copy's threads take one at a time. A helper that wakes late takes fewer
pieces, or none: the caller never waits for a helper that has not started, only for the piece
it is copying. (Smaller pieces cost more than they share: each is a GIL hand-over between the
threads, and 512 KiB pieces made a 4 MiB copy 1.7x slower than 2 MiB ones.)"""

SPLIT_BACKOFF_COPIES = 32
"""After a split copy whose caller waited for the helper longer than it took to copy and hash
its own pieces (the helper had no CPU: another process busy on the other core, or the GIL held
by another thread), this many copies are made by the caller alone. A reader beside a busy
process took ~1 ms for a 4 MiB split copy against ~0.27 ms alone (``docs/performance.md``, "A
split copy that never waits for a busy helper")."""


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
        helper = _helper()
        if helper.busy.acquire(blocking=False):  # else another thread's split copy is running
            try:
                if helper.skip:
                    helper.skip -= 1
                else:
                    return helper.copy_checksum(dest, src)  # type: ignore[arg-type]
            finally:
                helper.busy.release()
    copy_bytes(dest, src)
    return block_checksum(dest)


def _flat(view: memoryview | Parts) -> bool:
    return type(view) is memoryview and view.ndim == 1 and view.itemsize == 1


class _Helper:
    """One daemon thread sharing the pieces of a split :func:`copy_checksum`, one split copy at
    a time (``busy``); idle, it waits on a semaphore. Pieces ``[_next, _end)`` are unclaimed:
    the caller takes ``_next``, the helper ``_end - 1``, each under ``_cond``. ``skip``: copies
    left to make without the helper (:data:`SPLIT_BACKOFF_COPIES`)."""

    def __init__(self, *, start: bool = True) -> None:
        self.busy = threading.Lock()
        self.skip = 0
        self._cond = threading.Condition(threading.Lock())
        self._go = threading.Semaphore(0)
        self._job: tuple[memoryview, memoryview] | None = None
        self._next = self._end = 0
        self._copying = 0  # pieces the helper has claimed and not finished
        self._error: BaseException | None = None
        if start:
            threading.Thread(target=self._run, name="kvpool-copy", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._go.acquire()  # a release per split copy; one woken late finds nothing left
            while self._help():
                pass

    def _help(self) -> bool:
        """Copy the last unclaimed piece of the current split copy; False when none is left."""
        with self._cond:
            if self._next >= self._end or self._job is None:
                return False
            self._end -= 1
            piece = self._end
            dest, src = self._job
            self._copying += 1
        try:
            copy_bytes(*_piece(dest, src, piece))
        except BaseException as e:  # handed to the caller, which raises it
            self._error = e
        with self._cond:
            self._copying -= 1
            if not self._copying:
                self._cond.notify()
        return True

    def copy_checksum(self, dest: memoryview, src: memoryview) -> int:
        """The split copy (the caller holds ``busy``): returns only once every piece the helper
        claimed is copied, whatever fails, so nothing writes into ``dest`` after the call."""
        count = -(-src.nbytes // SPLIT_CHUNK_BYTES)
        with self._cond:
            self._job, self._next, self._end, self._error = (dest, src), 0, count, None
        self._go.release()
        h = xxhash.xxh3_64()
        mine = 0  # pieces [0, mine) copied and hashed here
        start = time.perf_counter()
        try:
            while True:
                with self._cond:
                    if self._next >= self._end:
                        break
                    self._next += 1
                to, frm = _piece(dest, src, mine)
                copy_bytes(to, frm)
                h.update(to)
                mine += 1
        finally:
            own = time.perf_counter() - start
            with self._cond:
                self._end = self._next  # nothing more is claimed
                while self._copying:
                    self._cond.wait()
                self._job = None
            if time.perf_counter() - start > 2 * own:
                self.skip = SPLIT_BACKOFF_COPIES
        if self._error is not None:
            raise self._error
        for piece in range(mine, count):  # the helper's pieces, all copied
            h.update(_piece(dest, src, piece)[0])
        return int(h.intdigest())


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
