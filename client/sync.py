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
from kvpool.client.settings import DEFAULTS, make_config
from kvpool.mastercall import SyncMasterClient


def _shutdown(data: BlockingDataPlane, masters: SyncMasterClient, metrics: ClientMetrics) -> None:
    """Close the client's connections and its /metrics server. Runs once (weakref.finalize):
    from close(), or when the Client is garbage-collected, or at interpreter exit."""
    data.close()
    masters.close()
    metrics.close_threaded()


class Client(SyncPath):
    """A kvpool client: put and get KV-cache blocks by key. Thread-safe."""

    def __init__(
        self,
        masters: list[str] | str,
        *,
        timeout_s: float = DEFAULTS.timeout_s,
        replicas: int = DEFAULTS.replicas,
        strict: bool = False,
        max_value_size: int = DEFAULTS.max_value_size,
        connections_per_node: int = DEFAULTS.connections_per_node,
        max_tier: str = DEFAULTS.max_tier,
        transport: str = DEFAULTS.transport,
        lookup_cache_size: int = DEFAULTS.lookup_cache_size,
        lookup_cache_ttl_s: float = DEFAULTS.lookup_cache_ttl_s,
        hedge_reads: bool = DEFAULTS.hedge_reads,
        hedge_delay_ms: float = DEFAULTS.hedge_delay_ms,
        metrics_port: int = DEFAULTS.metrics_port,
        metrics_host: str = DEFAULTS.metrics_host,
        cluster_token: str = DEFAULTS.cluster_token,
        cluster_token_file: str = DEFAULTS.cluster_token_file,
        tls_ca_file: str = DEFAULTS.tls_ca_file,
        tls_cert_file: str = DEFAULTS.tls_cert_file,
        tls_key_file: str = DEFAULTS.tls_key_file,
        tls_server_name: str = DEFAULTS.tls_server_name,
    ) -> None:
        """``transport``: ``auto`` (a node on this host through its shared memory, others
        over TCP), ``tcp`` or ``shm`` (shared memory only; a node it cannot reach that way
        is a failure) — to measure both on one host. ``lookup_cache_size``: index entries
        kept so that a repeated get skips the master (0: none). ``cluster_token`` (or
        ``cluster_token_file``): the cluster's token, when it has one; ``tls_ca_file``: dial the
        masters over TLS checked against this CA (``tls_cert_file``/``tls_key_file``: a client
        certificate). Unset, these default to the ``KVPOOL_CLUSTER_TOKEN``,
        ``KVPOOL_CLUSTER_TOKEN_FILE`` and ``KVPOOL_TLS_*`` environment variables.
        ``hedge_reads``: a read whose replica has not answered after ``hedge_delay_ms`` (plus
        1 ms per MB read) is also sent to the key's next replica; the first good answer wins.
        ``metrics_port``: serve this client's Prometheus /metrics on ``metrics_host``
        (127.0.0.1; 0: any free port, see :attr:`metrics_address`; -1: off). ``max_tier``
        (gpu, cpu, ssd): the slowest tier a get accepts when it does not say (empty: any).
        Every default is :class:`~kvpool.config.ClientConfig`'s."""
        config = make_config(
            masters,
            timeout_s=timeout_s,
            replicas=replicas,
            max_value_size=max_value_size,
            connections_per_node=connections_per_node,
            max_tier=max_tier,
            transport=transport,
            lookup_cache_size=lookup_cache_size,
            lookup_cache_ttl_s=lookup_cache_ttl_s,
            hedge_reads=hedge_reads,
            hedge_delay_ms=hedge_delay_ms,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            cluster_token=cluster_token,
            cluster_token_file=cluster_token_file,
            tls_ca_file=tls_ca_file,
            tls_cert_file=tls_cert_file,
            tls_key_file=tls_key_file,
            tls_server_name=tls_server_name,
        )
        super().__init__(config, strict=strict)
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
