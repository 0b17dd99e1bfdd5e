"""A store node's metrics and span attributes (see :mod:`kvpool.metrics`, :mod:`kvpool.tracing`).

The block store keeps its counters (hits, misses by reason, evictions, demotions, promotions per
tier); :func:`node_families` turns a snapshot of them into Prometheus families at scrape time, on
the node's event loop. Miss reasons are named as the client names them (``version_mismatch`` for
the wire's WRONG_VERSION, ``checksum_mismatch`` for CORRUPT).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import Metric

from kvpool.metrics import TRANSFER_LATENCY, counter, gauge
from kvpool.proto.wire import MissReason, TierLevel
from kvpool.store_node.block_store import BlockStore
from kvpool.store_node.blocks import ReadResult

TIER_LABELS = {TierLevel.GPU: "gpu", TierLevel.CPU: "cpu", TierLevel.SSD: "ssd"}
MISS_REASON_NAMES = {
    MissReason.ABSENT: "absent",
    MissReason.STAGED: "staged",
    MissReason.WRONG_VERSION: "version_mismatch",
    MissReason.EVICTED: "evicted",
    MissReason.SLOW_TIER: "slow_tier",
    MissReason.CORRUPT: "checksum_mismatch",
}
GET_CPU_LATENCY = TRANSFER_LATENCY.labels("get", "cpu")
GET_MISS_LATENCY = TRANSFER_LATENCY.labels("get", "miss")
MGET_LATENCY = TRANSFER_LATENCY.labels("mget", "cpu")


def get_attributes(result: ReadResult) -> dict[str, Any]:
    """Span attributes of one GET's outcome."""
    if result.copy is None or result.block is None:
        return {"kvpool.hit": False, "kvpool.miss_reason": MISS_REASON_NAMES[result.reason]}
    return {
        "kvpool.hit": True,
        "kvpool.tier": TIER_LABELS.get(result.copy.level, "other"),
        "kvpool.bytes": result.block.size_bytes,
    }


def node_families(store: BlockStore, registered: bool = True) -> Iterator[Metric]:
    """Every family a node serves besides the transfer latency histogram."""
    stats = store.stats()
    c = store.counters
    yield _one(counter("kvpool_node_hits", "GETs answered with the block"), stats.hits)
    misses = counter("kvpool_node_misses", "GETs answered MISS, by reason", ["reason"])
    for reason, n in c.misses.items():
        misses.add_metric([MISS_REASON_NAMES[reason]], float(n))
    yield misses
    yield _one(counter("kvpool_node_get_bytes", "bytes of blocks served"), c.get_bytes)
    yield _one(
        counter(
            "kvpool_node_directory_reads",
            "hits same-host clients read through the shared directory with no message (counted "
            "in kvpool_node_hits too; they have no transfer latency here)",
        ),
        c.directory_reads,
    )
    yield _one(counter("kvpool_node_puts", "blocks staged by PUT"), c.puts)
    yield _one(
        counter("kvpool_node_publishes", "staged blocks made readable by PUBLISH"), c.publishes
    )
    yield _one(
        counter(
            "kvpool_node_receipt_publishes",
            "PUBLISHes settled by the commit's receipt, with no Lookup on the leader (counted "
            "in kvpool_node_publishes too)",
        ),
        c.receipt_publishes,
    )
    yield _one(counter("kvpool_node_put_bytes", "bytes of blocks staged by PUT"), c.put_bytes)
    yield _one(
        counter("kvpool_node_evictions", "blocks lost to pressure (their last copy went)"),
        c.evictions,
    )
    yield _one(
        counter(
            "kvpool_node_index_shed",
            "blocks dropped because the index was nearly full and the leader asked for room "
            "(index_shed; counted in kvpool_node_evictions too)",
        ),
        c.shed,
    )
    yield _one(
        counter("kvpool_node_checksum_mismatches", "copies whose bytes failed their checksum"),
        c.checksum_mismatches,
    )
    yield _one(counter("kvpool_node_no_space", "PUTs refused for lack of room"), c.no_space)
    yield _one(
        counter(
            "kvpool_node_missing_reported",
            "replicas the index named on this node that it never received (a put committed "
            "them and its bytes never came), reported gone",
        ),
        c.missing_reported,
    )
    yield _one(counter("kvpool_node_bad_frames", "malformed or foreign frames"), c.bad_frames)
    yield _one(
        counter(
            "kvpool_node_replica_repairs",
            "replicas this node re-created for under-replicated blocks",
        ),
        getattr(c, "repairs", 0),
    )
    yield _one(gauge("kvpool_node_blocks", "blocks held (staged and committed)"), stats.blocks)
    yield _one(gauge("kvpool_node_staged_blocks", "blocks staged, not committed"), stats.staged)
    yield _one(
        gauge("kvpool_node_leased_bytes", "bytes freed but still being sent"),
        stats.leased_bytes_lingering,
    )
    marks = gauge("kvpool_node_watermark_ratio", "eviction watermarks (every tier)", ["mark"])
    marks.add_metric(["high"], stats.high_watermark)
    marks.add_metric(["low"], stats.low_watermark)
    yield marks
    yield _one(gauge("kvpool_node_registered", "1 while registered with the masters"), registered)
    per_tier: list[tuple[Any, str, str]] = [
        (gauge, "kvpool_node_tier_capacity_bytes", "capacity of each tier"),
        (gauge, "kvpool_node_tier_used_bytes", "bytes used in each tier"),
        (gauge, "kvpool_node_tier_fill_ratio", "used / capacity of each tier (alarm: 0.85)"),
        (gauge, "kvpool_node_tier_blocks", "block copies in each tier"),
        (gauge, "kvpool_node_tier_fragmentation_ratio", "free space not in the largest extent"),
        (counter, "kvpool_node_tier_hits", "reads served from each tier"),
        (counter, "kvpool_node_tier_evictions", "copies dropped from each tier under pressure"),
        (counter, "kvpool_node_tier_demotions", "copies written to a slower tier on the way out"),
        (counter, "kvpool_node_tier_promotions", "copies made in each tier from a slower one"),
    ]
    families = [make(name, doc, ["tier"]) for make, name, doc in per_tier]
    for t in stats.tiers:
        fill = t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0
        values = (
            t.capacity_bytes,
            t.used_bytes,
            fill,
            t.blocks,
            t.fragmentation,
            t.hits,
            t.evictions,
            t.demotions,
            t.promotions,
        )
        for family, value in zip(families, values, strict=True):
            family.add_metric([t.name], float(value))
    yield from families


def _one(family: Any, value: float) -> Metric:
    family.add_metric([], float(value))
    metric: Metric = family
    return metric
