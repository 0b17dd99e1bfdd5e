"""The ``rdma://`` transport: registered only when ``pyverbs`` imports and an RDMA device exists.

UNTESTED: no machine kvpool is developed on has an RDMA device, so this transport only probes
for one. Where a device exists the scheme is registered so that a node could advertise it, and
opening a connection says plainly that the data path over verbs is not implemented in this
release (clients then use ``tcp``). Nothing picks ``rdma`` automatically.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from kvpool.errors import TransportError

if TYPE_CHECKING:
    from kvpool.transports.blocking import BlockingConnection
    from kvpool.transports.tcp import FrameConnection


@functools.cache
def rdma_available() -> bool:
    """pyverbs imports and lists at least one RDMA device."""
    try:
        from pyverbs.device import get_device_list  # type: ignore[import-not-found]
    except Exception:
        return False
    try:
        return bool(get_device_list())
    except Exception:
        return False


class RdmaTransport:
    scheme = "rdma"

    async def open(self, address: str, timeout_s: float, token: bytes = b"") -> FrameConnection:
        raise TransportError(
            f"{address}: an RDMA device is present but kvpool's verbs data path is not "
            "implemented in this release; use tcp"
        )

    def open_blocking(
        self, address: str, timeout_s: float, token: bytes = b""
    ) -> BlockingConnection:
        raise TransportError(
            f"{address}: an RDMA device is present but kvpool's verbs data path is not "
            "implemented in this release; use tcp"
        )
