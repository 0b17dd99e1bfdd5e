"""The client for engines that run an event loop: ``from kvpool import AsyncClient``.

    async with AsyncClient(["10.0.0.1:7300", "10.0.0.2:7300", "10.0.0.3:7300"]) as kv:
        await kv.put("model-x/tp0/blk/3f2a…", block)
        data = await kv.get("model-x/tp0/blk/3f2a…")

The same calls as :class:`~kvpool.Client`, as coroutines, on the caller's event loop: the
client's state (:mod:`kvpool.client.state`, the same as the synchronous client's) driven by
:class:`~kvpool.client.core.ClientCore`, with its I/O on the loop — frames over pooled,
pipelined connections (TCP, or a same-host node's shared memory), the masters' frame RPC port
(or ``grpc.aio``).
An ``AsyncClient`` belongs to the loop it is first used on. Misses and failures of the cache
return None / False (or raise the typed error with ``strict=True``); bad keys and values raise in
every mode.
"""

from __future__ import annotations

from kvpool.client.core import ClientCore
from kvpool.client.settings import DEFAULTS, make_config


class AsyncClient(ClientCore):
    """A kvpool client for asyncio code; see the module doc."""

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
        """The settings of :class:`kvpool.Client`, with its defaults (ClientConfig's);
        ``metrics_port``'s /metrics is served from ``async with`` or :meth:`start_metrics`."""
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

    async def __aenter__(self) -> AsyncClient:
        await self.start_metrics()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<kvpool.AsyncClient masters={list(self.config.masters)} {state}>"
