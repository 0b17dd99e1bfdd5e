"""The block checksum: xxh3-64 over the block's bytes, computed once by the writer, stored in the
index, checked by the node on PUT and by the client on every read."""

from __future__ import annotations

import collections
import os
import threading
import time
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


AHEAD_MIN_BYTES = 256 * 1024
"""A block at least this large is worth hashing on :class:`HashAhead`'s helper thread: below it,
handing the block over costs about what hashing it here does."""


def _hash_unlocked(data: Any) -> int:
    """:func:`block_checksum`, with the GIL released while hashing: xxhash's ``update`` releases
    it (every version we claim); its one-shot digest does only from 4.1, and only above 64 KiB."""
    if type(data) is Parts:
        return block_checksum(data)
    h = xxhash.xxh3_64()
    h.update(data)
    return int(h.intdigest())


_FREE, _BUSY, _DONE = 0, 1, 2


class HashAhead:
    """The checksums of a list of blocks, shared between the caller and a helper thread.

    :meth:`get` answers block ``i``'s checksum: hashed in the caller's thread unless the helper
    has it (then taken as done). The helper takes blocks from the front, one at a time, each
    claimed under a lock; a caller asking for a block the helper is hashing hashes the last free
    one meanwhile, so the two share the list (xxhash's ``update`` runs without the GIL). The 32
    checksums of a shared-memory reservation of 32 x 1 MiB took 0.6x the time of one thread
    (``docs/performance.md``, "A batch's checksums made by two threads").

    :meth:`close` (always called; :func:`hash_ahead` does) stops the helper taking more and waits
    for the block it is hashing, so no reference to a caller's buffer outlives the call. The value
    of every block is the same as :func:`block_checksum`'s, whichever thread hashed it."""

    def __init__(self, blocks: list[Any]) -> None:
        self._blocks = blocks
        self._sums: list[int] = [0] * len(blocks)
        self._state = [_FREE] * len(blocks)
        self._cond = threading.Condition(threading.Lock())
        self._cursor = 0  # the helper's next block to look at
        self._closed = False
        self._extra_failed = False  # a block hashed ahead by the caller failed: no more of that

    def get(self, i: int) -> int:
        while True:
            with self._cond:
                if self._state[i] == _DONE:
                    return self._sums[i]
                mine = i
                if self._state[i] == _BUSY:  # the helper has it: hash another one meanwhile
                    mine = -1 if self._extra_failed else self._last_free()
                    if mine < 0:
                        while self._state[i] == _BUSY:
                            self._cond.wait()
                        continue
                self._state[mine] = _BUSY
            try:
                self._hash(mine)
            except Exception:
                if mine == i:
                    raise
                self._extra_failed = True  # that block's error is raised when it is asked for

    def _last_free(self) -> int:
        for j in range(len(self._state) - 1, self._cursor - 1, -1):
            if self._state[j] == _FREE:
                return j
        return -1

    def _hash(self, i: int) -> None:
        """Hash block ``i``, claimed (``_BUSY``) by this thread."""
        try:
            value = _hash_unlocked(self._blocks[i])
        except BaseException:
            with self._cond:
                self._state[i] = _FREE
                self._cond.notify_all()
            raise
        with self._cond:
            self._sums[i], self._state[i] = value, _DONE
            self._cond.notify_all()

    def close(self) -> None:
        """Take no more blocks into the helper; return once it holds none of them."""
        with self._cond:
            self._closed = True
            while _BUSY in self._state:
                self._cond.wait()
            self._blocks = []

    def _help(self) -> bool:
        """Hash the next free block (on the helper thread); False once none is left."""
        with self._cond:
            if self._closed:
                return False
            while self._cursor < len(self._state) and self._state[self._cursor] != _FREE:
                self._cursor += 1
            i = self._cursor
            if i >= len(self._state):
                return False
            self._state[i] = _BUSY
            data = self._blocks[i]
        try:
            value = _hash_unlocked(data)
        except Exception:  # the caller hashes it again and meets the error itself
            del data
            with self._cond:
                self._state[i] = _FREE
                self._cursor = len(self._state)  # the helper takes no more of this list
                self._cond.notify_all()
            return False
        del data
        with self._cond:
            self._sums[i], self._state[i] = value, _DONE
            self._cond.notify_all()
        return True


class _AheadHelper:
    """The daemon thread that hashes :class:`HashAhead` lists, one list at a time, in the order
    they came; a caller whose list waits meanwhile hashes its blocks itself."""

    def __init__(self, *, start: bool = True) -> None:
        self._jobs: collections.deque[HashAhead] = collections.deque()
        self._go = threading.Semaphore(0)
        if start:
            threading.Thread(target=self._run, name="kvpool-hash", daemon=True).start()

    def submit(self, job: HashAhead) -> None:
        self._jobs.append(job)
        self._go.release()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            job = self._jobs.popleft()
            while job._help():
                pass
            del job


_AHEAD: _AheadHelper | None = None


def hash_ahead(blocks: list[Any]) -> HashAhead:
    """A :class:`HashAhead` of ``blocks``, handed to the helper thread. Close it when done."""
    global _AHEAD
    if _AHEAD is None:
        with _HELPER_LOCK:
            if _AHEAD is None:
                _AHEAD = _AheadHelper()
    job = HashAhead(blocks)
    _AHEAD.submit(job)
    return job


def _forget_helper() -> None:
    """A forked child has no helper threads (only the forking thread survives a fork)."""
    global _HELPER, _HELPER_LOCK, _AHEAD
    _HELPER, _HELPER_LOCK, _AHEAD = None, threading.Lock(), None


os.register_at_fork(after_in_child=_forget_helper)
