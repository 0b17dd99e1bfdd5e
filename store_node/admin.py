"""The node's admin service (``kvpool.v1.NodeAdmin``): capacity, fill and counters over gRPC,
one ``TierStats`` per tier (CPU first, then GPU and SSD when present); and the replica work the
master asks of a node: copy blocks to another node (``CopyBlocks``: read from this node's own
data server, checked, then PUT + PUBLISH on the target, so every tier and read lease works as for
any reader), pin or unpin blocks, drop released replicas (``UpdateBlocks``)."""

from __future__ import annotations

import functools
from typing import Any, Protocol

from kvpool.logs import get_logger
from kvpool.proto.v1 import node_pb2, node_pb2_grpc
from kvpool.store_node.block_store import BlockState, BlockStore
from kvpool.store_node.replicate import IndexedBlock, check_refs, copy_blocks
from kvpool.transports.tcp import ConnectionPool, open_tcp_address

MAX_COPY_TIMEOUT_S = 30.0

SERVICE_NAME = "kvpool.v1.NodeAdmin"


class NodeIdentity(Protocol):
    """Who this node is right now (it changes on re-registration)."""

    @property
    def node_id(self) -> str: ...

    @property
    def member_id(self) -> int: ...

    @property
    def incarnation(self) -> int: ...

    @property
    def data_address(self) -> str: ...


class NodeAdmin(node_pb2_grpc.NodeAdminServicer):
    def __init__(
        self, store: BlockStore, identity: NodeIdentity, *, logger: Any = None, token: bytes = b""
    ) -> None:
        """``token``: the cluster token, offered on the data connections of node-to-node copies
        (this node's own data server and the target's both ask for it)."""
        self._store = store
        self._identity = identity
        self._token = token
        self._pool: ConnectionPool | None = None
        self._log = logger or get_logger("kvpool.node.admin")

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    def stats(self) -> node_pb2.GetStatsResponse:
        stats = self._store.stats()
        identity = self._identity
        return node_pb2.GetStatsResponse(
            node_id=identity.node_id,
            member_id=identity.member_id,
            incarnation=identity.incarnation,
            data_address=identity.data_address,
            tiers=[
                node_pb2.TierStats(
                    name=t.name,
                    capacity_bytes=t.capacity_bytes,
                    used_bytes=t.used_bytes,
                    block_count=t.blocks,
                    high_watermark=stats.high_watermark,
                    low_watermark=stats.low_watermark,
                    fragmentation=t.fragmentation,
                    hits_total=t.hits,
                    evictions_total=t.evictions,
                    demotions_total=t.demotions,
                    promotions_total=t.promotions,
                    detail=t.detail,
                )
                for t in stats.tiers
            ],
            staged_count=stats.staged,
            hits_total=stats.hits,
            misses_total=stats.misses_total,
            evictions_total=stats.evictions,
            puts_total=stats.puts,
            bad_frames_total=stats.bad_frames,
        )

    async def GetStats(  # noqa: N802 (the gRPC method name)
        self, request: node_pb2.GetStatsRequest, context: Any
    ) -> node_pb2.GetStatsResponse:
        return self.stats()

    async def CopyBlocks(  # noqa: N802 (the gRPC method name)
        self, request: node_pb2.CopyBlocksRequest, context: Any
    ) -> node_pb2.CopyBlocksResponse:
        if self._pool is None:
            self._pool = ConnectionPool(
                size=2, opener=functools.partial(open_tcp_address, token=self._token)
            )
        refs = [
            IndexedBlock(b.key, b.write_id, b.version, b.size_bytes, b.checksum)
            for b in request.blocks
        ]
        check_refs(request.target_data_address, refs, max_block_size=self._store.max_block_size)
        timeout_s = min(request.timeout_s or 5.0, MAX_COPY_TIMEOUT_S)
        if not timeout_s > 0:  # NaN, negative
            timeout_s = 5.0
        # Only blocks this node holds with exactly that size and checksum are read (the index
        # may be stale); nothing is allocated for the others.
        held = [self._holds(r) for r in refs]
        todo = [r for r, ok in zip(refs, held, strict=True) if ok]
        done = await copy_blocks(
            self._pool,
            self._identity.data_address,
            request.target_data_address,
            todo,
            timeout_s=timeout_s,
        )
        it = iter(done)
        errors = [next(it) if ok else "not held here" for ok in held]
        failed = [(r.key, e) for r, e in zip(refs, errors, strict=True) if e]
        if failed:
            self._log.warning(
                "copy_failed",
                target=request.target_data_address,
                blocks=len(failed),
                first_key=failed[0][0],
                error=failed[0][1],
            )
        return node_pb2.CopyBlocksResponse(copied=[not e for e in errors])

    def _holds(self, ref: IndexedBlock) -> bool:
        block = self._store.block(ref.key, ref.write_id)
        return (
            block is not None
            and block.state is not BlockState.RECEIVING
            and block.size_bytes == ref.size_bytes
            and block.checksum == ref.checksum
        )

    async def UpdateBlocks(  # noqa: N802 (the gRPC method name)
        self, request: node_pb2.UpdateBlocksRequest, context: Any
    ) -> node_pb2.UpdateBlocksResponse:
        changed = 0
        for b in request.pin:
            changed += self._store.set_pinned(b.key, b.write_id, True)
        for b in request.unpin:
            changed += self._store.set_pinned(b.key, b.write_id, False)
        for b in request.drop:
            if b.write_id:  # never "every write of the key": only the released one
                changed += self._store.delete(b.key, b.write_id)
        return node_pb2.UpdateBlocksResponse(changed=changed)
