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
from kvpool.client.settings import ClientConstructor
from kvpool.config import ClientConfig


class AsyncClient(ClientConstructor, ClientCore):
    """A kvpool client for asyncio code; see the module doc."""

    def _start(self, config: ClientConfig, *, strict: bool) -> None:
        """``metrics_port``'s /metrics is served from ``async with`` or :meth:`start_metrics`."""
        ClientCore.__init__(self, config, strict=strict)

    async def __aenter__(self) -> AsyncClient:
        await self.start_metrics()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<kvpool.AsyncClient masters={list(self.config.masters)} {state}>"
