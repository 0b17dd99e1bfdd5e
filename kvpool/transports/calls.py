"""A request frame and, once answered, its response: what the pure client logic hands a
connection (blocking or on an event loop) and reads back, so both speak through one type."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple, overload

from kvpool.buffers import Parts
from kvpool.checksum import block_checksum
from kvpool.proto.wire import COUNT, MGET_RECORD, FrameError, Header, Status

MAX_ALLOC_BYTES = 1 << 30
"""Most bytes of a response taken into fresh memory, where the caller gave no buffer: an answer
that declares more is refused before anything is allocated."""


def owned_bytes(data: memoryview | Parts) -> bytes:
    """``data`` as ``bytes``: the object itself where ``data`` views the whole of a ``bytes``
    object (a blocking connection receives a payload with no caller buffer into one), else a
    copy."""
    if isinstance(data, Parts):
        return bytes(data)
    obj = data.obj
    if type(obj) is bytes and data.nbytes == len(obj):
        return obj
    return bytes(data)


def may_allocate(expect: int, size: int) -> bool:
    """Whether an answer's ``size`` bytes, with no caller buffer to take them, may go into
    fresh memory: exactly the size the index named (``expect``, a call's :attr:`Call.expect`),
    else (-1: not known) at most :data:`MAX_ALLOC_BYTES`. A peer's frame never decides how
    much a client allocates."""
    return size == expect if expect >= 0 else size <= MAX_ALLOC_BYTES


def refused_answer(address: str, size: int, sink: memoryview | Parts | None, expect: int) -> str:
    """Why an answer of ``size`` bytes was not taken (:func:`may_allocate`, or a caller's
    buffer of another size)."""
    if sink is not None:
        into = f"a buffer of {sink.nbytes}"
    elif expect >= 0:
        into = f"a block of {expect}"
    else:
        into = f"no buffer (at most {MAX_ALLOC_BYTES} bytes are taken)"
    return f"{address}: response of {size} bytes for {into}"


class Call:
    """One request and, once answered, its response (``header`` and ``data``)."""

    __slots__ = (
        "checksum",
        "data",
        "digests",
        "error",
        "expect",
        "expects",
        "flags",
        "header",
        "hit_ends",
        "key",
        "op",
        "payload",
        "records",
        "request_id",
        "sink",
        "sinks",
        "table",
        "version",
        "write_id",
    )

    def __init__(
        self,
        op: int,
        key: bytes = b"",
        *,
        write_id: int = 0,
        version: int = 0,
        checksum: int = 0,
        flags: int = 0,
        payload: bytes | bytearray | memoryview | Parts = b"",
        sink: memoryview | Parts | None = None,
        table: struct.Struct | None = None,
        sinks: Sequence[memoryview | Parts | None] | None = None,
        expect: int = -1,
        expects: Sequence[int] | None = None,
    ) -> None:
        self.op = op
        self.key = key
        self.write_id = write_id
        self.version = version
        self.checksum = checksum
        self.flags = flags
        self.payload = payload
        self.sink = sink
        self.table = table  # the response payload is a table of these records
        self.sinks = sinks  # MGET: where each hit's bytes go (None: into a fresh buffer)
        # The size the index names for the answer's bytes (-1: not known, as in a read by
        # content): an answer of another size is refused before anything is allocated for it.
        self.expect = expect
        self.expects = expects  # MGET: the same, per key
        self.request_id = 0
        self.header: Header | None = None
        self.data: memoryview | Parts | None = None  # the response payload (sink, table, message)
        self.records: list[tuple[int, ...]] = []  # table records, when ``table`` is set
        self.error: Exception | None = None  # this call's response could not be taken
        # MGET: the checksum of each hit's bytes, taken as they land (:func:`hash_landed`; None
        # where not taken), and which hit each of :func:`hit_views`' views ends (-1: none).
        self.digests: list[int | None] | None = None
        self.hit_ends: list[int] = []

    def request_header(self, trace: bytes = b"") -> Header:
        """The request frame's header (``request_id`` set), with the trace context ``trace``."""
        return Header(
            trace=trace,
            op=self.op,
            request_id=self.request_id,
            write_id=self.write_id,
            version=self.version,
            payload_len=len(self.payload),
            checksum=self.checksum,
            key_len=len(self.key),
            flags=self.flags,
        )

    @property
    def status(self) -> int:
        return self.header.status if self.header is not None else -1

    def message(self) -> str:
        if self.header is None or self.data is None or self.status in (Status.OK, Status.MISS):
            return ""
        return bytes(self.data).decode("utf-8", "replace")


def table_head_size(call: Call) -> int | None:
    """Bytes of a table response's count and records, when the request says how many records
    come back (a table call with ``sinks``: one per key); None when only the count can say."""
    record = call.table
    assert record is not None
    return None if call.sinks is None else COUNT.size + record.size * len(call.sinks)


def parse_records(call: Call, head: memoryview) -> int:
    """Fill ``call.records`` from the start of a table response (``head``: at least its count and
    records): the bytes they took. FrameError when the table does not match the request."""
    record = call.table
    assert record is not None
    if head.nbytes < COUNT.size:
        raise FrameError("response table shorter than its count")
    (count,) = COUNT.unpack_from(head)
    if call.sinks is not None and count != len(call.sinks):
        raise FrameError(f"response table of {count} records for {len(call.sinks)} requests")
    end: int = COUNT.size + record.size * int(count)
    if end > head.nbytes:
        raise FrameError("response table truncated")
    call.records = list(record.iter_unpack(head[COUNT.size : end]))
    return end


class OwnHit(NamedTuple):
    """An MGET hit with no caller buffer, to be received into a ``bytes`` object of its own:
    ``size`` bytes, whose view goes to ``datas[slot]`` (the call's ``sinks``)."""

    datas: list[memoryview | Parts | None]
    slot: int
    size: int


def hit_views(call: Call, left: int, own_from: int | None = None) -> list[memoryview | OwnHit]:
    """Where the bytes after an MGET table go (``call.records`` parsed; ``left`` of them), in
    order: each hit's caller buffer when it has one of the hit's size, else a piece of one
    fresh buffer shared by such hits — or, for a hit with no buffer of at least ``own_from``
    bytes, an :class:`OwnHit` (a connection that can receive straight into new ``bytes``:
    the caller then takes that object, with no shared buffer first and no copy after).
    ``call.sinks`` becomes what holds each record's bytes (None for a miss, for an OwnHit
    until it is received, and for a hit whose buffer has another size: it is dropped). Both
    transports receive straight into these views: the bytes are copied once, by the kernel.
    FrameError when the hits do not take exactly ``left`` bytes."""
    sinks = call.sinks
    assert sinks is not None
    assert call.table is MGET_RECORD
    own = own_from if own_from is not None else MAX_ALLOC_BYTES + 1
    expects = call.expects if call.expects is not None else [-1] * len(sinks)
    spill_bytes = own_bytes = total = 0
    for rec, sink, expected in zip(call.records, sinks, expects, strict=True):
        if rec[0] == Status.OK:
            if expected >= 0 and rec[3] != expected:
                raise FrameError(f"an MGET hit of {rec[3]} bytes for a block of {expected}")
            total += rec[3]
            if sink is None and rec[3] >= own:
                own_bytes += rec[3]
            elif sink is None or sink.nbytes != rec[3]:
                spill_bytes += rec[3]
    if total != left:
        raise FrameError(f"MGET data of {left} bytes for a table of {total}")
    if spill_bytes + own_bytes > MAX_ALLOC_BYTES:
        raise FrameError(
            f"MGET hits of {spill_bytes + own_bytes} bytes with no buffer to take them"
        )
    spill = memoryview(bytearray(spill_bytes)) if spill_bytes else None
    datas: list[memoryview | Parts | None] = []
    views: list[memoryview | OwnHit] = []
    ends = call.hit_ends = []
    call.digests = None
    pos = 0
    for rec, sink in zip(call.records, sinks, strict=True):
        if rec[0] != Status.OK:
            datas.append(None)
            continue
        n = rec[3]
        if sink is None and n >= own:
            ends.append(len(datas))
            views.append(OwnHit(datas, len(datas), n))
            datas.append(None)
            continue
        view: memoryview
        if sink is not None and sink.nbytes == n:
            if isinstance(sink, Parts):  # the caller's pieces, each filled in turn
                if sink.views:
                    ends.extend([-1] * (len(sink.views) - 1) + [len(datas)])
                    views.extend(sink.views)
                datas.append(sink)
                continue
            datas.append(sink)
            view = sink
        else:
            view = spill[pos : pos + n] if spill is not None else memoryview(b"")  # n == 0
            pos += n
            datas.append(view if sink is None else None)  # a wrong size is dropped
        if n:
            ends.append(len(datas) - 1)
            views.append(view)
    call.sinks = datas
    return views


def hash_landed(call: Call, slot: int) -> None:
    """Take the checksum of MGET hit ``slot``'s bytes now that they have all landed in
    ``call.sinks[slot]`` (the judge then compares it instead of hashing them again): hashed
    while they are still in the CPU's cache and, on a connection that receives in the caller's
    thread, while the node sends the next hits (overlapped, not after the whole answer)."""
    data = call.sinks[slot] if call.sinks is not None else None
    if data is None:
        return
    if call.digests is None:
        call.digests = [None] * len(call.sinks)  # type: ignore[arg-type]
    call.digests[slot] = block_checksum(data)


@overload
def table_rest(call: Call, head: memoryview, left: int) -> list[memoryview]: ...
@overload
def table_rest(
    call: Call, head: memoryview, left: int, own_from: int
) -> list[memoryview | OwnHit]: ...
def table_rest(
    call: Call, head: memoryview, left: int, own_from: int | None = None
) -> list[memoryview] | list[memoryview | OwnHit]:
    """After a table response's ``head`` (:func:`table_head_size` bytes): its records parsed,
    and the views for the ``left`` bytes that follow (MGET hits, :func:`hit_views`; no other
    table has any)."""
    parse_records(call, head)
    if call.table is MGET_RECORD and call.sinks is not None:
        return hit_views(call, left, own_from)
    call.hit_ends, call.digests = [], None
    if left:
        raise FrameError(f"{left} bytes after a response table")
    return []
