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


def put_all(kv: Client, keys: list[str]) -> None:
    """Put every key; a full CPU tier answers NO_SPACE (retryable) while blocks are on their
    way to the SSD: retry, as an engine's best-effort writer would."""
    for key in keys:
        deadline = time.monotonic() + 10
        while not kv.put(key, value(key)):
            assert time.monotonic() < deadline, f"{key} never accepted"
            time.sleep(0.02)


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
