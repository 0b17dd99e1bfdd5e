"""The data-plane frame: a fixed binary header, the key, then the raw payload.

Block bytes move between clients and store nodes (and node to node) in frames; they never travel
through gRPC. Every frame, request or response, is::

    header (HEADER_SIZE bytes, little-endian, layout below)
    key    (key_len bytes, UTF-8)
    payload(payload_len bytes)

=========  ======  ==========================================================================
offset     type    field
=========  ======  ==========================================================================
0          4s      magic ``b"KVPF"``
4          u16     protocol version (``kvpool.proto.PROTOCOL_VERSION``)
6          u8      op (:class:`Op`)
7          u8      status (:class:`Status`; 0 in requests)
8          u64     request id: chosen by the sender, echoed in the response (pipelining)
16         u64     write id: a block's identity on a node
24         u64     version: the index version (PUBLISH), else 0
32         u64     payload length in bytes
40         u64     checksum: xxh3-64 of the block's bytes (PUT request, GET response)
48         u16     key length in bytes
50         u16     flags (op-specific; for a MISS, the :class:`MissReason`)
52         u32     extensions (bit 0: :data:`EXT_TRACED`), else 0
=========  ======  ==========================================================================

A request may carry its caller's trace context (OpenTelemetry): with :data:`EXT_TRACED` set in
the extensions word, :data:`TRACE_CONTEXT` (trace id, span id, trace flags: 25 bytes) follows the
header, before the key, and is counted in the key length. A sender only sets it for a peer that
offered ``trace`` in its HELLO answer, so an older peer never sees it and ``PROTOCOL_VERSION``
stays 1; readers of this release strip it before the frame reaches a handler
(:attr:`Header.trace`). Responses never carry it.

Multi-key and shared-memory ops (``MGET``, ``SHM_*``) carry a table in their payload: a ``u32``
count, then fixed records (:data:`KEY_RECORD` + key bytes in requests, :data:`MGET_RECORD`,
:data:`SHM_RECORD` or :data:`RESERVE_RECORD` in responses); the helpers below build and parse
them. An ``MGET`` response's payload is the record table followed by the bytes of every hit, in
request order. ``HELLO`` answers a small JSON object naming the node's features (a peer that does
not know ``HELLO`` answers BAD_REQUEST or an empty OK: no features). None of these change how an
older frame is read, so ``PROTOCOL_VERSION`` stays 1: a node that does not know an op answers
BAD_REQUEST and the client uses the single-key ops.

``RPC`` carries a call to a master (its frame RPC port, offered in GetMembers): the key is the
method's name, the payload the serialized protobuf request, ``version`` the caller's time budget
in microseconds; the answer's payload is the serialized response, or with status RPC_ERROR the
typed error (:mod:`kvpool.errors` code, message, leader) as JSON.

``AUTH`` proves a connection belongs to the cluster: where a peer is configured with a cluster
token, the first frame of every connection must be ``AUTH`` with the token as its payload; the
peer answers OK, or UNAUTHORIZED (with a message) and closes. A peer without a token answers OK.
On a shared-memory socket the client sends ``AUTH`` before the arena is handed over.

A response carries the request's op and request id. An error response (status other than OK and
MISS) carries a UTF-8 message as its payload. ``flags`` of a GET request is the slowest
:class:`TierLevel` the caller accepts (0: any); ``flags`` of a GET hit names the tier that served
it; ``flags`` of a MISS is its :class:`MissReason`. Both sides check magic and version on the first
six bytes, before anything else: a peer speaking another version gets a VERSION_MISMATCH
response naming both versions, then the connection is closed.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import NamedTuple

from kvpool.proto import PROTOCOL_VERSION

MAGIC = b"KVPF"
HEADER = struct.Struct("<4sHBBQQQQQHHI")
HEADER_SIZE = HEADER.size  # 56
PREFIX_SIZE = 6  # magic + version: enough to refuse a stranger early
MAX_KEY_BYTES = 1024
"""Longest key, in UTF-8 bytes, accepted anywhere in kvpool."""
MAX_ERROR_MESSAGE_BYTES = 4096
EXT_TRACED = 1
"""Extensions bit: a trace context follows the header (see the module doc)."""
TRACE_CONTEXT = struct.Struct("<16s8sB")
"""Trace id (16 bytes), span id (8 bytes), W3C trace flags (1 byte)."""
TRACE_CONTEXT_SIZE = TRACE_CONTEXT.size  # 25


class Op(enum.IntEnum):
    PUT = 1  # stage a block: key, write id, checksum, payload
    GET = 2  # read a committed block by exact (key, write id)
    PUBLISH = 3  # make a staged block readable: key, write id, version
    DELETE = 4  # drop a block (key, write id; write id 0 = every block of the key)
    PING = 5  # liveness and version check
    HELLO = 6  # features of the node (JSON payload in the response)
    MGET = 7  # many GETs in one frame: request table of (write id, key); response table + bytes
    SHM_GET = 8  # like MGET, but answers where each block lies in the shared arena (leased)
    SHM_RELEASE = 9  # end leases handed out by SHM_GET (payload: lease ids); no response
    SHM_RESERVE = 10  # reserve arena extents for puts (table of write id, size, checksum, key)
    SHM_COMMIT = 11  # the reserved extents are written: verify and stage them (reservation ids)
    RPC = 12  # a master call: key = method name, payload = protobuf request, version = budget us
    AUTH = 13  # first frame of a connection to a peer with a cluster token: payload = the token


class Status(enum.IntEnum):
    OK = 0
    MISS = 1  # no such committed block; flags carry the MissReason
    NO_SPACE = 2  # the node could not make room for a PUT
    CHECKSUM_MISMATCH = 3  # PUT payload did not match its checksum
    BAD_REQUEST = 4  # malformed frame; payload says why
    VERSION_MISMATCH = 5  # peer speaks another protocol version; payload says both
    TOO_LARGE = 6  # payload above the node's block size limit
    INTERNAL = 7  # unexpected server error; payload says what
    UNAUTHORIZED = 8  # AUTH: a missing or wrong cluster token; the connection is then closed
    DEFERRED = 9  # MGET/SHM_GET record only: not in memory here, read it with a single GET
    RPC_ERROR = 10  # RPC: the call raised; payload = JSON {"code", "message", "leader"}


class MissReason(enum.IntEnum):
    ABSENT = 0  # never held, or already dropped
    STAGED = 1  # held but not published (not committed yet)
    WRONG_VERSION = 2  # a different write id of this key is held
    EVICTED = 3  # was held and evicted
    SLOW_TIER = 4  # held, but only on a tier slower than the GET's limit
    CORRUPT = 5  # held on a tier whose bytes no longer match the checksum: dropped


class TierLevel(enum.IntEnum):
    """A store node's tiers, fastest first. As a GET request's flags: the slowest tier the
    caller accepts (``ANY`` = 0: every tier); as a GET hit's flags: the tier that served it."""

    ANY = 0
    GPU = 1
    CPU = 2
    SSD = 3


