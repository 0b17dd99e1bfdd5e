"""The client for engines that run an event loop: ``from kvpool import AsyncClient``.

    async with AsyncClient(["10.0.0.1:7300", "10.0.0.2:7300", "10.0.0.3:7300"]) as kv:
        await kv.put("model-x/tp0/blk/3f2a…", block)
        data = await kv.get("model-x/tp0/blk/3f2a…")

The same calls as :class:`~kvpool.Client`, as coroutines, on the caller's event loop: it is the
async :class:`~kvpool.client.core.ClientCore` that the synchronous client shares (its placement,
lookup cache, per-node plans, failure policy), with its I/O on the loop — frames over pooled,
pipelined connections (TCP, or a same-host node's shared memory), ``grpc.aio`` to the masters.
An ``AsyncClient`` belongs to the loop it is first used on. Misses and failures of the cache
return None / False (or raise the typed error with ``strict=True``); bad keys and values raise in
every mode.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvpool.client.core import ClientCore, PutReceipt
from kvpool.client.settings import DEFAULTS, make_config
from kvpool.client.values import BytesLike, PutItems, WritableBuffer


class AsyncClient:
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
        self._core = ClientCore(config, strict=strict)

    async def start_metrics(self) -> str:
        """Serve this client's /metrics when ``metrics_port`` asks for it (``async with`` does
        this); its address ("" when off). Idempotent."""
        return self._core.metrics.address or await self._core.start_metrics()

    @property
    def metrics_address(self) -> str:
        """``host:port`` of this client's /metrics ("" when off or not started yet)."""
        return self._core.metrics.address

    async def put(self, key: str, value: BytesLike, *, strict: bool | None = None) -> bool:
        """Store ``value`` under ``key``: True once committed (do not change ``value`` until
        this returns)."""
        return await self._core.put(key, value, strict=strict)

    async def put_receipt(
        self, key: str, value: BytesLike, *, strict: bool | None = None
    ) -> PutReceipt | None:
        return await self._core.put_receipt(key, value, strict=strict)

    async def get(
        self, key: str, *, strict: bool | None = None, max_tier: str | None = None
    ) -> bytes | None:
        return await self._core.get(key, strict=strict, max_tier=max_tier)

    async def get_into(
        self,
        key: str,
        buffer: WritableBuffer,
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> int | None:
        return await self._core.get_into(key, buffer, strict=strict, max_tier=max_tier)

    async def exists(self, key: str, *, strict: bool | None = None) -> bool:
        return await self._core.exists(key, strict=strict)

    async def remove(self, key: str, *, strict: bool | None = None) -> bool:
        return await self._core.remove(key, strict=strict)

    async def batch_put(self, items: PutItems, *, strict: bool | None = None) -> list[bool]:
        return await self._core.batch_put(items, strict=strict)

    async def batch_put_receipts(
        self, items: PutItems, *, strict: bool | None = None
    ) -> list[PutReceipt | None]:
        return await self._core.batch_put_receipts(items, strict=strict)

    async def batch_get(
        self, keys: Sequence[str], *, strict: bool | None = None, max_tier: str | None = None
    ) -> list[bytes | None]:
        return await self._core.batch_get(keys, strict=strict, max_tier=max_tier)

    async def batch_get_into(
        self,
        keys: Sequence[str],
        buffers: Sequence[WritableBuffer],
        *,
        strict: bool | None = None,
        max_tier: str | None = None,
    ) -> list[int | None]:
        return await self._core.batch_get_into(keys, buffers, strict=strict, max_tier=max_tier)

    async def pin(self, keys: Sequence[str], replicas: int = 1) -> list[bool]:
        """Pin keys at ``replicas`` copies: never evicted, kept at that count, replicated in
        the index. True per key pinned, False when absent; PinQuotaExceededError over quota."""
        return await self._core.pin(keys, replicas)

    async def unpin(self, keys: Sequence[str]) -> list[bool]:
        """End pins (True per key the index has)."""
        return await self._core.pin(keys, 0)

    async def prefix_match(
        self, keys: Sequence[str], *, strict: bool | None = None, fetch_entries: bool = True
    ) -> int:
        """How many leading keys of a chain are cached (0 on failure); ``fetch_entries`` as
        :meth:`kvpool.Client.prefix_match`."""
        return await self._core.prefix_match(keys, strict=strict, fetch_entries=fetch_entries)

    async def get_or_compute(
        self, key: str, compute: Callable[[], Awaitable[BytesLike] | BytesLike]
    ) -> bytes:
        """The cached bytes, or ``compute()``'s (a coroutine is awaited), stored best effort."""
        return await self._core.get_or_compute(key, compute)

    @property
    def stats(self) -> dict[str, Any]:
        return self._core.stats

    @property
    def closed(self) -> bool:
        return self._core.closed

    async def close(self) -> None:
        """Close connections and channels. Idempotent."""
        await self._core.close()

    async def __aenter__(self) -> AsyncClient:
        await self.start_metrics()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<kvpool.AsyncClient masters={list(self._core.config.masters)} {state}>"
