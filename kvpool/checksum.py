"""The block checksum: xxh3-64 over the block's bytes, computed once by the writer, stored in the
index, checked by the node on PUT and by the client on every read."""

from __future__ import annotations

import os
import threading
from typing import Any

import xxhash

from kvpool.buffers import Parts, copy_bytes

SPLIT_COPY_BYTES = 4 * 1024 * 1024
"""A :func:`copy_checksum` of at least this many bytes is split in two: a helper thread copies
the second half while the caller's thread copies the first half and hashes it, then hashes the
second (xxhash holds the GIL; numpy's copy does not). A first read of a 4 MiB block out of a
node's shared memory took 0.87x the time on a 2-vCPU VM; at 1 and 2 MiB the helper's wake-up
cost more than it saved (``docs/performance.md``, "A large read out of shared memory in two
halves")."""


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
    shared memory, reused once the block is evicted). Large flat copies are split with a helper
    thread (:data:`SPLIT_COPY_BYTES`); the value is the same either way."""
    n = src.nbytes
    if n >= SPLIT_COPY_BYTES and _flat(dest) and _flat(src) and dest.nbytes == n:
        helper = _helper()
        if helper.busy.acquire(blocking=False):  # else another thread's split copy is running
            try:
                return helper.copy_checksum(dest, src)  # type: ignore[arg-type]
            finally:
                helper.busy.release()
    copy_bytes(dest, src)
    return block_checksum(dest)


def _flat(view: memoryview | Parts) -> bool:
    return type(view) is memoryview and view.ndim == 1 and view.itemsize == 1


class _Helper:
    """One daemon thread copying the second half of a split :func:`copy_checksum`, one split
    copy at a time (``busy``); idle, it waits on a semaphore."""

    def __init__(self) -> None:
        self.busy = threading.Lock()
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._job: tuple[memoryview, memoryview] | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="kvpool-copy", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            assert self._job is not None
            dest, src = self._job
            try:
                copy_bytes(dest, src)
            except BaseException as e:  # handed to the caller, which raises it
                self._error = e
            self._job = None
            self._done.release()

    def copy_checksum(self, dest: memoryview, src: memoryview) -> int:
        """The split copy (the caller holds ``busy``): returns only once the helper's half is
        copied, whatever fails, so nothing writes into ``dest`` after the call."""
        half = (src.nbytes // 2) & ~4095
        self._error = None
        self._job = (dest[half:], src[half:])
        self._go.release()
        try:
            copy_bytes(dest[:half], src[:half])
            h = xxhash.xxh3_64(dest[:half])
        finally:
            self._done.acquire()
        if self._error is not None:
            raise self._error
        h.update(dest[half:])
        return int(h.intdigest())


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
