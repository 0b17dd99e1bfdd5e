"""Between ``transformers``' KV cache and one tensor per run of tokens.

kvpool stores a block of ``block_size`` tokens as one tensor of shape
``(layers, 2, kv_heads, tokens, head_dim)`` — K and V of every layer — cut along the token axis
(:data:`TOKEN_AXIS`). These helpers read such a tensor out of a ``DynamicCache`` and build a
``DynamicCache`` from one, across the transformers versions the ``llm`` extra allows (the cache
holds ``layers`` of keys/values since 4.56; older ones ``key_cache``/``value_cache`` lists).
"""

from __future__ import annotations

import inspect
from typing import Any

TOKEN_AXIS = 3
"""The token axis of a KV tensor (layers, 2, kv_heads, tokens, head_dim)."""


def new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def cache_argument(model: Any) -> str:
    """The name under which ``model.forward`` takes the cache (``cache`` in recent transformers,
    ``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def layers_of(cache: Any) -> list[tuple[Any, Any]]:
    """Each layer's (keys, values), each (batch, kv_heads, tokens, head_dim)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def kv_tensor(cache: Any, start: int, end: int) -> Any:
    """Tokens ``start:end`` of the cache (batch 0) as one contiguous tensor
    (layers, 2, kv_heads, end - start, head_dim)."""
    import torch

    return torch.stack(
        [torch.stack((k[0, :, start:end], v[0, :, start:end])) for k, v in layers_of(cache)]
    ).contiguous()


def cache_from_kv(kv: Any) -> Any:
    """A DynamicCache holding ``kv`` (layers, 2, kv_heads, tokens, head_dim) for batch 1."""
    cache = new_cache()
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
    return cache
