"""A node's directory of the committed blocks in its CPU arena, shared with same-host clients so
that they read those blocks with no message to the node.

The node writes it; a client maps it read-only (the memfd is sealed against writable mappings
where the kernel allows, Linux 5.1+) next to the arena (:mod:`kvpool.transports.shm`). Layout: a
64-byte header (magic, slot count, ``alive_until`` in ``CLOCK_MONOTONIC`` nanoseconds), then
64-byte slots in buckets of :data:`BUCKET_SLOTS`. A slot holds a key's fingerprint (BLAKE2b-128
of its bytes), the block's arena offset, size, checksum and write id, and a tag: xxh3-64 of the
48 bytes before it. A key's bucket is given by its fingerprint; a full bucket takes no more
(those blocks are read through the node, as before).

A reader trusts nothing it has not checked. A slot counts only when its tag matches (one being
rewritten, or torn, does not); the bytes count only when the copy of them hashes to the slot's
checksum — copied first, hashed after, so that an extent freed and reused while it was copied is
a mismatch and the read goes to the node, never another block's bytes. The node lists only
committed blocks (the index confirmed them) with a CPU copy, and takes a block out before its
memory can be freed or reused. It renews ``alive_until`` every :data:`BEAT_S`; a directory whose
node stopped renewing it (killed, stopped, shut down) is not read after at most :data:`ALIVE_S`.

A second memfd, writable by clients, holds one 32-bit read count per slot: a client adds its
reads there and the node folds them into its eviction policy (a block read through the
directory is as hot as one read through the node). A count a client spoils can only mislead the
policy, never a read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import struct
import time
from typing import NamedTuple

import numpy as np
import xxhash

MAGIC = b"KVPDIR01"
HEADER = struct.Struct("<8sQQ")
"""magic, slots, alive_until (CLOCK_MONOTONIC ns)."""
ALIVE = struct.Struct("<Q")
ALIVE_AT = 16
HEADER_BYTES = 64
BODY = struct.Struct("<16sQQQQ")
"""fingerprint, offset, size, checksum, write id; the tag follows."""
TAG = struct.Struct("<Q")
SLOT_BYTES = 64
BUCKET_SLOTS = 8
BUCKET_BYTES = BUCKET_SLOTS * SLOT_BYTES
MIN_SLOTS = 1024
MAX_SLOTS = 1 << 20
BYTES_PER_SLOT = 16 << 10
"""Slots per arena byte: one for every 16 KiB (a 1 GiB arena: 65,536 slots, 4 MiB)."""
BEAT_S = 0.2
ALIVE_S = 1.0
MAX_READS_PER_TAKE = 1 << 16
"""Most reads one slot is credited with per :meth:`DirectoryWriter.take_reads` (every
:data:`BEAT_S`: ~330k reads a second of one block, above what a client can make): the counters
are clients' memory, and a client that scribbles over them must not make every block hot."""
MAX_SLOTS_PER_TAKE = 8192
"""Most slots one take credits (the most read), so that folding them stays a bounded piece of
the node's event loop whatever the counters say."""
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def slots_for(arena_bytes: int) -> int:
    """The slot count for an arena of ``arena_bytes``: a power of two within the limits."""
    want = max(MIN_SLOTS, min(MAX_SLOTS, arena_bytes // BYTES_PER_SLOT))
    return 1 << (want - 1).bit_length()


def fingerprint(key_bytes: bytes) -> bytes:
    return hashlib.blake2b(key_bytes, digest_size=16).digest()


def _bucket(fp: bytes, buckets: int) -> int:
    return int.from_bytes(fp[:8], "little") & (buckets - 1)


class Found(NamedTuple):
    slot: int
    offset: int
    size: int
    checksum: int
    write_id: int


class DirectoryWriter:
    """The node's side: one slot per listed block. Not thread-safe (the node's event loop)."""

    def __init__(self, slots: int) -> None:
        if slots < BUCKET_SLOTS or slots & (slots - 1):
            raise ValueError(f"directory slots must be a power of two >= {BUCKET_SLOTS}")
        self.slots = slots
        self._buckets = slots // BUCKET_SLOTS
        self._used = bytearray(slots)
        self.fd, self._map = _memfd("kvpool-directory", HEADER_BYTES + slots * SLOT_BYTES)
        try:
            self.hits_fd, self._hits_map = _memfd("kvpool-directory-reads", slots * 4)
        except BaseException:
            self._map.close()
            os.close(self.fd)
            raise
        self.hits = np.frombuffer(self._hits_map, dtype=np.uint32)
        HEADER.pack_into(self._map, 0, MAGIC, slots, 0)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        self.sealed = True
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals | F_SEAL_FUTURE_WRITE)
        except OSError:  # a kernel before 5.1: clients map it read-only all the same
            self.sealed = False
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
        with contextlib.suppress(OSError):
            fcntl.fcntl(self.hits_fd, fcntl.F_ADD_SEALS, seals)
        self.listed = 0

    def put(self, key_bytes: bytes, offset: int, size: int, checksum: int, write_id: int) -> int:
        """List a block; its slot, or -1 when its bucket is full."""
        fp = fingerprint(key_bytes)
        first = _bucket(fp, self._buckets) * BUCKET_SLOTS
        used = self._used
        for slot in range(first, first + BUCKET_SLOTS):
            if not used[slot]:
                break
        else:
            return -1
        body = BODY.pack(fp, offset, size, checksum, write_id)
        pos = HEADER_BYTES + slot * SLOT_BYTES
        self.hits[slot] = 0
        self._map[pos : pos + BODY.size] = body
        TAG.pack_into(self._map, pos + BODY.size, xxhash.xxh3_64_intdigest(body))
        used[slot] = 1
        self.listed += 1
        return slot

    def drop(self, slot: int) -> None:
        """Unlist a slot: the tag goes first, so no reader takes the slot from then on."""
        if not self._used[slot]:
            return
        pos = HEADER_BYTES + slot * SLOT_BYTES
        TAG.pack_into(self._map, pos + BODY.size, 0)
        self._map[pos : pos + BODY.size] = bytes(BODY.size)
        self._used[slot] = 0
        self.listed -= 1

    def beat(self, alive_for_s: float = ALIVE_S) -> None:
        """Readers may use the directory for ``alive_for_s`` more (0: from now on, not)."""
        until = time.monotonic_ns() + int(alive_for_s * 1e9) if alive_for_s > 0 else 0
        ALIVE.pack_into(self._map, ALIVE_AT, until)

    def take_reads(self) -> list[tuple[int, int]]:
        """(slot, reads) for every slot clients counted reads on since the last call; what it
        answers is taken off the counts."""
        hits = self.hits
        # Clients count into this memory while the node reads it: work on one copy of it
        # (numpy's nonzero counts, then fills, and fails when the count changed in between).
        seen = hits.copy()
        touched = np.flatnonzero(seen)
        if not touched.size:
            return []
        counted = seen[touched]
        counts = np.minimum(counted, MAX_READS_PER_TAKE)
        # Take away what was seen rather than zeroing: a read counted since the copy stays for
        # the next take. Only a read counted between this gather and scatter may go uncredited
        # (a hint, no more); the clamp keeps a count a client wrote back from before the last
        # take (smaller than what was seen) from wrapping around.
        now = hits[touched]
        hits[touched] = now - np.minimum(now, counted)
        listed = np.frombuffer(self._used, dtype=np.uint8)[touched].astype(bool)
        slots, counts = touched[listed], counts[listed]
        if slots.size > MAX_SLOTS_PER_TAKE:
            top = np.argpartition(counts, -MAX_SLOTS_PER_TAKE)[-MAX_SLOTS_PER_TAKE:]
            slots, counts = slots[top], counts[top]
        return list(zip(slots.tolist(), counts.tolist(), strict=True))

    def close(self) -> None:
        with contextlib.suppress(ValueError, BufferError):
            self.beat(0)
        del self.hits
        for m in (self._map, self._hits_map):
            with contextlib.suppress(BufferError):
                m.close()
        for fd in (self.fd, self.hits_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


class DirectoryReader:
    """A client's view of a node's directory (see the module doc)."""

    def __init__(self, fd: int, hits_fd: int) -> None:
        """Map the two memfds (the caller keeps and closes the fds); ValueError when they are
        not a directory of this layout."""
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            raise ValueError("not a kvpool directory")
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            magic, slots, _alive = HEADER.unpack_from(self._map, 0)
            if (
                magic != MAGIC
                or not BUCKET_SLOTS <= slots <= MAX_SLOTS
                or slots & (slots - 1)
                or size != HEADER_BYTES + slots * SLOT_BYTES
                or os.fstat(hits_fd).st_size != slots * 4
            ):
                raise ValueError("not a kvpool directory of this layout")
            self._hits_map = mmap.mmap(
                hits_fd, slots * 4, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            self._map.close()
            raise
        self.slots = slots
        self._buckets = slots // BUCKET_SLOTS
        self._hits = np.frombuffer(self._hits_map, dtype=np.uint32)

    def alive(self) -> bool:
        """The node renewed the directory within :data:`ALIVE_S`."""
        until: int = ALIVE.unpack_from(self._map, ALIVE_AT)[0]
        return time.monotonic_ns() < until

    def find(self, key_bytes: bytes) -> Found | None:
        """The slot listing ``key_bytes`` whose tag checks, or None."""
        fp = fingerprint(key_bytes)
        start = HEADER_BYTES + _bucket(fp, self._buckets) * BUCKET_BYTES
        raw = self._map[start : start + BUCKET_BYTES]
        pos = raw.find(fp)
        while pos % SLOT_BYTES:
            if pos < 0:
                return None
            pos = raw.find(fp, pos + 1)
        body = raw[pos : pos + BODY.size]
        if TAG.unpack_from(raw, pos + BODY.size)[0] != xxhash.xxh3_64_intdigest(body):
            return None
        _fp, offset, size, checksum, write_id = BODY.unpack(body)
        return Found((start - HEADER_BYTES + pos) // SLOT_BYTES, offset, size, checksum, write_id)

    def count_read(self, slot: int) -> None:
        """Tell the node the block in ``slot`` was read (its eviction policy hears of it)."""
        self._hits[slot] += 1

    def close(self) -> None:
        del self._hits
        for m in (self._map, self._hits_map):
            with contextlib.suppress(BufferError):
                m.close()


def _memfd(name: str, size: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
