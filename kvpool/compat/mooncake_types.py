"""Mooncake Store's return codes, ``ReplicateConfig`` and ``BufferHandle``, for
:mod:`kvpool.compat.mooncake`.

The codes are Mooncake's ``ErrorCode`` values (``mooncake-store/include/types.h`` at the
Mooncake commit named in docs/mooncake.md), so an engine's checks (``== 0``, ``< 0``, a specific
code) read the same on kvpool.
"""

from __future__ import annotations

import ctypes
import enum

from kvpool.errors import (
    BlockMissError,
    BufferTooSmallError,
    ChecksumMismatchError,
    DeadlineExceededError,
    IndexFullError,
    InvalidArgumentError,
    InvalidKeyError,
    KVPoolError,
    NoNodesError,
    NoSpaceError,
    NotLeaderError,
    UnavailableError,
)

OK = 0
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200
INVALID_KEY = -400
INVALID_PARAMS = -600
INVALID_READ = -701
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
TRANSFER_FAIL = -800
CHECKSUM_MISMATCH = -801
RPC_FAIL = -900
RPC_TIMEOUT = -901
NOT_SUPPORTED = -1012

# health_check() answers.
HC_HEALTHY = 0
HC_NOT_INITIALIZED = 1
HC_MASTER_UNREACHABLE = 2

DEFAULT_GLOBAL_SEGMENT_SIZE = 16 << 20
DEFAULT_LOCAL_BUFFER_SIZE = 16 << 20
DEFAULT_MASTER_SERVER_ADDR = "127.0.0.1:50051"
DEFAULT_CLIENT_HTTP_PORT = 9300
DEFAULT_TENANT_ID = "default"


def error_code(error: KVPoolError) -> int:
    """The Mooncake ErrorCode for a kvpool error."""
    if isinstance(error, BufferTooSmallError):
        return BUFFER_OVERFLOW
    if isinstance(error, InvalidKeyError):
        return INVALID_KEY
    if isinstance(error, InvalidArgumentError):
        return INVALID_PARAMS
    if isinstance(error, BlockMissError):
        return OBJECT_NOT_FOUND
    if isinstance(error, NoSpaceError | NoNodesError | IndexFullError):
        return NO_AVAILABLE_HANDLE
    if isinstance(error, ChecksumMismatchError):
        return CHECKSUM_MISMATCH
    if isinstance(error, DeadlineExceededError):
        return RPC_TIMEOUT
    if isinstance(error, UnavailableError | NotLeaderError):
        return RPC_FAIL
    return INTERNAL_ERROR


class ReplicaStatus(enum.IntEnum):
    """Mooncake's ``ReplicaStatus``. Every replica kvpool's index names is COMPLETE: a write
    enters the index only once its bytes are staged on its nodes."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class Descriptor:
    """Mooncake's buffer ``Descriptor``: ``size``, ``buffer_address`` and
    ``transport_endpoint``. On kvpool the endpoint is the store node's data address and the
    address is 0: a node's memory is not addressable by clients (no one-sided reads)."""

    def __init__(
        self, size: int = 0, buffer_address: int = 0, transport_endpoint: str = ""
    ) -> None:
        self.size = size
        self.buffer_address = buffer_address
        self.transport_endpoint = transport_endpoint

    def __repr__(self) -> str:
        return (
            f"<Descriptor size={self.size} buffer_address={self.buffer_address} "
            f"transport_endpoint={self.transport_endpoint}>"
        )


class MemoryDescriptor:
    """A memory replica's ``buffer_descriptor``."""

    def __init__(self, buffer_descriptor: Descriptor) -> None:
        self.buffer_descriptor = buffer_descriptor


class DiskDescriptor:
    """A disk replica's ``file_path`` ("" on kvpool: the node's SSD tier names no file to
    clients) and ``object_size``."""

    def __init__(self, file_path: str = "", object_size: int = 0) -> None:
        self.file_path = file_path
        self.object_size = object_size


class ReplicaDescriptor:
    """One replica as ``get_replica_desc`` answers it: a memory replica when the node last
    reported the block in its GPU or CPU tier, a disk replica when on its SSD tier."""

    def __init__(self, size: int, endpoint: str, on_disk: bool) -> None:
        self.status = ReplicaStatus.COMPLETE
        self._size = size
        self._endpoint = endpoint
        self._on_disk = on_disk

    def is_memory_replica(self) -> bool:
        return not self._on_disk

    def is_disk_replica(self) -> bool:
        return self._on_disk

    def is_local_disk_replica(self) -> bool:
        return False  # kvpool's SSD tier belongs to a store node, never to a client

    def get_memory_descriptor(self) -> MemoryDescriptor:
        if self._on_disk:
            raise TypeError(
                "a disk replica has no memory descriptor (is_memory_replica() is False)"
            )
        return MemoryDescriptor(Descriptor(self._size, 0, self._endpoint))

    def get_disk_descriptor(self) -> DiskDescriptor:
        if not self._on_disk:
            raise TypeError("a memory replica has no disk descriptor (is_disk_replica() is False)")
        return DiskDescriptor("", self._size)

    def __repr__(self) -> str:
        kind = "disk" if self._on_disk else "memory"
        return f"<ReplicaDescriptor {kind} size={self._size} endpoint={self._endpoint}>"


class ReplicateConfig:
    """Mooncake's per-put replication settings. kvpool honours ``replica_num``; the other
    fields are accepted and have no kvpool meaning (see docs/mooncake.md)."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_ttl_ms = 0
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.group_ids: list[str] = []
        self.session_ids: list[str] = []

    def __repr__(self) -> str:
        return f"ReplicateConfig(replica_num={self.replica_num})"

    __str__ = __repr__


class BufferHandle(bytearray):
    """An object read by ``get_buffer`` / ``batch_get_buffer``: the buffer protocol (writable,
    1-D bytes), ``ptr()`` (its address), ``size()`` and ``len()``, as Mooncake's. Its memory
    stays where it is while the handle lives (it cannot be resized)."""

    __slots__ = ("_pin",)

    def __init__(self, size: int) -> None:
        super().__init__(size)
        # An exported view keeps the bytearray from reallocating, so ptr() stays valid.
        self._pin = (ctypes.c_char * size).from_buffer(self) if size else None

    def ptr(self) -> int:
        return ctypes.addressof(self._pin) if self._pin is not None else 0

    def size(self) -> int:
        return len(self)

    def __repr__(self) -> str:
        return f"<BufferHandle size={len(self)}>"
