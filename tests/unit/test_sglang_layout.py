"""kvpool.integrations.sglang_layout: the SGLang backend's keys and where a page lies in host
memory (pure; SGLang itself is not needed)."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.errors import ConfigError
from kvpool.integrations.sglang_layout import (
    MHA_PARTS,
    MLA_PARTS,
    KeyScheme,
    PageShape,
    Region,
    components_from_meta,
    key_prefix,
    rank_suffix,
)


def shape(**kw: object) -> PageShape:
    base: dict[str, object] = {
        "mla": False, "dtype": "bfloat16", "layout": "page_first", "page_size": 64,
        "layers": 32, "heads": 8, "head_dim": 128,
    }  # fmt: skip
    base.update(kw)
    return PageShape(**base)  # type: ignore[arg-type]


def test_the_fingerprint_changes_with_everything_that_changes_the_bytes() -> None:
    fp = shape().fingerprint()
    for change in (
        {"mla": True}, {"dtype": "float16"}, {"layout": "page_head"}, {"page_size": 32},
        {"layers": 16}, {"heads": 4}, {"head_dim": 64},
    ):  # fmt: skip
        assert shape(**change).fingerprint() != fp, change
    # the same byte order: layer by layer
    assert (
        shape(layout="layer_first").fingerprint() == shape(layout="page_first_direct").fingerprint()
    )
    with pytest.raises(ConfigError, match="page_unified"):
        shape(layout="page_unified").fingerprint()


def test_keys_carry_model_and_rank_as_sglangs_mooncake_backend_one_per_page() -> None:
    prefix = key_prefix("sglang", "meta-llama/Llama-3-8B", "abc")
    assert prefix == "sglang/meta-llama-Llama-3-8B/abc/"
    assert key_prefix("sglang", None, "abc") == "sglang/default/abc/"
    mha = KeyScheme(prefix, rank_suffix(mla=False, tp_rank=3, pp_rank=0, pp_size=1), MHA_PARTS)
    assert mha.page_keys(["h1", "h2"]) == [f"{prefix}h1_3_kv", f"{prefix}h2_3_kv"]
    mla = KeyScheme(prefix, rank_suffix(mla=True, tp_rank=3, pp_rank=0, pp_size=1), MLA_PARTS)
    assert mla.page_keys(["h1"]) == [f"{prefix}h1_k"]
    assert mla.page_keys(["h1"], "swa") == [f"{prefix}h1_swa_k"]
    assert rank_suffix(mla=False, tp_rank=1, pp_rank=2, pp_size=4) == "1_2"
    assert rank_suffix(mla=True, tp_rank=1, pp_rank=2, pp_size=4) == "2"


def test_a_page_first_page_is_its_k_then_its_v_from_where_they_are() -> None:
    mem = np.arange(4096, dtype=np.uint8)
    base = mem.ctypes.data
    regions = [Region(base, mem.data)]
    # two pages, K and V each: the pool lists k, v per page
    ptrs = [base, base + 2048, base + 100, base + 2148]
    pages = components_from_meta(regions, ptrs, [100] * 4, pages=2, per_page=2)
    assert [[bytes(p)[:1] for p in c.parts] for c in pages] == [
        [b"\x00", b"\x00"], [b"\x64", b"\x64"],
    ]  # fmt: skip
    assert all(len(c.parts) == 2 and c.nbytes == 200 for c in pages)
    assert np.shares_memory(np.frombuffer(pages[1].parts[1], dtype=np.uint8), mem)  # no copy


def test_a_layer_first_page_is_every_layer_of_k_then_every_layer_of_v() -> None:
    mem = np.arange(4096, dtype=np.uint8)
    base = mem.ctypes.data
    regions = [Region(base, mem.data)]
    # one page, two layers: k0, v0, k1, v1 (layer stride 1000, V 2000 further)
    ptrs = [base, base + 2000, base + 1000, base + 3000]
    (page,) = components_from_meta(regions, ptrs, [10] * 4, pages=1, per_page=2)
    assert [p.nbytes for p in page.parts] == [10, 10, 10, 10]
    assert [int(bytes(p)[0]) for p in page.parts] == [0, 1000 % 256, 2000 % 256, 3000 % 256]
    # adjacent layers merge into one view
    (m,) = components_from_meta(regions, [base, base + 10], [10, 10], pages=1, per_page=1)
    assert len(m.parts) == 1
    assert m.nbytes == 20


def test_a_pointer_outside_the_registered_pool_is_refused() -> None:
    mem = np.zeros(64, dtype=np.uint8)
    regions = [Region(mem.ctypes.data, mem.data)]
    with pytest.raises(ValueError, match="outside the registered host pool"):
        components_from_meta(regions, [mem.ctypes.data + 60], [8], pages=1, per_page=1)
    with pytest.raises(ValueError, match="pointers"):
        components_from_meta(regions, [mem.ctypes.data] * 3, [1] * 3, pages=2, per_page=1)
