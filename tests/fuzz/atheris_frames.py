"""Coverage-guided fuzzing (atheris) of what parses bytes from a socket: the frame reader with a
handler that sizes sinks as a node does, the key tables, id lists, response tables and the RPC
port's protobuf requests. Any exception other than the parsers' own typed ones is a crash.

    python -m tests.fuzz.atheris_frames -runs=100000 -max_len=8192
"""

from __future__ import annotations

import contextlib
import sys

from google.protobuf.message import DecodeError

from kvpool.proto.wire import (
    MGET_RECORD,
    FrameError,
    Header,
    decode_ids,
    decode_key_table,
    read_table,
)
from kvpool.transports.frames import FrameReader

MAX_SINK = 1 << 20


class Sizing:
    """Sinks as a server gives them: exact size up to a limit, else the payload is skipped."""

    def __init__(self) -> None:
        self.frames = 0
        self.stopped = False

    def frame_sink(self, header: Header, key: bytes) -> memoryview | None:
        if header.payload_len <= MAX_SINK and header.op % 2:
            return memoryview(bytearray(header.payload_len))
        return None

    def frame_received(self, header: Header, key: bytes, payload: memoryview | None) -> None:
        self.frames += 1
        if payload is not None and len(payload) != header.payload_len:
            raise AssertionError("a payload of the wrong size was delivered")

    def version_mismatch(self, theirs: int) -> None:
        self.stopped = True

    def bad_frame(self, error: FrameError) -> None:
        self.stopped = True


def one_input(data: bytes) -> None:
    handler = Sizing()
    reader = FrameReader(handler, scratch_bytes=64 * 1024)
    step = (data[0] % 97 + 1) if data else 1
    for i in range(0, len(data), step):  # fed in pieces, as reads arrive
        if reader.stopped:
            break
        reader.feed(data[i : i + step])
        if reader.scratch_bytes > 64 * 1024:
            raise AssertionError("scratch grew past its limit")
    reader.release()
    for parse in (decode_key_table, decode_ids):
        with contextlib.suppress(FrameError):
            parse(data)
    with contextlib.suppress(FrameError):
        read_table(MGET_RECORD, data, data[0] if data else 0)
    from kvpool.raft_master.rpc_port import METHODS

    for request_type in METHODS.values():
        with contextlib.suppress(DecodeError):
            request_type.FromString(data)


def main() -> None:
    import atheris

    import kvpool.proto.wire
    import kvpool.transports.frames

    # Coverage of the parsers guides the search (they are imported already: instrument them).
    atheris.instrument_func(kvpool.transports.frames.FrameReader._parse)
    atheris.instrument_func(kvpool.transports.frames.FrameReader.get_buffer)
    atheris.instrument_func(kvpool.transports.frames.FrameReader.buffer_updated)
    for name in ("unpack_header", "check_prefix", "decode_key_table", "decode_ids", "read_table"):
        atheris.instrument_func(getattr(kvpool.proto.wire, name))
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
