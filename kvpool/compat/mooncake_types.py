"""Mooncake Store's return codes, ``ReplicateConfig`` and ``BufferHandle``, for
:mod:`kvpool.compat.mooncake`.

The codes are Mooncake's ``ErrorCode`` values (``mooncake-store/include/types.h`` at the
Mooncake commit named in docs/mooncake.md), so an engine's checks (``== 0``, ``< 0``, a specific
code) read the same on kvpool.
"""

from __future__ import annotations

import ctypes

from kvpool.errors import (
    BlockMissError,
    BufferTooSmallError,
    ChecksumMismatchError,
    DeadlineExceededError,
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
    if isinstance(error, NoSpaceError | NoNodesError):
        return NO_AVAILABLE_HANDLE
    if isinstance(error, ChecksumMismatchError):
        return CHECKSUM_MISMATCH
    if isinstance(error, DeadlineExceededError):
        return RPC_TIMEOUT
    if isinstance(error, UnavailableError | NotLeaderError):
        return RPC_FAIL
    return INTERNAL_ERROR


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
