"""The block checksum: xxh3-64 over the block's bytes, computed once by the writer, stored in the
index, checked by the node on PUT and by the client on every read."""

from __future__ import annotations

from typing import Any

import xxhash


def block_checksum(data: Any) -> int:
    """xxh3-64 of a bytes-like object (bytes, bytearray, memoryview, contiguous numpy array)."""
    return int(xxhash.xxh3_64_intdigest(data))
