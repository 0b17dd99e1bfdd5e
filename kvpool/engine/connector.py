"""The engine's link to kvpool: load the cached KV of a prompt's leading blocks, save new ones.

    connector = KVConnector(client, namespace, kv_shape=(layers, 2, kv_heads, head_dim),
                            dtype="float32", cost_model=CostModel())
    loaded = connector.load(prompt_ids)      # LoadResult: kv tensor of the first loaded.tokens
    ...prefill prompt_ids[loaded.tokens:] on top of it...
    connector.save(all_ids, cache, from_block=loaded.matched_blocks)

Load: the prompt's block keys (:mod:`kvpool.keys`), the cost model's plan (skip blocks on a tier
slower than recomputing them, or the whole cache), one ``prefix_match``, one batched get of the
matched blocks, and the leading run of hits joined into one tensor. Any failure of the store —
dead masters or nodes, timeouts, a block lost between the match and the read, a block that does
not decode — only shortens that run: the engine recomputes the rest. Nothing here raises because
the store failed.

A failure of the store itself — the client raised (a client made with ``strict=True`` raises
instead of answering "nothing cached") — pauses the connector for ``retry_after_s``: requests in
that window do not wait for a dead store's deadline again; the first one after it tries again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpool.client.cost import CostModel, ReadPlan
from kvpool.client.pause import StorePause
from kvpool.client.tensors import BlockStore, get_tensor_blocks, put_tensor_blocks
from kvpool.engine.kvcache import TOKEN_AXIS, cache_length, kv_tensor
from kvpool.errors import InvalidArgumentError, KVPoolError
from kvpool.keys import KeyNamespace, block_keys
from kvpool.logs import get_logger


class KVStoreClient(BlockStore, Protocol):
    """What the connector needs of a client (``kvpool.Client`` has it)."""

    def prefix_match(self, keys: Sequence[str]) -> int: ...

    @property
    def stats(self) -> dict[str, Any]: ...


@dataclass
class LoadResult:
    prompt_blocks: int = 0
    """Full blocks in the prompt (the ones with keys)."""
    matched_blocks: int = 0
    """Leading blocks the index holds (prefix_match)."""
    loaded_blocks: int = 0
    """Leading blocks read, checked and joined."""
    tokens: int = 0
    """Tokens whose KV ``kv`` holds: loaded blocks, but never the prompt's last token (its
    logits are needed, so it is always computed)."""
    bytes: int = 0
    seconds: float = 0.0
    skipped_slow_tier: int = 0
    """Blocks the client skipped because they were only on a tier slower than recomputing."""
    plan: ReadPlan | None = None
    kv: Any = None
    """(layers, 2, kv_heads, tokens, head_dim) torch tensor, or None."""
    failure: str = ""
    """Why the store could not be used this time ("" when it could, or when the cost model
    chose not to)."""


@dataclass
class SaveResult:
    blocks: int = 0
    stored: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failure: str = ""


@dataclass
class ConnectorTotals:
    loads: int = 0
    prompt_blocks: int = 0
    loaded_blocks: int = 0
    bytes_loaded: int = 0
    skipped_slow_tier: int = 0
    cache_skipped: int = 0
    failures: int = 0
    saved_blocks: int = 0
    bytes_saved: int = 0
    failed_saves: int = 0
    plans: list[str] = field(default_factory=list)


def _slow_tier_misses(client: Any) -> int:
    try:
        return int(client.stats["misses_by_reason"].get("slow_tier", 0))
    except (AttributeError, KeyError, TypeError):
        return 0


class KVConnector:
    """Loads and saves a model's KV blocks through a kvpool client; see the module doc."""

    def __init__(
        self,
        client: KVStoreClient,
        namespace: KeyNamespace,
        *,
        kv_shape: tuple[int, int, int, int],
        dtype: str,
        cost_model: CostModel | None = None,
        retry_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
    ) -> None:
        layers, two, kv_heads, head_dim = kv_shape
        if two != 2:
            raise InvalidArgumentError(f"kv_shape: (layers, 2, kv_heads, head_dim), got {kv_shape}")
        self.client = client
        self.namespace = namespace
        self.block_size = namespace.block_size
        self.kv_shape = kv_shape
        self.dtype = dtype
        self.block_bytes = layers * 2 * kv_heads * head_dim * self.block_size * _itemsize(dtype)
        self.cost_model = cost_model
        self._store_pause = StorePause(retry_after_s, clock)
        self.totals = ConnectorTotals()
        self._log = logger if logger is not None else get_logger("kvpool.engine")

    def keys(self, tokens: Sequence[int]) -> list[str]:
        return block_keys(self.namespace, tokens)

    def load(self, tokens: Sequence[int]) -> LoadResult:
        """The cached KV of the leading blocks of ``tokens`` (a prompt)."""
        started = time.perf_counter()
        keys = self.keys(tokens)
        result = LoadResult(prompt_blocks=len(keys))
        self.totals.loads += 1
        self.totals.prompt_blocks += len(keys)
        # The last token is always computed: blocks wholly after it are of no use.
        keys = keys[: -(-(len(tokens) - 1) // self.block_size)]
        if not keys:
            return result
        if self.cost_model is not None:
            result.plan = self.cost_model.plan(
                blocks=len(keys), block_bytes=self.block_bytes, block_tokens=self.block_size
            )
            self.totals.plans.append(result.plan.describe())
            if not result.plan.fetch:
                self.totals.cache_skipped += 1
                result.seconds = time.perf_counter() - started
                return result
        if self._store_pause.paused():
            result.failure = "store skipped: it failed recently"
            return self._finish(result, started)
        max_tier = result.plan.max_tier if result.plan is not None else None
        try:
            result.matched_blocks = self.client.prefix_match(keys)
            if result.matched_blocks:
                slow_before = _slow_tier_misses(self.client)
                read = get_tensor_blocks(
                    self.client, keys[: result.matched_blocks], like="torch", max_tier=max_tier
                )
                result.skipped_slow_tier = _slow_tier_misses(self.client) - slow_before
                self._accept(result, read.tensor, read.blocks, len(tokens))
        except InvalidArgumentError:
            raise
        except KVPoolError as e:  # the store failed (a strict client, or a closed one)
            result.failure = f"{type(e).__name__}: {e.message}"
            self._store_pause.failed()
        missing = result.matched_blocks - result.loaded_blocks
        if missing and not result.failure and not result.skipped_slow_tier:
            result.failure = (
                f"{missing} of {result.matched_blocks} matched blocks could not be read"
            )
        return self._finish(result, started)

    def _finish(self, result: LoadResult, started: float) -> LoadResult:
        result.seconds = time.perf_counter() - started
        self.totals.loaded_blocks += result.loaded_blocks
        self.totals.bytes_loaded += result.bytes
        self.totals.skipped_slow_tier += result.skipped_slow_tier
        self.totals.failures += bool(result.failure)
        if result.failure:
            self._log.debug("kv_load_fell_back", reason=result.failure)
        if self.cost_model is not None and result.loaded_blocks and not result.failure:
            # Which tier served each block is not known here; most reads are from memory.
            self.cost_model.observe_read("cpu", result.loaded_blocks, result.bytes, result.seconds)
        return result

    def _accept(self, result: LoadResult, kv: Any, blocks: int, prompt_len: int) -> None:
        if kv is None or blocks == 0:
            return
        layers, _, kv_heads, head_dim = self.kv_shape
        expected = (layers, 2, kv_heads, blocks * self.block_size, head_dim)
        if tuple(kv.shape) != expected or str(kv.dtype).removeprefix("torch.") != self.dtype:
            result.failure = f"blocks of shape {tuple(kv.shape)} {kv.dtype}, expected {expected}"
            return
        result.loaded_blocks = blocks
        result.bytes = blocks * self.block_bytes
        result.tokens = min(blocks * self.block_size, prompt_len - 1)
        result.kv = kv.narrow(TOKEN_AXIS, 0, result.tokens)

    def save(self, tokens: Sequence[int], cache: Any, *, from_block: int = 0) -> SaveResult:
        """Store the full blocks of ``tokens`` from ``from_block`` on, their KV taken from
        ``cache`` (which holds the KV of at least those tokens). Best effort."""
        started = time.perf_counter()
        n_blocks = min(len(tokens), cache_length(cache)) // self.block_size
        result = SaveResult()
        if from_block >= n_blocks:
            return result
        keys = self.keys(tokens[: n_blocks * self.block_size])[from_block:]
        result.blocks = len(keys)
        if self._store_pause.paused():
            result.failure = "store skipped: it failed recently"
        else:
            kv = kv_tensor(cache, from_block * self.block_size, n_blocks * self.block_size)
            try:
                stored = put_tensor_blocks(
                    self.client,
                    keys,
                    kv,
                    axis=TOKEN_AXIS,
                    block_len=self.block_size,
                    start_row=from_block * self.block_size,
                )
                result.stored = sum(stored)
            except InvalidArgumentError:
                raise
            except KVPoolError as e:
                result.failure = f"{type(e).__name__}: {e.message}"
                self._store_pause.failed()
        if result.stored < result.blocks and not result.failure:
            result.failure = f"{result.blocks - result.stored} of {result.blocks} puts failed"
        result.bytes = result.stored * self.block_bytes
        result.seconds = time.perf_counter() - started
        self.totals.saved_blocks += result.stored
        self.totals.bytes_saved += result.bytes
        self.totals.failed_saves += bool(result.failure)
        return result


def _itemsize(dtype: str) -> int:
    sizes = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
    try:
        return sizes[dtype]
    except KeyError:
        raise InvalidArgumentError(f"dtype: expected one of {', '.join(sizes)}") from None
