"""The leader's replica loop: hot blocks, pins, repair after a node loss, drain, cooling.

A thin async shell around the pure planner (:mod:`kvpool.raft_master.replica_plan`) and the hot
detector (:mod:`kvpool.raft_master.hot`). Every ``period_s`` on the leader it:

1. reads the index (under its lock) and plans, in priority order: blocks on draining members,
   blocks that lost a replica to a dead member (target = the count their entry lists, the dead
   one included, so the copy *replaces* it), pinned blocks under their pin, hot blocks under
   ``hot_max_replicas``; and the replicas to release (drained members' copies that others also
   hold, copies added while a block was hot once it has cooled);
2. asks each source node to copy to its target over the data plane (``NodeAdmin.CopyBlocks``;
   bytes never pass through the master), rate-limited by token buckets in blocks/s and bytes/s;
3. commits what was copied with one ``ChangeReplicas`` command per round (exact write id: an
   entry overwritten meanwhile is left alone), then releases, then tells nodes to pin/unpin and
   to drop released copies (``NodeAdmin.UpdateBlocks``);
4. declares a drained member left (``MarkMemberDown`` reason ``"drained"``) once the index
   names it for nothing.

Draining is replicated state: ``DrainNode`` commits ``SetDraining`` and the member record in the
index carries the mark (:mod:`kvpool.raft_master.members`). Clients leave a draining member out
of the ring they place puts by, the index commits no new replica to it, and every round reads
the mark from the index, so a drain carries on through a leader failover by itself.

Soft state (hot counters, what was added while hot) lives on the leader only and is rebuilt
after a failover: hot counts from the next heartbeats; extra replicas of a block that cooled
during a failover stay until evicted (a wasted copy, never a wrong read).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvpool.config import MasterConfig
from kvpool.errors import KVPoolError
from kvpool.grpcutil import call_metadata, create_channel, unary
from kvpool.logs import get_logger
from kvpool.proto.ring import HashRing, RingMember
from kvpool.proto.v1 import node_pb2, node_pb2_grpc
from kvpool.raft_master.commands import (
    ChangeReplicas,
    ChangeReplicasResult,
    MarkMemberDown,
    MarkMemberDownResult,
    ReplicaChange,
)
from kvpool.raft_master.hot import HotDetector
from kvpool.raft_master.index import BlockIndex, unpack_record
from kvpool.raft_master.members import DRAINED
from kvpool.raft_master.replica_plan import (
    BlockReplicas,
    CopyTask,
    ReleaseTask,
    TokenBucket,
    plan_block,
    plan_cooling,
)
from kvpool.raft_master.replication import Replicator

PERIOD_S = 0.2
MAX_TASKS_PER_ROUND = 4096
SCAN_KEYS_PER_MEMBER = 1 << 20
COPY_RPC_TIMEOUT_S = 10.0


@dataclass
class Plan:
    copies: list[CopyTask] = field(default_factory=list)
    releases: list[ReleaseTask] = field(default_factory=list)
    pin: list[tuple[int, node_pb2.BlockRef]] = field(default_factory=list)  # member, block
    drained: list[int] = field(default_factory=list)
    under_target: int = 0
    repairing: set[int] = field(default_factory=set)  # dead members whose keys await repair
    addresses: dict[int, tuple[str, str]] = field(default_factory=dict)  # id -> data, admin


def _block(key: str, record: bytes) -> BlockReplicas:
    version, write_id, size_bytes, checksum, _, listed = unpack_record(record)
    return BlockReplicas(key, write_id, version, size_bytes, checksum, listed)


def _ref(b: BlockReplicas) -> node_pb2.BlockRef:
    return node_pb2.BlockRef(
        key=b.key,
        write_id=b.write_id,
        version=b.version,
        size_bytes=b.size_bytes,
        checksum=b.checksum,
    )


class ReplicaLoop:
    """Leader-only: keeps blocks at their target replica counts."""

    def __init__(
        self,
        cfg: MasterConfig,
        replicator: Replicator,
        *,
        established: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
        period_s: float = PERIOD_S,
    ) -> None:
        self._cfg = cfg
        self._security = cfg.security()  # the cluster token (and TLS) for the nodes' admin calls
        self._metadata = call_metadata(self._security)
        self._replicator = replicator
        self._established = established or replicator.is_ready
        self._clock = clock
        self._log = logger or get_logger("kvpool.raft_master.replicas")
        self._period_s = period_s
        self.hot = HotDetector(
            hot_reads_per_s=cfg.hot_reads_per_s or 1e18, half_life_s=cfg.hot_half_life_s
        )
        self._blocks_bucket = TokenBucket(cfg.repair_blocks_per_s, cfg.repair_blocks_per_s / 4)
        self._bytes_bucket = TokenBucket(cfg.repair_bytes_per_s, cfg.repair_bytes_per_s / 4)
        self._term: int | None = None
        self._hot_keys: list[str] = []
        self._added_hot: dict[str, list[int]] = {}
        self._cooling: set[str] = set()
        self._pins_told: set[tuple[int, str, int]] = set()
        self._hopeless: set[tuple[int, str]] = set()
        self._stubs: dict[str, node_pb2_grpc.NodeAdminStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.repairing: set[int] = set()
        self.under_target = 0
        self.copies_total = 0
        self.releases_total = 0
        self.copy_failures_total = 0

    # --- inputs -----------------------------------------------------------------------------

    def reads_reported(self, counts: list[tuple[str, int]]) -> None:
        """A node's heartbeat: its most-read keys since the last one."""
        if self._cfg.hot_reads_per_s <= 0:
            return
        now = self._clock()
        for key, reads in counts:
            self.hot.add(key, reads, now)

    def looked_up(self, keys: list[str]) -> None:
        """Keys a lookup named together (a prefix chain, in order)."""
        if self._cfg.hot_reads_per_s > 0 and len(keys) > 1:
            self.hot.link(keys)

    def hold_purge(self, member_id: int) -> bool:
        """The failure loop must not purge this dead member's replicas yet: repair reads the
        block's pre-loss replica count from them."""
        return member_id in self.repairing

    def hot_keys(self) -> list[str]:
        return list(self._hot_keys)

    # --- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except KVPoolError as e:
                self._log.info("replica_round_deferred", error=e.message)
            except Exception:
                self._log.exception("replica_round_failed")
            await asyncio.sleep(self._period_s)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stubs.clear()

    def _reset(self) -> None:
        self._hot_keys = []
        self._added_hot.clear()
        self._pins_told.clear()
        self._hopeless.clear()
        self.repairing = set()

    async def step(self) -> None:
        if not self._replicator.leads():
            if self._term is not None:
                self._term = None
                self._reset()
            return
        term = self._replicator.term()
        if term != self._term:
            self._term = term
            self._reset()
        if not self._established():
            return
        now = self._clock()
        if self._cfg.hot_reads_per_s > 0:
            hot, cooled = self.hot.update(now)
            self._hot_keys = hot
            self._cooling.update(cooled)
            self._cooling.difference_update(hot)
            self.hot.prune(now)
        plan = self._replicator.read(self.plan)
        self.repairing = plan.repairing
        self.under_target = plan.under_target
        await self._copy(plan, now)
        await self._release(plan)
        await self._pin(plan)
        for member_id in plan.drained:
            result = await self._replicator.propose(
                MarkMemberDown(os.urandom(16), member_id, DRAINED), self._cfg.commit_timeout_s
            )
            if isinstance(result, MarkMemberDownResult) and result.changed:
                self._log.info("node_drained", member_id=member_id)

    # --- planning (under the index lock: no awaits) ---------------------------------------------

    def plan(self, ix: BlockIndex) -> Plan:
        """This round's work, read from the index (under its lock: no awaits)."""
        plan = Plan()
        live = ix.live_members()
        for rec in live:
            plan.addresses[rec.member_id] = (rec.data_address, rec.admin_address)
        ring = HashRing(
            [RingMember(r.member_id, r.node_id, r.capacity_bytes, r.zone) for r in live]
        )
        draining = {r.member_id for r in live if r.draining}  # replicated: survives failover
        seen: set[str] = set()
        pins = ix.pins()

        def consider(key: str, target: int, reason: str) -> None:
            if key in seen or len(plan.copies) + len(plan.releases) >= MAX_TASKS_PER_ROUND:
                return
            seen.add(key)
            record = ix.entry_record(key)
            if record is None:
                return
            b = _block(key, record)
            copies, releases = plan_block(
                b,
                ring,
                target=max(target, pins.get(key, 0), len(b.listed)),
                draining=draining,
                reason=reason,
            )
            if copies:
                plan.under_target += 1
            plan.copies.extend(copies)
            plan.releases.extend(releases)

        for d in sorted(draining):
            keys = ix.member_keys(d, SCAN_KEYS_PER_MEMBER)
            if not keys:
                plan.drained.append(d)
            for key in keys:
                consider(key, 1, "drain")
        dead_members = ix.dead_members_with_keys()
        if self._hopeless:
            gone = set(dead_members)
            self._hopeless = {(m, k) for m, k in self._hopeless if m in gone}
        for dead in dead_members:
            for key in ix.member_keys(dead, SCAN_KEYS_PER_MEMBER):
                if (dead, key) in self._hopeless:
                    continue
                before = len(plan.copies)
                consider(key, 1, "repair")
                if len(plan.copies) > before:
                    plan.repairing.add(dead)
                elif key in seen:
                    self._hopeless.add((dead, key))  # no survivor, or already at target
        for key, n in pins.items():
            consider(key, n, "pin")
            record = ix.entry_record(key)
            if record is not None:
                b = _block(key, record)
                for m in b.listed:
                    if m in ring.members and (m, key, b.write_id) not in self._pins_told:
                        plan.pin.append((m, _ref(b)))
        for key in self._hot_keys:
            consider(key, self._cfg.hot_max_replicas, "hot")
        for key in list(self._cooling):
            added = self._added_hot.get(key)
            record = ix.entry_record(key)
            if not added or record is None:
                self._cooling.discard(key)
                self._added_hot.pop(key, None)
                continue
            b = _block(key, record)
            plan.releases.extend(plan_cooling(b, ring.members, added, keep=pins.get(key, 1)))
            self._cooling.discard(key)
            self._added_hot.pop(key, None)
        return plan

    # --- performing ---------------------------------------------------------------------------

    def _stub(self, admin_address: str) -> node_pb2_grpc.NodeAdminStub:
        stub = self._stubs.get(admin_address)
        if stub is None:
            channel = create_channel(admin_address, self._security)
            self._channels[admin_address] = channel
            stub = node_pb2_grpc.NodeAdminStub(channel)
            self._stubs[admin_address] = stub
        return stub

    async def _copy(self, plan: Plan, now: float) -> None:
        allowed: list[CopyTask] = []
        for task in plan.copies:
            if not self._blocks_bucket.take(1, now):
                break
            if not self._bytes_bucket.take(task.block.size_bytes, now):
                break
            allowed.append(task)
        if not allowed:
            return
        groups: dict[tuple[int, int], list[CopyTask]] = defaultdict(list)
        for task in allowed:
            groups[(task.source, task.target)].append(task)

        async def run_group(source: int, target: int, tasks: list[CopyTask]) -> list[CopyTask]:
            src = plan.addresses.get(source)
            dst = plan.addresses.get(target)
            if src is None or dst is None or not src[1]:
                return []
            request = node_pb2.CopyBlocksRequest(
                target_data_address=dst[0],
                blocks=[_ref(t.block) for t in tasks],
                timeout_s=COPY_RPC_TIMEOUT_S / 2,
            )
            try:
                response = await unary(
                    self._stub(src[1]).CopyBlocks,
                    request,
                    timeout_s=COPY_RPC_TIMEOUT_S,
                    address=src[1],
                    metadata=self._metadata,
                )
            except KVPoolError as e:
                self._log.warning("copy_rpc_failed", source=source, error=e.message)
                self.copy_failures_total += len(tasks)
                return []
            done = [t for t, ok in zip(tasks, response.copied, strict=False) if ok]
            self.copy_failures_total += len(tasks) - len(done)
            return done

        results = await asyncio.gather(*(run_group(s, t, ts) for (s, t), ts in groups.items()))
        copied = [t for group in results for t in group]
        if not copied:
            return
        changes = tuple(
            ReplicaChange(t.block.key, t.block.write_id, t.target, t.replaces) for t in copied
        )
        result = await self._replicator.propose(
            ChangeReplicas(os.urandom(16), changes), self._cfg.commit_timeout_s
        )
        if not isinstance(result, ChangeReplicasResult):
            return
        reasons: dict[str, int] = defaultdict(int)
        stale: list[tuple[int, node_pb2.BlockRef]] = []
        for task, ok in zip(copied, result.applied, strict=True):
            if ok:
                self.copies_total += 1
                reasons[task.reason] += 1
                if task.reason == "hot":
                    self._added_hot.setdefault(task.block.key, []).append(task.target)
            else:
                stale.append((task.target, _ref(task.block)))  # overwritten meanwhile: drop it
        self._log.info("replicas_added", **reasons, refused=len(stale))
        await self._update(plan, drop=stale)

    async def _release(self, plan: Plan) -> None:
        if not plan.releases:
            return
        changes = tuple(ReplicaChange(r.key, r.write_id, 0, r.member) for r in plan.releases)
        result = await self._replicator.propose(
            ChangeReplicas(os.urandom(16), changes), self._cfg.commit_timeout_s
        )
        if not isinstance(result, ChangeReplicasResult):
            return
        drop = [
            (r.member, node_pb2.BlockRef(key=r.key, write_id=r.write_id))
            for r, ok in zip(plan.releases, result.applied, strict=True)
            if ok
        ]
        self.releases_total += len(drop)
        if drop:
            self._log.info("replicas_released", count=len(drop))
        await self._update(plan, drop=drop)

    async def _pin(self, plan: Plan) -> None:
        if not plan.pin:
            return
        done = await self._update(plan, pin=plan.pin)
        for member_id, ref in done:
            self._pins_told.add((member_id, ref.key, ref.write_id))

    async def _update(
        self,
        plan: Plan,
        *,
        pin: list[tuple[int, node_pb2.BlockRef]] = (),  # type: ignore[assignment]
        drop: list[tuple[int, node_pb2.BlockRef]] = (),  # type: ignore[assignment]
    ) -> list[tuple[int, node_pb2.BlockRef]]:
        """Best effort: tell members to pin or drop blocks; the (member, ref) pins delivered."""
        by_member: dict[int, node_pb2.UpdateBlocksRequest] = defaultdict(
            node_pb2.UpdateBlocksRequest
        )
        for m, ref in pin:
            by_member[m].pin.append(ref)
        for m, ref in drop:
            by_member[m].drop.append(ref)
        delivered: list[tuple[int, node_pb2.BlockRef]] = []
        for m, request in by_member.items():
            address = plan.addresses.get(m)
            if address is None or not address[1]:
                continue
            try:
                await unary(
                    self._stub(address[1]).UpdateBlocks,
                    request,
                    timeout_s=COPY_RPC_TIMEOUT_S,
                    address=address[1],
                    metadata=self._metadata,
                )
            except KVPoolError as e:
                self._log.info("update_blocks_failed", member_id=m, error=e.message)
                continue
            delivered.extend((m, ref) for ref in request.pin)
        return delivered
