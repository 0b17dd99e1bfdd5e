"""Node-to-node block copies for replicas: read exactly ``(key, write id)`` from a source node,
check it against the indexed size and checksum, stage it on a target node under the same write
id, publish it there with the indexed version.

Used by a store node when the master asks it to copy blocks it holds (hot blocks, pins, repair,
drain): the bytes go source node → target node over the data plane, never through the master.
A copy that fails any check is not published, so the target can never serve a wrong block; the
master only adds the target to the index once it is published.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvpool.checksum import block_checksum
from kvpool.errors import KVPoolError
from kvpool.proto.wire import Op, Status, TierLevel, encode_key
from kvpool.transports.tcp import ConnectionPool


@dataclass(frozen=True, slots=True)
class BlockRef:
    """One committed block as the index names it."""

    key: str
    write_id: int
    version: int
    size_bytes: int
    checksum: int


async def copy_block(
    pool: ConnectionPool, source: str, target: str, ref: BlockRef, *, timeout_s: float
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
    refs: list[BlockRef],
    *,
    timeout_s: float,
    parallel: int = 8,
) -> list[str]:
    """Copy blocks, ``parallel`` at a time; per block ``""`` (published) or why not."""
    gate = asyncio.Semaphore(parallel)

    async def one(ref: BlockRef) -> str:
        async with gate:
            return await copy_block(pool, source, target, ref, timeout_s=timeout_s)

    return list(await asyncio.gather(*(one(r) for r in refs)))
