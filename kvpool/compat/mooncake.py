"""Mooncake Store's Python API over a kvpool cluster: ``MooncakeDistributedStore``.

    from kvpool.compat.mooncake import MooncakeDistributedStore   # was: from mooncake.store ...

    store = MooncakeDistributedStore()
    store.setup("localhost", "P2PHANDSHAKE", 512 << 20, 128 << 20, "tcp", "",
                "10.0.0.1:7300,10.0.0.2:7300,10.0.0.3:7300")     # kvpool masters
    store.put("key", b"value")          # 0, or a negative Mooncake error code
    store.get("key")                    # the bytes, or b"" when missing

Method names, arguments and return conventions are those of Mooncake's bindings
(``mooncake-integration/store/store_py.cpp``): ``put`` → 0 or a negative ``ErrorCode``, ``get``
→ ``b""`` when missing, ``is_exist`` → 1 / 0 / a negative code, ``get_into`` → bytes read or a
negative code… SGLang's Mooncake HiCache backend runs on it unchanged (docs/mooncake.md lists
what is tested and where kvpool differs). Every call finishes within ``timeout_s``; none raises
because the store failed: a failure is a negative code, an empty value or None, as in Mooncake.

Keys live in the namespace ``mooncake/<tenant_id>/`` of the kvpool cluster, so that
``remove_all`` removes what the Mooncake API wrote for that tenant, cluster-wide, and never a
block written by a native kvpool client.

Zero-copy calls take raw addresses. Mooncake calls an unregistered address undefined behaviour;
here an address range outside the buffers given to :meth:`~MooncakeDistributedStore.register_buffer`
is refused with ``INVALID_PARAMS`` before any memory is touched, and ``register_buffer`` refuses
device memory and unmapped ranges (:mod:`kvpool.compat.memory`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from kvpool.buffers import Parts
from kvpool.client.sync import Client
from kvpool.client.tensors import BlockFormatError, decode_tensor, encode_tensor
from kvpool.compat.memory import Regions, adjacent
from kvpool.compat.mooncake_types import (
    BUFFER_OVERFLOW,
    CHECKSUM_MISMATCH,
    DEFAULT_CLIENT_HTTP_PORT,
    DEFAULT_GLOBAL_SEGMENT_SIZE,
    DEFAULT_LOCAL_BUFFER_SIZE,
    DEFAULT_MASTER_SERVER_ADDR,
    DEFAULT_TENANT_ID,
    HC_HEALTHY,
    HC_MASTER_UNREACHABLE,
    HC_NOT_INITIALIZED,
    INTERNAL_ERROR,
    INVALID_KEY,
    INVALID_PARAMS,
    INVALID_READ,
    NO_AVAILABLE_HANDLE,
    NOT_SUPPORTED,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    OK,
    RPC_FAIL,
    RPC_TIMEOUT,
    TRANSFER_FAIL,
    BufferHandle,
    Descriptor,
    DiskDescriptor,
    MemoryDescriptor,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    error_code,
)
from kvpool.errors import InvalidKeyError, KVPoolError, UnavailableError
from kvpool.logs import get_logger

__all__ = [
    "BUFFER_OVERFLOW",
    "CHECKSUM_MISMATCH",
    "HC_HEALTHY",
    "HC_MASTER_UNREACHABLE",
    "HC_NOT_INITIALIZED",
    "INTERNAL_ERROR",
    "INVALID_KEY",
    "INVALID_PARAMS",
    "INVALID_READ",
    "NOT_SUPPORTED",
    "NO_AVAILABLE_HANDLE",
    "OBJECT_ALREADY_EXISTS",
    "OBJECT_NOT_FOUND",
    "OK",
    "RPC_FAIL",
    "RPC_TIMEOUT",
    "TRANSFER_FAIL",
    "BufferHandle",
    "Descriptor",
    "DiskDescriptor",
    "MemoryDescriptor",
    "MooncakeDistributedStore",
    "ReplicaDescriptor",
    "ReplicaStatus",
    "ReplicateConfig",
    "error_code",
]

T = TypeVar("T")

_PROBE_KEY = "kvpool/compat/mooncake/setup-probe"
_SETUP_KEYS = {
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
    "ipc_socket_path",
    "enable_ssd_offload",
    "ssd_offload_path",
    "tenant_id",
    "enable_client_http_server",
    "client_http_port",
    "timeout_s",
}
_TRUE = {"1", "true", "yes", "on"}
_SETUP_ALIASES = {"master_server_address": "master_server_addr", "device_name": "rdma_devices"}
"""Names other callers of Mooncake's ``setup(dict)`` use (LMCache 0.5's Mooncake connector
passes its legacy ``master_server_address`` and ``device_name``): read as the setting they
name when that one is not given, and said so once. Mooncake itself ignores them (its master
address then falls back to 127.0.0.1:50051)."""

_said: set[str] = set()
_said_lock = threading.Lock()


def _say_once(log: Any, setting: str, value: object) -> None:
    """Log once per process that a Mooncake setting has no kvpool meaning."""
    with _said_lock:
        if setting in _said:
            return
        _said.add(setting)
    log.info("mooncake_setting_ignored", setting=setting, value=repr(value)[:80])


def namespace(tenant_id: str) -> str:
    """The kvpool key prefix under which a Mooncake tenant's objects live."""
    return f"mooncake/{tenant_id}/"


