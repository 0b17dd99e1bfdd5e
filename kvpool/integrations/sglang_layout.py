"""Where a page of an SGLang host pool lies in memory, and what its kvpool keys are.

Pure helpers of :mod:`kvpool.integrations.sglang` that need no SGLang import: the key scheme, the
byte order of each host-pool layout, and the views of host memory a page's components occupy.

A page is stored as one kvpool block: for an MHA pool its K then its V (each
``layers x page_size x heads x head_dim`` elements), for an MLA pool its one latent part. Each
part's bytes are the page's elements in the layout's byte order; layouts with the same order
share blocks (``layer_first`` and ``page_first_direct`` both store layer by layer), layouts with
another order get other keys, so that no instance can read a page in the wrong order. One block
per page: one key per page to look up, and a page is evicted, replicated and lost whole, never
half of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.errors import ConfigError

# The order of a component's elements in memory, per host-pool layout: t = token of the
# page, l = layer, h = head, d = head dim.
BYTE_ORDER = {
    "page_first": "tlhd",
    "page_first_direct": "lthd",
    "layer_first": "lthd",
    "page_head": "htld",
}
MHA_PARTS = 2
"""An MHA page's parts in the host pool's metadata: K, then V."""
MLA_PARTS = 1


@dataclass(frozen=True, slots=True)
class PageShape:
    """What must match for two engines to share a page's bytes."""

    mla: bool
    dtype: str
    layout: str
    page_size: int
    layers: int
    heads: int
    head_dim: int

    def fingerprint(self) -> str:
        order = BYTE_ORDER.get(self.layout)
        if order is None:
            raise ConfigError(
                f"host pool layout {self.layout!r} is not supported by kvpool's SGLang backend "
                f"(supported: {', '.join(sorted(BYTE_ORDER))})"
            )
        text = (
            f"{'mla' if self.mla else 'mha'}|{self.dtype}|{order}|p{self.page_size}|"
            f"l{self.layers}|h{self.heads}|d{self.head_dim}"
        )
        return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


@dataclass(frozen=True, slots=True)
class KeyScheme:
    """``<namespace>/<model>/<fingerprint>/<page hash>_<rank suffix>_<kind>``: the model and
    the rank as SGLang's Mooncake backend puts them in its keys, the page shape as
    docs/keys.md asks of a namespace; ``kind`` is ``kv`` (an MHA page: K then V) or ``k`` (an
    MLA page)."""

    prefix: str
    rank_suffix: str  # "3" (MHA, TP rank 3), "3_1" (with pipeline stage 1), "" (MLA)
    parts: int  # MHA_PARTS or MLA_PARTS

    def page_keys(self, page_hashes: Sequence[str], pool: str = "") -> list[str]:
        """One key per page, in order."""
        tail = f"_{pool}" if pool else ""
        sep = f"_{self.rank_suffix}" if self.rank_suffix else ""
        kind = "kv" if self.parts == MHA_PARTS else "k"
        end = f"{sep}{tail}_{kind}"
        prefix = self.prefix
        return [f"{prefix}{h}{end}" for h in page_hashes]


def key_prefix(namespace: str, model_name: str | None, fingerprint: str) -> str:
    model = "-".join((model_name or "default").split("/"))
    return f"{namespace}/{model}/{fingerprint}/"


def rank_suffix(*, mla: bool, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """MHA pages differ per TP rank (each holds its heads); MLA pages are the same on every
    rank, so the rank stays out of their key. The pipeline stage is in both when there is
    more than one."""
    parts = [] if mla else [str(tp_rank)]
    if pp_size > 1:
        parts.append(str(pp_rank))
    return "_".join(parts)


@dataclass(frozen=True, slots=True)
class Region:
    """A host tensor's memory as bytes: ``base`` its address, ``mem`` a view of all of it."""

    base: int
    mem: memoryview

    def view(self, ptr: int, size: int) -> memoryview | None:
        offset = ptr - self.base
        if offset < 0 or size < 0 or offset + size > self.mem.nbytes:
            return None
        return self.mem[offset : offset + size]


def find_view(regions: Sequence[Region], ptr: int, size: int) -> memoryview:
    """The view of ``[ptr, ptr + size)`` inside one of ``regions``; a range outside every
    registered host buffer is a bug of the caller's metadata, never touched."""
    for region in regions:
        view = region.view(ptr, size)
        if view is not None:
            return view
    raise ValueError(f"host range 0x{ptr:x}+{size} is outside the registered host pool")


@dataclass(slots=True)
class Component:
    """One page's block: the host memory it occupies, in order (a put sends these pieces as
    they are, a read fills them: :class:`kvpool.buffers.Parts`)."""

    parts: list[memoryview]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def components_from_meta(
    regions: Sequence[Region],
    ptrs: Sequence[int],
    sizes: Sequence[int],
    pages: int,
    per_page: int,
) -> list[Component]:
    """Split a host pool's ``get_page_buffer_meta`` answer into one component per page: the
    page's ``per_page`` parts, each whole before the next (K, then V). The pool lists a page's
    pointers part by part (``k, v``) or, in ``layer_first``, layer by layer (``k0, v0, k1,
    v1…``): part ``c`` of a page is every ``per_page``-th pointer from ``c``. Adjacent pointers
    merge into one view."""
    if pages <= 0 or len(ptrs) != len(sizes) or len(ptrs) % (pages * per_page):
        raise ValueError(
            f"host pool metadata: {len(ptrs)} pointers for {pages} pages x {per_page} parts"
        )
    step = len(ptrs) // pages
    out: list[Component] = []
    for page in range(pages):
        base = page * step
        merged: list[tuple[int, int]] = []
        for c in range(per_page):
            for i in range(base + c, base + step, per_page):
                if merged and merged[-1][0] + merged[-1][1] == ptrs[i]:
                    merged[-1] = (merged[-1][0], merged[-1][1] + sizes[i])
                else:
                    merged.append((ptrs[i], sizes[i]))
        out.append(Component([find_view(regions, p, n) for p, n in merged]))
    return out
