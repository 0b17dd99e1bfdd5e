"""Mooncake Store's Python API over a kvpool cluster: ``MooncakeDistributedStore``.

    from kvpool.compat.mooncake import MooncakeDistributedStore   # was: from mooncake.store ...

    store = MooncakeDistributedStore()
    store.setup("localhost", "P2PHANDSHAKE", 512 << 20, 128 << 20, "tcp", "",
                "10.0.0.1:7300,10.0.0.2:7300,10.0.0.3:7300")     # kvpool masters
    store.put("key", b"value")          # 0, or a negative Mooncake error code
    store.get("key")                    # the bytes, or b"" when missing

The method names, arguments and return conventions are Mooncake Store's (``put`` → 0 or a
negative ``ErrorCode``, ``get`` → ``b""`` when missing, ``is_exist`` → 1/0/-1, ``get_into`` →
bytes read or negative…), so a connector written for Mooncake Store can point at a kvpool
cluster by changing its import. ``docs/mooncake.md`` has the table of what maps to what and
where the two differ. Every call finishes within ``timeout_s``; none raises because the store
failed (a failure is a negative code, an empty value or -1, as in Mooncake).

Zero-copy calls take raw addresses, as Mooncake's do. Mooncake says an unregistered address is
undefined behaviour; here an address range that is not inside a buffer given to
:meth:`register_buffer` is refused with ``INVALID_PARAMS`` before any memory is touched.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

from kvpool.client.sync import Client
from kvpool.client.tensors import BlockFormatError, decode_tensor, encode_tensor
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
from kvpool.logs import get_logger

# Mooncake Store's ErrorCode values (mooncake-store/include/types.h).
OK = 0
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
NO_AVAILABLE_HANDLE = -200
INVALID_KEY = -400
INVALID_PARAMS = -600
INVALID_READ = -701
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
RPC_FAIL = -900

DEFAULT_GLOBAL_SEGMENT_SIZE = 16 << 20
DEFAULT_LOCAL_BUFFER_SIZE = 1 << 30


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
        return INVALID_READ
    if isinstance(error, DeadlineExceededError | UnavailableError | NotLeaderError):
        return RPC_FAIL
    return INTERNAL_ERROR


def _is_int(value: object) -> bool:
    """Callers pass addresses from ctypes, numpy or torch: refuse anything else early."""
    return isinstance(value, int) and not isinstance(value, bool)


class ReplicateConfig:
    """Mooncake's per-put replication settings. kvpool honours ``replica_num``; the pins and
    segment preferences are accepted and ignored (see docs/mooncake.md)."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.prefer_alloc_in_same_node = False

    def __repr__(self) -> str:
        return f"ReplicateConfig(replica_num={self.replica_num})"


