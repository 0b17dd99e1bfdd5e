"""A client's metrics, opt-in (``metrics_port``; see :mod:`kvpool.metrics`): what the engine saw —
hits, misses by reason (absent, evicted, node_down, version_mismatch, checksum_mismatch,
timeout, ...), puts, fallbacks, replica retries — read from its counters at scrape time."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from prometheus_client.core import Metric

from kvpool.client.stats import ClientStats
from kvpool.logs import get_logger
from kvpool.metrics import (
    METRICS_OFF,
    REGISTRY,
    MetricsServer,
    counter,
    register_collector,
    start_metrics,
)

log = get_logger("kvpool.client")


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
    direct = counter(
        "kvpool_client_direct_reads",
        "keys read by content from their ring node with no Lookup first (hit), or that missed "
        "there and were looked up (miss)",
        ["outcome"],
    )
    direct.add_metric(["hit"], float(snap["direct_hits"]))
    direct.add_metric(["miss"], float(snap["direct_misses"]))
    yield direct
    for name, key, doc in (
        ("kvpool_client_fallbacks", "fallbacks", "get_or_compute calls that computed the value"),
        ("kvpool_client_replica_retries", "replica_retries", "reads moved on to another replica"),
        ("kvpool_client_ring_refreshes", "ring_refreshes", "placement ring refreshes"),
        ("kvpool_client_hedged_reads", "hedged_reads", "keys also read from a second replica"),
        ("kvpool_client_hedge_wins", "hedge_wins", "keys the hedged second read served"),
        ("kvpool_client_node_holds", "node_holds", "times a node was held back after it failed"),
    ):
        family = counter(name, doc)
        family.add_metric([], float(snap[key]))
        yield family


class ClientMetrics:
    """The client's /metrics server and collector: on the client's event loop (AsyncClient), or
    for a client with no event loop (the synchronous Client) prometheus_client's own server in a
    daemon thread (the counters are safe to read from any thread)."""

    def __init__(self, stats: ClientStats) -> None:
        self._stats = stats
        self._server: MetricsServer | None = None
        self._threaded: tuple[WSGIServer, threading.Thread] | None = None
        self._remove: Callable[[], None] | None = None
        self.address = ""

    def start_threaded(self, host: str, port: int) -> str:
        """Serve /metrics from a daemon thread; its address ("" when ``port`` is off)."""
        if port == METRICS_OFF:
            return ""
        self._threaded = start_http_server(port, addr=host, registry=REGISTRY)
        self._remove = register_collector(lambda: client_families(self._stats))
        shown = f"[{host}]" if ":" in host else host
        self.address = f"{shown}:{self._threaded[0].server_port}"
        log.info("metrics_serving", role="client", address=self.address)
        return self.address

    def close_threaded(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None
        if self._threaded is not None:
            server, thread = self._threaded
            self._threaded = None
            server.shutdown()
            server.server_close()
            thread.join(timeout=5.0)

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
