"""The vLLM connector's worker side with no vLLM: pages of real torch tensors laid out as vLLM's
CPU cache, moved to and from an in-memory store; what fails when a block is lost, a layer not
waited for, or the store down. Skipped without torch."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from kvpool.errors import UnavailableError
from kvpool.integrations.vllm_blocks import HashChain, PagedLayout, paged_layout
from kvpool.integrations.vllm_plan import BlockTransfer
from kvpool.integrations.vllm_worker import HostPages, StagedPages, Transfers, page_store

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed"
)

BS, HEADS, HEAD = 4, 2, 8
LAYERS = 3
BLOCKS = 10


class Store:
    """sizes / batch_get_into / batch_put_receipts over a dict, with a switch to fail."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.down = False
        self.calls: list[str] = []
        self.gate: threading.Event | None = None

    def sizes(self, keys: Sequence[str]) -> list[int | None]:
        self.calls.append("sizes")
        if self.down:
            raise UnavailableError("no master answered")
        return [len(self.data[k]) if k in self.data else None for k in keys]

    def batch_get_into(
        self, keys: Sequence[str], buffers: Sequence[Any], *, strict: bool | None = None
    ) -> list[int | None]:
        self.calls.append("get")
        if self.gate is not None:
            self.gate.wait(5)
        out: list[int | None] = []
        for key, buf in zip(keys, buffers, strict=True):
            value = self.data.get(key)
            if self.down or value is None or len(value) > len(memoryview(buf).cast("B")):
                out.append(None)
                continue
            memoryview(buf).cast("B")[: len(value)] = value
            out.append(len(value))
        return out

    def batch_put_receipts(
        self, items: Sequence[tuple[str, Any]], *, strict: bool | None = None
    ) -> list[Any]:
        self.calls.append("put")
        if self.gate is not None:
            self.gate.wait(5)
        if self.down:
            return [None] * len(items)
        for key, value in items:
            self.data[key] = bytes(memoryview(value).cast("B"))
        return [object()] * len(items)


