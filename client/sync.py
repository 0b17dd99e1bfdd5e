"""The synchronous client an inference engine embeds: ``from kvpool import Client``.

    with Client(["10.0.0.1:7300", "10.0.0.2:7300", "10.0.0.3:7300"]) as kv:
        kv.put("model-x/tp0/blk/3f2a…", block)       # True once committed
        data = kv.get("model-x/tp0/blk/3f2a…")        # bytes, or None on a miss

Every call runs in the caller's thread through :class:`~kvpool.client.fastpath.SyncPath`, the
client's state (:mod:`kvpool.client.state`) driven with blocking I/O: no event loop and no
thread of the client's own (but the /metrics server's, when ``metrics_port`` asks for one). One
``Client`` may be shared by many engine threads. Misses and failures of the cache return None /
False (or raise the typed error with ``strict=True``); bad keys and values raise in every mode.
"""

from __future__ import annotations

import weakref

from kvpool.client.blocking_plane import BlockingDataPlane
from kvpool.client.client_metrics import ClientMetrics
from kvpool.client.fastpath import SyncPath
from kvpool.client.settings import ClientConstructor
from kvpool.config import ClientConfig
from kvpool.mastercall import SyncMasterClient


def _shutdown(data: BlockingDataPlane, masters: SyncMasterClient, metrics: ClientMetrics) -> None:
    """Close the client's connections and its /metrics server. Runs once (weakref.finalize):
    from close(), or when the Client is garbage-collected, or at interpreter exit."""
    data.close()
    masters.close()
    metrics.close_threaded()


class Client(ClientConstructor, SyncPath):
    """A kvpool client: put and get KV-cache blocks by key. Thread-safe."""

    def _start(self, config: ClientConfig, *, strict: bool) -> None:
        SyncPath.__init__(self, config, strict=strict)
        self._finalizer = weakref.finalize(self, _shutdown, self._data, self._masters, self.metrics)
        if config.metrics_port != -1:
            try:
                self.metrics.start_threaded(config.metrics_host, config.metrics_port)
            except BaseException:
                self.close()
                raise

    @property
    def metrics_address(self) -> str:
        """``host:port`` of this client's /metrics ("" when off)."""
        return self.metrics.address

    def close(self) -> None:
        """Close connections (and the /metrics server). Idempotent."""
        self.mark_closed()
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<kvpool.Client masters={list(self.config.masters)} {state}>"
