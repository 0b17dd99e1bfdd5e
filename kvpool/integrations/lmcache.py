"""``KVPoolConnectorAdapter``: kvpool as an LMCache remote-storage plugin.

LMCache configuration (YAML or ``LMCACHE_*`` variables)::

    chunk_size: 256
    local_cpu: true
    max_local_cpu_size: 5                      # LMCache's CPU backend is the buffer reads land in
    remote_storage_plugins: ["kvpool"]
    remote_url: "kvpool://10.0.0.1:7300,10.0.0.2:7300,10.0.0.3:7300"
    extra_config:
      remote_storage_plugin.kvpool.module_path: kvpool.integrations.lmcache
      remote_storage_plugin.kvpool.class_name: KVPoolConnectorAdapter
      remote_storage_plugin.kvpool.timeout_s: 1.0            # optional (and the other settings)

The masters come from ``remote_url`` (``kvpool://host:port,host:port``) or from
``remote_storage_plugin.kvpool.masters``. Every ``remote_storage_plugin.kvpool.<setting>`` is a
kvpool setting (``kvpool.integrations.settings``); an unknown one is refused by name.

:class:`KVPoolRemoteConnector` implements LMCache's ``RemoteConnector``: exists, get, put,
their sync and batched forms, prefix contains, non-blocking batched get, remove, ping, close.
A chunk is one kvpool object holding exactly the bytes of LMCache's memory object: a put sends
them from LMCache's memory, a get receives them into a memory object LMCache's CPU backend
allocated (no copy either way); a partial chunk is told by its size. Keys:
``lmcache/<format fingerprint>/<LMCache's key>``, the fingerprint covering the chunk's memory
format, dtypes, shapes and chunk size (``docs/engines/lmcache.md``). A failed or slow store is a
miss (``None``, ``False``, 0) within ``timeout_s``, and once found down it is left alone for
``retry_after_s`` (presence queries miss, puts are dropped, at once); nothing raises into LMCache
because the store failed.

LMCache builds one backend per name in ``remote_storage_plugins`` and another one for
``remote_url``: both reach the same pool, so the second connector of one LMCache configuration
for the same masters stands aside (it holds and writes nothing, logged once) instead of writing
every chunk twice.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvpool.client.pause import STORE_DOWN, StorePause
from kvpool.errors import ConfigError, InvalidArgumentError, KVPoolError
from kvpool.integrations.settings import StoreSettings, read_settings, warm_up
from kvpool.keys import canonical_dtype, namespace
from kvpool.logs import get_logger

try:
    from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"kvpool.integrations.lmcache needs LMCache (pip install lmcache): {e}"
    ) from e

__all__ = ["KVPoolConnectorAdapter", "KVPoolRemoteConnector", "lmcache_settings"]

SCHEME = "kvpool://"
PLUGIN = "kvpool"
KEY_PREFIX = "lmcache"
THREADS = 4
"""Threads that run the blocking kvpool calls of LMCache's coroutines."""

_LOG = get_logger("kvpool.lmcache")
T = TypeVar("T")

_primaries: dict[tuple[int, tuple[str, ...]], int] = {}
_primaries_lock = threading.Lock()


def _plugin_name(url: str) -> str | None:
    if url.startswith("plugin://"):
        name = url[len("plugin://") :]
        if name.split(".", 1)[0] == PLUGIN:
            return name
    return None


def lmcache_settings(url: str, config: Any) -> StoreSettings:
    """kvpool's settings from LMCache's ``remote_url`` / plugin URL and ``extra_config``."""
    plugin = _plugin_name(url) or PLUGIN
    prefix = f"remote_storage_plugin.{plugin}."
    extra = dict(getattr(config, "extra_config", None) or {})
    raw = {
        k[len(prefix) :]: v
        for k, v in extra.items()
        if k.startswith(prefix) and k[len(prefix) :] not in ("module_path", "class_name")
    }
    masters: str | None = None
    if url.startswith(SCHEME):
        masters = url[len(SCHEME) :].split("/", 1)[0].split("?", 1)[0]
    else:
        remote_url = getattr(config, "remote_url", None) or ""
        if remote_url.startswith(SCHEME):
            masters = remote_url[len(SCHEME) :].split("/", 1)[0].split("?", 1)[0]
    if "masters" not in raw and not masters:
        raise ConfigError(
            f"LMCache: no kvpool masters: set remote_url to 'kvpool://host:port,...' or "
            f"extra_config['{prefix}masters']"
        )
    return read_settings(raw, where=f"LMCache extra_config[{prefix!r}...]", masters=masters)


