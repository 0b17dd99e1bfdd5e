"""KVPoolHiCacheStorage, built the way SGLang builds an out-of-tree store (its
``StorageBackendFactory`` with the ``dynamic`` backend), on SGLang's real host pools on CPU,
against a real kvpool cluster: pages set and got byte for byte, a second engine reading the
first's pages, tensor-parallel ranks, hybrid pools, misses when the store is gone, and bad
settings refused by name."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvpool.integrations.sglang import KVPoolHiCacheStorage
from kvpool.launcher.cluster import LocalCluster

pytestmark = pytest.mark.integration

PAGE = 16
LAYERS = 2


def host_pool(layout: str, *, mla: bool = False, dtype: torch.dtype = torch.bfloat16) -> Any:
    """SGLang's own host pool over its own device pool, both on the CPU."""
    if mla:
        dev = MLATokenToKVPool(1024, PAGE, dtype, 64, 16, LAYERS, "cpu", False, 0, LAYERS)
        info = dev.get_device_pool_infos()[0].buffer_info
        return MLATokenToKVPoolHost(
            info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS,
            target_layer_num=LAYERS,
        )  # fmt: skip
    dev = MHATokenToKVPool(
        1024, PAGE, dtype, 4, 64, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS
    )
    info = dev.get_device_pool_infos()[0].buffer_info
    return MHATokenToKVPoolHost(
        info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS,
    )  # fmt: skip


def storage_config(
    masters: list[str] | str,
    *,
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
    model: str | None = "org/tiny-model",
    metrics: bool = False,
    **extra: Any,
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=True,
        model_name=model,
        extra_config={
            "backend_name": "kvpool",
            "module_path": "kvpool.integrations.sglang",
            "class_name": "KVPoolHiCacheStorage",
            "interface_v1": 1,
            "masters": masters,
            **extra,
        },
    )


def backend(cluster: LocalCluster, pool: Any, **kw: Any) -> KVPoolHiCacheStorage:
    config = storage_config(cluster.client_master_addresses, **kw)
    made = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(made, KVPoolHiCacheStorage)
    made.register_mem_pool_host(pool)
    return made


def fill(pool: Any, pages: range) -> None:
    """Random bytes in the given pages of the pool."""
    gen = torch.Generator().manual_seed(pages.start)
    for p in pages:
        page = pool.get_data_page(p * PAGE, flat=True)
        noise = torch.randint(0, 255, (page.numel() * page.element_size(),), generator=gen)
        pool.set_from_flat_data_page(p * PAGE, noise.to(torch.uint8).view(pool.dtype))


def page_bytes(pool: Any, page: int) -> bytes:
    data = pool.get_data_page(page * PAGE, flat=True)
    return bytes(data.contiguous().view(torch.uint8).numpy())


def indices(pages: range) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def hashes(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]


LAYOUTS = [
    ("page_first", False),
    ("page_first_direct", False),
    ("layer_first", False),
    ("page_head", False),
    ("page_first", True),
    ("page_first_direct", True),
    ("layer_first", True),
]


@pytest.mark.parametrize(("layout", "mla"), LAYOUTS)
def test_pages_round_trip_byte_exact(sglang_cluster: LocalCluster, layout: str, mla: bool) -> None:
    pool = host_pool(layout, mla=mla)
    store = backend(sglang_cluster, pool, mla=mla)
    try:
        keys = hashes(8)
        fill(pool, range(8))
        assert store.batch_exists(keys) == 0
        assert store.batch_set_v1(keys, indices(range(8))) == [True] * 8
        assert store.batch_exists(keys) == 8
        assert store.batch_get_v1(keys, indices(range(8, 16))) == [True] * 8
        for i in range(8):
            assert page_bytes(pool, 8 + i) == page_bytes(pool, i), f"page {i} differs"
        assert store.batch_set_v1(keys, indices(range(8))) == [True] * 8  # already stored
    finally:
        store.close()


