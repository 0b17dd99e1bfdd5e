"""The node's admin service (``kvpool.v1.NodeAdmin``): capacity, fill and counters over gRPC,
one ``TierStats`` per tier (CPU first, then GPU and SSD when present)."""

from __future__ import annotations

from typing import Any, Protocol

from kvpool.proto.v1 import node_pb2, node_pb2_grpc
from kvpool.store_node.block_store import BlockStore

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
    def __init__(self, store: BlockStore, identity: NodeIdentity) -> None:
        self._store = store
        self._identity = identity

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