def format_fingerprint(metadata: Any, chunk_size: int, fmt: Any, shapes: Any, dtypes: Any) -> str:
    """Hex fingerprint of what makes a chunk's bytes readable as this engine's chunk."""
    shape_text = ";".join("x".join(str(int(n)) for n in shape) for shape in shapes)
    ns = namespace(
        str(getattr(metadata, "model_name", "") or "lmcache"),
        dtype=",".join(canonical_dtype(str(d)) for d in dtypes),
        kv_layout=f"lmcache:{getattr(fmt, 'name', fmt)}:{shape_text}",
        block_size=chunk_size,
        extra=f"mla={bool(getattr(metadata, 'use_mla', False))}",
    )
    return ns.fingerprint.hex()


class KVPoolRemoteConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache's ``RemoteConnector`` on a kvpool client; see the module doc."""

    def __init__(
        self,
        settings: StoreSettings,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        metadata: Any,
    ) -> None:
        super().__init__(config, metadata)
        self.settings = settings
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        chunk = int(getattr(metadata, "chunk_size", 0) or getattr(config, "chunk_size", 256))
        fp = format_fingerprint(metadata, chunk, self.meta_fmt, self.meta_shapes, self.meta_dtypes)
        self._prefix = f"{KEY_PREFIX}/{fp}/"
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="kvpool-lmcache")
        # strict: a failed store raises, caught here as a miss (ping tells it apart)
        self._client = settings.client(strict=True)
        self._pause = StorePause(settings.retry_after_s)
        owner = (id(config), settings.masters)
        with _primaries_lock:
            self.standing_aside = _primaries.setdefault(owner, id(self)) != id(self)
        self._owner = owner
        if self.standing_aside:
            _LOG.info(
                "lmcache_duplicate_backend",
                masters=list(settings.masters),
                note="another backend of this LMCache configuration serves these masters",
            )
        else:
            if warm_up(self._client, _LOG).masters:
                self._pause.failed()  # the first requests miss at once rather than wait on it
            _LOG.info(
                "lmcache_connector_ready", masters=list(settings.masters), key_prefix=self._prefix
            )

    # --- plumbing ------------------------------------------------------------------------------

    def key(self, key: Any) -> str:
        """The kvpool key of an LMCache ``CacheEngineKey``."""
        return f"{self._prefix}{key.to_string()}"

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _allocate(self) -> Any:
        return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)

    def _accept(self, memory_obj: Any, size: int | None) -> Any:
        """``memory_obj`` holding a chunk of ``size`` bytes, or None (released) on a miss."""
        if size is None:
            memory_obj.ref_count_down()
            return None
        full = size == self.full_chunk_size_bytes
        if not full and len(self.meta_shapes) != 1:
            memory_obj.ref_count_down()  # a partial chunk of several groups: not told by size
            return None
        try:
            obj = self.reshape_partial_chunk(memory_obj, size)
        except ValueError as e:  # a size no chunk of this format has: never data
            _LOG.warning("lmcache_chunk_refused", size=size, error=str(e))
            memory_obj.ref_count_down()
            return None
        if not full:
            obj.meta.shapes = [obj.meta.shape]  # LMCache's reshape sets only the first
        return obj

    # --- reads ---------------------------------------------------------------------------------

    def _get_sync(self, key: Any) -> Any:
        if self.standing_aside:
            return None
        memory_obj = self._allocate()
        if memory_obj is None:
            return None
        try:
            size = self._client.get_into(self.key(key), memory_obj.byte_array, strict=False)
        except InvalidArgumentError as e:  # larger than a full chunk: not this format's
            _LOG.warning("lmcache_chunk_refused", error=str(e))
            size = None
        return self._accept(memory_obj, size)

    async def get(self, key: Any) -> Any:
        return await self._run(lambda: self._get_sync(key))

    def _batched_get_sync(self, keys: Sequence[Any]) -> list[Any]:
        if self.standing_aside or not keys:
            return [None] * len(keys)
        objs = [self._allocate() for _ in keys]
        wanted = [i for i, obj in enumerate(objs) if obj is not None]
        sizes: list[int | None] = [None] * len(keys)
        try:
            got = self._client.batch_get_into(
                [self.key(keys[i]) for i in wanted],
                [objs[i].byte_array for i in wanted],
                strict=False,
            )
            for i, size in zip(wanted, got, strict=True):
                sizes[i] = size
        except InvalidArgumentError as e:
            _LOG.warning("lmcache_chunk_refused", error=str(e))
        return [
            self._accept(obj, size) if obj is not None else None
            for obj, size in zip(objs, sizes, strict=True)
        ]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        return await self._run(lambda: self._batched_get_sync(keys))

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The leading run of hits (the chunks read after a miss are released)."""
        objs = await self.batched_get(keys)
        leading: list[Any] = []
        for obj in objs:
            if obj is None:
                break
            leading.append(obj)
        for obj in objs[len(leading) :]:
            if obj is not None:
                obj.ref_count_down()
        return leading

    def _asked(self, fn: Callable[[], T], miss: T) -> T:
        """A presence query: ``miss`` at once while the store is left alone after a failure
        (``retry_after_s``); a failure that says the store is down or too slow starts that."""
        if self._pause.paused():
            return miss
        try:
            return fn()
        except KVPoolError as e:
            if isinstance(e, STORE_DOWN):
                self._pause.failed()
            return miss

    def _exists_sync(self, key: Any) -> bool:
        if self.standing_aside:
            return False
        return self._asked(lambda: self._client.exists(self.key(key)), False)

    async def exists(self, key: Any) -> bool:
        return await self._run(lambda: self._exists_sync(key))

    def exists_sync(self, key: Any) -> bool:
        return self._exists_sync(key)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """How many leading keys the pool holds (one prefix match)."""
        if self.standing_aside or not keys:
            return 0
        return self._asked(lambda: self._client.prefix_match([self.key(k) for k in keys]), 0)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(
        self, lookup_id: str, keys: list[Any], pin: bool = False
    ) -> int:
        return await self._run(lambda: self.batched_contains(keys))

    # --- writes --------------------------------------------------------------------------------

    def _put_sync(self, items: list[tuple[Any, Any]]) -> None:
        if self.standing_aside or not items:
            return
        if self._pause.paused():
            _LOG.debug("lmcache_put_dropped", chunks=len(items), reason="store left alone")
            return
        receipts = self._client.batch_put_receipts(
            [(self.key(k), obj.byte_array) for k, obj in items], strict=False
        )
        failed = sum(r is None for r in receipts)
        if failed:
            _LOG.debug("lmcache_put_failed", failed=failed, of=len(receipts))

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self._run(lambda: self._put_sync([(key, memory_obj)]))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        items = list(zip(keys, memory_objs, strict=True))
        await self._run(lambda: self._put_sync(items))

    def remove_sync(self, key: Any) -> bool:
        if self.standing_aside:
            return False
        try:
            return self._client.remove(self.key(key))
        except KVPoolError:
            return False

    async def list(self) -> list[str]:
        raise NotImplementedError("kvpool keeps no key listing: LMCache's list() is not served")

    # --- health and life -----------------------------------------------------------------------

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the masters answer a lookup within the deadline, 1 otherwise."""

        def probe() -> int:
            try:
                self._client.sizes([self._prefix + "ping"])
            except KVPoolError:
                return 1
            return 0

        return await self._run(probe)

    async def close(self) -> None:
        with _primaries_lock:
            if _primaries.get(self._owner) == id(self):
                del _primaries[self._owner]
        self._client.close()
        self._pool.shutdown(wait=False)


class KVPoolConnectorAdapter(ConnectorAdapter):  # type: ignore[misc]
    """Creates a :class:`KVPoolRemoteConnector` for ``kvpool://...`` and ``plugin://kvpool``."""

    def __init__(self) -> None:
        super().__init__(SCHEME)

    def can_parse(self, url: str) -> bool:
        return url.startswith(SCHEME) or _plugin_name(url) is not None

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        metadata = context.metadata
        if metadata is None:
            metadata = getattr(context.local_cpu_backend, "metadata", None)
        settings = lmcache_settings(context.url, context.config)
        return KVPoolRemoteConnector(
            settings, context.loop, context.local_cpu_backend, context.config, metadata
        )
