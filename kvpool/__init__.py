"""kvpool: a distributed KV-cache store for LLM inference.

    from kvpool import Client

    with Client(["127.0.0.1:7300"]) as kv:
        kv.put("prefix/0", block_bytes)
        data = kv.get("prefix/0")      # bytes, or None on a miss

``Client`` (and ``AsyncClient``, for engines that run an event loop) is imported lazily so that
``import kvpool.errors`` (used by every process) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvpool.errors import KVPoolError

__version__ = "0.1.0"
__all__ = ["AsyncClient", "Client", "KVPoolError", "__version__"]

if TYPE_CHECKING:
    from kvpool.client.aio import AsyncClient
    from kvpool.client.sync import Client


def __getattr__(name: str) -> Any:
    if name == "Client":
        from kvpool.client.sync import Client

        return Client
    if name == "AsyncClient":
        from kvpool.client.aio import AsyncClient

        return AsyncClient
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