class MooncakeDistributedStore:
    """Mooncake Store's ``MooncakeDistributedStore`` on kvpool; see the module doc."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[int, Client] = {}
        self._masters: list[str] = []
        self._timeout_s = 2.0
        self._hostname = ""
        self._regions: dict[int, int] = {}
        self._written: set[str] = set()
        self._log = get_logger("kvpool.compat.mooncake")

    # --- life cycle -------------------------------------------------------------------------

    def setup(  # noqa: PLR0917 - Mooncake's positional signature
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE,
        local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = "127.0.0.1:7300",
        *,
        timeout_s: float = 2.0,
    ) -> int:
        """Connect to the kvpool masters named by ``master_server_addr`` (comma-separated
        host:port). ``metadata_server``, the segment and buffer sizes and ``rdma_devices`` have
        no kvpool meaning and are ignored; ``protocol`` "rdma" runs over TCP. 0 once a master
        answered; ``RPC_FAIL`` when none did, ``INVALID_PARAMS`` for bad addresses."""
        if protocol not in ("tcp", "rdma"):
            return INVALID_PARAMS
        if protocol == "rdma":
            self._log.warning("mooncake_rdma_over_tcp", devices=rdma_devices)
        masters = [m.strip() for m in str(master_server_addr).split(",") if m.strip()]
        try:
            client = Client(masters, timeout_s=timeout_s, strict=True)
        except KVPoolError as e:
            return error_code(e)
        try:
            client.exists("kvpool/compat/mooncake/setup-probe")
        except KVPoolError as e:
            client.close()
            return error_code(e)
        self.close()
        with self._lock:
            self._masters, self._timeout_s, self._hostname = masters, timeout_s, local_hostname
            self._clients = {1: client}
        return OK

    def get_hostname(self) -> str:
        return self._hostname

    def close(self) -> int:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
        return OK

    def _client(self, config: ReplicateConfig | None = None) -> Client:
        replicas = max(1, int(getattr(config, "replica_num", 1) or 1))
        with self._lock:
            if not self._clients:
                raise UnavailableError("setup() has not succeeded (or close() was called)")
            client = self._clients.get(replicas)
            if client is None:
                client = Client(
                    self._masters, timeout_s=self._timeout_s, replicas=replicas, strict=True
                )
                self._clients[replicas] = client
            return client

    # --- bytes ------------------------------------------------------------------------------

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes-like) under ``key``: 0 or a negative error code. An existing
        key is replaced (Mooncake answers OBJECT_ALREADY_EXISTS in some versions)."""
        try:
            self._client(config).put(key, value)
        except KVPoolError as e:
            return error_code(e)
        self._written.add(key)
        return OK

    upsert = put

    def put_batch(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None
    ) -> int:
        """Store many values with one commit: 0 when all were stored, else a negative code."""
        if len(keys) != len(values):
            return INVALID_PARAMS
        codes = self._put_many(keys, values, config)
        return next((c for c in codes if c != OK), OK)

    upsert_batch = put_batch

    def _put_many(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None
    ) -> list[int]:
        try:
            done = self._client(config).batch_put(list(zip(keys, values, strict=True)))
        except KVPoolError as e:
            return [error_code(e)] * len(keys)
        self._written.update(k for k, ok in zip(keys, done, strict=True) if ok)
        return [OK if ok else TRANSFER_FAIL for ok in done]

    def get(self, key: str) -> bytes:
        """The bytes stored under ``key``; ``b""`` when missing or on failure."""
        try:
            return self._client().get(key) or b""
        except KVPoolError:
            return b""

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """Each key's bytes (``b""`` where missing), one lookup for all."""
        try:
            found = self._client().batch_get(list(keys))
        except KVPoolError:
            return [b""] * len(keys)
        return [data or b"" for data in found]

    # --- existence, size, removal ---------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 when the key exists, 0 when not, -1 on error."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1/0/-1 per key, one lookup for all."""
        try:
            sizes = self._client().sizes(list(keys))
        except KVPoolError:
            return [-1] * len(keys)
        return [0 if size is None else 1 for size in sizes]

    def get_size(self, key: str) -> int:
        """The object's size in bytes, or a negative code (OBJECT_NOT_FOUND when missing)."""
        try:
            (size,) = self._client().sizes([key])
        except KVPoolError as e:
            return error_code(e)
        return OBJECT_NOT_FOUND if size is None else size

    def remove(self, key: str) -> int:
        """0 when removed, OBJECT_NOT_FOUND when there was no such key, else a negative code."""
        try:
            removed = self._client().remove(key)
        except KVPoolError as e:
            return error_code(e)
        self._written.discard(key)
        return OK if removed else OBJECT_NOT_FOUND

    def remove_all(self) -> int:
        """Remove every key put through this store object (kvpool has no cluster-wide listing):
        the number removed, or -1 on error."""
        removed = 0
        for key in sorted(self._written):
            code = self.remove(key)
            if code == OK:
                removed += 1
            elif code != OBJECT_NOT_FOUND:
                return -1
        return removed

    # --- zero-copy --------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Allow ``put_from``/``get_into`` on ``[buffer_ptr, buffer_ptr + size)``: 0."""
        if not _is_int(buffer_ptr) or not _is_int(size) or buffer_ptr <= 0 or size <= 0:
            return INVALID_PARAMS
        with self._lock:
            self._regions[buffer_ptr] = max(size, self._regions.get(buffer_ptr, 0))
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        with self._lock:
            return OK if self._regions.pop(buffer_ptr, None) is not None else INVALID_PARAMS

    def _view(self, buffer_ptr: int, size: int) -> memoryview | None:
        """A writable view of registered memory, or None when the range is not registered."""
        if not _is_int(buffer_ptr) or not _is_int(size) or size < 0:
            return None
        with self._lock:
            inside = any(
                start <= buffer_ptr and buffer_ptr + size <= start + length
                for start, length in self._regions.items()
            )
        if not inside:
            return None
        return memoryview((ctypes.c_char * size).from_address(buffer_ptr)).cast("B")

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        """Store ``size`` bytes at ``buffer_ptr`` (registered memory): 0 or a negative code."""
        view = self._view(buffer_ptr, size)
        return INVALID_PARAMS if view is None else self.put(key, view, config)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read the object into registered memory: the bytes read, or a negative code
        (OBJECT_NOT_FOUND, BUFFER_OVERFLOW when ``size`` is too small…)."""
        view = self._view(buffer_ptr, size)
        if view is None:
            return INVALID_PARAMS
        try:
            n = self._client().get_into(key, view)
        except KVPoolError as e:
            return error_code(e)
        return OBJECT_NOT_FOUND if n is None else n

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``put_from`` for many keys with one commit: a code per key."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        views = [self._view(p, n) for p, n in zip(buffer_ptrs, sizes, strict=True)]
        ok = [i for i, v in enumerate(views) if v is not None]
        codes = [INVALID_PARAMS] * len(keys)
        results = self._put_many([keys[i] for i in ok], [views[i] for i in ok], config)
        for i, code in zip(ok, results, strict=True):
            codes[i] = code
        return codes

    def batch_get_into(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """``get_into`` for many keys with one lookup: bytes read or a negative code per key."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        views = [self._view(p, n) for p, n in zip(buffer_ptrs, sizes, strict=True)]
        try:
            found = self._client().batch_get(list(keys))
        except KVPoolError as e:
            return [error_code(e)] * len(keys)
        codes = []
        for view, data in zip(views, found, strict=True):
            if view is None:
                codes.append(INVALID_PARAMS)
            elif data is None:
                codes.append(OBJECT_NOT_FOUND)
            elif len(data) > view.nbytes:
                codes.append(BUFFER_OVERFLOW)
            else:
                view[: len(data)] = data
                codes.append(len(data))
        return codes

    # --- torch tensors ----------------------------------------------------------------------

    def put_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        """Store a tensor (numpy, torch or cupy) with its shape and dtype: 0 or a negative code.
        The bytes are kvpool's tensor block format, not Mooncake's."""
        try:
            block = encode_tensor(tensor)
        except KVPoolError as e:
            return error_code(e)
        return self.put(key, block, config)

    pub_tensor = put_tensor

    def get_tensor(self, key: str) -> Any:
        """The torch tensor stored with ``put_tensor``, or None."""
        return self.batch_get_tensor([key])[0]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        if len(keys) != len(tensors_list):
            return [INVALID_PARAMS] * len(keys)
        try:
            blocks = [encode_tensor(t) for t in tensors_list]
        except KVPoolError as e:
            return [error_code(e)] * len(keys)
        return self._put_many(keys, blocks, None)

    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any]:
        try:
            found = self._client().batch_get(list(keys))
        except KVPoolError:
            return [None] * len(keys)
        out: list[Any] = []
        for data in found:
            try:
                out.append(None if data is None else decode_tensor(data, like="torch"))
            except BlockFormatError:
                out.append(None)
        return out
