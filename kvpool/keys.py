"""The KV-cache key scheme (``docs/keys.md``): ``from kvpool.keys import KeyNamespace, block_keys``.

    ns = KeyNamespace(model="my-llama", dtype="float16", kv_layout="hf:L,2,H,T,D", block_size=64)
    keys = block_keys(ns, prompt_token_ids)        # one key per full block, chained
    cached = client.prefix_match(keys)             # how many leading blocks the pool holds

The scheme itself lives in :mod:`kvpool.proto.keys` (it is part of the wire contract); this module
re-exports it and raises kvpool's typed :class:`~kvpool.errors.InvalidArgumentError` (a
``ValueError``) for bad input.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpool.errors import InvalidArgumentError
from kvpool.proto import keys as _keys
from kvpool.proto.keys import (
    HASH_BYTES,
    KEY_PREFIX,
    KEY_SCHEME_VERSION,
    KeyNamespace,
    canonical_dtype,
    full_blocks,
    is_scheme_key,
)

__all__ = [
    "HASH_BYTES",
    "KEY_PREFIX",
    "KEY_SCHEME_VERSION",
    "KeyNamespace",
    "block_hash",
    "block_keys",
    "canonical_dtype",
    "chain_hashes",
    "full_blocks",
    "is_scheme_key",
    "key_for",
    "namespace",
]


def namespace(
    model: str,
    *,
    dtype: str,
    kv_layout: str,
    block_size: int,
    revision: str = "",
    tp_rank: int = 0,
    tp_size: int = 1,
    extra: str = "",
) -> KeyNamespace:
    """A :class:`KeyNamespace`; InvalidArgumentError names a bad field."""
    try:
        return KeyNamespace(
            model=model,
            dtype=dtype,
            kv_layout=kv_layout,
            block_size=block_size,
            revision=revision,
            tp_rank=tp_rank,
            tp_size=tp_size,
            extra=extra,
        )
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"key namespace: {e}") from None


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """One block's 16-byte hash from its parent's hash and its token ids."""
    try:
        return _keys.block_hash(parent, token_ids)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(str(e)) from None


def chain_hashes(
    ns: KeyNamespace, token_ids: Sequence[int] | Iterable[int], *, parent: bytes | None = None
) -> list[bytes]:
    """The 16-byte hash of every full block of ``token_ids``, in order."""
    try:
        tokens = token_ids if isinstance(token_ids, Sequence) else list(token_ids)
        return _keys.chain_hashes(ns, tokens, parent=parent)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(str(e)) from None


def key_for(ns: KeyNamespace, hash_: bytes) -> str:
    """The key of the block whose hash is ``hash_``."""
    try:
        return _keys.key_for(ns, hash_)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(str(e)) from None


def block_keys(
    ns: KeyNamespace, token_ids: Sequence[int] | Iterable[int], *, parent: bytes | None = None
) -> list[str]:
    """The key of every full block of ``token_ids`` (a trailing partial block gets none)."""
    try:
        return _keys.block_keys(ns, token_ids, parent=parent)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(str(e)) from None
