"""The index's data layouts: packed entry records, member records, lookup views, snapshots.

An entry is one ``bytes`` object per key (:data:`_RECORD`, then the replicas as little-endian
u32 member ids): 72 bytes with one replica, against about 280 for a tuple of Python ints. A
tier hint (common.proto ``Tier``, 0 = unknown) may follow as one last byte: the replica count
is ``(len - head) // 4``, so a record with the byte reads the same in a release that ignores it.

:class:`IndexSnapshot` and :func:`restore_snapshot_v1` are part of the durable snapshot format
(PySyncObj pickles the state by reference to them): never rename or move them.
"""

from __future__ import annotations

import pickle
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

STATE_FORMAT = 1
"""Version of :meth:`BlockIndex.export_state`'s layout (the Raft snapshot)."""
_SNAPSHOT_ZLIB_LEVEL = 1

_RECORD = struct.Struct("<QQQQ?")  # version, write_id, size_bytes, checksum, pinned
_RECORD_SIZE = _RECORD.size
RECORD_HEAD = _RECORD_SIZE
"""Where a record's replica ids start."""
_U32 = 4


@dataclass(frozen=True, slots=True)
class MemberRecord:
    """A store-node incarnation as the index knows it."""

    member_id: int
    node_id: str
    incarnation: int
    data_address: str
    admin_address: str
    capacity_bytes: int
    zone: str
    live: bool
    draining: bool = False  # live, readable, takes no new replica (a drain is moving it off)


class BlockView(NamedTuple):
    """One key's entry as a lookup returns it: live replicas only. (A named tuple: a Lookup
    builds one per key, and a frozen dataclass costs about a microsecond more each.)"""

    key: str
    version: int
    write_id: int
    size_bytes: int
    checksum: int
    replicas: tuple[int, ...]
    pinned: bool
    tier: int = 0  # the tier a replica last reported (common.proto Tier; 0 = unknown)


@dataclass(frozen=True, slots=True)
class IndexStatus:
    entries: int
    revision: int
    ring_version: int
    members: int
    live_members: int
    dedupe_entries: int


def pack_record(
    version: int,
    write_id: int,
    size_bytes: int,
    checksum: int,
    replicas: Sequence[int],
    *,
    pinned: bool = False,
    tier: int = 0,
) -> bytes:
    head = _RECORD.pack(version, write_id, size_bytes, checksum, pinned)
    tail = bytes([tier]) if tier else b""
    return head + struct.pack(f"<{len(replicas)}I", *replicas) + tail


def record_tier(record: bytes) -> int:
    """The record's tier hint (0 when it has none)."""
    return record[-1] if (len(record) - _RECORD_SIZE) % _U32 else 0


def with_tier(record: bytes, tier: int) -> bytes:
    """The record with its tier hint set to ``tier`` (0: removed)."""
    base = record[: len(record) - (len(record) - _RECORD_SIZE) % _U32]
    return base + bytes([tier]) if tier else base


_RECORDS_WITH = tuple(struct.Struct(_RECORD.format + "I" * n) for n in range(9))
"""A record with n replicas as one struct (n <= 8: one unpack call per lookup)."""


def unpack_record(record: bytes) -> tuple[int, int, int, int, bool, tuple[int, ...]]:
    """``(version, write_id, size_bytes, checksum, pinned, replicas)``."""
    n = (len(record) - _RECORD_SIZE) // _U32
    if n < len(_RECORDS_WITH):
        fields = _RECORDS_WITH[n].unpack_from(record)
        return fields[0], fields[1], fields[2], fields[3], fields[4], fields[5:]
    version, write_id, size_bytes, checksum, pinned = _RECORD.unpack_from(record)
    replicas = struct.unpack_from(f"<{n}I", record, _RECORD_SIZE)
    return version, write_id, size_bytes, checksum, pinned, replicas


_REPLICAS = tuple(struct.Struct("<" + "I" * n) for n in range(9))


def record_replicas(record: bytes) -> tuple[int, ...]:
    n = (len(record) - _RECORD_SIZE) // _U32
    if n < len(_REPLICAS):
        return _REPLICAS[n].unpack_from(record, _RECORD_SIZE)
    return struct.unpack_from(f"<{n}I", record, _RECORD_SIZE)


class IndexSnapshot:
    """The index state on its way into a Raft snapshot, pickled compactly.

    PySyncObj pickles snapshots with protocol 2, which writes every ``bytes`` object as a call
    that rebuilds it from a latin-1 string, then gzips at level 9: 27 s of child CPU and a
    36 MB file at 1 M entries. This wrapper pickles itself (in the forked child, where
    ``__reduce__`` runs) as one zlib-compressed protocol-5 pickle instead: about 3 s and 22 MB.
    :func:`restore_snapshot_v1` is part of the durable format: never rename it."""

    __slots__ = ("state",)

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        payload = zlib.compress(pickle.dumps(self.state, protocol=5), _SNAPSHOT_ZLIB_LEVEL)
        return restore_snapshot_v1, (payload,)


def restore_snapshot_v1(payload: bytes) -> dict[str, Any]:
    """Unpickling an :class:`IndexSnapshot` yields the state dict it wrapped."""
    state: dict[str, Any] = pickle.loads(zlib.decompress(payload))  # noqa: S301 - our own dump
    return state
