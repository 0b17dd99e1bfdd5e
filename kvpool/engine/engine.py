"""An example inference engine: prefill with KV blocks from kvpool, greedy decode, save blocks.

    engine = Engine.create(ModelSpec(), client=kv, block_size=64)   # client=None: no cache
    out = engine.generate(prompt_ids, max_new_tokens=16)
    out.tokens, out.ttft_s, out.load.loaded_blocks

One request, batch 1, on the CPU: the shortest path that shows what the cache changes. Time to
first token (TTFT) runs from the call to the first generated token: the key hashing, the
lookup and reads, building the cache, the prefill of the tokens not loaded, and the first
argmax. Saving the new blocks happens after the last token (an engine would do it in the
background), so it is in ``total_s`` but not in the TTFT.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.client.cost import CostModel
from kvpool.engine.connector import KVConnector, KVStoreClient, LoadResult, SaveResult
from kvpool.engine.kvcache import cache_argument, cache_from_kv, new_cache
from kvpool.engine.model import ModelSpec
from kvpool.errors import InvalidArgumentError
from kvpool.keys import KeyNamespace


@dataclass
class Generation:
    prompt_tokens: int
    tokens: list[int]
    """The generated ids (greedy)."""
    logits: list[Any]
    """The logits (float32 CPU tensors) that chose each generated token."""
    ttft_s: float
    total_s: float
    prefill_tokens: int
    """Prompt tokens computed (the rest came from the cache)."""
    prefill_s: float
    load: LoadResult | None
    save: SaveResult | None


def namespace_for(spec: ModelSpec, block_size: int, *, tp_rank: int = 0) -> KeyNamespace:
    """The key namespace of this model's KV blocks."""
    return KeyNamespace(
        model=spec.name,
        revision=f"seed-{spec.seed}",
        dtype=spec.dtype,
        kv_layout=spec.kv_layout,
        block_size=block_size,
        tp_rank=tp_rank,
        tp_size=1,
    )


class Engine:
    """A model and, optionally, a :class:`KVConnector` to kvpool."""

    def __init__(self, model: Any, spec: ModelSpec, connector: KVConnector | None = None) -> None:
        self.model = model
        self.spec = spec
        self.connector = connector
        self._cache_arg = cache_argument(model)

    def warm_up(self) -> None:
        """One small forward pass, so that one-off start-up costs (kernel selection, lazy
        allocations) are not measured as the first request's prefill."""
        import torch

        with torch.inference_mode():
            self._forward(list(range(8)), new_cache())

    @classmethod
    def create(
        cls,
        spec: ModelSpec,
        *,
        client: KVStoreClient | None = None,
        block_size: int = 64,
        cost_model: CostModel | None = None,
        model: Any = None,
    ) -> Engine:
        """An engine for ``spec`` (``model``: an already built one, to share weights between
        engines), using kvpool through ``client`` when given."""
        model = model if model is not None else spec.build()
        connector = None
        if client is not None:
            connector = KVConnector(
                client,
                namespace_for(spec, block_size),
                kv_shape=(spec.layers, 2, spec.kv_heads, spec.head_dim),
                dtype=spec.dtype,
                cost_model=cost_model,
            )
        engine = cls(model, spec, connector)
        engine.warm_up()
        return engine

    def _forward(self, ids: list[int], cache: Any) -> Any:
        import torch

        out = self.model(
            input_ids=torch.tensor([ids], dtype=torch.long),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_arg: cache},
        )
        return out.logits[0, -1].float()

    def _observe_prefill(self, tokens: int, seconds: float) -> None:
        """Teach the cost model what recomputing costs (prefills of a block or more only: a
        few tokens measure the per-call overhead, not the per-token cost)."""
        connector = self.connector
        cost = connector.cost_model if connector is not None else None
        if connector is not None and cost is not None and tokens >= connector.block_size:
            cost.observe_recompute(tokens, seconds)

    def generate(self, prompt: Sequence[int], max_new_tokens: int = 16) -> Generation:
        """Greedy generation of ``max_new_tokens`` tokens after ``prompt``."""
        import torch

        if not prompt:
            raise InvalidArgumentError("the prompt must hold at least one token")
        if max_new_tokens < 1:
            raise InvalidArgumentError("max_new_tokens: must be at least 1")
        prompt = [int(t) for t in prompt]
        if len(prompt) + max_new_tokens > self.spec.max_positions:
            raise InvalidArgumentError(
                f"{len(prompt)} + {max_new_tokens} tokens exceed the model's "
                f"{self.spec.max_positions} positions"
            )
        with torch.inference_mode():
            started = time.perf_counter()
            load = self.connector.load(prompt) if self.connector is not None else None
            cache = cache_from_kv(load.kv) if load is not None and load.kv is not None else None
            cache = cache if cache is not None else new_cache()
            start = load.tokens if load is not None else 0
            prefill_started = time.perf_counter()
            logits = self._forward(prompt[start:], cache)
            token = int(logits.argmax())
            ttft = time.perf_counter() - started
            prefill_s = time.perf_counter() - prefill_started
            self._observe_prefill(len(prompt) - start, prefill_s)
            tokens, all_logits = [token], [logits.clone()]
            for _ in range(max_new_tokens - 1):
                logits = self._forward([token], cache)
                token = int(logits.argmax())
                tokens.append(token)
                all_logits.append(logits.clone())
            save = None
            if self.connector is not None:
                assert load is not None
                fed = prompt + tokens[:-1]  # the cache holds the KV of every token fed in
                save = self.connector.save(fed, cache, from_block=load.matched_blocks)
            total = time.perf_counter() - started
        return Generation(
            prompt_tokens=len(prompt),
            tokens=tokens,
            logits=all_logits,
            ttft_s=ttft,
            total_s=total,
            prefill_tokens=len(prompt) - start,
            prefill_s=prefill_s,
            load=load,
            save=save,
        )
