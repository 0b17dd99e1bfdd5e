"""The ``kvpool.v1.Master`` gRPC service (grpc.aio): validation, leader guard, group commit.

Writes (CommitPuts, Remove, RegisterNode, Heartbeat, ReportEvictions, LeaveNode) are served by the
leader only; elsewhere they raise :class:`NotLeaderError` carrying the leader's gRPC address from
the replicated masters table. Lookup and PrefixMatch are answered by the leader only, while it
holds its read lease (``raft_read_lease``; :mod:`kvpool.raft_master.lease`), so that every
write acknowledged to any client is found; GetMembers and ClusterStatus are answered from the
local copy on any master (a stale ring is refused at commit time).

Group commit: CommitPuts requests that arrive while a Raft entry is in flight are merged into the
next entry (a ``Batch`` whose sub-commands keep their own request ids and results), up to
``commit_batch_max_entries`` put entries per Raft entry.

Raised :class:`~kvpool.errors.KVPoolError` s become a status plus metadata in the handlers of
:mod:`kvpool.grpcutil`; the server keeps serving after any bad request.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc.aio
from google.protobuf.message import Message

from kvpool import receipts
from kvpool.config import INDEX_SHED_FROM, MasterConfig
from kvpool.errors import (
    IndexFullError,
    InternalError,
    InvalidKeyError,
    MalformedRequestError,
    NotCaughtUpError,
    NotLeaderError,
    UnavailableError,
)
from kvpool.logs import OncePer, get_logger
from kvpool.proto import PROTOCOL_VERSION
from kvpool.proto.v1 import common_pb2, master_pb2, master_pb2_grpc
from kvpool.proto.wire import MAX_KEY_BYTES
from kvpool.raft_master.commands import (
    PUT_COMMITTED,
    Batch,
    ClaimedBlock,
    ClaimReplicas,
    ClaimReplicasResult,
    CommitPuts,
    DropReplicas,
    DropReplicasResult,
    MarkMemberDown,
    MarkMemberDownResult,
    PutItem,
    RegisterMaster,
    RegisterMember,
    RegisterMemberResult,
    RemoveKeys,
    RemoveKeysResult,
    Result,
    SimpleCommand,
)
from kvpool.raft_master.failure import FailureDetector
from kvpool.raft_master.group_commit import GroupCommitter
from kvpool.raft_master.index import BlockIndex, MemberRecord
from kvpool.raft_master.members import check_registered
from kvpool.raft_master.replication import Replicator
from kvpool.raft_master.request_checks import check_key_count, check_registration

REQUEST_ID_BYTES = 16
MAX_REVISION_WAIT_S = 1.0
INDEX_FULL_LOG_EVERY_S = 10.0  # at most one index_full warning this often
_TIERS = frozenset(common_pb2.Tier.values())

# --- validation -------------------------------------------------------------------------------


def check_request_id(request_id: bytes) -> bytes:
    if len(request_id) != REQUEST_ID_BYTES:
        raise MalformedRequestError(
            f"request_id must be {REQUEST_ID_BYTES} bytes, got {len(request_id)}"
        )
    return bytes(request_id)


def check_key(key: str) -> str:
    if not key:
        raise InvalidKeyError("empty key")
    if len(key) > MAX_KEY_BYTES // 4 and len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise InvalidKeyError(
            f"key of {len(key.encode('utf-8'))} UTF-8 bytes is above the limit of {MAX_KEY_BYTES}"
        )
    return key


def check_keys(keys: Iterable[str], *, allow_empty: bool) -> list[str]:
    out = list(keys)
    if not out:
        if not allow_empty:
            raise MalformedRequestError("no keys given")
        return out
    # Lengths first, for the whole batch at once: a key can only be too long in UTF-8 when it
    # is longer than a quarter of the limit in characters.
    if "" in out or max(map(len, out)) > MAX_KEY_BYTES // 4:
        for key in out:
            check_key(key)
    return out


def member_pb(rec: MemberRecord) -> common_pb2.Member:
    return common_pb2.Member(
        member_id=rec.member_id,
        node_id=rec.node_id,
        incarnation=rec.incarnation,
        data_address=rec.data_address,
        admin_address=rec.admin_address,
        capacity_bytes=rec.capacity_bytes,
        zone=rec.zone,
        live=rec.live,
        draining=rec.draining,
    )


def shed_share(held: int, limit: int, mine: int) -> int:
    """How many of its coldest blocks a node holding ``mine`` of the index's ``held`` entries
    is asked to drop in its heartbeat's answer (``index_shed``; ``limit`` 0: off): the entries
    past INDEX_SHED_FROM of the index's limit, times the node's share of the entries (as if
    each entry's replicas all dropped it at once; the next heartbeats ask again for what is
    left); 0 below it. A full index keeps admitting new keys this way, the coldest blocks
    making room, instead of freezing what the cache holds."""
    floor = int(limit * INDEX_SHED_FROM)
    if held <= floor or held <= 0 or limit <= 0:
        return 0
    return min(math.ceil((held - floor) * mine / held), 0xFFFFFFFF)


def _named_live_members(ix: BlockIndex, ids: Iterable[int]) -> list[MemberRecord]:
    out: dict[int, MemberRecord] = {}
    for member_id in ids:
        if member_id not in out:
            rec = ix.member(member_id)
            if rec is not None and rec.live:
                out[member_id] = rec
    return [out[m] for m in sorted(out)]


# --- the servicer -------------------------------------------------------------------------------


@dataclass
class NodeStats:
    capacity_bytes: int = 0
    used_bytes: int = 0
    block_count: int = 0
    staged_count: int = 0
    hits_total: int = 0
    misses_total: int = 0
    evictions_total: int = 0


class ReplicaHooks(Protocol):
    """What the service needs of the replica loop (:mod:`kvpool.raft_master.replica_loop`)."""

    def reads_reported(self, counts: list[tuple[str, int]]) -> None: ...

    def looked_up(self, keys: list[str]) -> None: ...


class ReplicaCalls(Protocol):
    """The replica calls (:mod:`kvpool.raft_master.replica_rpc`)."""

    async def pin(self, request: master_pb2.PinRequest, context: Any) -> master_pb2.PinResponse: ...

    async def drain(
        self, request: master_pb2.DrainNodeRequest, context: Any
    ) -> master_pb2.DrainNodeResponse: ...

    async def status(
        self, request: master_pb2.ReplicaStatusRequest, context: Any
    ) -> master_pb2.ReplicaStatusResponse: ...


class MasterService(master_pb2_grpc.MasterServicer):
    """Implements ``kvpool.v1.Master`` over one :class:`Replicator`."""

    def __init__(
        self,
        cfg: MasterConfig,
        replicator: Replicator,
        detector: FailureDetector,
        *,
        grpc_address: str,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
    ) -> None:
        self.cfg = cfg
        self.replicator = replicator
        self.detector = detector
        self.grpc_address = grpc_address
        self._clock = clock
        self._log = logger or get_logger("kvpool.raft_master.service")
        self.receipt_key = receipts.derive_key(cfg.raft_secret)  # signs commits for the nodes
        self.committer = GroupCommitter(
            self._propose_raw,
            max_entries=cfg.commit_batch_max_entries,
            timeout_s=cfg.commit_timeout_s,
        )
        self._node_stats: dict[int, NodeStats] = {}
        self.index_limit = cfg.index_entry_limit()  # puts of new keys refused at this size
        self.index_full_refusals = 0  # CommitPuts refused for it (IndexFullError)
        self.index_shed_asked = 0  # blocks nodes were asked to drop to make room (index_shed)
        self._index_full_log = OncePer(self._log, INDEX_FULL_LOG_EVERY_S, clock=clock)
        self.rpc_address = ""  # the frame RPC port, when offered (see rpc_port.py)
        self.read_address = ""  # the read port, offered with it (see read_port.py)
        self._established_term: int | None = None
        self._announce_in_flight = False
        self.replicas: ReplicaHooks | None = None  # the replica loop, set by the server
        self.replica_rpc: ReplicaCalls | None = None  # Pin, DrainNode, ReplicaStatus

    # --- leadership -----------------------------------------------------------------------

    def _leader_grpc_address(self) -> str | None:
        leader = self.replicator.leader_raft_address()
        if leader is None:
            return None
        return self.replicator.read(lambda ix: ix.master_grpc_address(leader))

    def _not_leader(self) -> NotLeaderError:
        leader = self._leader_grpc_address()
        if leader == self.grpc_address:
            leader = None
        return NotLeaderError(
            f"master {self.grpc_address} is not the Raft leader"
            + (f"; the leader is {leader}" if leader else "; no leader known yet"),
            leader=leader,
        )

    def _require_leader(self) -> None:
        if not self.replicator.is_leader():
            raise self._not_leader()

    def require_leader(self) -> None:
        """Raise NotLeaderError (naming the leader when known) unless this master leads."""
        self._require_leader()

    async def propose(self, command: SimpleCommand, context: Any = None) -> Result:
        """Replicate one command within the caller's deadline."""
        return await self._propose(command, context)

    def leader_established(self) -> bool:
        """Leader, and an entry proposed in this term has been applied here: the local index
        holds every entry committed before this leadership (safe to declare nodes unknown)."""
        return self.replicator.is_leader() and self._established_term == self.replicator.term()

    async def _propose_raw(self, command: SimpleCommand | Batch, timeout_s: float) -> Result:
        try:
            return await self.replicator.propose(command, timeout_s)
        except UnavailableError:
            if not self.replicator.is_leader():
                raise self._not_leader() from None
            raise

    async def _propose(self, command: SimpleCommand, context: Any = None) -> Result:
        timeout_s = self.cfg.commit_timeout_s
        remaining = context.time_remaining() if context is not None else None
        if remaining is not None:
            timeout_s = max(0.001, min(timeout_s, remaining))
        return await self._propose_raw(command, timeout_s)

    async def maintain(self) -> None:
        """Called periodically by the server: establish leadership with a barrier entry and
        keep this master's gRPC address in the replicated masters table."""
        if not self.replicator.is_leader():
            if self._established_term is not None:
                self._established_term = None
                self._node_stats.clear()
        elif not self.leader_established():
            term = self.replicator.term()
            await self._announce()
            if self.replicator.is_leader() and self.replicator.term() == term:
                self._established_term = term
            return
        leader = self.replicator.leader_raft_address()
        if leader is None or self._announce_in_flight:
            return
        raft = self.cfg.raft_listen
        if self.replicator.read(lambda ix: ix.master_grpc_address(raft)) != self.grpc_address:
            await self._announce()

    async def _announce(self) -> None:
        self._announce_in_flight = True
        try:
            await self.replicator.propose(
                RegisterMaster(os.urandom(16), self.cfg.raft_listen, self.grpc_address),
                self.cfg.commit_timeout_s,
            )
        finally:
            self._announce_in_flight = False

    # --- writes ---------------------------------------------------------------------------------

    async def CommitPuts(  # noqa: N802 - gRPC method name
        self, request: master_pb2.CommitPutsRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.CommitPutsResponse:
        request_id = check_request_id(request.request_id)
        if not request.entries:
            raise MalformedRequestError("CommitPuts without entries")
        if len(request.entries) > self.cfg.commit_batch_max_entries:
            raise MalformedRequestError(
                f"{len(request.entries)} entries in one CommitPuts; at most "
                f"{self.cfg.commit_batch_max_entries}"
            )
        items = []
        for e in request.entries:
            check_key(e.key)
            if e.write_id == 0:
                raise MalformedRequestError(f"entry {e.key!r}: write_id 0 is reserved")
            if not e.replicas:
                raise MalformedRequestError(f"entry {e.key!r}: no replicas")
            items.append(PutItem(e.key, e.write_id, e.size_bytes, e.checksum, tuple(e.replicas)))
        self._require_leader()
        self._refuse_new_keys_when_full(items)
        command = CommitPuts(request_id, request.ring_version, tuple(items))
        result = await self.committer.submit(command)
        response = master_pb2.CommitPutsResponse(
            revision=result.revision,
            stale_ring=result.stale_ring,
            ring_version=result.ring_version,
        )
        key, sign, committed = self.receipt_key, receipts.sign, PUT_COMMITTED
        for item, o in zip(items, result.outcomes, strict=False):
            response.results.add(
                status=o.status,
                version=o.version,
                replicas=o.replicas,
                superseded_write_id=o.superseded_write_id,
                superseded_replicas=o.superseded_replicas,
                receipt=(
                    sign(key, item.key.encode("utf-8"), item.write_id, o.version)
                    if key and o.status == committed
                    else 0
                ),
            )
        return response

    def _refuse_new_keys_when_full(self, items: list[PutItem]) -> None:
        """At ``index_max_entries`` a put adding a key is refused whole (its blocks stay
        staged on their nodes until the reaper frees them); overwrites go on. Checked by the
        leader before proposing, so the followers apply whatever the log holds and masters
        configured with different limits never disagree; puts already in flight may pass the
        limit by their own size."""
        limit = self.index_limit
        held = self.replicator.read(len)
        if held < limit:
            return
        keys = [it.key for it in items]
        if self.replicator.read(lambda ix: all(ix.entry_record(k) is not None for k in keys)):
            return  # overwrites only (of entries held, even with every replica down)
        self.index_full_refusals += 1
        self._index_full_log.warning(
            "index_full", "index", entries=held, limit=limit, refused=self.index_full_refusals
        )
        raise IndexFullError(
            f"the index holds {held} entries, at its limit ({limit}, index_max_entries): puts "
            "of keys it does not hold are refused until blocks leave it"
        )

    async def Remove(  # noqa: N802 - gRPC method name
        self, request: master_pb2.RemoveRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.RemoveResponse:
        request_id = check_request_id(request.request_id)
        prefixes = tuple(request.prefixes)
        keys = check_keys(request.keys, allow_empty=bool(prefixes))
        self._require_leader()
        command = RemoveKeys(request_id, tuple(keys), prefixes, request.limit)
        result = await self._propose(command, context)
        if not isinstance(result, RemoveKeysResult):
            raise InternalError(f"unexpected result {type(result).__name__}")
        members = self.replicator.read(
            lambda ix: _named_live_members(ix, (m for b in result.blocks for m in b.replicas))
        )
        response = master_pb2.RemoveResponse(
            removed=result.removed,
            revision=result.revision,
            members=map(member_pb, members),
            prefix_removed=result.prefix_removed,
            more=result.more,
        )
        for b in result.blocks:
            response.blocks.add(key=b.key, write_id=b.write_id, replicas=b.replicas)
        return response

    async def RegisterNode(  # noqa: N802 - gRPC method name
        self, request: master_pb2.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.RegisterNodeResponse:
        request_id = check_request_id(request.request_id)
        check_registration(request, self.cfg.max_node_capacity)
        self._require_leader()
        result = await self._propose(
            RegisterMember(
                request_id,
                request.node_id,
                request.incarnation,
                request.data_address,
                request.admin_address,
                request.capacity_bytes,
                request.zone,
            ),
            context,
        )
        if not isinstance(result, RegisterMemberResult):
            raise InternalError(f"unexpected result {type(result).__name__}")
        check_registered(result, request.node_id, request.incarnation)
        self.detector.heartbeat(result.member_id, self._clock())
        self._node_stats[result.member_id] = NodeStats(capacity_bytes=request.capacity_bytes)
        self._log.info(
            "node_registered",
            node=request.node_id,
            member_id=result.member_id,
            incarnation=request.incarnation,
            ring_version=result.ring_version,
        )
        return master_pb2.RegisterNodeResponse(
            member_id=result.member_id,
            ring_version=result.ring_version,
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            node_timeout_s=self.cfg.node_timeout_s,
            receipt_key=self.receipt_key,
        )

    async def Heartbeat(  # noqa: N802 - gRPC method name
        self, request: master_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.HeartbeatResponse:
        self._require_leader()
        if not self.leader_established():
            raise UnavailableError("the new leader is still applying the log; retry shortly")
        # "unknown" makes a node drop its blocks and join again: only a leader that cannot
        # have been replaced may say it (one woken from a pause still believes it leads).
        await self._require_read_lease(context)
        member_id = request.member_id
        limit = self.index_limit if self.cfg.index_shed else 0

        def read(ix: BlockIndex) -> tuple[bool, int, int]:
            known = (rec := ix.member(member_id)) is not None and rec.live
            shed = shed_share(len(ix), limit, ix.member_block_count(member_id)) if known else 0
            return known, ix.ring_version, shed

        known, ring_version, shed = self.replicator.read(read)
        self.index_shed_asked += shed
        if known:
            if request.hot_blocks and self.replicas is not None:
                self.replicas.reads_reported([(b.key, b.reads) for b in request.hot_blocks])
            self.detector.heartbeat(member_id, self._clock())
            self._node_stats[member_id] = NodeStats(
                capacity_bytes=request.capacity_bytes,
                used_bytes=request.used_bytes,
                block_count=request.block_count,
                staged_count=request.staged_count,
                hits_total=request.hits_total,
                misses_total=request.misses_total,
                evictions_total=request.evictions_total,
            )
        else:
            self._node_stats.pop(member_id, None)
        return master_pb2.HeartbeatResponse(
            known=known, ring_version=ring_version, receipt_key=self.receipt_key, shed_blocks=shed
        )

    async def ReportEvictions(  # noqa: N802 - gRPC method name
        self, request: master_pb2.ReportEvictionsRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.ReportEvictionsResponse:
        request_id = check_request_id(request.request_id)
        if request.member_id == 0:
            raise MalformedRequestError("ReportEvictions without member_id")
        blocks = tuple((check_key(b.key), b.write_id) for b in request.blocks)
        self._require_leader()
        if not blocks:
            revision = self.replicator.read(lambda ix: ix.revision)
            return master_pb2.ReportEvictionsResponse(dropped=0, revision=revision)
        result = await self._propose(DropReplicas(request_id, request.member_id, blocks), context)
        if not isinstance(result, DropReplicasResult):
            raise InternalError(f"unexpected result {type(result).__name__}")
        return master_pb2.ReportEvictionsResponse(dropped=result.dropped, revision=result.revision)

    async def ClaimReplicas(  # noqa: N802 - gRPC method name
        self, request: master_pb2.ClaimReplicasRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.ClaimReplicasResponse:
        request_id = check_request_id(request.request_id)
        if request.member_id == 0:
            raise MalformedRequestError("ClaimReplicas without member_id")
        if len(request.blocks) > self.cfg.commit_batch_max_entries:
            raise MalformedRequestError(
                f"{len(request.blocks)} blocks in one ClaimReplicas; at most "
                f"{self.cfg.commit_batch_max_entries}"
            )
        blocks = []
        for b in request.blocks:
            check_key(b.key)
            if b.write_id == 0:
                raise MalformedRequestError(f"block {b.key!r}: write_id 0 is reserved")
            if b.tier not in _TIERS:
                raise MalformedRequestError(f"block {b.key!r}: unknown tier {b.tier}")
            blocks.append(
                ClaimedBlock(b.key, b.write_id, b.version, b.size_bytes, b.checksum, int(b.tier))
            )
        self._require_leader()
        result = await self._propose(
            ClaimReplicas(request_id, request.member_id, request.restore, tuple(blocks)), context
        )
        if not isinstance(result, ClaimReplicasResult):
            raise InternalError(f"unexpected result {type(result).__name__}")
        return master_pb2.ClaimReplicasResponse(accepted=result.accepted, revision=result.revision)

    async def LeaveNode(  # noqa: N802 - gRPC method name
        self, request: master_pb2.LeaveNodeRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.LeaveNodeResponse:
        request_id = check_request_id(request.request_id)
        if request.member_id == 0:
            raise MalformedRequestError("LeaveNode without member_id")
        self._require_leader()
        record, ring_version = self.replicator.read(
            lambda ix: (ix.member(request.member_id), ix.ring_version)
        )
        if record is None:  # already down and purged: leaving again is a no-op
            return master_pb2.LeaveNodeResponse(ring_version=ring_version)
        result = await self._propose(MarkMemberDown(request_id, request.member_id, "left"), context)
        if not isinstance(result, MarkMemberDownResult):
            raise InternalError(f"unexpected result {type(result).__name__}")
        self.detector.forget(request.member_id)
        self._node_stats.pop(request.member_id, None)
        if result.changed:
            self._log.info("node_left", node=record.node_id, member_id=request.member_id)
        return master_pb2.LeaveNodeResponse(ring_version=result.ring_version)

    # --- replicas (delegated) -------------------------------------------------------------------

    def _replica_calls(self) -> ReplicaCalls:
        if self.replica_rpc is None:
            raise UnavailableError("this master serves no replica calls")
        return self.replica_rpc

    async def Pin(  # noqa: N802 - gRPC method name
        self, request: master_pb2.PinRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.PinResponse:
        return await self._replica_calls().pin(request, context)

    async def DrainNode(  # noqa: N802 - gRPC method name
        self, request: master_pb2.DrainNodeRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.DrainNodeResponse:
        return await self._replica_calls().drain(request, context)

    async def ReplicaStatus(  # noqa: N802 - gRPC method name
        self, request: master_pb2.ReplicaStatusRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.ReplicaStatusResponse:
        return await self._replica_calls().status(request, context)

    # --- reads ------------------------------------------------------------------------------------

    async def _require_read_lease(self, context: Any) -> None:
        """Lookups are answered by the leader only, while it holds its read lease, which
        includes having applied every entry of earlier terms (:mod:`kvpool.raft_master.lease`):
        then every write acknowledged to any client is in the local index. A follower names the
        leader;
        a leader without its lease waits briefly for it (a renewal is due every heartbeat),
        then answers UNAVAILABLE, which callers retry."""
        if not self.cfg.raft_read_lease:
            return
        if self.replicator.lease_held():
            return
        if not self.replicator.is_leader():
            raise self._not_leader()
        loop = asyncio.get_running_loop()
        wait_s = self.cfg.raft_min_timeout_s
        remaining = context.time_remaining() if context is not None else None
        if remaining is not None:
            wait_s = min(wait_s, max(0.0, remaining - 0.05))
        deadline = loop.time() + wait_s
        while loop.time() < deadline:
            await asyncio.sleep(min(0.005, max(0.0, deadline - loop.time())))
            if not self.replicator.is_leader():
                raise self._not_leader()
            if self.replicator.lease_held():
                return
        raise UnavailableError(
            f"master {self.grpc_address} leads but holds no read lease yet (a majority of the "
            "masters has not confirmed it lately); retry"
        )

    async def _wait_for_revision(self, min_revision: int, context: Any) -> None:
        if min_revision <= self.replicator.read(lambda ix: ix.revision):
            return
        loop = asyncio.get_running_loop()
        wait_s = MAX_REVISION_WAIT_S
        remaining = context.time_remaining() if context is not None else None
        if remaining is not None:
            wait_s = min(wait_s, max(0.0, remaining - 0.05))
        deadline = loop.time() + wait_s
        delay = 0.001
        while True:
            revision = self.replicator.read(lambda ix: ix.revision)
            if revision >= min_revision:
                return
            if loop.time() >= deadline:
                raise NotCaughtUpError(
                    f"master {self.grpc_address} has applied revision {revision}; "
                    f"the caller asked for {min_revision}"
                )
            await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
            delay = min(delay * 2, 0.02)

    async def Lookup(  # noqa: N802 - gRPC method name
        self, request: master_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.LookupResponse:
        keys = self._read_keys(request, "Lookup")
        await self._require_read_lease(context)
        await self._wait_for_revision(request.min_revision, context)
        return self._lookup(request, keys)

    def _read_keys(
        self, request: master_pb2.LookupRequest | master_pb2.PrefixMatchRequest, method: str
    ) -> list[str]:
        check_key_count(len(request.keys), self.cfg.max_lookup_keys, method)
        return check_keys(request.keys, allow_empty=True)

    def _lookup(
        self,
        request: master_pb2.LookupRequest,
        keys: list[str],
        on_loop: Callable[[Callable[[list[str]], None], list[str]], Any] | None = None,
    ) -> master_pb2.LookupResponse:
        if self.replicas is not None and len(keys) > 1 and not request.internal:
            if on_loop is None:
                self.replicas.looked_up(keys)
            else:
                on_loop(self.replicas.looked_up, keys)

        def read(ix: BlockIndex) -> tuple[Any, list[MemberRecord], int, int]:
            views = ix.lookup(keys)
            named = (m for v in views if v is not None for m in v.replicas)
            return views, _named_live_members(ix, named), ix.revision, ix.ring_version

        views, members, revision, ring_version = self.replicator.read(read)
        response = master_pb2.LookupResponse(
            revision=revision, ring_version=ring_version, members=map(member_pb, members)
        )
        add = response.entries.add
        for key, v in zip(keys, views, strict=True):
            if v is None:
                add(key=key, found=False)
            else:
                add(
                    key=key,
                    found=True,
                    version=v.version,
                    write_id=v.write_id,
                    size_bytes=v.size_bytes,
                    checksum=v.checksum,
                    replicas=v.replicas,
                    pinned=v.pinned,
                    tier=v.tier,
                )
        return response

    async def PrefixMatch(  # noqa: N802 - gRPC method name
        self, request: master_pb2.PrefixMatchRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.PrefixMatchResponse:
        keys = self._read_keys(request, "PrefixMatch")
        await self._require_read_lease(context)
        await self._wait_for_revision(request.min_revision, context)
        return self._prefix_match(request, keys)

    def _prefix_match(
        self, request: master_pb2.PrefixMatchRequest, keys: list[str]
    ) -> master_pb2.PrefixMatchResponse:
        if not request.each:
            matched, revision = self.replicator.read(
                lambda ix: (ix.prefix_match(keys), ix.revision)
            )
            return master_pb2.PrefixMatchResponse(matched=matched, revision=revision)
        found, revision = self.replicator.read(lambda ix: (ix.present(keys), ix.revision))
        matched = next((i for i, hit in enumerate(found) if not hit), len(found))
        return master_pb2.PrefixMatchResponse(matched=matched, revision=revision, found=found)

    def read_now(
        self,
        method: str,
        request: Any,
        on_loop: Callable[[Callable[[list[str]], None], list[str]], Any] | None = None,
    ) -> Message | None:
        """Answer a read (``Lookup``, ``PrefixMatch``, ``GetMembers``) without waiting, as the
        async method would answer it: None when that would wait first (no read lease yet, or an
        index behind the caller's ``min_revision``) or for any other method — then call that.
        Invalid requests raise as there. The frame RPC port answers most reads here, with no
        coroutine or task (:mod:`kvpool.raft_master.rpc_port`), and the read port from its
        threads (:mod:`kvpool.raft_master.read_port`): the index is read under its apply lock,
        and ``on_loop`` (``loop.call_soon_threadsafe``) takes what must run on the event loop
        (a Lookup's chain for the hot-prefix replicas)."""
        if method == "GetMembers":
            return self._members()
        if method not in ("PrefixMatch", "Lookup"):
            return None
        keys = self._read_keys(request, method)
        if self.cfg.raft_read_lease and not self.replicator.lease_held():
            return None
        if request.min_revision > self.replicator.read(lambda ix: ix.revision):
            return None
        if method == "PrefixMatch":
            return self._prefix_match(request, keys)
        return self._lookup(request, keys, on_loop)

    async def GetMembers(  # noqa: N802 - gRPC method name
        self, request: master_pb2.GetMembersRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.GetMembersResponse:
        return self._members()

    def _members(self) -> master_pb2.GetMembersResponse:
        members, ring_version = self.replicator.read(
            lambda ix: (ix.live_members(), ix.ring_version)
        )
        return master_pb2.GetMembersResponse(
            ring_version=ring_version,
            members=map(member_pb, members),
            rpc_address=self.rpc_address,
            read_address=self.read_address,
        )

    def master_status(self) -> master_pb2.MasterStatus:
        raft = self.replicator.status()
        leader_raft = self.replicator.leader_raft_address() or ""
        is_leader = self.replicator.is_leader()

        def read(ix: BlockIndex) -> tuple[int, int, str | None]:
            return ix.revision, len(ix), ix.master_grpc_address(leader_raft)

        revision, entries, leader_grpc = self.replicator.read(read)
        role = "leader" if is_leader else ("follower" if raft.role == "leader" else raft.role)
        return master_pb2.MasterStatus(
            grpc_address=self.grpc_address,
            raft_address=self.cfg.raft_listen,
            role=role,
            term=raft.term,
            commit_index=raft.commit_index,
            last_applied=raft.last_applied,
            leader_raft_address=leader_raft,
            leader_grpc_address=leader_grpc or "",
            ready=self.replicator.is_ready(),
            log_size=raft.log_size,
            revision=revision,
            entries=entries,
            follower_match_index=raft.follower_match_index if is_leader else {},
            max_entries=self.index_limit,
        )

    async def ClusterStatus(  # noqa: N802 - gRPC method name
        self, request: master_pb2.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> master_pb2.ClusterStatusResponse:
        master = self.master_status()
        members, ring_version = self.replicator.read(
            lambda ix: (ix.live_members(), ix.ring_version)
        )
        leader = self.replicator.is_leader()
        now = self._clock()
        response = master_pb2.ClusterStatusResponse(
            master=master, ring_version=ring_version, protocol_version=str(PROTOCOL_VERSION)
        )
        for rec in members:
            stats = self._node_stats.get(rec.member_id) if leader else None
            age = self.detector.last_seen_age(rec.member_id, now) if leader else None
            node = response.nodes.add(member=member_pb(rec))
            node.last_heartbeat_age_s = -1.0 if age is None else age
            if stats is not None:
                node.used_bytes = stats.used_bytes
                node.block_count = stats.block_count
                node.hits_total = stats.hits_total
                node.misses_total = stats.misses_total
                node.evictions_total = stats.evictions_total
        return response
