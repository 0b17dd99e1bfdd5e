"""The frame reader: pipelined frames, payloads in place, strangers refused."""

from __future__ import annotations

import random

import pytest

from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.wire import HEADER_SIZE, FrameError, Header, Op, unpack_header
from kvpool.transports.frames import DIRECT_THRESHOLD, FrameReader


class Recorder:
    def __init__(self, sinks: bool = True) -> None:
        self.frames: list[tuple[Header, bytes, bytes | None]] = []
        self.sinks = sinks
        self.mismatch: int | None = None
        self.error: FrameError | None = None

    def frame_sink(self, header: Header, key: bytes) -> memoryview | None:
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
