"""kvpool as an SGLang HiCache storage backend: :class:`KVPoolHiCacheStorage`.

Loaded the way SGLang loads an out-of-tree store::

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
            "module_path": "kvpool.integrations.sglang", "class_name": "KVPoolHiCacheStorage",
            "interface_v1": 1, "masters": ["10.0.0.1:7300", "10.0.0.2:7300"]}'

``interface_v1: 1`` makes SGLang call the zero-copy ``batch_get_v1`` / ``batch_set_v1``
(without it SGLang copies every page through a temporary tensor of its own). The settings
(``masters`` as a list or a comma-separated string, ``timeout_s``, ``retry_after_s``, ``replicas``,
``namespace``, the token and TLS files, …) are listed in docs/engines/sglang.md; the token and
TLS settings default to the usual ``KVPOOL_*`` variables.

Pages go between the host pool's memory and the store nodes with no copy of ours: a page is one
kvpool block — its K then its V (MHA), or its one latent part (MLA) — sent from and read straight
into the pool's tensors, piece by piece where the page is spread out (K and V apart, or every
layer apart in ``layer_first``). One key per page, one index lookup per batch. A failed or slow
store is a miss (False, 0, None) within ``timeout_s``, and once a presence query or a set found
it down it is left alone for ``retry_after_s`` (those calls miss at once meanwhile); no method
raises into SGLang's threads once the backend is built.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvpool.client.pause import STORE_DOWN, StorePause
from kvpool.client.sync import Client
from kvpool.integrations.settings import warm_up
from kvpool.integrations.sglang_config import BackendSettings, parse_settings
from kvpool.integrations.sglang_layout import (
    MHA_PARTS,
    MLA_PARTS,
    Component,
    KeyScheme,
    PageShape,
    Region,
    components_from_meta,
    key_prefix,
    rank_suffix,
)
from kvpool.logs import get_logger

T = TypeVar("T")

ERROR_LOG_INTERVAL_S = 10.0


class KVPoolHiCacheStorage(HiCacheStorage):  # type: ignore[misc]  # SGLang is untyped here
    """SGLang's ``HiCacheStorage`` on a kvpool cluster; see the module doc."""

    def __init__(
        self,
        storage_config: HiCacheStorageConfig | None,
        kwargs: dict[str, Any] | None = None,
        *,
        client: Client | None = None,
    ) -> None:
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self._log = get_logger("kvpool.integrations.sglang")
        self.settings: BackendSettings = parse_settings(extra, self._log)
        if storage_config is not None and storage_config.should_split_heads:
            raise ValueError(
                "kvpool's SGLang backend does not split heads across TP sizes (tp_lcm_size): "
                "remove tp_lcm_size from --hicache-storage-backend-extra-config"
            )
        if storage_config is not None and storage_config.dcp_size > 1:
            raise ValueError(
                "kvpool's SGLang backend does not support decode context parallelism "
                f"(dcp_size={storage_config.dcp_size})"
            )
        self.storage_config = storage_config
        self.tp_rank = storage_config.tp_rank if storage_config else 0
        self.pp_rank = storage_config.pp_rank if storage_config else 0
        self.pp_size = storage_config.pp_size if storage_config else 1
        self.is_mla = bool(storage_config.is_mla_model) if storage_config else False
        self.model_name = storage_config.model_name if storage_config else None
        self._client = client or self.settings.make_client()
        self._own_client = client is None
        self._pause = StorePause(self.settings.retry_after_s)
        reachable: bool | None = None  # an own client's warm-up says; a given one is asked
        if self._own_client:
            reachable = not warm_up(self._client, self._log, tp_rank=self.tp_rank).masters
        self._scheme: KeyScheme | None = None
        self._regions: list[Region] = []
        self.registered_pools: dict[Any, Any] = {}
        self._pool_schemes: dict[Any, tuple[KeyScheme, list[Region]]] = {}
        self._errors_logged_at = 0.0
        self._errors_lock = threading.Lock()
        self._metrics = bool(storage_config.enable_storage_metrics) if storage_config else False
        self._io: dict[str, list[float]] = {
            "prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [], "backup_bandwidth": []
        }  # fmt: skip
        self.mem_pool_host: Any = None
        if not self.settings.interface_v1:
            self._log.warning(
                "kvpool_sglang_copying_path",
                hint='add "interface_v1": 1 to the extra config for the zero-copy calls',
            )
        if not (self._reachable() if reachable is None else reachable):
            self._pause.failed()  # the first requests miss at once rather than wait on it
            self._log.warning(
                "kvpool_sglang_store_unreachable",
                masters=list(self.settings.masters),
                effect="every lookup misses until a master answers",
                retry_after_s=self.settings.retry_after_s,
            )

    def _reachable(self) -> bool:
        try:
            self._client.sizes(["kvpool/integrations/sglang/probe"], strict=True)
        except Exception:
            return False
        return True

    # --- registration -----------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """SGLang hands over its host KV pool: pages are read and written in its tensors."""
        super().register_mem_pool_host(mem_pool_host)
        if getattr(mem_pool_host, "kv_buffer", None) is None:
            return  # a logical anchor (hybrid pools): its pools come through v2
        scheme, regions = self._describe(mem_pool_host, mla=self.is_mla)
        self._scheme, self._regions = scheme, regions
        self._log.info(
            "kvpool_sglang_registered",
            layout=mem_pool_host.layout,
            prefix=scheme.prefix,
            rank_suffix=scheme.rank_suffix,
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A hybrid model's other host pools (SWA, draft…), each with its own keys."""
        self.registered_pools[host_pool_name] = host_pool
        if host_pool_name == PoolName.KV or getattr(host_pool, "kv_buffer", None) is None:
            return
        mla = not hasattr(host_pool, "v_buffer")
        self._pool_schemes[host_pool_name] = self._describe(host_pool, mla=mla)

    def _describe(self, pool: Any, *, mla: bool) -> tuple[KeyScheme, list[Region]]:
        buffers = [pool.kv_buffer]
        extra = getattr(pool, "get_hybrid_pool_buffer", None)
        if callable(extra):
            buffers.extend(b for b in extra() if b is not None)
        regions = []
        for buf in buffers:
            if buf.device.type != "cpu":
                raise ValueError(
                    f"kvpool's SGLang backend reads host pools only; got a {buf.device} tensor"
                )
            if buf.numel() == 0:
                continue
            flat = buf.detach().reshape(-1).view(torch.uint8).numpy()
            regions.append(Region(int(buf.data_ptr()), memoryview(flat)))
        heads = 1 if mla else int(getattr(pool, "head_num", 1))
        head_dim = int(getattr(pool, "kv_cache_dim", 0) or getattr(pool, "head_dim", 0))
        shape = PageShape(
            mla=mla,
            dtype=str(pool.dtype).removeprefix("torch."),
            layout=str(pool.layout),
            page_size=int(pool.page_size),
            layers=int(pool.layer_num),
            heads=heads,
            head_dim=head_dim,
        )
        scheme = KeyScheme(
            key_prefix(self.settings.namespace, self.model_name, shape.fingerprint()),
            rank_suffix(mla=mla, tp_rank=self.tp_rank, pp_rank=self.pp_rank, pp_size=self.pp_size),
            MLA_PARTS if mla else MHA_PARTS,
        )
        return scheme, regions

    # --- failure policy ---------------------------------------------------------------------

    def _guard(self, op: str, fn: Callable[[], T], miss: T, *, pause: bool = False) -> T:
        """Run ``fn``; any exception is logged (at most every 10 s) and answered as ``miss``.
        ``pause``: a call that asks the index (presence, sets) — answered ``miss`` at once while
        the store is left alone after a failure (``retry_after_s``), and a failure that says
        the store is down or too slow starts that pause."""
        if pause and self._pause.paused():
            return miss
        try:
            return fn()
        except Exception as e:
            if pause and isinstance(e, STORE_DOWN):
                self._pause.failed()
            now = time.monotonic()
            with self._errors_lock:
                say = now - self._errors_logged_at >= ERROR_LOG_INTERVAL_S
                if say:
                    self._errors_logged_at = now
            if say:
                self._log.warning("kvpool_sglang_call_failed", op=op, error=repr(e)[:300])
            return miss

    # --- the zero-copy interface (interface_v1) ---------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages have every component stored: one lookup for the batch."""
        if not keys:
            return 0
        return self._guard("batch_exists", lambda: self._leading_pages(keys), 0, pause=True)

    def _leading_pages(self, keys: Sequence[str]) -> int:
        names = self._kv_scheme().page_keys(keys)
        return self._client.prefix_match(names, fetch_entries=False, strict=True)

    def _kv_scheme(self) -> KeyScheme:
        if self._scheme is None:
            raise RuntimeError("register_mem_pool_host has not been called")
        return self._scheme

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read pages straight into the host pool at ``host_indices``: True per page read
        whole. A page not read whole is False (its host memory is then undefined, and SGLang
        does not use it)."""
        if self.mem_pool_host is not None and self.mem_pool_host.kv_buffer is None:
            return [True] * len(keys)
        started = time.perf_counter()
        done = self._guard(
            "batch_get_v1",
            lambda: self._get_pages(keys, host_indices, self.mem_pool_host, None),
            [False] * len(keys),
        )
        self._record("prefetch", done, time.perf_counter() - started)
        return done

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store pages from the host pool at ``host_indices`` (pages already stored are not
        sent again): True per page stored."""
        if self.mem_pool_host is not None and self.mem_pool_host.kv_buffer is None:
            return [True] * len(keys)
        started = time.perf_counter()
        done = self._guard(
            "batch_set_v1",
            lambda: self._set_pages(keys, host_indices, self.mem_pool_host, None),
            [False] * len(keys),
            pause=True,
        )
        self._record("backup", done, time.perf_counter() - started)
        return done

    def _record(self, kind: str, done: list[bool], seconds: float) -> None:
        """SGLang's storage metrics (``--enable-storage-metrics``): pages and GB/s per call."""
        if not self._metrics or not done:
            return
        pages = sum(done)
        pool = self.mem_pool_host
        page_bytes = int(getattr(pool, "size_per_token", 0)) * int(getattr(pool, "page_size", 1))
        gbps = pages * page_bytes / max(seconds, 1e-9) / (1 << 30)
        with self._errors_lock:
            self._io[f"{kind}_pgs"].append(pages)
            self._io[f"{kind}_bandwidth"].append(gbps)

    def _page_components(
        self, pool: Any, host_indices: torch.Tensor, pages: int, pool_name: Any
    ) -> tuple[KeyScheme, list[Component]]:
        if pool_name is None:
            scheme, regions = self._kv_scheme(), self._regions
        else:
            scheme, regions = self._pool_schemes[pool_name]
        indices = host_indices.detach().to(device="cpu")
        ptrs, sizes = pool.get_page_buffer_meta(indices)
        return scheme, components_from_meta(regions, ptrs, sizes, pages, scheme.parts)

    def _get_pages(
        self, keys: Sequence[str], host_indices: torch.Tensor, pool: Any, pool_name: Any
    ) -> list[bool]:
        if not keys:
            return []
        scheme, comps = self._page_components(pool, host_indices, len(keys), pool_name)
        names = scheme.page_keys(keys, "" if pool_name is None else str(pool_name))
        read = self._client.batch_get_into(names, [c.parts for c in comps])
        return [n is not None and n == c.nbytes for n, c in zip(read, comps, strict=True)]

    def _set_pages(
        self, keys: Sequence[str], host_indices: torch.Tensor, pool: Any, pool_name: Any
    ) -> list[bool]:
        if not keys:
            return []
        scheme, comps = self._page_components(pool, host_indices, len(keys), pool_name)
        names = scheme.page_keys(keys, "" if pool_name is None else str(pool_name))
        return self._put_components(names, comps)

    def _put_components(self, names: list[str], comps: Sequence[Component]) -> list[bool]:
        """Put the pages the index does not hold yet (each from its pieces of host memory)."""
        present = self._client.sizes(names, strict=True)
        stored = [
            size is not None and size == c.nbytes for size, c in zip(present, comps, strict=True)
        ]
        todo = [i for i, done in enumerate(stored) if not done]
        if todo:
            items = [(names[i], comps[i].parts) for i in todo]
            for i, ok in zip(todo, self._client.batch_put(items), strict=True):
                stored[i] = ok
        return stored

    # --- the copying interface (without interface_v1) ---------------------------------------

    def _flat_components(self, pages: Sequence[Any]) -> list[Component]:
        """The blocks of flat data pages (``get_data_page`` / ``get_dummy_flat_data_page``
        tensors): the whole page, K half then V half (MHA), in the pool's byte order — the
        bytes the zero-copy path sends for the same page."""
        out: list[Component] = []
        for page in pages:
            if not isinstance(page, torch.Tensor) or page.device.type != "cpu":
                raise TypeError(f"expected a CPU tensor page, got {type(page).__name__}")
            raw = memoryview(page.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            out.append(Component([raw]))
        return out

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None]:
        """Read pages into the given flat page tensors (SGLang's dummy pages): each tensor,
        or None where the page is not stored whole."""
        if not keys:
            return []
        return self._guard(
            "batch_get",
            lambda: self._get_flat(keys, target_locations),
            [None] * len(keys),
        )

    def _get_flat(self, keys: Sequence[str], targets: Any) -> list[torch.Tensor | None]:
        if targets is None:
            targets = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        if len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(targets)} target pages")
        for t in targets:
            if not t.is_contiguous():
                raise ValueError("target pages must be contiguous tensors")
        comps = self._flat_components(targets)
        names = self._kv_scheme().page_keys(keys)
        read = self._client.batch_get_into(names, [c.parts[0] for c in comps])
        return [
            t if n is not None and n == c.nbytes else None
            for t, n, c in zip(targets, read, comps, strict=True)
        ]

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store flat data pages (SGLang's ``get_data_page``): True when every page is stored."""
        if not keys or values is None or len(values) != len(keys):
            return False
        return self._guard(
            "batch_set", lambda: all(self._set_flat(keys, values)), False, pause=True
        )

    def _set_flat(self, keys: Sequence[str], values: Sequence[Any]) -> list[bool]:
        comps = self._flat_components(values)
        return self._put_components(self._kv_scheme().page_keys(keys), comps)

    def get(
        self,
        key: str,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> torch.Tensor | None:
        """One flat page (into ``target_location`` when it is a tensor), or None."""
        targets = [target_location] if isinstance(target_location, torch.Tensor) else None
        return self.batch_get([key], targets)[0]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store one flat page."""
        return value is not None and self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # --- hybrid pools (v2) ------------------------------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix when the KV pages and every side pool's pages must be stored,
        each side pool by its hit policy (every page, or the trailing window); one lookup."""
        return self._guard(
            "batch_exists_v2",
            lambda: self._exists_v2(keys, pool_transfers or []),
            PoolTransferResult(0, {}, []),
            pause=True,
        )

    def _exists_v2(self, keys: list[str], transfers: list[PoolTransfer]) -> PoolTransferResult:
        logical_kv = self.mem_pool_host is not None and self.mem_pool_host.kv_buffer is None
        names: list[str] = []
        spans: list[tuple[PoolTransfer, int, int]] = []
        if not logical_kv:
            names.extend(self._kv_scheme().page_keys(keys))
        for t in transfers:
            pool_scheme, _ = self._pool_schemes[t.name]
            start = len(names)
            names.extend(pool_scheme.page_keys(keys, str(t.name)))
            spans.append((t, start, len(names)))
        present = [s is not None for s in self._client.sizes(names, strict=True)] if names else []

        if logical_kv:
            kv_pages = len(keys)
        else:
            kv_present = present[: len(keys)]
            kv_pages = kv_present.index(False) if False in kv_present else len(keys)
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for t, start, end in spans:
            if not restorable:
                break
            page_ok = present[start:end]
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = page_ok.index(False) if False in page_ok[:kv_pages] else kv_pages
                allowed = set(range(1, boundary + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(t.keys) if t.keys else 1)
                allowed = {
                    n for n in range(1, kv_pages + 1) if all(page_ok[max(0, n - window) : n])
                }
                boundary = max(allowed, default=0)
            else:
                allowed, boundary = set(), 0  # a policy this backend does not serve: a miss
            if boundary:
                hit_count[t.name] = boundary
            restorable = [n for n in restorable if n in allowed]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Read each side pool's pages into its host pool: True per page read whole."""
        return {t.name: self._transfer(t, read=True) for t in transfers}

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        """Store each side pool's pages from its host pool: True per page stored."""
        return {t.name: self._transfer(t, read=False) for t in transfers}

    def _transfer(self, t: PoolTransfer, *, read: bool) -> list[bool]:
        keys = list(t.keys or [])
        pool = self.registered_pools.get(t.name)
        if pool is None or t.name not in self._pool_schemes or t.host_indices is None:
            return [False] * len(keys)
        op = self._get_pages if read else self._set_pages
        return self._guard(
            f"batch_{'get' if read else 'set'}_v2",
            lambda: op(keys, t.host_indices, pool, t.name),
            [False] * len(keys),
            pause=not read,
        )

    # --- the rest of the interface ----------------------------------------------------------

    def clear(self) -> None:
        """Remove this model's pages (every rank's) from the cluster, in prefix steps."""

        def clear_all() -> None:
            prefix = key_prefix(self.settings.namespace, self.model_name, "").rstrip("/") + "/"
            while self._client.remove_prefix(prefix)[1]:
                pass

        self._guard("clear", clear_all, None)

    def close(self) -> None:
        if self._own_client:
            self._client.close()

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (None unless storage metrics are on)."""
        if not self._metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        with self._errors_lock:
            for name, values in self._io.items():
                getattr(metrics, name).extend(values)
                values.clear()
        return metrics


__all__ = ["KVPoolHiCacheStorage"]
