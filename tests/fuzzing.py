"""The fuzz suite's strategies and the attacks it sends to every port (issue 16).

Hypothesis strategies over the data-plane frame header and each message kvpool speaks (every
:class:`~kvpool.proto.wire.Op`, the key tables, the RPC port's protobuf requests, AUTH), turned
into the inputs an attacker sends: random bytes, valid frames truncated, oversized (declared
lengths past every limit) and bit-flipped. :func:`send` pushes one input to one port of a
running cluster and never raises for what the server does with it. Used by the unit fuzz
tests (pure: the frame reader and the decoders), the integration fuzz test (every port of a
real cluster) and ``scripts/hostile_probe.py``.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from hypothesis import strategies as st

from kvpool.proto.v1 import master_pb2
from kvpool.proto.wire import (
    EXT_TRACED,
    MAX_KEY_BYTES,
    MAX_TABLE_KEYS,
    TRACE_CONTEXT_SIZE,
    Header,
    Op,
    encode_ids,
    encode_key_table,
)

U64 = 2**64 - 1
# Lengths at and around every limit a server applies, and the absurd ones.
INTERESTING_SIZES = [
    0, 1, 55, 56, 57, 1023, 1024, 1025, 4096, 65535, 65536, 65537, 1 << 20, (16 << 20) + 1,
    (32 << 20) + 1, (64 << 20) + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**40, 2**63, U64,
]  # fmt: skip
ANY_SIZE = st.one_of(st.sampled_from(INTERESTING_SIZES), st.integers(0, U64))
ANY_OP = st.one_of(st.sampled_from(list(Op)), st.integers(0, 255))
KEYS = st.one_of(
    st.binary(min_size=0, max_size=64),
    st.text(min_size=1, max_size=40).map(lambda t: t.encode("utf-8")),
    st.just(b"k" * MAX_KEY_BYTES),
)
RPC_METHODS = ["Lookup", "CommitPuts", "GetMembers", "PrefixMatch", "Remove", "RegisterNode", ""]


@st.composite
def headers(draw: st.DrawFn) -> Header:
    """Any header: every field from its whole range, with the interesting values favoured."""
    ext = draw(st.sampled_from([0, 0, 0, EXT_TRACED, draw(st.integers(0, 2**32 - 1))]))
    return Header(
        op=draw(ANY_OP),
        status=draw(st.integers(0, 255)),
        request_id=draw(st.integers(0, U64)),
        write_id=draw(st.one_of(st.just(0), st.integers(1, U64))),
        version=draw(st.one_of(st.just(U64), st.integers(0, U64))),
        payload_len=draw(ANY_SIZE),
        checksum=draw(st.integers(0, U64)),
        key_len=draw(
            st.one_of(st.integers(0, MAX_KEY_BYTES + TRACE_CONTEXT_SIZE + 1), st.integers(0, 65535))
        ),
        flags=draw(st.integers(0, 65535)),
        protocol_version=draw(st.sampled_from([1, 1, 1, 0, 2, 65535])),
        ext=ext,
    )


@st.composite
def tables(draw: st.DrawFn) -> bytes:
    """A key table (MGET, SHM_GET, SHM_RESERVE), well-formed or not."""
    records = draw(
        st.lists(st.tuples(KEYS, st.integers(0, U64), ANY_SIZE, st.integers(0, U64)), max_size=8)
    )
    raw = encode_key_table(records)
    kind = draw(st.sampled_from(["ok", "count", "cut"]))
    if kind == "count":  # a count that lies
        return (
            struct.pack("<I", draw(st.sampled_from([MAX_TABLE_KEYS + 1, 2**32 - 1, 3]))) + raw[4:]
        )
    if kind == "cut":
        return raw[: draw(st.integers(0, len(raw)))]
    return raw


@st.composite
def rpc_payloads(draw: st.DrawFn) -> bytes:
    """A protobuf request of the RPC port, well-formed, or random bytes."""
    kind = draw(st.sampled_from(["lookup", "commit", "prefix", "remove", "random"]))
    keys = draw(st.lists(st.text(max_size=20), max_size=5))
    if kind == "lookup":
        return master_pb2.LookupRequest(
            keys=keys, min_revision=draw(st.integers(0, U64))
        ).SerializeToString()
    if kind == "prefix":
        return master_pb2.PrefixMatchRequest(keys=keys).SerializeToString()
    if kind == "remove":
        return master_pb2.RemoveRequest(
            request_id=draw(st.binary(max_size=20)), keys=keys
        ).SerializeToString()
    if kind == "commit":
        request = master_pb2.CommitPutsRequest(request_id=draw(st.binary(max_size=20)))
        for key in keys:
            request.entries.add(
                key=key,
                write_id=draw(st.integers(0, U64)),
                size_bytes=draw(ANY_SIZE),
                checksum=draw(st.integers(0, U64)),
                replicas=draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)),
            )
        return request.SerializeToString()
    return draw(st.binary(max_size=256))


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    """One message of each kind kvpool speaks, framed as a client would (header, key, payload)."""
    op = draw(st.sampled_from(list(Op)))
    key = draw(KEYS)
    payload = b""
    if op in (Op.MGET, Op.SHM_GET, Op.SHM_RESERVE):
        payload = draw(tables())
    elif op in (Op.SHM_RELEASE, Op.SHM_COMMIT):
        payload = encode_ids(draw(st.lists(st.integers(0, U64), max_size=8)))
    elif op is Op.RPC:
        key = draw(st.sampled_from(RPC_METHODS)).encode()
        payload = draw(rpc_payloads())
    elif op in (Op.PUT, Op.AUTH):
        payload = draw(st.binary(max_size=512))
    header = Header(
        op=op,
        request_id=draw(st.integers(0, U64)),
        write_id=draw(st.integers(0, U64)),
        version=draw(st.integers(0, U64)),
        payload_len=len(payload),
        checksum=draw(st.integers(0, U64)),
        key_len=len(key),
        flags=draw(st.sampled_from([0, 1, 2, 3, 4, 65535])),
    )
    return header.pack() + key + payload


def _flip(data: bytes, positions: list[int]) -> bytes:
    if not data:
        return data
    out = bytearray(data)
    for p in positions:
        out[p % len(out)] ^= 1 << (p % 8)
    return bytes(out)


@st.composite
def hostile(draw: st.DrawFn) -> bytes:
    """What an attacker sends: random bytes, valid messages truncated, bit-flipped, with a
    header declaring lengths past every limit, or several messages back to back."""
    kind = draw(st.sampled_from(["random", "message", "truncated", "flipped", "oversized", "many"]))
    if kind == "random":
        return draw(st.binary(min_size=1, max_size=2048))
    if kind == "oversized":
        header = draw(headers())
        return header.pack() + draw(st.binary(max_size=256))
    if kind == "many":
        return b"".join(draw(st.lists(messages(), min_size=2, max_size=6)))
    data = draw(messages())
    if kind == "truncated":
        return data[: draw(st.integers(1, max(1, len(data) - 1)))]
    if kind == "flipped":
        return _flip(data, draw(st.lists(st.integers(0, 8 * len(data)), min_size=1, max_size=4)))
    return data


@st.composite
def raft_hostile(draw: st.DrawFn) -> bytes:
    """What an attacker sends a Raft port: PySyncObj's 4-byte length, and anything after it."""
    length = draw(st.one_of(st.sampled_from([-1, 0, 1, 150, 65536, 65537, 2**31 - 1]),
                            st.integers(-(2**31), 2**31 - 1)))  # fmt: skip
    return struct.pack("i", length) + draw(st.binary(max_size=1024))


