"""The frame reader: pipelined frames, payloads in place, strangers refused."""

from __future__ import annotations

import random
import struct

import pytest

from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.wire import HEADER_SIZE, FrameError, Header, Op, unpack_header
from kvpool.transports.frames import DIRECT_THRESHOLD, FrameReader, Scatter


class Recorder:
    def __init__(self, sinks: bool = True) -> None:
        self.frames: list[tuple[Header, bytes, bytes | None]] = []
        self.sinks = sinks
        self.mismatch: int | None = None
        self.error: FrameError | None = None

    def frame_sink(self, header: Header, key: bytes) -> memoryview | Scatter | None:
        return memoryview(bytearray(header.payload_len)) if self.sinks else None

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        self.frames.append((header, key, bytes(payload) if payload is not None else None))

    def version_mismatch(self, theirs: int) -> None:
        self.mismatch = theirs

    def bad_frame(self, error: FrameError) -> None:
        self.error = error


def frame(
    key: bytes, payload: bytes, request_id: int = 1, version: int = PROTOCOL_VERSION
) -> bytes:
    h = Header(
        op=Op.PUT,
        request_id=request_id,
        payload_len=len(payload),
        key_len=len(key),
        protocol_version=version,
    )
    return h.pack() + key + payload


def test_header_round_trips() -> None:
    h = Header(
        op=Op.GET,
        status=1,
        request_id=7,
        write_id=2**64 - 1,
        version=3,
        payload_len=9,
        checksum=12345,
        key_len=4,
        flags=2,
    )
    raw = h.pack()
    assert len(raw) == HEADER_SIZE
    assert unpack_header(raw) == h


@pytest.mark.parametrize("chunk", [1, 7, 56, 4096, 1 << 20])
def test_pipelined_frames_survive_any_chunking(chunk: int) -> None:
    rng = random.Random(chunk)
    sizes = [0, 1, 100, DIRECT_THRESHOLD - 1, DIRECT_THRESHOLD, 3 * DIRECT_THRESHOLD + 5, 1 << 20]
    frames = [(f"k{i}".encode(), rng.randbytes(n)) for i, n in enumerate(sizes)]
    stream = b"".join(frame(k, p, i + 1) for i, (k, p) in enumerate(frames))
    rec = Recorder()
    reader = FrameReader(rec, scratch_bytes=64 * 1024)
    for i in range(0, len(stream), chunk):
        reader.feed(stream[i : i + chunk])
    assert [(h.request_id, k, p) for h, k, p in rec.frames] == [
        (i + 1, k, p) for i, (k, p) in enumerate(frames)
    ]


def test_discarded_payloads_do_not_desynchronise() -> None:
    rec = Recorder(sinks=False)
    reader = FrameReader(rec, scratch_bytes=4096)
    reader.feed(frame(b"a", b"x" * 100_000, 1) + frame(b"b", b"y" * 10, 2))
    assert [(h.request_id, k, p) for h, k, p in rec.frames] == [(1, b"a", None), (2, b"b", None)]


def test_garbage_is_refused_as_a_bad_frame() -> None:
    rec = Recorder()
    reader = FrameReader(rec)
    reader.feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 100)
    assert rec.error is not None
    assert "bad magic" in str(rec.error)
    assert reader.stopped
    assert rec.frames == []


def test_other_protocol_version_is_reported_before_the_header_completes() -> None:
    rec = Recorder()
    reader = FrameReader(rec)
    reader.feed(frame(b"k", b"v", version=PROTOCOL_VERSION + 1)[:6])
    assert rec.mismatch == PROTOCOL_VERSION + 1


class ScatterRecorder(Recorder):
    """Every frame's payload is a little table — two sizes — then two parts of those sizes:
    the table goes into a piece of its own, each part into a buffer named after the table."""

    def __init__(self, honest: bool = True) -> None:
        super().__init__()
        self.parts: list[list[bytes]] = []
        self._bufs: list[memoryview] = []
        self.honest = honest

    def frame_sink(self, header: Header, key: bytes) -> memoryview | Scatter | None:
        head = memoryview(bytearray(8))

        def rest(left: int) -> list[memoryview]:
            a, b = struct.unpack("<II", head)
            if self.honest and a + b != left:
                raise FrameError("parts and table disagree")
            self._bufs = [memoryview(bytearray(a)), memoryview(bytearray(b))]
            return list(self._bufs)

        return Scatter(head, rest)

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        super().frame_received(header, key, payload)
        self.parts.append([bytes(b) for b in self._bufs])


@pytest.mark.parametrize("chunk", [1, 7, 56, 4096, 1 << 20])
def test_a_scattered_payload_lands_in_the_pieces_its_table_names(chunk: int) -> None:
    rng = random.Random(chunk)
    pairs = [(0, 0), (1, 0), (0, 5), (100, 3), (DIRECT_THRESHOLD, 1), (2, 3 * DIRECT_THRESHOLD)]
    parts = [(rng.randbytes(a), rng.randbytes(b)) for a, b in pairs]
    stream = b"".join(
        frame(f"k{i}".encode(), struct.pack("<II", len(x), len(y)) + x + y, i + 1)
        for i, (x, y) in enumerate(parts)
    )
    rec = ScatterRecorder()
    reader = FrameReader(rec, scratch_bytes=64 * 1024)
    for i in range(0, len(stream), chunk):
        reader.feed(stream[i : i + chunk])
    assert rec.error is None
    assert rec.parts == [[x, y] for x, y in parts]
    # what frame_received gets is the first piece: the table
    assert [p for _, _, p in rec.frames] == [struct.pack("<II", *p) for p in pairs]


@pytest.mark.parametrize(
    ("table", "body"),
    [
        ((1, 1), b"abc"),  # one byte more than the table names
        ((2, 2), b"abc"),  # one byte fewer
        ((0, 0), b""),  # fine: a payload of its table alone
    ],
)
def test_a_payload_that_disagrees_with_its_table_stops_the_reader(
    table: tuple[int, int], body: bytes
) -> None:
    rec = ScatterRecorder(honest=False)
    reader = FrameReader(rec)
    reader.feed(frame(b"k", struct.pack("<II", *table) + body) + frame(b"k2", bytes(8), 2))
    if sum(table) == len(body):
        assert rec.error is None
        assert len(rec.frames) == 2
    else:
        assert isinstance(rec.error, FrameError)
        assert reader.stopped
        assert rec.frames == []  # neither the bad frame nor the one after it


def test_a_first_piece_longer_than_the_payload_is_refused() -> None:
    rec = ScatterRecorder()
    reader = FrameReader(rec)
    reader.feed(frame(b"k", b"1234"))  # shorter than the 8-byte table piece
    assert isinstance(rec.error, FrameError)
    assert rec.frames == []
