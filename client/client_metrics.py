"""A client's metrics, opt-in (``metrics_port``; see :mod:`kvpool.metrics`): what the engine saw —
hits, misses by reason (absent, evicted, node_down, version_mismatch, checksum_mismatch,
timeout, ...), puts, fallbacks, replica retries — read from its counters at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import Metric

from kvpool.client.stats import ClientStats
from kvpool.metrics import METRICS_OFF, MetricsServer, counter, register_collector, start_metrics


def client_families(stats: ClientStats) -> Iterator[Metric]:
    snap = stats.snapshot()
    hits = counter("kvpool_client_hits", "gets that returned the block")
    hits.add_metric([], float(snap["hits"]))
    yield hits
    misses = counter("kvpool_client_misses", "gets that returned nothing, by reason", ["reason"])
    for reason, n in sorted(snap["misses_by_reason"].items()):
        misses.add_metric([reason], float(n))
    yield misses
    puts = counter("kvpool_client_puts", "puts, by result", ["result"])
    puts.add_metric(["ok"], float(snap["puts_ok"]))
    puts.add_metric(["failed"], float(snap["puts_failed"]))
    yield puts
    for name, key, doc in (
        ("kvpool_client_fallbacks", "fallbacks", "get_or_compute calls that computed the value"),
        ("kvpool_client_replica_retries", "replica_retries", "reads moved on to another replica"),
        ("kvpool_client_ring_refreshes", "ring_refreshes", "placement ring refreshes"),
        ("kvpool_client_hedged_reads", "hedged_reads", "keys also read from a second replica"),
        ("kvpool_client_hedge_wins", "hedge_wins", "keys the hedged second read served"),
    ):
        family = counter(name, doc)
        family.add_metric([], float(snap[key]))
        yield family


class ClientMetrics:
    """The client's /metrics server and collector, started and stopped on its event loop."""

    def __init__(self, stats: ClientStats) -> None:
        self._stats = stats
        self._server: MetricsServer | None = None
        self._remove: Callable[[], None] | None = None
        self.address = ""

    async def start(self, host: str, port: int) -> str:
        if port == METRICS_OFF:
            return ""
        self._server = await start_metrics(host, port, "client")
        assert self._server is not None
        self._remove = register_collector(lambda: client_families(self._stats))
        shown = f"[{host}]" if ":" in host else host
        self.address = f"{shown}:{self._server.port}"
        return self.address

    async def close(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None
        if self._server is not None:
            await self._server.close()
            self._server = None

    def __repr__(self) -> str:
        return f"ClientMetrics({self.address or 'off'})"


__all__: list[Any] = ["ClientMetrics", "client_families"]