def test_the_store_connects_while_sglang_creates_it_for_its_storage_threads(
    sglang_cluster: LocalCluster,
) -> None:
    pool = host_pool("page_first")
    store = backend(sglang_cluster, pool)
    try:
        conns = store._client._data._conns
        assert len(conns) == len(sglang_cluster.node_names)  # one per node, before any page
        keys = hashes(4)
        fill(pool, range(4))
        results: list[Any] = []
        worker = threading.Thread(  # SGLang calls a store from its own storage threads
            target=lambda: results.extend(
                [store.batch_set_v1(keys, indices(range(4))), store.batch_exists(keys)]
            )
        )
        worker.start()
        worker.join(30)
        assert results == [[True] * 4, 4]
        assert len(conns) == len(sglang_cluster.node_names)  # that thread opened none
    finally:
        store.close()


def test_storage_metrics_for_sglang(sglang_cluster: LocalCluster) -> None:
    pool = host_pool("page_first")
    store = backend(sglang_cluster, pool, metrics=True)
    try:
        keys = hashes(4)
        fill(pool, range(4))
        assert store.batch_set_v1(keys, indices(range(4))) == [True] * 4
        assert store.batch_get_v1(keys, indices(range(4, 8))) == [True] * 4
        stats = store.get_stats()
        assert stats.backup_pgs == [4]
        assert stats.prefetch_pgs == [4]
        assert stats.prefetch_bandwidth[0] > 0
        assert store.get_stats().prefetch_pgs == []  # drained by the call
    finally:
        store.close()


@pytest.mark.parametrize("busy_poll_us", [0, 500])
def test_batch_exists_is_the_leading_run_of_hits(
    sglang_cluster: LocalCluster, busy_poll_us: int
) -> None:
    pool = host_pool("page_first")
    store = backend(sglang_cluster, pool, busy_poll_us=busy_poll_us)
    try:
        assert store._client.config.busy_poll_us == busy_poll_us
        keys = hashes(6)
        fill(pool, range(6))
        stored = [keys[0], keys[1], keys[2], keys[4]]
        assert store.batch_set_v1(stored, indices(range(4))) == [True] * 4
        assert store.batch_exists(keys) == 3
        assert store.batch_exists(keys[3:]) == 0
        assert store.exists(keys[4])
        assert not store.exists(keys[5])
        got = store.batch_get_v1(keys[:4], indices(range(10, 14)))
        assert got == [True, True, True, False]
    finally:
        store.close()


def test_a_second_engine_process_reads_the_first_ones_pages(
    sglang_cluster: LocalCluster, tmp_path: Path
) -> None:
    """Another process with its own host pool, of another layout with the same byte order
    (layer_first writes, page_first_direct reads), gets the same pages."""
    pool = host_pool("layer_first")
    store = backend(sglang_cluster, pool)
    keys = hashes(5)
    fill(pool, range(5))
    try:
        assert store.batch_set_v1(keys, indices(range(5))) == [True] * 5
    finally:
        store.close()
    expected = tmp_path / "expected.bin"
    expected.write_bytes(b"".join(page_bytes(pool, i) for i in range(5)))
    reader = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_kvpool_hicache import backend_for, host_pool, indices, page_bytes
        pool = host_pool("page_first_direct")
        store = backend_for({sglang_cluster.client_master_addresses!r}, pool)
        assert store.batch_exists({keys!r}) == 5
        assert store.batch_get_v1({keys!r}, indices(range(20, 25))) == [True] * 5
        got = b"".join(page_bytes(pool, 20 + i) for i in range(5))
        assert got == open({str(expected)!r}, "rb").read(), "pages differ"
        print("READER OK")
    """)
    done = subprocess.run(
        [sys.executable, "-c", reader], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "READER OK" in done.stdout


def backend_for(masters: list[str], pool: Any, **kw: Any) -> KVPoolHiCacheStorage:
    """As ``backend``, for a process that has only the masters' addresses."""
    config = storage_config(masters, **kw)
    made = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(made, KVPoolHiCacheStorage)
    made.register_mem_pool_host(pool)
    return made


def test_another_byte_order_or_shape_never_reads_the_pages(sglang_cluster: LocalCluster) -> None:
    writer_pool = host_pool("page_first")
    writer = backend(sglang_cluster, writer_pool)
    keys = hashes(3)
    fill(writer_pool, range(3))
    readers = [
        backend(sglang_cluster, host_pool("page_head")),  # another byte order
        backend(sglang_cluster, host_pool("page_first", dtype=torch.float16)),  # another dtype
        backend(sglang_cluster, host_pool("page_first"), model="org/other-model"),
    ]
    try:
        assert writer.batch_set_v1(keys, indices(range(3))) == [True] * 3
        for reader in readers:
            assert reader.batch_exists(keys) == 0
            assert reader.batch_get_v1(keys, indices(range(5, 8))) == [False] * 3
    finally:
        for s in (writer, *readers):
            s.close()


