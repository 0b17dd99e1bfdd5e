"""Metrics: Prometheus text on an HTTP port (``metrics_port``), served on the process's event loop.

Names follow ``kvpool_<subsystem>_<what>_<unit>``. Counters that the processes already keep
(hits, misses, evictions, Raft state) are not counted twice: a :class:`SnapshotCollector` reads
them at scrape time, on the event loop that owns them (the HTTP server runs there too, so a scrape
never races the code that updates them). Only the latency histograms are updated on the hot
path; their buckets start at 50 µs so that sub-millisecond calls are told apart.

``metrics_port``: ``0`` (default) binds any free port on the process's listen host (logged as
``metrics_serving`` and written to the ready file), ``-1`` serves nothing, anything else is that
port. ``GET /metrics`` answers the text format; every other path 404.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from kvpool.logs import get_logger

METRICS_OFF = -1
LATENCY_BUCKETS_S: tuple[float, ...] = (
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    500e-3,
    1.0,
    2.5,
    5.0,
)
"""Latency buckets in seconds: sub-millisecond resolution at the low end."""

REGISTRY = CollectorRegistry(auto_describe=True)
"""This process's metrics (not prometheus_client's global registry: no process/platform
collectors that cost at every scrape, and tests can build their own)."""

RPC_SERVER_LATENCY = Histogram(
    "kvpool_rpc_server_latency_seconds",
    "time to answer one control-plane call, by method and transport (grpc or frame)",
    ["method", "transport"],
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
TRANSFER_LATENCY = Histogram(
    "kvpool_node_transfer_latency_seconds",
    "time from a data-plane request's arrival to its answer being queued, by op and tier",
    ["op", "tier"],
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)

log = get_logger("kvpool.metrics")


class SnapshotCollector(Collector):
    """Metric families built at scrape time by ``build`` (one callable per subsystem)."""

    def __init__(self, build: Callable[[], Iterable[Metric]]) -> None:
        self._build = build

    def collect(self) -> Iterator[Metric]:
        yield from self._build()

    def describe(self) -> Iterator[Metric]:
        return iter(())  # unchecked: names are built at scrape time


def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def register_collector(
    build: Callable[[], Iterable[Metric]], registry: CollectorRegistry = REGISTRY
) -> Callable[[], None]:
    """Add a scrape-time collector; returns the function that removes it again."""
    collector = SnapshotCollector(build)
    registry.register(collector)

    def remove() -> None:
        with contextlib.suppress(KeyError):
            registry.unregister(collector)

    return remove


def render(registry: CollectorRegistry = REGISTRY) -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(registry)


class MetricsServer:
    """A minimal HTTP/1.0 server for ``GET /metrics`` on the running event loop."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self._registry = registry
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            line = request.split(b"\r\n", 1)[0].decode("latin-1").split()
            if (
                len(line) >= 2
                and line[0] in ("GET", "HEAD")
                and line[1].split("?")[0]
                in (
                    "/metrics",
                    "/",
                )
            ):
                body = render(self._registry)
                head = f"HTTP/1.0 200 OK\r\nContent-Type: {CONTENT_TYPE_LATEST}\r\n"
            else:
                body = b"not found: try /metrics\n"
                head = "HTTP/1.0 404 Not Found\r\nContent-Type: text/plain\r\n"
            head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + (body if line and line[0] != "HEAD" else b""))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:  # a scrape must never take the process down
            log.exception("metrics_scrape_failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None


async def start_metrics(host: str, port: int, role: str, **fields: Any) -> MetricsServer | None:
    """Serve this process's metrics on ``host:port`` (see the module doc for ``port``); None
    when ``port`` is :data:`METRICS_OFF`. Raises OSError when the port cannot be had."""
    if port == METRICS_OFF:
        return None
    server = MetricsServer()
    bound = await server.start(host, port)
    log.info("metrics_serving", role=role, address=f"{host}:{bound}", **fields)
    return server
