"""A real cluster whose node has an SSD tier: nothing that fits is lost, SSD hits are exact,
cost-aware reads, and a restarted node serves its SSD blocks again without any put."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpool.client.sync import Client
from kvpool.grpcutil import create_channel, unary
from kvpool.launcher.cluster import LocalCluster
from kvpool.proto.v1 import node_pb2, node_pb2_grpc

pytestmark = pytest.mark.integration

ClusterFactory = Callable[..., LocalCluster]
BLOCK = 64 << 10
CPU = 4 << 20


def tier_stats(cluster: LocalCluster) -> dict[str, Any]:
    async def ask() -> node_pb2.GetStatsResponse:
        channel = create_channel(cluster.nodes[0].grpc)
        try:
            response: node_pb2.GetStatsResponse = await unary(
                node_pb2_grpc.NodeAdminStub(channel).GetStats,
                node_pb2.GetStatsRequest(),
                timeout_s=5,
            )
            return response
        finally:
            await channel.close()

    return {t.name: t for t in asyncio.run(ask()).tiers}


def value(key: str) -> bytes:
    return random.Random(key).randbytes(BLOCK)


def put_all(kv: Client, keys: list[str], batch: int = 8) -> None:
    """Put every key, a few per commit; a full CPU tier answers NO_SPACE (retryable) while
    blocks are on their way to the SSD: retry those, as an engine's best-effort writer would."""
    for start in range(0, len(keys), batch):
        todo = keys[start : start + batch]
        deadline = time.monotonic() + 10
        while todo:
            done = kv.batch_put([(k, value(k)) for k in todo])
            todo = [k for k, ok in zip(todo, done, strict=True) if not ok]
            if todo:
                assert time.monotonic() < deadline, f"{todo} never accepted"
                time.sleep(0.005)


def test_ssd_tier_keeps_three_times_the_cpu_tier_and_survives_a_restart(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    ssd = tmp_path / "ssd"
    cluster = cluster_factory(
        masters=1,
        nodes=1,
        cpu_cache_size=str(CPU),
        extra_node_flags=[
            "--ssd-cache-path", str(ssd),
            "--ssd-cache-size", "32MiB",
            "--ssd-segment-size", "1MiB",
            "--ssd-write-batch-size", "1MiB",
            "--max-block-size", "1MiB",
            "--no-cpu-tier-prefault",
            "--eviction-report-interval-s", "0.05",
        ],
    )  # fmt: skip
    keys = [f"tiers/{i}" for i in range(3 * CPU // BLOCK)]  # three times the CPU tier
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        put_all(kv, keys)
        time.sleep(0.5)  # tier reports reach the index
        for key in keys:  # nothing that fits in CPU + SSD was lost, every byte exact
            assert kv.get(key) == value(key), key
        tiers = tier_stats(cluster)
        assert tiers["ssd"].hits_total >= len(keys) // 2
        assert tiers["cpu"].demotions_total >= len(keys) // 2
        assert "O_DIRECT" in tiers["ssd"].detail or "buffered" in tiers["ssd"].detail

        # Cost-aware reads: a block only on the SSD is a miss for an engine that wants memory.
        time.sleep(0.5)
        on_ssd = [k for k in keys[:16] if kv.get(k, max_tier="cpu") is None]
        assert on_ssd, "the oldest blocks should have left CPU memory"
        assert kv.stats["misses_by_reason"]["slow_tier"] >= len(on_ssd)
        assert kv.get(on_ssd[0], max_tier="ssd") == value(on_ssd[0])

    # kill -9 the node and start it again: its SSD blocks come back without any put.
    cluster.kill("node-1")
    cluster.restart("node-1")
    log = Path(cluster.nodes[0].log).read_text()
    recovered = [json.loads(x) for x in log.splitlines() if '"ssd_tier_recovered"' in x][-1]
    assert recovered["blocks"] >= len(keys) // 2
    assert recovered["corrupt"] == 0
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        deadline = time.monotonic() + 20
        hits: list[str] = []
        while time.monotonic() < deadline:
            answers = kv.batch_get(keys)
            hits = [k for k, v in zip(keys, answers, strict=True) if v is not None]
            if len(hits) >= recovered["blocks"]:
                break
            time.sleep(0.2)
        assert len(hits) == recovered["blocks"], Path(cluster.nodes[0].log).read_text()[-3000:]
        for key, got in zip(keys, kv.batch_get(keys), strict=True):
            assert got is None or got == value(key)
    print(
        f"\nwarm restart: {recovered['blocks']} blocks verified in {recovered['seconds']} s, "
        f"{len(hits)} of {len(keys)} keys hit again without a put"
    )


def test_kill_9_in_a_write_flood_with_a_full_ssd_tier_never_serves_a_wrong_byte(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    """The SSD tier full (segments being reclaimed), demotions and manifest appends in flight
    when the node is killed: after the restart every hit is byte exact, the blocks whose
    writes were cut are dropped, and the node takes puts again."""
    cluster = cluster_factory(
        masters=1,
        nodes=1,
        cpu_cache_size=str(4 << 20),
        extra_node_flags=[
            "--ssd-cache-path", str(tmp_path / "ssd"),
            "--ssd-cache-size", "8MiB",
            "--ssd-segment-size", "1MiB",
            "--ssd-write-batch-size", "512KiB",
            "--max-block-size", "1MiB",
            "--no-cpu-tier-prefault",
        ],
    )  # fmt: skip
    keys = [f"full/{i}" for i in range(400)]  # 25 MiB through 4 MiB of CPU and 8 MiB of SSD
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        put_all(kv, keys[:300])
        assert tier_stats(cluster)["ssd"].evictions_total > 0  # the SSD is full and cycling
        flood = [kv.put(k, value(k)) for k in keys[300:330]]
        assert any(flood)
        cluster.kill("node-1")  # right after a burst: writes and records may be cut
    cluster.restart("node-1")
    log = Path(cluster.nodes[0].log).read_text()
    recovered = [json.loads(x) for x in log.splitlines() if '"ssd_tier_recovered"' in x][-1]
    assert recovered["blocks"] > 0
    with Client(cluster.master_addresses, timeout_s=5.0) as kv:
        time.sleep(1.0)  # claims applied
        hits = 0
        for key, got in zip(keys, kv.batch_get(keys), strict=True):
            assert got is None or got == value(key), key
            hits += got is not None
        assert hits > 0
        put_all(kv, keys[330:])
        for key in keys[-20:]:
            assert kv.get(key) == value(key)