class FrameError(ValueError):
    """A frame that cannot be parsed: wrong magic, wrong version, bad lengths."""


class Header(NamedTuple):
    """A frame's header, as :func:`unpack_header` reads it (a named tuple: every frame makes
    one, and a tuple is made several times faster than a frozen dataclass)."""

    op: int
    status: int = Status.OK
    request_id: int = 0
    write_id: int = 0
    version: int = 0
    payload_len: int = 0
    checksum: int = 0
    key_len: int = 0
    flags: int = 0
    protocol_version: int = PROTOCOL_VERSION
    ext: int = 0
    trace: bytes = b""  # the caller's trace context (TRACE_CONTEXT), b"" when none

    def pack(self) -> bytes:
        """The header's bytes, followed by the trace context when the header has one (so that
        ``header.pack() + key`` is always the frame's start)."""
        trace = self.trace
        return (
            HEADER.pack(
                MAGIC,
                self.protocol_version,
                self.op,
                self.status,
                self.request_id,
                self.write_id,
                self.version,
                self.payload_len,
                self.checksum,
                self.key_len + len(trace),
                self.flags,
                (self.ext | EXT_TRACED) if trace else self.ext,
            )
            + trace
        )


def check_prefix(prefix: bytes | bytearray | memoryview) -> int:
    """Validate magic and version from the first PREFIX_SIZE bytes; return the peer's version.

    Raises FrameError for a wrong magic. A different version is returned, not raised: the caller
    answers it with VERSION_MISMATCH.
    """
    if len(prefix) < PREFIX_SIZE:
        raise FrameError(f"short frame prefix: {len(prefix)} bytes")
    if bytes(prefix[:4]) != MAGIC:
        raise FrameError(f"bad magic {bytes(prefix[:4])!r}: not a kvpool data-plane peer")
    version: int = struct.unpack_from("<H", prefix, 4)[0]
    return version


