"""vLLM's paged KV blocks as kvpool keys: pure, no vLLM import (the scheduler and the workers
of one engine, and every engine of a fleet, must compute the same keys).

A vLLM block holds ``block_size`` tokens; each attention layer keeps that block in a *page* of
its own KV tensor (on the CPU backend ``[num_blocks, kv_heads, block_size, 2 * head_size]`` per
layer, so one page is one contiguous run of bytes). kvpool stores **one object per (block,
layer)**: its bytes are exactly the page's bytes, so a save sends the page from vLLM's memory
and a load receives into it, with no copy in between.

Keys follow ``docs/keys.md``: the block's chained hash in the namespace of the engine's model,
revision, KV dtype, layout (vLLM's physical layout, the page's shape and the layer count),
block size and tensor-parallel rank, then ``/<layer index>``::

    kv1/<namespace fingerprint>/<block hash>/<layer>

Two engines that differ in any of those never share a key; a block's key names its whole
prefix (the hash chain), so a hit is always the KV of exactly that prefix.

A prefix match asks for the keys block by block, every rank's layers in turn (block 0: rank 0
layer 0, rank 0 layer 1, ..., rank 1 layer 0, ...; then block 1), so the number of leading keys
held, divided by layers x ranks, is the number of leading blocks held whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.errors import ConfigError
from kvpool.keys import KeyNamespace, chain_hashes, key_for, namespace


@dataclass(frozen=True)
class PagedLayout:
    """What one engine's KV blocks are, as the scheduler and every worker see them."""

    block_size: int
    layer_names: tuple[str, ...]
    page_bytes: int
    """One layer's page of one block, in bytes (the size of every object)."""
    namespaces: tuple[KeyNamespace, ...]
    """One per tensor-parallel rank."""

    @property
    def layers(self) -> int:
        return len(self.layer_names)

    @property
    def tp_size(self) -> int:
        return len(self.namespaces)

    @property
    def keys_per_block(self) -> int:
        """Objects one block is stored as, over all ranks."""
        return self.layers * self.tp_size

    def key(self, rank: int, block_hash: bytes, layer: int) -> str:
        """The key of one layer's page of one block, for tensor-parallel rank ``rank``."""
        return f"{key_for(self.namespaces[rank], block_hash)}/{layer}"

    def block_keys(self, rank: int, block_hash: bytes) -> list[str]:
        """The keys of every layer's page of one block, for one rank, in layer order."""
        base = key_for(self.namespaces[rank], block_hash)
        return [f"{base}/{layer}" for layer in range(self.layers)]

    def match_keys(self, chains: Sequence[Sequence[bytes]], start: int, stop: int) -> list[str]:
        """Keys of blocks ``start``..``stop - 1``, block by block, every rank's layers in turn
        (``chains[rank][block]`` are the block hashes)."""
        keys: list[str] = []
        for block in range(start, stop):
            for rank in range(self.tp_size):
                keys.extend(self.block_keys(rank, chains[rank][block]))
        return keys

    def whole_blocks(self, matched_keys: int) -> int:
        """Leading blocks held whole (every layer of every rank) when a prefix match over
        :meth:`match_keys` answered ``matched_keys``."""
        return matched_keys // self.keys_per_block


def paged_layout(
    *,
    model: str,
    revision: str,
    dtype: str,
    block_size: int,
    layer_names: Sequence[str],
    page_bytes: int,
    physical_layout: str,
    page_shape: Sequence[int],
    tp_size: int,
    extra: str = "",
) -> PagedLayout:
    """The layout of an engine: its namespaces (one per rank) from what makes its blocks
    interchangeable. ``physical_layout`` is vLLM's name of the cache layout (``LBHNC``),
    ``page_shape`` a page's shape (``[kv_heads, block_size, 2 * head_size]``)."""
    if not layer_names:
        raise ConfigError("vLLM reported no attention layer to store KV for")
    if page_bytes <= 0:
        raise ConfigError(f"a KV page of {page_bytes} bytes")
    if tp_size < 1:
        raise ConfigError(f"tensor_parallel_size {tp_size}")
    shape = "x".join(str(int(n)) for n in page_shape)
    kv_layout = f"vllm:{physical_layout}:page={shape}:bytes={page_bytes}:layers={len(layer_names)}"
    namespaces = tuple(
        namespace(
            model,
            revision=revision,
            dtype=dtype,
            kv_layout=kv_layout,
            block_size=block_size,
            tp_rank=rank,
            tp_size=tp_size,
            extra=extra,
        )
        for rank in range(tp_size)
    )
    return PagedLayout(
        block_size=block_size,
        layer_names=tuple(layer_names),
        page_bytes=page_bytes,
        namespaces=namespaces,
    )


@dataclass
class HashChain:
    """The block hashes of one request's tokens, one chain per rank, grown as tokens come."""

    layout: PagedLayout
    chains: list[list[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.chains:
            self.chains = [[] for _ in range(self.layout.tp_size)]

    @property
    def blocks(self) -> int:
        return len(self.chains[0])

    def extend(self, tokens: Sequence[int], blocks: int) -> None:
        """Hash blocks up to ``blocks`` (``tokens`` must hold at least that many full blocks)."""
        have = self.blocks
        if blocks <= have:
            return
        size = self.layout.block_size
        if len(tokens) < blocks * size:
            raise ValueError(f"{blocks} blocks need {blocks * size} tokens, have {len(tokens)}")
        span = list(tokens[have * size : blocks * size])
        for rank, chain in enumerate(self.chains):
            parent = chain[-1] if chain else None
            chain.extend(chain_hashes(self.layout.namespaces[rank], span, parent=parent))

    def span(self, start: int, stop: int) -> tuple[tuple[bytes, ...], ...]:
        """Every rank's hashes of blocks ``start``..``stop - 1``."""
        return tuple(tuple(chain[start:stop]) for chain in self.chains)
