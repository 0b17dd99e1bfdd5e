"""Values that name their writer, so that any byte read can be traced to the put that wrote it.

A value is a fixed header followed by a deterministic fill::

    magic    4 bytes   b"KVcv"
    key      8 bytes   xxh3-64 of the key's UTF-8 bytes (little endian)
    writer   4 bytes   signed: a workload process id, or a negative id for a computed value
    seq      8 bytes   the writer's sequence number for this value
    size     4 bytes   the whole value's length in bytes, header included
    fill     size - 28 bytes from a PRNG seeded by (key hash, writer, seq)

:func:`decode_value` answers the :class:`ValueId` only when the header names *this* key and every
byte equals what :func:`make_value` would produce for it; anything else is a
:class:`Corruption` with a reason: another key's bytes, a short or long read, a torn or mixed
value, a flipped byte. Pure functions, no I/O.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = b"KVcv"
_HEADER = struct.Struct("<4sQiQI")
HEADER_BYTES = _HEADER.size
"""The smallest value: a header with no fill (28 bytes)."""
MAX_VALUE_BYTES = (1 << 32) - 1
"""The size field is 32 bits."""

# Corruption reasons, strongest evidence first.
TOO_SHORT = "too_short"
BAD_MAGIC = "bad_magic"
WRONG_KEY = "wrong_key"
WRONG_SIZE = "wrong_size"
BAD_BYTES = "bad_bytes"
REASONS: tuple[str, ...] = (TOO_SHORT, BAD_MAGIC, WRONG_KEY, WRONG_SIZE, BAD_BYTES)


@dataclass(frozen=True, slots=True, order=True)
class ValueId:
    """Who wrote a value: ``writer`` (a workload process id; negative for a value that
    ``get_or_compute`` computed) and that writer's sequence number ``seq``."""

    writer: int
    seq: int

    @property
    def computed(self) -> bool:
        return self.writer < 0

    def to_json(self) -> list[int]:
        return [self.writer, self.seq]

    @classmethod
    def from_json(cls, raw: object) -> ValueId:
        if not isinstance(raw, list | tuple) or len(raw) != 2:
            raise ValueError(f"a value id is [writer, seq], not {raw!r}")
        return cls(int(raw[0]), int(raw[1]))

    def __str__(self) -> str:
        return f"{self.writer}:{self.seq}"


@dataclass(frozen=True, slots=True)
class Corruption:
    """Bytes that are not exactly one value of this key. ``reason`` is one of :data:`REASONS`;
    ``claimed`` is the id the header names when the header could be parsed, ``key_hash`` the
    key hash it names (another key's, for :data:`WRONG_KEY`)."""

    reason: str
    detail: str
    claimed: ValueId | None = None
    key_hash: int | None = None

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


def computed_writer(process_id: int) -> int:
    """The writer id of values ``get_or_compute`` computes in workload process ``process_id``
    (negative, so never a putting process's id)."""
    return -(process_id + 1)


CONTENT_WRITER = (1 << 31) - 1
"""The writer id of every value of a content-named key (``--content-keys``): each key has one
value, whoever writes it, as a key of kvpool's scheme has."""


def key_hash(key: str) -> int:
    """xxh3-64 of the key's UTF-8 bytes."""
    return int(xxhash.xxh3_64_intdigest(key.encode("utf-8")))


def _fill(khash: int, writer: int, seq: int, n: int) -> bytes:
    seed = xxhash.xxh3_64_intdigest(struct.pack("<QqQ", khash, writer, seq))
    return np.random.Generator(np.random.PCG64(seed)).bytes(n)


def make_value(key: str, writer: int, seq: int, size: int) -> bytes:
    """The value ``writer`` writes as its ``seq``-th value of ``key``: ``size`` bytes
    (at least :data:`HEADER_BYTES`, at most :data:`MAX_VALUE_BYTES`)."""
    if not HEADER_BYTES <= size <= MAX_VALUE_BYTES:
        raise ValueError(f"a value is {HEADER_BYTES}..{MAX_VALUE_BYTES} bytes, not {size}")
    if not -(1 << 31) <= writer < (1 << 31) or not 0 <= seq < (1 << 64):
        raise ValueError(f"writer {writer} or seq {seq} out of range")
    khash = key_hash(key)
    header = _HEADER.pack(MAGIC, khash, writer, seq, size)
    return header + _fill(khash, writer, seq, size - HEADER_BYTES)


def decode_value(key: str, data: bytes | bytearray | memoryview) -> ValueId | Corruption:
    """The id of the value ``data`` is, if it is exactly one value of ``key``; else why not."""
    view = memoryview(data).cast("B")
    n = view.nbytes
    if n < HEADER_BYTES:
        return Corruption(TOO_SHORT, f"{n} bytes, shorter than a value header ({HEADER_BYTES})")
    magic, khash, writer, seq, size = _HEADER.unpack_from(view)
    if magic != MAGIC:
        return Corruption(BAD_MAGIC, f"header starts {bytes(magic)!r}, not {MAGIC!r}")
    claimed = ValueId(writer, seq)
    expected_hash = key_hash(key)
    if khash != expected_hash:
        return Corruption(
            WRONG_KEY,
            f"value {claimed} names key hash {khash:#018x}, this key's is {expected_hash:#018x}",
            claimed,
            khash,
        )
    if size != n:
        return Corruption(
            WRONG_SIZE, f"value {claimed} says {size} bytes, {n} were read", claimed, khash
        )
    fill = view[HEADER_BYTES:]
    expected = _fill(khash, writer, seq, n - HEADER_BYTES)
    if fill != expected:
        got = np.frombuffer(fill, dtype=np.uint8)
        want = np.frombuffer(expected, dtype=np.uint8)
        differ = np.flatnonzero(got != want)
        first = int(differ[0]) + HEADER_BYTES
        last = int(differ[-1]) + HEADER_BYTES
        return Corruption(
            BAD_BYTES,
            f"value {claimed}: {differ.size} of {n} bytes differ, offsets {first}..{last}",
            claimed,
            khash,
        )
    return claimed


@dataclass(frozen=True, slots=True)
class SizeDistribution:
    """Value sizes, log-uniform between ``min_bytes`` and ``max_bytes`` (many small values,
    some large ones: with the defaults the median is about 6 KiB)."""

    min_bytes: int = HEADER_BYTES
    max_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not HEADER_BYTES <= self.min_bytes <= self.max_bytes <= MAX_VALUE_BYTES:
            raise ValueError(
                f"value sizes must satisfy {HEADER_BYTES} <= min ({self.min_bytes}) "
                f"<= max ({self.max_bytes}) <= {MAX_VALUE_BYTES}"
            )

    def draw(self, rng: random.Random) -> int:
        if self.min_bytes == self.max_bytes:
            return self.min_bytes
        low, high = math.log(self.min_bytes), math.log(self.max_bytes + 1)
        return min(self.max_bytes, max(self.min_bytes, int(math.exp(rng.uniform(low, high)))))
