"""A request frame and, once answered, its response: what the pure client logic hands a
connection (blocking or on an event loop) and reads back, so both speak through one type."""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvpool.proto.wire import COUNT, MGET_RECORD, FrameError, Header, Status


class Call:
    """One request and, once answered, its response (``header`` and ``data``)."""

    __slots__ = (
        "checksum",
        "data",
        "error",
        "flags",
        "header",
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
        payload: bytes | bytearray | memoryview = b"",
        sink: memoryview | None = None,
        table: struct.Struct | None = None,
        sinks: Sequence[memoryview | None] | None = None,
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
        self.request_id = 0
        self.header: Header | None = None
        self.data: memoryview | None = None  # the response payload (sink, table or message)
        self.records: list[tuple[int, ...]] = []  # table records, when ``table`` is set
        self.error: Exception | None = None  # this call's response could not be taken

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


def parse_table(call: Call, payload: memoryview) -> None:
    """Fill ``call.records`` from a whole table response (and, for MGET, each hit's bytes:
    copied into its sink when one of the right size was given, else a view of ``payload``).
    FrameError when the table does not match the request."""
    record = call.table
    assert record is not None
    if payload.nbytes < COUNT.size:
        raise FrameError("response table shorter than its count")
    (count,) = COUNT.unpack_from(payload)
    if call.sinks is not None and count != len(call.sinks):
        raise FrameError(f"response table of {count} records for {len(call.sinks)} requests")
    end = COUNT.size + record.size * count
    if end > payload.nbytes:
        raise FrameError("response table truncated")
    call.records = list(record.iter_unpack(payload[COUNT.size : end]))
    if record is not MGET_RECORD or call.sinks is None:
        return
    datas: list[memoryview | None] = []
    pos = end
    for rec, sink in zip(call.records, call.sinks, strict=True):
        if rec[0] != Status.OK:
            datas.append(None)
            continue
        size = rec[3]
        if pos + size > payload.nbytes:
            raise FrameError("MGET data shorter than its table")
        piece = payload[pos : pos + size]
        pos += size
        if sink is not None and sink.nbytes == size:
            sink[:] = piece
            datas.append(sink)
        elif sink is None:
            datas.append(piece)
        else:
            datas.append(None)
    if pos != payload.nbytes:
        raise FrameError(f"{payload.nbytes - pos} bytes after the MGET data")
    call.sinks = datas