def tensors(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    # vLLM's CPU layout: every layer a view of one allocation, [blocks, heads, block, 2*head]
    whole = torch.randn(LAYERS, BLOCKS, HEADS, BS, 2 * HEAD, generator=g).to(torch.bfloat16)
    return {f"layer.{i}": whole[i] for i in range(LAYERS)}


def layout() -> PagedLayout:
    return paged_layout(
        model="m", revision="", dtype="bfloat16", block_size=BS,
        layer_names=[f"layer.{i}" for i in range(LAYERS)], page_bytes=HEADS * BS * 2 * HEAD * 2,
        physical_layout="LBHNC:NONE", page_shape=(HEADS, BS, HEAD, HEAD), tp_size=1,
    )  # fmt: skip


def transfer(lay: PagedLayout, req: str, tokens: list[int], block_ids: list[int]) -> BlockTransfer:
    chain = HashChain(lay)
    chain.extend(tokens, len(block_ids))
    return BlockTransfer(req, 0, tuple(block_ids), chain.span(0, len(block_ids)))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def worker(store: Store, caches: dict[str, Any], clock: Clock | None = None) -> Transfers:
    t = Transfers(store, layout(), 0, timeout_s=1.0, retry_after_s=5.0, clock=clock or Clock())
    t.register(caches)
    return t


def load_all(t: Transfers, transfers: list[BlockTransfer]) -> set[int]:
    t.start_load(transfers)
    for name in t.layout.layer_names:
        t.wait_layer(name)
    return t.finish_load()


def page(caches: dict[str, Any], layer: int, block: int) -> bytes:
    import torch

    return bytes(caches[f"layer.{layer}"][block].contiguous().view(torch.uint8).numpy().tobytes())


def saved(t: Transfers, transfers: list[BlockTransfer]) -> None:
    t.save(transfers)
    t.drain([x.req_id for x in transfers])


def test_cpu_caches_are_sent_from_and_received_into_in_place() -> None:
    caches = tensors(1)
    pages = page_store([caches[f"layer.{i}"] for i in range(LAYERS)], layout().page_bytes)
    assert isinstance(pages, HostPages)
    view = memoryview(pages.send_buffer(1, 3)).cast("B")  # type: ignore[arg-type]
    assert bytes(view) == page(caches, 1, 3)
    caches["layer.1"][3].zero_()  # the view is vLLM's memory itself
    assert bytes(view) == bytes(len(view))


def test_a_second_worker_reads_exactly_the_pages_the_first_saved() -> None:
    store = Store()
    lay = layout()
    tokens = list(range(3 * BS + 1))
    src, dst = tensors(1), tensors(2)
    writer = worker(store, src)
    saved(writer, [transfer(lay, "a", tokens, [2, 5, 7])])
    assert len(store.data) == 3 * LAYERS
    reader = worker(store, dst)
    assert load_all(reader, [transfer(lay, "b", tokens, [0, 1, 9])]) == set()
    for layer in range(LAYERS):
        for s, d in ((2, 0), (5, 1), (7, 9)):
            assert page(dst, layer, d) == page(src, layer, s)
    assert page(dst, 0, 4) == page(tensors(2), 0, 4)  # other blocks untouched


def test_a_lost_block_fails_with_every_later_block_of_its_request() -> None:
    store = Store()
    lay = layout()
    tokens = list(range(4 * BS))
    saved(worker(store, tensors(1)), [transfer(lay, "a", tokens, [1, 2, 3, 4])])
    other = list(range(100, 100 + 2 * BS))
    saved(worker(store, tensors(1)), [transfer(lay, "o", other, [5, 6])])
    chain = HashChain(lay)
    chain.extend(tokens, 4)
    del store.data[lay.key(0, chain.chains[0][1], 2)]  # block 1, layer 2 evicted
    dst = tensors(3)
    reader = worker(store, dst)
    failed = load_all(
        reader, [transfer(lay, "b", tokens, [0, 1, 2, 3]), transfer(lay, "c", other, [8, 9])]
    )
    assert failed == {1, 2, 3}  # block 0 and the other request are whole
    assert page(dst, 2, 0) == page(tensors(1), 2, 1)


def test_a_page_of_the_wrong_size_is_a_failure_not_data() -> None:
    store = Store()
    lay = layout()
    tokens = list(range(2 * BS))
    saved(worker(store, tensors(1)), [transfer(lay, "a", tokens, [1, 2])])
    chain = HashChain(lay)
    chain.extend(tokens, 2)
    key = lay.key(0, chain.chains[0][0], 0)
    store.data[key] = store.data[key][:-2]
    assert load_all(worker(store, tensors(3)), [transfer(lay, "b", tokens, [0, 1])]) == {0, 1}


def test_a_layer_the_forward_pass_did_not_wait_for_fails_the_whole_load() -> None:
    store = Store()
    lay = layout()
    tokens = list(range(2 * BS))
    saved(worker(store, tensors(1)), [transfer(lay, "a", tokens, [1, 2])])
    reader = worker(store, tensors(3))
    reader.start_load([transfer(lay, "b", tokens, [4, 5])])
    reader.wait_layer("layer.0")
    reader.wait_layer("model.mlp.0")  # not an attention layer of ours: nothing to wait for
    assert reader.finish_load() == {4, 5}


def test_layers_are_usable_one_by_one_while_later_ones_still_load() -> None:
    store = Store()
    lay = layout()
    tokens = list(range(BS))
    saved(worker(store, tensors(1)), [transfer(lay, "a", tokens, [1])])
    reader = worker(store, tensors(3))
    release = threading.Event()
    reads = 0
    real = store.batch_get_into

    def slow_after_layer_0(
        keys: Sequence[str], buffers: Sequence[Any], **kw: Any
    ) -> list[int | None]:
        nonlocal reads
        reads += 1
        if reads > 1:
            release.wait(5)  # layer 1 is still on the wire
        return real(keys, buffers, **kw)

    store.batch_get_into = slow_after_layer_0  # type: ignore[method-assign]
    reader.start_load([transfer(lay, "b", tokens, [0])])
    reader.wait_layer("layer.0")  # returns with layer 0 in place, layer 1 not read yet
    assert reads <= 2
    assert not release.is_set()
    release.set()
    reader.wait_layer("layer.1")
    reader.wait_layer("layer.2")
    assert reader.finish_load() == set()
    assert reads == LAYERS


def test_a_dead_store_fails_loads_drops_saves_and_is_left_alone() -> None:
    store = Store()
    lay = layout()
    tokens = list(range(2 * BS))
    clock = Clock()
    t = worker(store, tensors(1), clock)
    store.down = True
    assert load_all(t, [transfer(lay, "b", tokens, [0, 1])]) == {0, 1}
    calls = len(store.calls)
    assert load_all(t, [transfer(lay, "b", tokens, [0, 1])]) == {0, 1}
    t.save([transfer(lay, "a", tokens, [2, 3])])
    assert len(store.calls) == calls  # paused: neither asked
    assert t.totals.dropped_saves == 1
    store.down = False
    clock.now += 5.0
    saved(t, [transfer(lay, "a", tokens, [2, 3])])
    assert load_all(t, [transfer(lay, "b", tokens, [0, 1])]) == set()


def test_held_requests_are_reported_only_once_their_saves_are_done() -> None:
    store = Store()
    store.gate = threading.Event()
    lay = layout()
    t = worker(store, tensors(1))
    t.save([transfer(lay, "a", list(range(BS)), [1])])
    t.hold(["a", "b"])
    assert t.finished_saving({"a", "b"}) == {"b"}  # b had nothing pending
    assert t.finished_saving(set()) == set()
    store.gate.set()
    t.drain(["a"])
    assert t.finished_saving(set()) == {"a"}  # a was reported finished before
    assert t.finished_saving({"a"}) == set()  # once


def test_strided_or_device_pages_go_through_host_buffers() -> None:
    import torch

    store = Store()
    lay = layout()
    tokens = list(range(2 * BS))
    src = tensors(1)
    saved(worker(store, src), [transfer(lay, "a", tokens, [1, 2])])
    # the same pages, stored block-inner (a layout whose page is not one run)
    strided = {
        k: torch.zeros(HEADS, BLOCKS, BS, 2 * HEAD, dtype=torch.bfloat16).permute(1, 0, 2, 3)
        for k in src
    }
    reader = worker(store, strided)
    assert isinstance(reader.pages, StagedPages)
    assert load_all(reader, [transfer(lay, "b", tokens, [3, 4])]) == set()
    for layer in range(LAYERS):
        assert torch.equal(strided[f"layer.{layer}"][3], src[f"layer.{layer}"][1])
        assert torch.equal(strided[f"layer.{layer}"][4], src[f"layer.{layer}"][2])