def unpack_header(buf: bytes | bytearray | memoryview) -> Header:
    """Parse a full header. Raises FrameError on a wrong magic or a malformed field."""
    (
        magic,
        version,
        op,
        status,
        request_id,
        write_id,
        block_version,
        payload_len,
        checksum,
        key_len,
        flags,
        ext,
    ) = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}: not a kvpool data-plane peer")
    if ext & EXT_TRACED:
        if key_len < TRACE_CONTEXT_SIZE or key_len > MAX_KEY_BYTES + TRACE_CONTEXT_SIZE:
            raise FrameError(f"key length {key_len} of a traced frame out of range")
    elif key_len > MAX_KEY_BYTES:
        raise FrameError(f"key length {key_len} above the limit of {MAX_KEY_BYTES} bytes")
    return Header(
        op,
        status,
        request_id,
        write_id,
        block_version,
        payload_len,
        checksum,
        key_len,
        flags,
        version,
        ext,
    )


def split_trace(header: Header, key: bytes) -> tuple[Header, bytes]:
    """A traced frame's header and key as read (the context counted in ``key_len``) → the header
    with :attr:`Header.trace` set and the key alone. Other frames are returned as they are."""
    if not header.ext & EXT_TRACED:
        return header, key
    return (
        header._replace(
            key_len=header.key_len - TRACE_CONTEXT_SIZE,
            ext=header.ext & ~EXT_TRACED,
            trace=key[:TRACE_CONTEXT_SIZE],
        ),
        key[TRACE_CONTEXT_SIZE:],
    )


def pack_trace(trace_id: int, span_id: int, trace_flags: int) -> bytes:
    return TRACE_CONTEXT.pack(trace_id.to_bytes(16, "big"), span_id.to_bytes(8, "big"), trace_flags)


def unpack_trace(trace: bytes) -> tuple[int, int, int]:
    """(trace id, span id, trace flags) of a packed trace context."""
    raw_trace, raw_span, trace_flags = TRACE_CONTEXT.unpack(trace)
    return int.from_bytes(raw_trace, "big"), int.from_bytes(raw_span, "big"), trace_flags


def version_mismatch_message(ours: int, theirs: int) -> str:
    return (
        f"protocol version mismatch: this peer speaks kvpool protocol {ours}, "
        f"the other side speaks {theirs}; run the same kvpool release on both sides"
    )


def encode_key(key: str) -> bytes:
    """UTF-8 bytes of a key, validated against MAX_KEY_BYTES (raises ValueError)."""
    raw = key.encode("utf-8")
    if not raw:
        raise ValueError("empty key")
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(raw)} bytes is above the limit of {MAX_KEY_BYTES}")
    return raw


# --- tables of multi-key ops ------------------------------------------------------------------