class MooncakeDistributedStore:
    """Mooncake Store's ``MooncakeDistributedStore`` on kvpool; see the module doc."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clients: dict[int, Client] = {}
        self._masters: list[str] = []
        self._timeout_s = 2.0
        self._hostname = ""
        self._ns = namespace(DEFAULT_TENANT_ID)
        self._memory = Regions()
        self._log = get_logger("kvpool.compat.mooncake")

    # --- life cycle -------------------------------------------------------------------------

    def setup(  # noqa: PLR0917 - Mooncake's positional signature
        self,
        local_hostname: str | Mapping[str, Any],
        metadata_server: str = "",
        global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE,
        local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE,
        protocol: str = "tcp",
        rdma_devices: str = "",
        master_server_addr: str = DEFAULT_MASTER_SERVER_ADDR,
        engine: object = None,
        *,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str = "",
        tenant_id: str = DEFAULT_TENANT_ID,
        enable_client_http_server: bool = False,
        client_http_port: int = DEFAULT_CLIENT_HTTP_PORT,
        ipc_socket_path: str = "",
        timeout_s: float = 2.0,
    ) -> int:
        """Connect to the kvpool masters named by ``master_server_addr`` (comma-separated
        ``host:port``); or ``setup(config: dict)`` with the same names as keys. 0 once a master
        answered; ``RPC_FAIL`` / ``RPC_TIMEOUT`` when none did, ``INVALID_PARAMS`` for a bad
        setting (logged with its name). The transfer-engine settings (metadata server, segment
        and buffer sizes, RDMA devices, ``engine``, SSD offload, the client HTTP server) have
        no kvpool meaning: accepted, and said so once in the log. ``protocol`` "rdma" runs over
        TCP. ``tenant_id`` picks the key namespace; ``timeout_s`` (kvpool's) bounds each call."""
        if isinstance(local_hostname, Mapping):
            return self._setup_from_dict(local_hostname)
        if protocol not in ("tcp", "rdma"):
            self._log.warning("mooncake_setup_refused", setting="protocol", value=protocol)
            return INVALID_PARAMS
        if protocol == "rdma":
            _say_once(self._log, "protocol=rdma (kvpool runs it over TCP)", rdma_devices)
        if not isinstance(tenant_id, str) or not tenant_id.strip() or "/" in tenant_id:
            self._log.warning("mooncake_setup_refused", setting="tenant_id", value=tenant_id)
            return INVALID_PARAMS
        always = object()  # Mooncake requires these, so they are always given
        for setting, value, default in (
            ("metadata_server", metadata_server, always),
            ("global_segment_size", global_segment_size, always),
            ("local_buffer_size", local_buffer_size, always),
            ("rdma_devices", rdma_devices, ""),
            ("engine", engine, None),
            ("enable_ssd_offload", enable_ssd_offload, False),
            ("ssd_offload_path", ssd_offload_path, ""),
            ("enable_client_http_server", enable_client_http_server, False),
            ("client_http_port", client_http_port, DEFAULT_CLIENT_HTTP_PORT),
            ("ipc_socket_path", ipc_socket_path, ""),
        ):
            if default is always or value != default:
                _say_once(self._log, setting, value)
        masters = [m.strip() for m in str(master_server_addr).split(",") if m.strip()]
        try:
            client = Client(masters, timeout_s=timeout_s, strict=True)
        except KVPoolError as e:
            self._log.warning("mooncake_setup_refused", setting="master_server_addr", error=str(e))
            return error_code(e)
        try:
            client.exists(_PROBE_KEY)
        except KVPoolError as e:
            client.close()
            return error_code(e)
        report = client.warm_up()  # the nodes' connections, now: setup is where Mooncake dials
        if not report.ok:
            self._log.warning("mooncake_setup_warm_up_incomplete", detail=report.summary())
        self.close()
        with self._lock:
            self._masters, self._timeout_s, self._hostname = masters, timeout_s, str(local_hostname)
            self._ns = namespace(tenant_id.strip())
            self._clients = {1: client}
        return OK

    def _setup_from_dict(self, config: Mapping[str, Any]) -> int:
        unknown = sorted(str(k) for k in config if k not in _SETUP_KEYS | _SETUP_ALIASES.keys())
        if unknown or "local_hostname" not in config:
            self._log.warning(
                "mooncake_setup_refused",
                setting=", ".join(unknown) or "local_hostname",
                reason="unknown setting" if unknown else "required",
            )
            return INVALID_PARAMS
        values = {str(k): str(v) for k, v in config.items()}  # Mooncake reads them as strings
        for alias, setting in _SETUP_ALIASES.items():
            if alias in values:
                value = values.pop(alias)
                shown = value if alias == "device_name" else "(not shown: an address)"
                if setting not in values:
                    values[setting] = value
                    _say_once(self._log, f"{alias} (read as {setting})", shown)
                else:
                    _say_once(self._log, f"{alias} (ignored: {setting} is given too)", shown)
        try:
            return self.setup(
                values["local_hostname"],
                values.get("metadata_server", ""),
                int(values.get("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE)),
                int(values.get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE)),
                values.get("protocol", "tcp"),
                values.get("rdma_devices", ""),
                values.get("master_server_addr", DEFAULT_MASTER_SERVER_ADDR),
                enable_ssd_offload=values.get("enable_ssd_offload", "").lower() in _TRUE,
                ssd_offload_path=values.get("ssd_offload_path", ""),
                tenant_id=values.get("tenant_id", DEFAULT_TENANT_ID),
                enable_client_http_server=(
                    values.get("enable_client_http_server", "").lower() in _TRUE
                ),
                client_http_port=int(values.get("client_http_port", DEFAULT_CLIENT_HTTP_PORT)),
                ipc_socket_path=values.get("ipc_socket_path", ""),
                timeout_s=float(values.get("timeout_s", 2.0)),
            )
        except ValueError as e:
            self._log.warning("mooncake_setup_refused", error=str(e))
            return INVALID_PARAMS

    def setup_dummy(self, mem_pool_size: int, local_buffer_size: int, server_address: str) -> int:
        """Mooncake's standalone mode (a separate client process owning the memory) has no
        kvpool counterpart: ``NOT_SUPPORTED``."""
        self._log.warning("mooncake_setup_dummy_not_supported", server_address=server_address)
        return NOT_SUPPORTED

    def health_check(self) -> int:
        """0 when a master answers, 1 before setup or after close, 2 when no master does."""
        with self._lock:
            client = self._clients.get(1)
        if client is None or client.closed:
            return HC_NOT_INITIALIZED
        try:
            client.exists(_PROBE_KEY)
        except KVPoolError:
            return HC_MASTER_UNREACHABLE
        return HC_HEALTHY

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

    def _name(self, key: object) -> str:
        if not isinstance(key, str) or not key:
            raise InvalidKeyError(f"a key must be a non-empty str, got {key!r:.40}")
        return self._ns + key

    def _names(self, keys: Sequence[object]) -> list[str]:
        return [self._name(k) for k in keys]

    # --- writes -----------------------------------------------------------------------------

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes-like) under ``key`` unless it exists: as in Mooncake, a put of
        an existing key keeps the first value and answers 0 (``upsert`` replaces it)."""
        return self._put_many([key], [value], config, replace=False)[0]

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` under ``key``, replacing what is there (the later write wins whole)."""
        return self._put_many([key], [value], config, replace=True)[0]

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of ``parts`` (1-D bytes-like) as one object, unless ``key``
        exists (each part sent from where it is: no gathering copy)."""
        return self._put_parts(key, parts, config, replace=False)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """``put_parts`` that replaces an existing object."""
        return self._put_parts(key, parts, config, replace=True)

    def _put_parts(
        self, key: str, parts: tuple[Any, ...], config: ReplicateConfig | None, replace: bool
    ) -> int:
        try:
            views = [memoryview(p) for p in parts]
        except TypeError:
            return INVALID_PARAMS
        if any(v.ndim != 1 or v.itemsize != 1 for v in views):
            return INVALID_PARAMS
        # A list of parts is one value to the client, each part sent from where it is.
        return self._put_many([key], [views], config, replace=replace)[0]

    def put_batch(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None
    ) -> int:
        """Store many values with one commit (existing keys kept): 0 when all are stored, else
        the first negative code."""
        if len(keys) != len(values):
            return INVALID_PARAMS
        codes = self._put_many(keys, values, config, replace=False)
        return next((c for c in codes if c != OK), OK)

    def upsert_batch(
        self, keys: Sequence[str], values: Sequence[Any], config: ReplicateConfig | None = None
    ) -> int:
        if len(keys) != len(values):
            return INVALID_PARAMS
        codes = self._put_many(keys, values, config, replace=True)
        return next((c for c in codes if c != OK), OK)

    def _put_many(
        self,
        keys: Sequence[Any],
        values: Sequence[Any],
        config: ReplicateConfig | None,
        *,
        replace: bool,
    ) -> list[int]:
        """One code per key: 0 stored (or, unless ``replace``, already there), else negative.
        Keep-first costs one lookup for the batch; bytes go only for the keys not there."""
        codes = [OK] * len(keys)
        try:
            names = self._names(keys)
            client = self._client(config)
        except KVPoolError as e:
            return [error_code(e)] * len(keys)
        todo = list(range(len(keys)))
        if not replace:
            try:
                sizes = client.sizes(names)
            except KVPoolError as e:
                return [error_code(e)] * len(keys)
            todo = [i for i in todo if sizes[i] is None]
        if not todo:
            return codes
        try:
            done = client.batch_put([(names[i], values[i]) for i in todo])
        except KVPoolError as e:
            for i in todo:
                codes[i] = error_code(e)
            return codes
        for i, ok in zip(todo, done, strict=True):
            if not ok:
                codes[i] = TRANSFER_FAIL
        return codes

    # --- reads ------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        """The bytes stored under ``key``; ``b""`` when missing or on failure."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """Each key's bytes (``b""`` where missing), one lookup for all."""
        try:
            found = self._client().batch_get(self._names(keys))
        except KVPoolError:
            return [b""] * len(keys)
        return [data or b"" for data in found]

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object in a :class:`BufferHandle`, or None when missing or on failure."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """Each object in its own :class:`BufferHandle` (read straight into it), None where
        missing; one lookup for all."""
        try:
            return self._client().batch_get_alloc(self._names(keys), BufferHandle)
        except KVPoolError:
            return [None] * len(keys)

    # --- existence, size, removal ---------------------------------------------------------

    def is_exist(self, key: str) -> int:
        """1 when the key exists, 0 when not, a negative code on error."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 / 0 / a negative code per key, one index call for all (no entries sent)."""
        try:
            found = self._client().batch_exists(self._names(keys))
        except KVPoolError as e:
            return [error_code(e)] * len(keys)
        return [1 if hit else 0 for hit in found]

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The replicas of ``key`` as the index has them (one descriptor per live node holding
        it; memory or disk by the tier the nodes last reported); [] when missing or on error,
        as Mooncake answers."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        """``{key: [descriptor, ...]}`` for the keys the index has, in one lookup; a missing
        key is left out (and every key on error), as Mooncake answers."""
        try:
            found = self._client().locate(self._names(keys))
        except KVPoolError as e:
            self._log.warning("mooncake_replica_desc_failed", keys=len(keys), error=e.message)
            return {}
        out: dict[str, list[ReplicaDescriptor]] = {}
        for key, where in zip(keys, found, strict=True):
            if where is not None:
                on_disk = where.tier == "ssd"
                out[key] = [
                    ReplicaDescriptor(where.size_bytes, m.data_address, on_disk)
                    for m in where.replicas
                ]
        return out

    def get_size(self, key: str) -> int:
        """The object's size in bytes, or a negative code (OBJECT_NOT_FOUND when missing)."""
        try:
            (size,) = self._client().sizes([self._name(key)])
        except KVPoolError as e:
            return error_code(e)
        return OBJECT_NOT_FOUND if size is None else size

    def remove(self, key: str, force: bool = False) -> int:
        """0 when removed, OBJECT_NOT_FOUND when there was no such key, else a negative code.
        ``force`` has nothing to skip: kvpool holds no read leases (a reader in flight keeps
        the bytes it is reading)."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """``remove`` for many keys with one commit: a code per key."""
        try:
            removed = self._client().batch_remove(self._names(keys))
        except KVPoolError as e:
            return [error_code(e)] * len(keys)
        return [OK if r else OBJECT_NOT_FOUND for r in removed]

    def remove_all(self, force: bool = False) -> int:
        """Remove every object of this tenant in the cluster, whoever wrote it (kvpool's
        prefix removal, in steps of at most 4096 keys per Raft commit): the number removed,
        or a negative code when a step failed (the keys of earlier steps stay removed)."""
        total = 0
        try:
            client = self._client()
            while True:
                removed, more = client.remove_prefix(self._ns)
                total += removed
                if not more:
                    return total
        except KVPoolError as e:
            self._log.warning("mooncake_remove_all_failed", removed=total, error=str(e))
            return error_code(e)

    # --- zero-copy --------------------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Allow the zero-copy calls on ``[buffer_ptr, buffer_ptr + size)``: 0, or
        ``INVALID_PARAMS`` (logged with the reason) for device memory or a range this process
        does not map writable."""
        problem = self._memory.register(buffer_ptr, size)
        if problem is not None:
            self._log.warning("mooncake_register_buffer_refused", reason=problem)
            return INVALID_PARAMS
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return OK if self._memory.unregister(buffer_ptr) else INVALID_PARAMS

    def put_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        """Store ``size`` bytes at ``buffer_ptr`` (registered memory) unless ``key`` exists."""
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def upsert_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``put_from`` for many keys with one commit: a code per key (the bytes are sent
        from the registered memory, no copy)."""
        return self._put_from(keys, buffer_ptrs, sizes, config, replace=False)

    def batch_upsert_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        return self._put_from(keys, buffer_ptrs, sizes, config, replace=True)

    def _put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None,
        *,
        replace: bool,
    ) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        views = [self._memory.view(p, n) for p, n in zip(buffer_ptrs, sizes, strict=True)]
        return self._put_views(keys, views, config, replace)

    def _put_views(
        self,
        keys: Sequence[str],
        views: Sequence[Any | None],
        config: ReplicateConfig | None,
        replace: bool,
    ) -> list[int]:
        ok = [i for i, v in enumerate(views) if v is not None]
        codes = [INVALID_PARAMS] * len(keys)
        if not ok:
            return codes
        results = self._put_many(
            [keys[i] for i in ok], [views[i] for i in ok], config, replace=replace
        )
        for i, code in zip(ok, results, strict=True):
            codes[i] = code
        return codes

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read the object into registered memory: the bytes read, or a negative code
        (OBJECT_NOT_FOUND, BUFFER_OVERFLOW when ``size`` is too small…)."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(
        self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[int]:
        """``get_into`` for many keys with one lookup, each read straight into its buffer:
        bytes read or a negative code per key."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        views = [self._memory.view(p, n) for p, n in zip(buffer_ptrs, sizes, strict=True)]
        return self._get_views(keys, views)

    def _get_views(
        self, keys: Sequence[str], views: Sequence[memoryview | Parts | None]
    ) -> list[int]:
        codes = [INVALID_PARAMS] * len(keys)
        ok = [i for i, v in enumerate(views) if v is not None]
        if not ok:
            return codes
        try:
            client = self._client()
            names = self._names([keys[i] for i in ok])
            sizes = client.sizes(names)
        except KVPoolError as e:
            for i in ok:
                codes[i] = error_code(e)
            return codes
        fits: list[int] = []
        sinks: list[memoryview | Parts] = []
        for i, size in zip(ok, sizes, strict=True):
            view = views[i]
            assert view is not None
            if size is None:
                codes[i] = OBJECT_NOT_FOUND
            elif size > view.nbytes:
                codes[i] = BUFFER_OVERFLOW
            else:
                fits.append(i)
                sinks.append(view)
        if not fits:
            return codes
        try:
            read = client.batch_get_into([self._name(keys[i]) for i in fits], sinks)
        except KVPoolError as e:
            for i in fits:
                codes[i] = error_code(e)
            return codes
        for i, n in zip(fits, read, strict=True):
            codes[i] = OBJECT_NOT_FOUND if n is None else n
        return codes

    # --- multi-buffer objects (an object's bytes spread over several buffers) ---------------

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Store each key's buffers, in order, as one object (existing keys kept): a code per
        key. Each buffer is sent from where it is (buffers that follow each other in memory as
        one): no gathering copy."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [INVALID_PARAMS] * len(keys)
        values: list[Any | None] = []
        for ptrs, sizes in zip(all_buffer_ptrs, all_sizes, strict=True):
            parts = self._memory.views(ptrs, sizes)
            if parts is None:
                values.append(None)
            elif adjacent(list(ptrs), list(sizes)):
                values.append(self._memory.view(ptrs[0], sum(sizes)))
            else:
                values.append(Parts(parts))
        return self._put_views(keys, values, config, replace=False)

    def batch_get_into_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Read each object into its buffers, in order: the bytes read or a negative code per
        key (BUFFER_OVERFLOW when the object is larger than the buffers together). Read
        straight into the buffers, in order: no staging copy."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [INVALID_PARAMS] * len(keys)
        targets: list[memoryview | Parts | None] = []
        for ptrs, sizes in zip(all_buffer_ptrs, all_sizes, strict=True):
            parts = self._memory.views(ptrs, sizes)
            if parts is None:
                targets.append(None)
            elif adjacent(list(ptrs), list(sizes)):
                targets.append(self._memory.view(ptrs[0], sum(sizes)))
            else:
                targets.append(Parts(parts))
        return self._get_views(keys, targets)

    # --- torch tensors ----------------------------------------------------------------------

    def put_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        """Store a tensor (numpy, torch or cupy) with its shape and dtype: 0 or a negative code.
        The bytes are kvpool's tensor block format, not Mooncake's."""
        return self._tensors([key], [tensor], config, replace=False)[0]

    pub_tensor = put_tensor

    def upsert_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        return self._tensors([key], [tensor], config, replace=True)[0]

    def get_tensor(self, key: str) -> Any:
        """The torch tensor stored with ``put_tensor``, or None."""
        return self.batch_get_tensor([key])[0]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        if len(keys) != len(tensors_list):
            return [INVALID_PARAMS] * len(keys)
        return self._tensors(keys, tensors_list, None, replace=False)

    def _tensors(
        self,
        keys: Sequence[str],
        tensors: Sequence[Any],
        config: ReplicateConfig | None,
        *,
        replace: bool,
    ) -> list[int]:
        try:
            blocks = [encode_tensor(t) for t in tensors]
        except KVPoolError as e:
            return [error_code(e)] * len(keys)
        return self._put_many(keys, blocks, config, replace=replace)

    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any]:
        found = self._read(keys, lambda c, names: c.batch_get(names))
        out: list[Any] = []
        for data in found:
            try:
                out.append(None if data is None else decode_tensor(data, like="torch"))
            except BlockFormatError:
                out.append(None)
        return out

    def _read(
        self, keys: Sequence[str], fn: Callable[[Client, list[str]], list[T | None]]
    ) -> list[T | None]:
        try:
            return fn(self._client(), self._names(keys))
        except KVPoolError:
            return [None] * len(keys)