def test_tensor_parallel_ranks(sglang_cluster: LocalCluster) -> None:
    """MHA pages are per rank (each rank holds its heads); MLA pages are shared by all."""
    keys = hashes(2)
    mha0, mha1 = host_pool("page_first"), host_pool("page_first")
    r0 = backend(sglang_cluster, mha0, tp_rank=0, tp_size=2)
    r1 = backend(sglang_cluster, mha1, tp_rank=1, tp_size=2)
    mla0, mla3 = host_pool("page_first", mla=True), host_pool("page_first", mla=True)
    m0 = backend(sglang_cluster, mla0, mla=True, tp_rank=0, tp_size=4)
    m3 = backend(sglang_cluster, mla3, mla=True, tp_rank=3, tp_size=4)
    try:
        fill(mha0, range(2))
        assert r0.batch_set_v1(keys, indices(range(2))) == [True, True]
        assert r1.batch_exists(keys) == 0
        fill(mla0, range(2))
        assert m0.batch_set_v1(keys, indices(range(2))) == [True, True]
        assert m3.batch_exists(keys) == 2
        assert m3.batch_get_v1(keys, indices(range(4, 6))) == [True, True]
        assert page_bytes(mla3, 4) == page_bytes(mla0, 0)
    finally:
        for s in (r0, r1, m0, m3):
            s.close()


def test_the_copying_interface_shares_pages_with_the_zero_copy_one(
    sglang_cluster: LocalCluster,
) -> None:
    """SGLang without interface_v1 calls batch_set(get_data_page…) / batch_get(dummy pages):
    the same blocks as batch_set_v1 / batch_get_v1."""
    pool = host_pool("page_first")
    store = backend(sglang_cluster, pool)
    try:
        keys = hashes(3)
        fill(pool, range(3))
        assert store.batch_set(keys[:2], [pool.get_data_page(i * PAGE) for i in range(2)])
        assert store.batch_set_v1(keys[2:], indices(range(2, 3))) == [True]
        dummies = [pool.get_dummy_flat_data_page() for _ in keys]
        got = store.batch_get(keys, dummies)
        for i, page in enumerate(got):
            assert page is not None
            pool.set_from_flat_data_page((10 + i) * PAGE, page)
            assert page_bytes(pool, 10 + i) == page_bytes(pool, i)
        assert store.batch_get_v1(keys[:2], indices(range(20, 22))) == [True, True]
        assert page_bytes(pool, 20) == page_bytes(pool, 0)
        assert store.get(keys[0], pool.get_dummy_flat_data_page()) is not None
        assert store.get(uuid.uuid4().hex, pool.get_dummy_flat_data_page()) is None
        assert store.set(uuid.uuid4().hex, pool.get_data_page(0))
    finally:
        store.close()


def test_hybrid_side_pools_v2(sglang_cluster: LocalCluster) -> None:
    """A side pool (an MHA host pool registered as SWA) through the v2 calls, with both
    hit policies SGLang uses."""
    kv, swa = host_pool("page_first"), host_pool("page_first")
    store = backend(sglang_cluster, kv)
    store.register_mem_host_pool_v2(swa, PoolName.SWA)
    try:
        keys = hashes(4)
        fill(kv, range(4))
        fill(swa, range(4))
        assert store.batch_set_v1(keys, indices(range(4))) == [True] * 4
        only_tail = PoolTransfer(
            name=PoolName.SWA, host_indices=indices(range(2, 4)), keys=keys[2:]
        )
        assert store.batch_set_v2([only_tail]) == {PoolName.SWA: [True, True]}
        every = PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
        assert store.batch_exists_v2(keys, [every]).kv_hit_pages == 0  # SWA pages 0, 1 missing
        window = PoolTransfer(
            name=PoolName.SWA, keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES
        )
        result = store.batch_exists_v2(keys, [window])
        assert result.kv_hit_pages == 4
        assert result.restorable_prefix_pages == [4]
        back = PoolTransfer(name=PoolName.SWA, host_indices=indices(range(8, 10)), keys=keys[2:])
        assert store.batch_get_v2([back]) == {PoolName.SWA: [True, True]}
        assert page_bytes(swa, 8) == page_bytes(swa, 2)
        assert page_bytes(swa, 9) == page_bytes(swa, 3)
    finally:
        store.close()


