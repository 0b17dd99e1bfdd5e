"""The master's replica calls: ``Pin`` (pins with a quota, replicated), ``DrainNode`` (the
replicated draining mark, then a wait for the replica loop to empty the node) and
``ReplicaStatus``. :class:`~kvpool.raft_master.service.MasterService` delegates to this."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from kvpool.config import MasterConfig
from kvpool.errors import InternalError, MalformedRequestError, UnknownMemberError
from kvpool.proto.v1 import master_pb2
from kvpool.raft_master.commands import (
    Result,
    SetDraining,
    SetDrainingResult,
    SetPins,
    SetPinsResult,
    SimpleCommand,
)
from kvpool.raft_master.index import BlockIndex
from kvpool.raft_master.replica_loop import ReplicaLoop
from kvpool.raft_master.replication import Replicator

MAX_PIN_REPLICAS = 16
DRAIN_POLL_S = 0.1
MAX_STATUS_HOT_KEYS = 100


class ReplicaRpc:
    def __init__(
        self,
        cfg: MasterConfig,
        replicator: Replicator,
        loop: ReplicaLoop,
        *,
        require_leader: Callable[[], None],
        propose: Callable[[SimpleCommand, Any], Awaitable[Result]],
        check_keys: Callable[..., list[str]],
        check_request_id: Callable[[bytes], bytes],
    ) -> None:
        self._cfg = cfg
        self._replicator = replicator
        self._loop = loop
        self._require_leader = require_leader
        self._propose = propose
        self._check_keys = check_keys
        self._check_request_id = check_request_id

    async def pin(self, request: master_pb2.PinRequest, context: Any) -> master_pb2.PinResponse:
        request_id = self._check_request_id(request.request_id)
        keys = self._check_keys(request.keys, allow_empty=False)
        if request.replicas > MAX_PIN_REPLICAS:
            raise MalformedRequestError(
                f"replicas: at most {MAX_PIN_REPLICAS} per pinned block, got {request.replicas}"
            )
        self._require_leader()
        result = await self._propose(
            SetPins(request_id, tuple(keys), request.replicas, self._cfg.pin_quota), context
        )
        if not isinstance(result, SetPinsResult):
            raise InternalError(f"unexpected result {type(result).__name__}")
        return master_pb2.PinResponse(
            statuses=result.statuses,  # type: ignore[arg-type]
            pinned_bytes=result.pinned_bytes,
            quota_bytes=self._cfg.pin_quota,
            revision=result.revision,
        )

    async def drain(
        self, request: master_pb2.DrainNodeRequest, context: Any
    ) -> master_pb2.DrainNodeResponse:
        """Mark the node's live member draining (replicated: ``SetDraining``), or clear the mark
        (``cancel``); with ``wait``, answer once the replica loop has emptied it and declared it
        left, or shortly before the caller's deadline. Asking again is harmless."""
        self._require_leader()
        node_id = request.node_id
        member_id = self._replicator.read(lambda ix: ix.member_of_node(node_id))
        record = self._replicator.read(lambda ix: ix.member(member_id) if member_id else None)
        if member_id is None or record is None or not record.live:
            raise UnknownMemberError(f"no live node {node_id!r} to drain")
        result = await self._propose(
            SetDraining(os.urandom(16), member_id, not request.cancel), context
        )
        if not isinstance(result, SetDrainingResult):
            raise InternalError(f"unexpected result {type(result).__name__}")
        if not result.found:
            raise UnknownMemberError(f"no live node {node_id!r} to drain")
        while True:
            member_id, left, live, draining = self._replicator.read(
                partial(_drain_progress, node_id=node_id, member_id=member_id)
            )
            remaining = context.time_remaining() if context is not None else None
            if (
                not live
                or request.cancel
                or not request.wait
                or (remaining is not None and remaining < 0.3)
            ):
                return master_pb2.DrainNodeResponse(
                    member_id=member_id, blocks_left=left, left=not live, draining=draining
                )
            self._require_leader()
            await asyncio.sleep(DRAIN_POLL_S)

    async def status(
        self, request: master_pb2.ReplicaStatusRequest, context: Any
    ) -> master_pb2.ReplicaStatusResponse:
        keys = list(request.keys)

        def read(ix: BlockIndex) -> tuple[list[int], int]:
            return [len(v.replicas) if v else 0 for v in ix.lookup(keys)], ix.pinned_bytes()

        counts, pinned_bytes = self._replicator.read(read)
        loop = self._loop
        return master_pb2.ReplicaStatusResponse(
            replicas=counts,
            under_target=loop.under_target,
            copies_total=loop.copies_total,
            releases_total=loop.releases_total,
            hot_keys=loop.hot_keys()[:MAX_STATUS_HOT_KEYS],
            pinned_bytes=pinned_bytes,
            leader=self._replicator.is_leader(),
        )


def _drain_progress(ix: BlockIndex, node_id: str, member_id: int) -> tuple[int, int, bool, bool]:
    """``(member, blocks left, live, draining)`` of a drain of ``member_id``. A node restarted
    mid-drain registers a new member that carries the mark on: the drain follows it."""
    current = ix.member_of_node(node_id)
    rec = ix.member(current) if current is not None else None
    if current is not None and current != member_id and rec is not None and rec.draining:
        member_id = current  # (a draining member is live)
    else:
        rec = ix.member(member_id)
    live = rec is not None and rec.live
    draining = rec is not None and rec.draining
    return member_id, len(ix.member_keys(member_id, 1 << 30)), live, draining
