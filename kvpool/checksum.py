"""The block checksum: xxh3-64 over the block's bytes, computed once by the writer, stored in the
index, checked by the node on PUT and by the client on every read."""

from __future__ import annotations

from typing import Any

import xxhash

from kvpool.buffers import Parts


def block_checksum(data: Any) -> int:
    """xxh3-64 of a bytes-like object (bytes, bytearray, memoryview, contiguous numpy array), or
    of a :class:`~kvpool.buffers.Parts`' pieces joined (hashed piece by piece, the same value)."""
    if type(data) is Parts:
        h = xxhash.xxh3_64()
        for view in data.views:
            h.update(view)
        return int(h.intdigest())
    return int(xxhash.xxh3_64_intdigest(data))
