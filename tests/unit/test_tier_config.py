"""Tier settings: validation, refusals at start, manifest compaction across a restart."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.checksum import block_checksum
from kvpool.config import NodeConfig, load_config
from kvpool.proto.wire import TierLevel
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.eviction import S3FifoPolicy
from kvpool.store_node.tier_worker import TierWorker
from kvpool.store_node.tiers.cpu import CpuTier
from kvpool.store_node.tiers.ssd import SsdTier
from kvpool.store_node.warm_restart import recover_ssd, restore_into

KIB = 1024


def problems(**settings: object) -> list[str]:
    return NodeConfig(**settings).validate()  # type: ignore[arg-type]


def test_tier_sizes_take_units_and_bad_combinations_are_named() -> None:
    cfg = load_config(
        NodeConfig,
        env={"KVPOOL_SSD_CACHE_SIZE": "2GiB"},
        overrides={"ssd_cache_path": "/data/kvpool", "gpu_cache_size": "16GiB"},
    )
    assert (cfg.ssd_cache_size, cfg.gpu_cache_size) == (2 << 30, 16 << 30)
    assert cfg.eviction_policy == "s3fifo"
    assert any(p.startswith("ssd_cache_path:") for p in problems(ssd_cache_size=1 << 30))
    assert any(p.startswith("ssd_cache_size:") for p in problems(ssd_cache_path="/x"))
    assert any(
        p.startswith("ssd_cache_size:")
        for p in problems(ssd_cache_path="/x", ssd_cache_size=64 << 20, ssd_segment_size=64 << 20)
    )
    assert any(p.startswith("ssd_segment_size:") for p in problems(ssd_segment_size=5000))
    assert any(p.startswith("promote_after_hits:") for p in problems(promote_after_hits=0))
    assert any(p.startswith("cpu_cache_size:") for p in problems(cpu_cache_size=1 << 50))


def test_a_node_with_an_ssd_tier_larger_than_the_free_disk_refuses_to_start(
    tmp_path: Path,
) -> None:
    config = {
        "masters": ["127.0.0.1:1"],
        "ssd_cache_path": str(tmp_path / "ssd"),
        "ssd_cache_size": "1000TiB",
        "log_format": "json",
        "cpu_cache_size": "16MiB",
        "max_block_size": "1MiB",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool.store_node.server", "--config-json", json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "ssd_cache_size" in proc.stderr
    assert "free space" in proc.stderr


def test_the_manifest_is_compacted_and_a_restart_still_finds_every_ssd_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvpool.store_node.tier_worker.COMPACT_MIN_RECORDS", 64)
    path = tmp_path / "ssd"
    size = 4 * KIB

    def fresh() -> tuple[BlockStore, CpuTier, SsdTier]:
        cpu = CpuTier(16 * size)
        ssd = SsdTier(path, 8 * 16 * KIB, 16 * KIB)
        store = BlockStore(
            cpu, S3FifoPolicy(), max_block_size=size, clock=time.monotonic, ssd=ssd,
            write_batch_bytes=16 * KIB,
        )  # fmt: skip
        return store, cpu, ssd

    store, cpu, ssd = fresh()

    async def flood() -> int:
        worker = TierWorker(store)
        worker.start()
        for i in range(400):
            data = (f"v{i}/".encode() * size)[:size]
            verdict = store.reserve(f"k{i}", 1, size, block_checksum(data))
            if verdict.block is None:
                await worker.idle()
                verdict = store.reserve(f"k{i}", 1, size, block_checksum(data))
            assert verdict.block is not None
            store.view(verdict.block)[:] = data
            store.finish_put(verdict.block)
            store.publish(f"k{i}", 1, i + 1)
            if i % 7 == 0:
                store.delete(f"k{i // 2}", 1)  # drops, so that dead records pile up
            await worker.idle()
        await worker.stop()
        return worker.compactions

    compactions = asyncio.run(flood())
    assert compactions >= 1
    store.check_invariants()
    on_ssd = {b.id for b in store.committed_blocks() if TierLevel.SSD in b.copies}
    assert on_ssd
    assert ssd.manifest.records < 400  # far fewer records than blocks that came and went
    cpu.close()
    ssd.close()

    store, cpu, ssd = fresh()
    try:
        recovery = recover_ssd(ssd)
        assert recovery.corrupt == 0
        restore_into(store, recovery)
        assert {b.id for b in store.committed_blocks()} == on_ssd
        store.check_invariants()
    finally:
        cpu.close()
        ssd.close()
