"""The SSD tier's manifest: an append-only log of what landed where, for warm restarts.

Records are appended as blocks land on the SSD (after their bytes were written), as blocks leave
it, and as segments are (re)opened. On start the log is replayed: a block record counts only if
its segment's latest opening has the same generation and no later record dropped it. Every block
that survives the replay is then checked against its checksum by reading it back (a torn write
or a bad sector is dropped, never served) before it is offered to the index again.

File layout (little-endian)::

    header: magic "KVPMANI1", u32 format, u64 segment bytes, u64 capacity bytes
    frames: u32 body length, u64 xxh3-64 of the body, body

    body OPEN  (1): u32 segment, u64 generation
    body LAND  (2): u32 segment, u64 generation, u64 offset, u64 size, u64 checksum,
                    u64 write id, u64 version, u16 key length, key (UTF-8)
    body DROP  (3): u32 segment, u64 generation, u64 offset

A frame whose length or hash does not check out ends the replay there (a torn tail after a
crash). The log is compacted — rewritten with one OPEN per segment in use and one LAND per live
block, then renamed over the old one — at start and whenever dead records outnumber live ones.
Appends are not fsynced: after a crash of the process the kernel still writes them; after a
power loss the checksum check at start drops whatever did not make it.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

MAGIC = b"KVPMANI1"
FORMAT = 1
_HEADER = struct.Struct("<8sIQQ")
_FRAME = struct.Struct("<IQ")
_OPEN = struct.Struct("<BIQ")
_LAND = struct.Struct("<BIQQQQQQH")
_DROP = struct.Struct("<BIQQ")
KIND_OPEN, KIND_LAND, KIND_DROP = 1, 2, 3
MAX_BODY_BYTES = 1 << 16


@dataclass(frozen=True, slots=True)
class OpenRecord:
    segment: int
    generation: int


@dataclass(frozen=True, slots=True)
class LandRecord:
    segment: int
    generation: int
    offset: int
    size_bytes: int
    checksum: int
    write_id: int
    version: int
    key: str


@dataclass(frozen=True, slots=True)
class DropRecord:
    segment: int
    generation: int
    offset: int


Record = OpenRecord | LandRecord | DropRecord


def encode(record: Record) -> bytes:
    if isinstance(record, LandRecord):
        key = record.key.encode("utf-8")
        body = (
            _LAND.pack(
                KIND_LAND,
                record.segment,
                record.generation,
                record.offset,
                record.size_bytes,
                record.checksum,
                record.write_id,
                record.version,
                len(key),
            )
            + key
        )
    elif isinstance(record, DropRecord):
        body = _DROP.pack(KIND_DROP, record.segment, record.generation, record.offset)
    else:
        body = _OPEN.pack(KIND_OPEN, record.segment, record.generation)
    return _FRAME.pack(len(body), xxhash.xxh3_64_intdigest(body)) + body


def header(segment_bytes: int, capacity_bytes: int) -> bytes:
    return _HEADER.pack(MAGIC, FORMAT, segment_bytes, capacity_bytes)


def _decode_body(body: bytes) -> Record | None:
    kind = body[0] if body else 0
    if kind == KIND_OPEN and len(body) == _OPEN.size:
        _, segment, generation = _OPEN.unpack(body)
        return OpenRecord(segment, generation)
    if kind == KIND_DROP and len(body) == _DROP.size:
        _, segment, generation, offset = _DROP.unpack(body)
        return DropRecord(segment, generation, offset)
    if kind == KIND_LAND and len(body) >= _LAND.size:
        _, seg, gen, offset, size, checksum, write_id, version, key_len = _LAND.unpack_from(body)
        if len(body) != _LAND.size + key_len:
            return None
        try:
            key = body[_LAND.size :].decode("utf-8")
        except UnicodeDecodeError:
            return None
        return LandRecord(seg, gen, offset, size, checksum, write_id, version, key)
    return None


@dataclass(slots=True)
class Replay:
    """What a manifest says is on the SSD."""

    layout_ok: bool  # the header matches this tier's segment size and capacity
    records: int = 0  # frames read
    torn_bytes: int = 0  # bytes after the last good frame (ignored)
    generations: dict[int, int] = field(default_factory=dict)  # segment -> latest generation
    order: list[int] = field(default_factory=list)  # segments, oldest opening first
    live: dict[int, dict[int, LandRecord]] = field(default_factory=dict)  # seg -> off -> rec

    def blocks(self) -> list[LandRecord]:
        """Every live block, by segment in opening order, then by offset."""
        out: list[LandRecord] = []
        for seg in self.order:
            out.extend(sorted(self.live.get(seg, {}).values(), key=lambda r: r.offset))
        return out


def replay(data: bytes, segment_bytes: int, capacity_bytes: int) -> Replay:
    """Replay manifest bytes (pure). A header for another layout gives ``layout_ok=False``
    and nothing else: the data file is not interpreted."""
    if len(data) < _HEADER.size:
        return Replay(layout_ok=not data)
    magic, fmt, seg_bytes, capacity = _HEADER.unpack_from(data)
    if (magic, fmt, seg_bytes, capacity) != (MAGIC, FORMAT, segment_bytes, capacity_bytes):
        return Replay(layout_ok=False)
    out = Replay(layout_ok=True)
    segments = capacity_bytes // segment_bytes
    pos = _HEADER.size
    view = memoryview(data)
    while pos + _FRAME.size <= len(data):
        length, digest = _FRAME.unpack_from(data, pos)
        start = pos + _FRAME.size
        if length == 0 or length > MAX_BODY_BYTES or start + length > len(data):
            break
        body = bytes(view[start : start + length])
        if xxhash.xxh3_64_intdigest(body) != digest:
            break
        record = _decode_body(body)
        if record is None or not 0 <= record.segment < segments:
            break
        pos = start + length
        out.records += 1
        _apply(out, record, segment_bytes)
    out.torn_bytes = len(data) - pos
    return out


def _apply(out: Replay, record: Record, segment_bytes: int) -> None:
    seg = record.segment
    if isinstance(record, OpenRecord):
        if record.generation > out.generations.get(seg, -1):
            out.generations[seg] = record.generation
            out.live.pop(seg, None)
            if seg in out.order:
                out.order.remove(seg)
            out.order.append(seg)
        return
    if out.generations.get(seg) != record.generation:
        return  # written before the segment was reused: stale
    if isinstance(record, LandRecord):
        if record.offset // segment_bytes != seg:
            return
        out.live.setdefault(seg, {})[record.offset] = record
    else:
        out.live.get(seg, {}).pop(record.offset, None)


class ManifestFile:
    """The manifest on disk: appends, and compaction by rewrite-and-rename. Blocking: used
    from the SSD tier's single writer thread (and at start). The first append of a process
    that did not :meth:`rewrite` it first (a recovery does) starts it afresh: records written
    before could name generations this process hands out again."""

    def __init__(self, path: Path, segment_bytes: int, capacity_bytes: int) -> None:
        self.path = path
        self._header = header(segment_bytes, capacity_bytes)
        self._fd: int | None = None
        self.records = 0  # frames in the file now
        self.appended_bytes = 0

    def read(self) -> bytes:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return b""

    def rewrite(self, records: Iterable[Record]) -> None:
        """Replace the manifest with exactly ``records`` (atomic: write, fsync, rename)."""
        self.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        chunks = [self._header]
        count = 0
        for record in records:
            chunks.append(encode(record))
            count += 1
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"".join(chunks))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.records = count
        self._open()

    def append(self, records: Iterable[Record]) -> int:
        """Append records (one write); returns how many."""
        frames = [encode(r) for r in records]
        if not frames:
            return 0
        if self._fd is None:
            self.rewrite([])  # never recovered in this process: what was there is stale
        assert self._fd is not None
        view = memoryview(b"".join(frames))
        self.appended_bytes += len(view)
        while view:
            view = view[os.write(self._fd, view) :]
        self.records += len(frames)
        return len(frames)

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