def test_a_dead_store_is_a_miss_within_the_deadline(tmp_path: Path) -> None:
    cluster = LocalCluster(
        tmp_path / "c", masters=1, nodes=1, cpu_cache_size="128MiB", in_memory=True
    )
    pool = host_pool("page_first")
    try:
        cluster.start()
        store = backend(cluster, pool, timeout_s=0.5)
        keys = hashes(4)
        fill(pool, range(4))
        assert store.batch_set_v1(keys, indices(range(4))) == [True] * 4
        cluster.kill("node-1")
        started = time.monotonic()
        assert store.batch_get_v1(keys, indices(range(8, 12))) == [False] * 4
        cluster.stop()
        assert store.batch_exists(keys) == 0
        assert store.batch_set_v1(hashes(2), indices(range(2))) == [False, False]
        assert store.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys]) == [None] * 4
        assert not store.batch_set(keys, [pool.get_data_page(0)] * 4)
        store.clear()
        assert time.monotonic() - started < 6 * 0.5 + 6.0
        store.close()
    finally:
        cluster.stop()


def test_a_dead_store_is_left_alone_for_retry_after_s() -> None:
    """An engine started while no master answers starts within one deadline (its warm-up says
    so; the store is not asked a second time), and while the store is left alone
    (``retry_after_s``) presence queries and sets answer a miss at once instead of each waiting
    out the deadline; after that the store is asked again."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    pool = host_pool("page_first")
    started = time.monotonic()
    store = backend_for([dead], pool, timeout_s=1.0, retry_after_s=1.5)
    try:
        built_s = time.monotonic() - started
        assert built_s < 1.75, f"built in {built_s:.2f} s: the dead store was waited on twice"
        asked = time.monotonic()
        assert store.batch_exists(hashes(4)) == 0
        assert store.batch_set_v1(hashes(2), indices(range(2))) == [False, False]
        assert time.monotonic() - asked < 0.3
        time.sleep(max(0.0, started + built_s + 1.6 - time.monotonic()))
        asked = time.monotonic()
        assert store.batch_exists(hashes(4)) == 0
        assert time.monotonic() - asked >= 0.9  # asked again: it waited out the deadline
    finally:
        store.close()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"masters": None}, "masters"),
        ({"masters": 7300}, "masters"),
        ({"masters": ""}, "masters"),
        ({"masters": "127.0.0.1:7300", "timeout_s": "soon"}, "timeout_s"),
        ({"masters": "127.0.0.1:7300", "replicas": "two"}, "replicas"),
        ({"masters": "127.0.0.1:7300", "transport": "pigeon"}, "transport"),
        ({"masters": "127.0.0.1:7300", "namespace": "a/b"}, "namespace"),
        ({"masters": "127.0.0.1:7300", "retry_after_s": -1}, "retry_after_s"),
        ({"masters": "127.0.0.1:7300", "retry_after_s": "later"}, "retry_after_s"),
        ({"masters": "not-an-address"}, "masters"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(extra: dict[str, Any], named: str) -> None:
    config = storage_config("x")
    assert config.extra_config is not None
    del config.extra_config["masters"]
    config.extra_config.update({k: v for k, v in extra.items() if v is not None})
    with pytest.raises(Exception, match=named):
        StorageBackendFactory.create_backend("dynamic", config, host_pool("page_first"))


def test_an_unsupported_layout_is_refused_at_registration(sglang_cluster: LocalCluster) -> None:
    pool = host_pool("page_first")
    config = storage_config(sglang_cluster.client_master_addresses)
    store = StorageBackendFactory.create_backend("dynamic", config, pool)
    try:
        pool.layout = "page_unified"
        with pytest.raises(Exception, match="page_unified"):
            store.register_mem_pool_host(pool)
    finally:
        store.close()
