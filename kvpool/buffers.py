"""One block's bytes in several buffers: :class:`Parts`.

A caller whose block lies in pieces of its own memory — an SGLang page's K and V halves, a
Mooncake object put from several buffers — hands the client the pieces, in order. A put sends
them as they are (one vectored write, or copied one by one into a node's shared memory) and a
read fills them the same way (scattered by ``recvmsg_into``, or copied piece by piece out of the
arena): the bytes are never gathered into one buffer first. The block is the pieces' bytes
joined, hashed as such (:func:`kvpool.checksum.block_checksum` hashes the pieces in order).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

NUMPY_COPY_BYTES = 256 * 1024
"""Copies at least this large go through numpy, which releases the GIL while it copies."""


class Parts:
    """The pieces of one block, in order: flat ``'B'`` memoryviews (empty ones are dropped).
    ``len()`` and ``nbytes`` are the block's size; ``parts[:n]`` is the first ``n`` bytes."""

    __slots__ = ("nbytes", "views")

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views: list[memoryview] = [v for v in views if v.nbytes]
        self.nbytes: int = sum(v.nbytes for v in self.views)

    def __len__(self) -> int:
        return self.nbytes

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self.views)

    def __bytes__(self) -> bytes:
        return b"".join(self.views)

    def __getitem__(self, index: slice) -> Parts:
        """``parts[:n]``: the first ``n`` bytes (the only slice a read asks for)."""
        if not isinstance(index, slice) or index.start or index.step not in (None, 1):
            raise TypeError("Parts takes only a leading slice [:n]")
        want = self.nbytes if index.stop is None else max(0, min(index.stop, self.nbytes))
        if want == self.nbytes:
            return self
        out: list[memoryview] = []
        for view in self.views:
            if want <= 0:
                break
            out.append(view[:want] if view.nbytes > want else view)
            want -= view.nbytes
        return Parts(out)

    def __repr__(self) -> str:
        return f"Parts({len(self.views)} pieces, {self.nbytes} bytes)"


def _copy(dest: memoryview, src: memoryview) -> None:
    if src.nbytes >= NUMPY_COPY_BYTES:
        np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dest[:] = src


def copy_bytes(dest: memoryview | Parts, src: memoryview | Parts) -> None:
    """``dest[:] = src`` for views or :class:`Parts` of the same size (a gather, a scatter, or
    both); large copies without holding the GIL."""
    if not isinstance(dest, Parts) and not isinstance(src, Parts):
        _copy(dest, src)
        return
    if dest.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dest.nbytes}")
    targets = dest.views if isinstance(dest, Parts) else [dest]
    sources = src.views if isinstance(src, Parts) else [src]
    t = s = 0  # offsets into the current target and source
    ti = si = 0
    while ti < len(targets) and si < len(sources):
        target, source = targets[ti], sources[si]
        n = min(target.nbytes - t, source.nbytes - s)
        _copy(target[t : t + n], source[s : s + n])
        t += n
        s += n
        if t == target.nbytes:
            ti, t = ti + 1, 0
        if s == source.nbytes:
            si, s = si + 1, 0
