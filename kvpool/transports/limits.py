"""What a server lets one peer, and all peers together, cost it: the limits every listening port
of a master or node applies to what arrives, so that a hostile or broken peer cannot exhaust it.

Every length, count and size a peer declares is checked against a limit before anything is
allocated for it; memory taken for a request's payload (a frame RPC call, an MGET or shared-memory
table) is charged to one :class:`MemoryBudget` per process and given back when the request has
been read, or when its connection closes half-way; a frame not complete within
``frame_timeout_s`` of its first byte closes its connection; a port accepts at most
``max_connections`` connections (a connection costs its socket and a 4 KiB scratch buffer while
idle, :mod:`kvpool.transports.frames`).

The settings come from :class:`kvpool.config.MasterConfig` / :class:`~kvpool.config.NodeConfig`
(``max_connections``, ``frame_timeout_s``, ``request_memory``, ``max_request_size``) and are
documented in docs/operations.md ("Limits on what peers send").
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CONNECTIONS = 4096
FRAME_TIMEOUT_S = 5.0
REQUEST_MEMORY_BYTES = 256 << 20
MAX_REQUEST_BYTES = 32 << 20


@dataclass(frozen=True)
class IngressLimits:
    max_connections: int = MAX_CONNECTIONS
    """Connections one listening port holds at once (those still proving the token included);
    one more is closed at once."""
    frame_timeout_s: float = FRAME_TIMEOUT_S
    """A frame (or a shared-memory reservation) not complete this long after its first byte
    closes its connection: whatever it had reserved is freed."""
    request_memory_bytes: int = REQUEST_MEMORY_BYTES
    """Memory all connections of the process together may hold for request payloads that are
    not block bytes (RPC calls, key tables); beyond it a request is refused, retryable."""
    max_request_bytes: int = MAX_REQUEST_BYTES
    """Largest such payload of one request."""


class MemoryBudget:
    """Bytes a process holds for request payloads, against a limit. Single-threaded (one event
    loop charges and credits it)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        self.refused = 0

    def take(self, size_bytes: int) -> bool:
        """Charge ``size_bytes``; False (nothing charged) when that would pass the limit."""
        if self.used_bytes + size_bytes > self.limit_bytes:
            self.refused += 1
            return False
        self.used_bytes += size_bytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return True

    def give(self, size_bytes: int) -> None:
        self.used_bytes = max(0, self.used_bytes - size_bytes)


def overloaded_message(size_bytes: int, budget: MemoryBudget) -> str:
    return (
        f"a request payload of {size_bytes} bytes does not fit in the memory left for requests "
        f"({budget.used_bytes} of {budget.limit_bytes} bytes in use by other requests); retry"
    )


def too_large_message(size_bytes: int, limit_bytes: int) -> str:
    return (
        f"a request payload of {size_bytes} bytes is above this server's limit of "
        f"{limit_bytes} bytes (max_request_size)"
    )