COUNT = struct.Struct("<I")
KEY_RECORD = struct.Struct("<QQQH")
"""Request record: write id, size (SHM_RESERVE) or 0, checksum (SHM_RESERVE) or 0, key length;
the key's bytes follow the record."""
MGET_RECORD = struct.Struct("<BB6xQQQ")
"""MGET response record: status, flags (miss reason or tier), write id, size, checksum."""
SHM_RECORD = struct.Struct("<BB6xQQQQQ")
"""SHM_GET response record: status, flags, write id, size, checksum, arena offset, lease id."""
RESERVE_RECORD = struct.Struct("<BB6xQQ")
"""SHM_RESERVE / SHM_COMMIT response record: status, flags, arena offset (reserve), reservation
id (reserve; 0 when refused)."""
ID = struct.Struct("<Q")
MAX_TABLE_KEYS = 4096
"""Most records in one multi-key frame."""
MAX_TABLE_BYTES = MAX_TABLE_KEYS * (KEY_RECORD.size + MAX_KEY_BYTES) + COUNT.size


class KeyRecord(NamedTuple):
    """One request record: the key's bytes, write id, and for SHM_RESERVE size and checksum."""

    key: bytes
    write_id: int
    size_bytes: int = 0
    checksum: int = 0


def encode_key_table(records: Sequence[tuple[bytes, int, int, int]]) -> bytes:
    """A request table: count, then per record (key, write id, size, checksum) its fixed part
    and the key's bytes."""
    parts = [COUNT.pack(len(records))]
    append, pack = parts.append, KEY_RECORD.pack
    for key, write_id, size, checksum in records:
        append(pack(write_id, size, checksum, len(key)))
        append(key)
    return b"".join(parts)


def decode_key_table(buf: bytes | bytearray | memoryview) -> list[KeyRecord]:
    """Parse a request table; FrameError when it is malformed."""
    view = memoryview(buf)
    if len(view) < COUNT.size:
        raise FrameError("table shorter than its count")
    (count,) = COUNT.unpack_from(view, 0)
    if count > MAX_TABLE_KEYS:
        raise FrameError(f"{count} records in one table; at most {MAX_TABLE_KEYS}")
    out: list[KeyRecord] = []
    append = out.append
    raw = bytes(view)
    pos = COUNT.size
    end = len(raw)
    unpack, rec = KEY_RECORD.unpack_from, KEY_RECORD.size
    for _ in range(count):
        if pos + rec > end:
            raise FrameError("table truncated in a record")
        write_id, size, checksum, key_len = unpack(raw, pos)
        pos += rec
        if key_len > MAX_KEY_BYTES or pos + key_len > end:
            raise FrameError("table truncated in a key (or key too long)")
        append(KeyRecord(raw[pos : pos + key_len], write_id, size, checksum))
        pos += key_len
    if pos != end:
        raise FrameError(f"{end - pos} bytes after the last record")
    return out


def encode_ids(ids: list[int]) -> bytes:
    return COUNT.pack(len(ids)) + b"".join(ID.pack(i) for i in ids)


def decode_ids(buf: bytes | bytearray | memoryview) -> list[int]:
    view = memoryview(buf)
    if len(view) < COUNT.size:
        raise FrameError("id list shorter than its count")
    (count,) = COUNT.unpack_from(view, 0)
    if count > MAX_TABLE_KEYS or len(view) != COUNT.size + count * ID.size:
        raise FrameError("id list of the wrong length")
    return [ID.unpack_from(view, COUNT.size + i * ID.size)[0] for i in range(count)]


def table_size(record: struct.Struct, count: int) -> int:
    """Bytes of a response table of ``count`` records."""
    return COUNT.size + record.size * count


def read_table(
    record: struct.Struct, buf: bytes | bytearray | memoryview, expected: int
) -> list[tuple[int, ...]]:
    """The records of a response table that must hold ``expected`` of them (FrameError if not)."""
    view = memoryview(buf)
    if len(view) < COUNT.size:
        raise FrameError("response table shorter than its count")
    (count,) = COUNT.unpack_from(view, 0)
    if count != expected or len(view) < COUNT.size + count * record.size:
        raise FrameError(f"response table of {count} records for {expected} requests")
    return list(record.iter_unpack(view[COUNT.size : COUNT.size + count * record.size]))
