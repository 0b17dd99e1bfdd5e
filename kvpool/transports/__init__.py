"""Data-plane transports, keyed by address scheme.

A store node advertises a data address such as ``tcp://10.0.0.7:7400``; the scheme picks the
transport. Today: ``tcp`` (:mod:`kvpool.transports.tcp`). Shared memory for same-host clients,
``inproc`` for tests and ``rdma`` are planned behind the same registry.
"""

from __future__ import annotations

from kvpool.errors import TransportError

SCHEMES: tuple[str, ...] = ("tcp",)


def scheme_of(address: str) -> str:
    """The scheme of a data address; raises TransportError for an unknown or missing one."""
    scheme, sep, _ = address.partition("://")
    if not sep:
        raise TransportError(f"data address without a scheme: {address!r}")
    if scheme not in SCHEMES:
        raise TransportError(
            f"unsupported transport {scheme!r} in {address!r} (supported: {', '.join(SCHEMES)})"
        )
    return scheme
