"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023).

Why this policy for KV-cache blocks:

- **Frequency-aware.** A block read many times (a shared system prompt, a RAG document, the
  prefix of a long chat) earns credit — up to :data:`MAX_FREQ` passes over the main queue
  without a read — while a block written once and read once or never leaves first, straight
  from the small queue. A prefix read a hundred times outlives one read once.
- **Scan-resistant.** New blocks enter a small probationary FIFO (10 % of the tier's bytes); a
  burst of one-off puts (a batch job, a long prompt never reused) washes through it without
  flushing the hot set from the main FIFO. A block that comes back soon after it was evicted
  from the small queue (its key is in the ghost FIFO) goes straight to main.
- **Cheap.** A read only bumps a small counter — no list surgery on the hot path, unlike LRU's
  move-to-end — and eviction is FIFO pops with a CLOCK-style second chance. GDSF would weigh
  size and recompute cost too, but KV blocks of one model are nearly all the same size, and a
  priority queue costs O(log n) per read; LRU-K needs K timestamps per block.

Sizes are in bytes (the small queue's share is by bytes, not by count). The ghost FIFO holds
keys only (a re-put of an evicted key has a new write id but the same bytes for KV caches).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

BlockId = tuple[str, int]

SMALL_FRACTION = 0.10
"""Share of the tracked bytes the small (probationary) FIFO may hold before it is evicted from."""
MAX_FREQ = 3
"""Reads remembered per block: a block survives this many passes of the main FIFO unread."""
PROMOTE_THRESHOLD = 2
"""Reads a block needs while in the small FIFO to move to main rather than out (the paper's
``freq > 1``): a block put and read once by the next decode step leaves from the small FIFO."""
GHOST_MIN = 1024
"""The ghost FIFO remembers at least this many evicted keys (more: as many as main holds)."""


class S3FifoPolicy:
    """Small FIFO + main FIFO + ghost FIFO of keys. Deterministic: ordered dicts only."""

    name = "s3fifo"

    def __init__(
        self,
        small_fraction: float = SMALL_FRACTION,
        max_freq: int = MAX_FREQ,
        promote_threshold: int = PROMOTE_THRESHOLD,
        ghost_min: int = GHOST_MIN,
    ) -> None:
        if not 0 < small_fraction < 1:
            raise ValueError("small_fraction must be in (0, 1)")
        self._small_fraction = small_fraction
        self._max_freq = max_freq
        self._threshold = promote_threshold
        self._ghost_min = ghost_min
        self._small: OrderedDict[BlockId, None] = OrderedDict()
        self._main: OrderedDict[BlockId, None] = OrderedDict()
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._freq: dict[BlockId, int] = {}
        self._size: dict[BlockId, int] = {}
        self._small_bytes = 0
        self._main_bytes = 0

    # --- events -------------------------------------------------------------------------------

    def inserted(self, block: BlockId, size_bytes: int = 0) -> None:
        if block in self._freq:
            self.removed(block)
        key = block[0]
        if key in self._ghost:
            del self._ghost[key]
            self._main[block] = None
            self._main_bytes += size_bytes
        else:
            self._small[block] = None
            self._small_bytes += size_bytes
        self._freq[block] = 0
        self._size[block] = size_bytes

    def touched(self, block: BlockId) -> None:
        freq = self._freq.get(block)
        if freq is not None and freq < self._max_freq:
            self._freq[block] = freq + 1

    def removed(self, block: BlockId) -> None:
        if self._freq.pop(block, None) is None:
            return
        size = self._size.pop(block)
        if self._small.pop(block, 0) is None:
            self._small_bytes -= size
        else:
            del self._main[block]
            self._main_bytes -= size

    # --- eviction -----------------------------------------------------------------------------

    def pop_victim(
        self, eligible: Callable[[BlockId], bool], max_refusals: int | None = None
    ) -> BlockId | None:
        """S3-FIFO's eviction, skipping what ``eligible`` refuses (rotated to the queue's
        tail). When every block of main is refused, small's head goes even if it was read
        (main could not take it anyway)."""
        budget = (self._max_freq + 3) * len(self._freq) + 2
        small_misses = 0  # consecutive ineligible blocks met at the head of small
        main_misses = 0
        refusals_left = len(self._freq) * 2 + 1 if max_refusals is None else max_refusals + 1
        while budget > 0 and self._freq:
            budget -= 1
            if small_misses + main_misses >= refusals_left:
                return None
            small_stuck = small_misses >= len(self._small)
            main_stuck = main_misses >= len(self._main)
            if small_stuck and main_stuck:
                return None
            total = self._small_bytes + self._main_bytes
            from_small = bool(self._small) and not small_stuck
            if from_small and self._main and not main_stuck:
                from_small = self._small_bytes >= self._small_fraction * total
            if from_small:
                block = next(iter(self._small))
                main_refuses = bool(self._main) and main_stuck
                if self._freq[block] >= self._threshold and not main_refuses:
                    size = self._size[block]
                    del self._small[block]
                    self._small_bytes -= size
                    self._main[block] = None
                    self._main_bytes += size
                    continue
                if not eligible(block):
                    self._small.move_to_end(block)
                    small_misses += 1
                    continue
                self._forget(block)
                self._remember_ghost(block[0])
                return block
            block = next(iter(self._main))
            freq = self._freq[block]
            if freq > 0:
                self._freq[block] = freq - 1
                self._main.move_to_end(block)
                continue
            if not eligible(block):
                self._main.move_to_end(block)
                main_misses += 1
                continue
            self._forget(block)
            return block
        return None

    # --- queries ------------------------------------------------------------------------------

    def frequency(self, block: BlockId) -> int | None:
        return self._freq.get(block)

    def in_main(self, block: BlockId) -> bool:
        return block in self._main

    def __contains__(self, block: object) -> bool:
        return block in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def check_invariants(self) -> None:
        assert len(self._small) + len(self._main) == len(self._freq) == len(self._size)
        assert self._small_bytes == sum(self._size[b] for b in self._small)
        assert self._main_bytes == sum(self._size[b] for b in self._main)
        assert all(0 <= f <= self._max_freq for f in self._freq.values())
        assert len(self._ghost) <= max(self._ghost_min, len(self._main)) + 1

    # --- internals ------------------------------------------------------------------------------

    def _forget(self, block: BlockId) -> None:
        del self._freq[block]
        size = self._size.pop(block)
        if self._small.pop(block, 0) is None:
            self._small_bytes -= size
        else:
            del self._main[block]
            self._main_bytes -= size

    def _remember_ghost(self, key: str) -> None:
        self._ghost[key] = None
        self._ghost.move_to_end(key)
        cap = max(self._ghost_min, len(self._main))
        while len(self._ghost) > cap:
            self._ghost.popitem(last=False)
