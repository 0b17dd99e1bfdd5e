"""Node-to-node block copies for replicas: read exactly ``(key, write id)`` from a source node,
check it against the indexed size and checksum, stage it on a target node under the same write
id, publish it there with the indexed version.

Used by a store node when the master asks it to copy blocks it holds (hot blocks, pins, repair,
drain): the bytes go source node → target node over the data plane, never through the master.
A copy that fails any check is not published, so the target can never serve a wrong block; the
master only adds the target to the index once it is published.

Every ref is checked before anything is allocated for it (:func:`check_refs`: key, write id,
size against the node's ``max_block_size``, how many refs): a bad request is refused whole with
a typed error (MALFORMED / REQUEST_TOO_LARGE). Copies in flight hold at most
``max_inflight_bytes`` of buffers together.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvpool.checksum import block_checksum
from kvpool.errors import KVPoolError, MalformedRequestError, RequestTooLargeError
from kvpool.proto.wire import MAX_KEY_BYTES, Op, Status, TierLevel, encode_key
from kvpool.transports.tcp import ConnectionPool, parse_tcp_address

MAX_COPY_REFS = 4096
"""Most blocks one CopyBlocks may name."""
MAX_INFLIGHT_BYTES = 256 << 20
"""Most bytes of copy buffers held at once by one copy_blocks call."""


@dataclass(frozen=True, slots=True)
class IndexedBlock:
    """One committed block as the index names it (a ``BlockRef`` of a CopyBlocks request): the
    exact write to read, and the size and checksum it must have."""

    key: str
    write_id: int
    version: int
    size_bytes: int
    checksum: int


def check_refs(target: str, refs: list[IndexedBlock], *, max_block_size: int) -> None:
    """Refuse a copy request that names a bad block or target (nothing allocated yet)."""
    try:
        parse_tcp_address(target)
    except KVPoolError:
        raise MalformedRequestError(f"target {target[:200]!r} is not a tcp://host:port") from None
    if len(refs) > MAX_COPY_REFS:
        raise RequestTooLargeError(f"{len(refs)} blocks in one copy; at most {MAX_COPY_REFS}")
    for ref in refs:
        raw = ref.key.encode("utf-8", "replace")
        if not raw or len(raw) > MAX_KEY_BYTES:
            raise MalformedRequestError(
                f"block key of {len(raw)} bytes: keys are 1 to {MAX_KEY_BYTES} bytes"
            )
        if ref.write_id == 0:
            raise MalformedRequestError(f"block {ref.key[:100]!r}: write id 0 names no block")
        if ref.size_bytes > max_block_size:
            raise MalformedRequestError(
                f"block {ref.key[:100]!r}: size {ref.size_bytes} is above this node's "
                f"max_block_size ({max_block_size})"
            )


class _ByteGate:
    """At most ``limit`` bytes held by the copies in flight (a copy larger than the limit
    runs alone)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held = 0
        self._changed = asyncio.Condition()

    async def acquire(self, size: int) -> None:
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._held == 0 or self._held + size <= self._limit
            )
            self._held += size

    async def release(self, size: int) -> None:
        async with self._changed:
            self._held -= size
            self._changed.notify_all()


async def copy_block(
    pool: ConnectionPool, source: str, target: str, ref: IndexedBlock, *, timeout_s: float
) -> str:
    """Copy one block; ``""`` when published on the target, else why not."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    key = encode_key(ref.key)
    try:
        src = await pool.get(source, timeout_s=timeout_s)
        sink = memoryview(bytearray(ref.size_bytes))
        got = await src.request(
            Op.GET,
            key,
            write_id=ref.write_id,
            flags=int(TierLevel.ANY),
            sink=sink,
            timeout_s=deadline - loop.time(),
        )
        if got.status != Status.OK:
            return f"source: {Status(got.status).name}"
        if block_checksum(sink) != ref.checksum:
            return "source: checksum mismatch"
        dst = await pool.get(target, timeout_s=deadline - loop.time())
        put = await dst.request(
            Op.PUT,
            key,
            write_id=ref.write_id,
            checksum=ref.checksum,
            payload=sink,
            timeout_s=deadline - loop.time(),
        )
        if put.status != Status.OK:
            return f"target put: {Status(put.status).name} {put.message()}".strip()
        pub = await dst.request(
            Op.PUBLISH,
            key,
            write_id=ref.write_id,
            version=ref.version,
            timeout_s=deadline - loop.time(),
        )
        if pub.status != Status.OK:
            return f"target publish: {Status(pub.status).name}"
    except KVPoolError as e:
        return e.message
    return ""


async def copy_blocks(
    pool: ConnectionPool,
    source: str,
    target: str,
    refs: list[IndexedBlock],
    *,
    timeout_s: float,
    parallel: int = 8,
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
) -> list[str]:
    """Copy blocks, ``parallel`` at a time and at most ``max_inflight_bytes`` of buffers at
    once; per block ``""`` (published) or why not. Check the refs first (:func:`check_refs`)."""
    gate = asyncio.Semaphore(parallel)
    room = _ByteGate(max_inflight_bytes)

    async def one(ref: IndexedBlock) -> str:
        async with gate:
            await room.acquire(ref.size_bytes)
            try:
                return await copy_block(pool, source, target, ref, timeout_s=timeout_s)
            finally:
                await room.release(ref.size_bytes)

    return list(await asyncio.gather(*(one(r) for r in refs)))
