"""The worker side of the vLLM connector: pages of vLLM's KV cache to and from kvpool.

No vLLM import: it is given the layer tensors (``register_kv_caches``) and each step's plan
(:class:`~kvpool.integrations.vllm_plan.StepPlan`), and answers which blocks failed to load.

**Pages.** Where a layer's page of a block is one contiguous run of host memory (vLLM's CPU
cache), the page *is* the buffer a save sends and a load receives into (:class:`HostPages`):
no copy on either side. Anywhere else (a device tensor, a layout whose page is strided) a
page goes through a host buffer of its own (:class:`StagedPages`): one copy each way.

**Loads** (:meth:`Transfers.start_load`) run on a loader thread, layer by layer, in layer
order: the forward pass waits in ``wait_for_layer_load`` only for the layer it is about to
use. One lookup (``sizes``) learns every page's index entry first, so each layer is then one
read per node. A block whose page is missing, of the wrong size or unreadable fails, and so
does every later block of its request (vLLM recomputes from the first failed block, so later
layers do not even read them). A load that outlives ``timeout_s`` reads no further layers.
The client never writes into a buffer after its call returned, and every layer waits for its
call, so nothing lands in vLLM's memory once the step moved on. Should the forward pass not
have waited for a layer that was loading, every block of that step is reported failed:
nothing read behind vLLM's back is ever used.

**Saves** (:meth:`Transfers.save`) go to a saver thread, one ``batch_put`` (one commit) per
step, off the forward pass: the step only collects which pages to send. vLLM keeps the blocks
of a finished request until :meth:`Transfers.finished_saving` reports them, and a preempted
request's saves are waited for before its blocks can be overwritten (``handle_preemptions``).
A failed store is left alone for ``retry_after_s``: saves in that window are dropped (a cache
may lose blocks), loads fail at once.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpool.client.pause import StorePause
from kvpool.client.values import BytesLike, WritableBuffer
from kvpool.errors import ConfigError, KVPoolError
from kvpool.integrations.vllm_blocks import PagedLayout
from kvpool.integrations.vllm_plan import BlockTransfer
from kvpool.logs import get_logger

OVERDUE_LOG_S = 5.0
"""How long past its deadline a load is waited for before it is logged as overdue."""


class PageStore(Protocol):
    """Where the pages of every layer are."""

    zero_copy: bool

    def send_buffer(self, layer: int, block_id: int) -> BytesLike:
        """The bytes of a page to save (read before the save returns)."""
        ...

    def receive_buffer(self, layer: int, block_id: int) -> WritableBuffer:
        """A buffer to read a page into."""
        ...

    def received(self, layer: int, block_id: int, buffer: WritableBuffer) -> None:
        """A page was read into ``buffer`` (from :meth:`receive_buffer`)."""
        ...


class WorkerClient(Protocol):
    """What the worker needs of a kvpool client (``kvpool.Client`` has it)."""

    def sizes(self, keys: Sequence[str]) -> list[int | None]: ...

    def batch_get_into(
        self, keys: Sequence[str], buffers: Sequence[Any], *, strict: bool | None = None
    ) -> list[int | None]: ...

    def batch_put_receipts(
        self, items: Sequence[tuple[str, Any]], *, strict: bool | None = None
    ) -> list[Any]: ...


def _torch() -> Any:
    import torch

    return torch


def _page_is_contiguous(tensor: Any) -> bool:
    """Whether each ``tensor[b]`` is one contiguous run (dims after the first are packed)."""
    expected = 1
    for size, stride in zip(reversed(tensor.shape[1:]), reversed(tensor.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


class HostPages:
    """Pages of host tensors, each a contiguous run: sent from and received into in place."""

    zero_copy = True

    def __init__(self, tensors: Sequence[Any], page_bytes: int) -> None:
        self._tensors = list(tensors)  # kept alive: the views below point into them
        self._views: list[memoryview] = []
        self._block_stride: list[int] = []
        self.page_bytes = page_bytes
        for t in self._tensors:
            if t.device.type != "cpu" or not _page_is_contiguous(t):
                raise ConfigError("HostPages needs CPU tensors whose pages are contiguous")
            item = t.element_size()
            if item * t[0].numel() != page_bytes:
                raise ConfigError(f"a page of {item * t[0].numel()} bytes, expected {page_bytes}")
            extent = item * ((t.shape[0] - 1) * t.stride(0)) + page_bytes
            raw = (ctypes.c_uint8 * extent).from_address(t.data_ptr())
            self._views.append(memoryview(raw).cast("B"))
            self._block_stride.append(item * t.stride(0))

    def _page(self, layer: int, block_id: int) -> memoryview:
        start = block_id * self._block_stride[layer]
        return self._views[layer][start : start + self.page_bytes]

    def send_buffer(self, layer: int, block_id: int) -> BytesLike:
        return self._page(layer, block_id)

    def receive_buffer(self, layer: int, block_id: int) -> WritableBuffer:
        return self._page(layer, block_id)

    def received(self, layer: int, block_id: int, buffer: WritableBuffer) -> None:
        return  # it was read in place


class StagedPages:
    """Pages of any tensor (a device, a strided layout): copied through host buffers."""

    zero_copy = False

    def __init__(self, tensors: Sequence[Any], page_bytes: int) -> None:
        self._tensors = list(tensors)
        self.page_bytes = page_bytes
        for t in self._tensors:
            if t.element_size() * t[0].numel() != page_bytes:
                raise ConfigError(f"a page of {t.element_size() * t[0].numel()} bytes")

    def send_buffer(self, layer: int, block_id: int) -> BytesLike:
        torch = _torch()
        page = self._tensors[layer][block_id].contiguous().cpu()
        host: BytesLike = page.reshape(-1).view(torch.uint8).numpy()
        return host

    def receive_buffer(self, layer: int, block_id: int) -> WritableBuffer:
        return bytearray(self.page_bytes)

    def received(self, layer: int, block_id: int, buffer: WritableBuffer) -> None:
        torch = _torch()
        target = self._tensors[layer][block_id]
        raw = torch.frombuffer(buffer, dtype=torch.uint8)
        target.copy_(raw.view(target.dtype).view(target.shape))


def page_store(tensors: Sequence[Any], page_bytes: int) -> PageStore:
    """Zero-copy pages where the tensors allow it, staged ones otherwise."""
    if all(t.device.type == "cpu" and _page_is_contiguous(t) for t in tensors):
        return HostPages(tensors, page_bytes)
    return StagedPages(tensors, page_bytes)


@dataclass
class _Load:
    transfers: tuple[BlockTransfer, ...]
    done: list[threading.Event]
    waited: list[bool]
    started: float
    failed: set[int] = field(default_factory=set)
    future: Future[None] | None = None


@dataclass
class WorkerTotals:
    loads: int = 0
    loaded_pages: int = 0
    failed_blocks: int = 0
    unwaited_loads: int = 0
    saves: int = 0
    saved_pages: int = 0
    failed_pages: int = 0
    dropped_saves: int = 0
    store_failures: int = 0


class Transfers:
    """Loads and saves of one worker; see the module doc."""

    def __init__(
        self,
        client: WorkerClient,
        layout: PagedLayout,
        rank: int,
        *,
        timeout_s: float,
        retry_after_s: float,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
    ) -> None:
        self.client = client
        self.layout = layout
        self.rank = rank
        self.timeout_s = timeout_s
        self._clock = clock
        self._log = logger if logger is not None else get_logger("kvpool.vllm")
        self.pages: PageStore | None = None
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvpool-vllm-load")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvpool-vllm-save")
        self._load: _Load | None = None
        self._lock = threading.Lock()
        self._pending: dict[str, int] = defaultdict(int)
        self._saved = threading.Condition(self._lock)
        self._held: set[str] = set()
        self._finished: set[str] = set()
        self._pause = StorePause(retry_after_s, clock)
        self.totals = WorkerTotals()

    # --- set-up --------------------------------------------------------------------------------

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        missing = [n for n in self.layout.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"vLLM registered no KV cache for layers {missing}")
        tensors = [kv_caches[name] for name in self.layout.layer_names]
        self.pages = page_store(tensors, self.layout.page_bytes)
        self._log.info(
            "kv_caches_registered",
            layers=len(tensors),
            page_bytes=self.layout.page_bytes,
            zero_copy=self.pages.zero_copy,
        )

    def _store_failed(self, what: str, error: Exception | str) -> None:
        self._pause.failed()
        self.totals.store_failures += 1
        self._log.warning(
            "kv_store_failed", op=what, error=str(error), retry_after_s=self._pause.retry_after_s
        )

    # --- loads ---------------------------------------------------------------------------------

    def start_load(self, transfers: Sequence[BlockTransfer]) -> None:
        """Start reading the pages of ``transfers`` (before the forward pass)."""
        self.finish_load()  # a previous step's load is always finished by now; be sure
        if not transfers or self.pages is None:
            return
        layers = self.layout.layers
        load = _Load(
            tuple(transfers),
            [threading.Event() for _ in range(layers)],
            [False] * layers,
            self._clock(),
        )
        self._load = load
        self.totals.loads += 1
        if self._pause.paused():
            load.failed.update(b for t in transfers for b in t.block_ids)
            for event in load.done:
                event.set()
            return
        load.future = self._loader.submit(self._run_load, load)

    def _run_load(self, load: _Load) -> None:
        try:
            self._read_layers(load)
        except Exception as e:
            load.failed.update(b for t in load.transfers for b in t.block_ids)
            self._log.warning("kv_load_error", error=f"{type(e).__name__}: {e}")
        finally:
            for event in load.done:
                event.set()

    def _read_layers(self, load: _Load) -> None:
        layout, pages = self.layout, self.pages
        assert pages is not None
        # Per transfer, how many leading blocks are still good (reading stops at a failure).
        good = [len(t.block_ids) for t in load.transfers]
        keys_of = [
            [layout.block_keys(self.rank, h) for h in t.hashes[self.rank]] for t in load.transfers
        ]
        try:
            sizes = self.client.sizes([k for keys in keys_of for block in keys for k in block])
        except KVPoolError as e:
            self._store_failed("load", e)
            sizes = [None] * sum(len(keys) * layout.layers for keys in keys_of)
        at = 0
        for i, keys in enumerate(keys_of):
            for b, block in enumerate(keys):
                if any(s != layout.page_bytes for s in sizes[at : at + len(block)]):
                    good[i] = min(good[i], b)
                at += len(block)
        for layer in range(layout.layers):
            if self._clock() - load.started > self.timeout_s:
                good = [0] * len(good)
            names: list[str] = []
            buffers: list[Any] = []
            where: list[tuple[int, int]] = []
            for i, t in enumerate(load.transfers):
                for b in range(good[i]):
                    names.append(keys_of[i][b][layer])
                    buffers.append(pages.receive_buffer(layer, t.block_ids[b]))
                    where.append((i, b))
            if names:
                got = self.client.batch_get_into(names, buffers, strict=False)
                for (i, b), size, buffer in zip(where, got, buffers, strict=True):
                    if size != layout.page_bytes:
                        good[i] = min(good[i], b)
                    elif b < good[i]:
                        pages.received(layer, load.transfers[i].block_ids[b], buffer)
                        self.totals.loaded_pages += 1
            load.done[layer].set()
        for i, t in enumerate(load.transfers):
            load.failed.update(t.block_ids[good[i] :])

    def wait_layer(self, layer_name: str) -> None:
        """Block until this step's pages of ``layer_name`` are in place (or failed)."""
        load = self._load
        if load is None or layer_name not in self.layout.layer_names:
            return  # nothing loading, or a layer whose KV kvpool does not hold
        layer = self.layout.layer_names.index(layer_name)
        load.waited[layer] = True
        event = load.done[layer]
        if not event.wait(self.timeout_s + OVERDUE_LOG_S):
            # The client bounds every call by its deadline; never let the forward pass run
            # while a read may still land in this layer.
            self._log.error("kv_load_overdue", layer=layer_name)
            event.wait()

    def finish_load(self) -> set[int]:
        """End this step's load: the vLLM block ids that failed (after the forward pass)."""
        load, self._load = self._load, None
        if load is None:
            return set()
        for event in load.done:
            event.wait()
        if load.future is not None:
            load.future.result()
        if not all(load.waited):
            # The forward pass may have used a layer before it was read: recompute it all.
            self.totals.unwaited_loads += 1
            load.failed.update(b for t in load.transfers for b in t.block_ids)
        if load.failed:
            self.totals.failed_blocks += len(load.failed)
            self._log.info("kv_load_failed_blocks", blocks=len(load.failed))
        return load.failed

    # --- saves ---------------------------------------------------------------------------------

    def save(self, transfers: Sequence[BlockTransfer]) -> None:
        """Send the pages of ``transfers`` (after the forward pass), off the caller's thread."""
        if not transfers or self.pages is None:
            return
        if self._pause.paused():
            self.totals.dropped_saves += 1
            return
        layout, pages = self.layout, self.pages
        items: list[tuple[str, Any]] = []
        seen: set[bytes] = set()  # requests of one step sharing a prefix share its blocks
        for t in transfers:
            for block_id, h in zip(t.block_ids, t.hashes[self.rank], strict=True):
                if h in seen:
                    continue
                seen.add(h)
                for layer, key in enumerate(layout.block_keys(self.rank, h)):
                    items.append((key, pages.send_buffer(layer, block_id)))
        owners = [t.req_id for t in transfers]
        with self._lock:
            for req_id in owners:
                self._pending[req_id] += 1
        self.totals.saves += 1
        self._saver.submit(self._run_save, items, owners)

    def _run_save(self, items: list[tuple[str, Any]], owners: list[str]) -> None:
        try:
            if self._pause.paused():
                self.totals.dropped_saves += 1
                return
            receipts = self.client.batch_put_receipts(items, strict=False)
            stored = sum(r is not None for r in receipts)
            self.totals.saved_pages += stored
            self.totals.failed_pages += len(items) - stored
            if stored == 0:
                self._store_failed("save", f"none of {len(items)} pages stored")
        except Exception as e:
            self.totals.failed_pages += len(items)
            self._store_failed("save", f"{type(e).__name__}: {e}")
        finally:
            with self._lock:
                for req_id in owners:
                    self._pending[req_id] -= 1
                    if self._pending[req_id] <= 0:
                        del self._pending[req_id]
                self._saved.notify_all()

    def hold(self, req_ids: Sequence[str]) -> None:
        """vLLM keeps these finished requests' blocks until reported by finished_saving."""
        with self._lock:
            self._held.update(req_ids)

    def finished_saving(self, finished_req_ids: set[str]) -> set[str]:
        """Held requests (among those vLLM reported finished) whose saves are all done."""
        with self._lock:
            self._finished |= finished_req_ids & self._held
            done = {r for r in self._finished if r not in self._pending}
            self._finished -= done
            self._held -= done
        return done

    def drain(self, req_ids: Sequence[str]) -> None:
        """Wait until these requests' saves are done (their blocks are about to be reused)."""
        wanted = set(req_ids)
        if not wanted:
            return
        with self._lock:
            while wanted & self._pending.keys():
                self._saved.wait(self.timeout_s)

    def close(self) -> None:
        self.finish_load()
        self._loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)