@dataclass
class Port:
    """One listening port of a cluster process: where, and how to reach it."""

    name: str  # e.g. "node-1 data"
    family: int
    address: tuple[str, int] | str  # (host, port), or an abstract unix name
    pid: int
    handshake: Callable[[socket.socket], None] | None = None


def send(port: Port, data: bytes, *, linger_s: float = 0.05) -> None:
    """Connect, send ``data`` (as much as the server takes), read a little, close. Never raises
    for what the server does (closing, refusing, answering)."""
    with contextlib.suppress(OSError):
        sock = socket.socket(port.family, socket.SOCK_STREAM)
        try:
            sock.settimeout(1.0)
            target = ("\0" + port.address) if isinstance(port.address, str) else port.address
            sock.connect(target)
            if port.handshake is not None:
                port.handshake(sock)
            sock.settimeout(0.2)
            with contextlib.suppress(OSError):
                sock.sendall(data)
            sock.settimeout(linger_s)
            with contextlib.suppress(OSError):
                sock.recv(65536)
        finally:
            sock.close()


def shm_handshake(sock: socket.socket) -> None:
    """Take the node's preamble and arena fd (and close the fd at once)."""
    import os

    with contextlib.suppress(OSError):
        _, fds, _, _ = socket.recv_fds(sock, 64, 4)
        for fd in fds:
            os.close(fd)
