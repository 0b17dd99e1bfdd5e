"""The node's conversation with the masters: register, heartbeat, report evictions, reap staged
blocks, leave.

Every call goes through :class:`kvpool.mastercall.MasterClient` (leader discovery, redirects,
retries inside a deadline). The deciding parts — which staged blocks to publish or free — are the
pure function :func:`staged_verdicts`; :class:`NodeRegistration` is the async shell around the
block store.

- Registration: a random 64-bit incarnation per process start; the same request id on every
  retry. Retried until registered (the masters may not have a leader yet).
- Heartbeats every ``heartbeat_interval_s`` (from the master). ``known=False`` means the index
  declared this node down and forgot its replicas: every block is dropped and the node registers
  again (``node_reregistered``), under a new member id but the same incarnation — the index
  tells a restarted process from a running one by it.
- Drained: a node that ``kvpool node drain`` emptied and declared left is refused when it
  registers again (``NodeDrainedError``) until its process restarts. It logs
  ``node_drained_stopped_serving`` once, reports itself not ready (``on_drained``), takes no
  part in the cluster any more and waits to be stopped; a commit naming it is refused by the
  index (it is not a live member), so a stale client's put there can only miss.
- Eviction reports: batches of at most :data:`REPORT_BATCH` blocks, retried with the same request
  id until they succeed; dropped when the member changed (the index forgot the old member).
- Tier reports (``report_tiers``): blocks whose fastest tier changed (demoted to the SSD,
  promoted back), coalesced per block, sent as ``ClaimReplicas`` without restore — hints the
  index hands out with lookups; a failed batch is dropped (hints only).
- Warm restart: blocks found on the SSD tier at start are claimed (``ClaimReplicas`` with
  restore) right after the first registration, in batches; the index accepts those it still
  holds with exactly that write, and the node drops the others (``ssd_blocks_restored``).
- Missing replicas: a read that missed a write this node never held (nor evicted lately) is
  remembered; ``staged_ttl_s`` later, if the node still lacks it and the index names it on
  this member, it is reported gone like an eviction (a put committed it while its bytes were
  on their way, and they never came).
- Staged reaper: staged blocks older than ``staged_ttl_s`` are looked up in one batch. Indexed with
  the same write id on this member → the client's PUBLISH was lost: publish with the index's
  version. Otherwise → free. Masters unreachable → try later; older than
  :data:`FORCE_REAP_TTLS` times the ttl → free anyway (and report it, in case the index names
  it).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kvpool.config import NodeConfig
from kvpool.errors import KVPoolError, NodeDrainedError, UnknownMemberError
from kvpool.logs import get_logger
from kvpool.mastercall import Backoff, MasterClient
from kvpool.proto.v1 import common_pb2, master_pb2
from kvpool.proto.wire import Status
from kvpool.store_node.block_store import BlockStore, StagedBlock
from kvpool.store_node.blocks import BlockId

REPORT_BATCH = 1024
"""Most blocks in one ReportEvictions or ClaimReplicas call."""
REAP_BATCH = 1024
"""Most staged blocks checked with one Lookup."""
FORCE_REAP_TTLS = 10
"""A staged block this many TTLs old is freed even when the masters cannot be asked."""
LEAVE_TIMEOUT_S = 1.0
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0

T = TypeVar("T")


MAX_SHED_PER_HEARTBEAT = 4096
"""Most blocks one heartbeat's answer makes a node drop for a nearly full index (``shed_blocks``):
the next heartbeat asks again for what is left."""
HOT_BLOCKS_PER_HEARTBEAT = 256
"""Most read counts one heartbeat carries (the keys read most since the last one)."""


def new_incarnation() -> int:
    """A random, non-zero 64-bit incarnation."""
    return secrets.randbits(64) or 1


def staged_verdicts(
    candidates: Iterable[StagedBlock],
    entries: Mapping[str, common_pb2.BlockEntry],
    member_id: int,
) -> tuple[list[tuple[str, int, int]], list[tuple[str, int]]]:
    """Split expired staged blocks by what the index says: ``(publish, free)``.

    ``publish`` holds ``(key, write_id, version)`` for blocks the index committed with this very
    write id on this member (the client's PUBLISH never arrived); everything else is freed: the
    put was never committed, was overwritten, or names other replicas.
    """
    publish: list[tuple[str, int, int]] = []
    free: list[tuple[str, int]] = []
    for block in candidates:
        entry = entries.get(block.key)
        if (
            entry is not None
            and entry.found
            and entry.write_id == block.write_id
            and member_id in entry.replicas
        ):
            publish.append((block.key, block.write_id, entry.version))
        else:
            free.append((block.key, block.write_id))
    return publish, free


@dataclass(slots=True)
class _PendingReport:
    request_id: bytes
    member_id: int
    blocks: list[tuple[str, int]]


@dataclass(slots=True)
class _PendingClaim:
    request: master_pb2.ClaimReplicasRequest
    member_id: int


class NodeRegistration:
    """This node's membership: identity, heartbeats, eviction reports, staged reaping."""

    def __init__(
        self,
        cfg: NodeConfig,
        store: BlockStore,
        masters: MasterClient,
        *,
        data_address: str,
        admin_address: str,
        on_registered: Callable[[int, bool], Awaitable[None]] | None = None,
        on_drained: Callable[[], Awaitable[None]] | None = None,
        on_receipt_key: Callable[[bytes], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        log: Any = None,
    ) -> None:
        self._cfg = cfg
        self._store = store
        self._masters = masters
        self.on_registered = on_registered
        self.on_drained = on_drained
        self.on_receipt_key = on_receipt_key
        """Hears the key that checks commit receipts, as the masters answer it (kvpool.receipts)."""
        self._clock = clock
        self._log = log if log is not None else get_logger("kvpool.node.registration")
        self.node_id = cfg.resolved_node_id
        self.data_address = data_address
        self.admin_address = admin_address
        self.incarnation = new_incarnation()
        self.member_id = 0  # 0 while not registered
        self.drained = False  # refused as drained: out of the cluster until a restart
        self.heartbeat_interval_s = DEFAULT_HEARTBEAT_INTERVAL_S
        self.node_timeout_s = 0.0
        self._pending_report: _PendingReport | None = None
        self._pending_tiers: _PendingClaim | None = None
        self._heartbeat_failing = False
        self._to_restore: list[BlockId] = []
        self.restored = 0
        self.restore_refused = 0

    # --- registration --------------------------------------------------------------------------

    async def register(self, stop: asyncio.Event) -> bool:
        """Register this incarnation; retried until it succeeds (True) or ``stop`` is set
        (False). Refused as drained: wait for ``stop``, then False. A non-retryable refusal
        (another protocol version, a malformed request) is raised."""
        loop = asyncio.get_running_loop()
        request = master_pb2.RegisterNodeRequest(
            request_id=secrets.token_bytes(16),
            node_id=self.node_id,
            incarnation=self.incarnation,
            data_address=self.data_address,
            admin_address=self.admin_address,
            capacity_bytes=self._store.tier.capacity_bytes,
            zone=self._cfg.zone,
        )
        backoff = Backoff(base_s=0.05, cap_s=1.0)
        attempts = 0
        while not stop.is_set():
            attempts += 1
            try:
                response = await self._masters.call(
                    "RegisterNode",
                    request,
                    deadline=loop.time() + self._cfg.request_timeout_s,
                    leader_only=True,
                )
            except NodeDrainedError as e:
                await self._stay_drained(stop, e.message)
                return False
            except KVPoolError as e:
                if not e.retryable:
                    raise
                log = self._log.warning if attempts == 1 else self._log.debug
                log("register_retry", attempt=attempts, error=e.message)
                await _wait(stop, backoff.next_delay())
                continue
            self.member_id = int(response.member_id)
            self._receipt_key(response.receipt_key)
            if response.heartbeat_interval_s > 0:
                self.heartbeat_interval_s = float(response.heartbeat_interval_s)
            self.node_timeout_s = float(response.node_timeout_s)
            return True
        return False

    async def _stay_drained(self, stop: asyncio.Event, reason: str) -> None:
        """Out of the cluster for good: say so once, report not ready, wait to be stopped. No
        more registrations: each would be refused again (only a restart rejoins)."""
        self.drained = True
        self.member_id = 0
        dropped = self._store.drop_all()
        self._log.warning(
            "node_drained_stopped_serving",
            incarnation=self.incarnation,
            dropped_blocks=dropped,
            reason=reason,
        )
        if self.on_drained is not None:
            await self.on_drained()
        await stop.wait()

    async def _reregister(self, stop: asyncio.Event) -> None:
        old_member = self.member_id
        dropped = self._store.drop_all()
        self.member_id = 0
        self._pending_report = None
        self._pending_tiers = None
        self._to_restore = []
        while await self.register(stop):
            if self.member_id != old_member:
                self._log.info(
                    "node_reregistered",
                    member_id=self.member_id,
                    old_member_id=old_member,
                    incarnation=self.incarnation,
                    dropped_blocks=dropped,
                )
                if self.on_registered is not None:
                    await self.on_registered(self.member_id, False)
                return
            # The same incarnation got its old member back: "unknown" was a stale answer and
            # the index still lists the blocks just dropped. Leave (they are purged, and
            # repaired from other replicas), then join again as a new member.
            self._log.warning("node_rejoin_stale", member_id=old_member)
            await self.leave()
            self.member_id = 0
            if await _wait(stop, self.heartbeat_interval_s):
                return

    async def leave(self) -> None:
        """Tell the index this member is leaving (best effort, short deadline)."""
        if not self.member_id:
            return
        loop = asyncio.get_running_loop()
        try:
            await self._masters.call(
                "LeaveNode",
                master_pb2.LeaveNodeRequest(
                    request_id=secrets.token_bytes(16), member_id=self.member_id
                ),
                deadline=loop.time() + min(LEAVE_TIMEOUT_S, self._cfg.request_timeout_s),
                leader_only=True,
            )
        except KVPoolError as e:
            self._log.warning("leave_failed", member_id=self.member_id, error=e.message)
        else:
            self._log.info("node_left", member_id=self.member_id)

    # --- the background work ----------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Register, then heartbeat, report evictions and reap staged blocks until ``stop``."""
        if not await self.register(stop):
            return
        if self.on_registered is not None:
            await self.on_registered(self.member_id, True)
        loops = [
            asyncio.create_task(self._heartbeat_loop(stop), name="node-heartbeat"),
            asyncio.create_task(self._report_loop(stop), name="node-eviction-reports"),
            asyncio.create_task(self._reap_loop(stop), name="node-staged-reaper"),
        ]
        if self._to_restore:
            loops.append(asyncio.create_task(self._restore_loop(stop), name="node-ssd-restore"))
        try:
            await asyncio.gather(*loops)
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)

    async def _heartbeat_loop(self, stop: asyncio.Event) -> None:
        while not await _wait(stop, self.heartbeat_interval_s):
            if not await self._guarded("heartbeat", self.heartbeat_once(), True):
                await self._reregister(stop)

    async def heartbeat_once(self) -> bool:
        """One heartbeat; False when the index no longer knows this member (re-register)."""
        loop = asyncio.get_running_loop()
        stats = self._store.stats()
        request = master_pb2.HeartbeatRequest(
            member_id=self.member_id,
            capacity_bytes=stats.capacity_bytes,
            used_bytes=stats.used_bytes,
            block_count=stats.blocks,
            staged_count=stats.staged,
            hits_total=stats.hits,
            misses_total=stats.misses_total,
            evictions_total=stats.evictions,
            hot_blocks=[
                master_pb2.HotBlock(key=k, reads=min(n, 0xFFFFFFFF))
                for k, n in self._store.take_read_counts(HOT_BLOCKS_PER_HEARTBEAT)
            ],
        )
        timeout_s = min(self._cfg.request_timeout_s, max(self.heartbeat_interval_s, 0.5))
        try:
            response = await self._masters.call(
                "Heartbeat", request, deadline=loop.time() + timeout_s, leader_only=True
            )
        except UnknownMemberError:
            return False
        except KVPoolError as e:
            if not self._heartbeat_failing:
                self._log.warning("heartbeat_failed", member_id=self.member_id, error=e.message)
            self._heartbeat_failing = True
            return True
        if self._heartbeat_failing:
            self._log.info("heartbeat_restored", member_id=self.member_id)
            self._heartbeat_failing = False
        self._receipt_key(response.receipt_key)
        if response.known and response.shed_blocks:
            self._shed(response.shed_blocks)
        return bool(response.known)

    def _shed(self, asked: int) -> None:
        """Drop the coldest blocks the leader asked for (the index is nearly full), at most
        MAX_SHED_PER_HEARTBEAT; none while evictions the index has not heard of yet are
        waiting, since its count, and so what it asks, does not show them yet."""
        if self._pending_report is not None or self._store.evictions_pending:
            return
        dropped = self._store.shed(min(asked, MAX_SHED_PER_HEARTBEAT))
        self._log.info("index_full_shed", asked=asked, dropped=dropped, member_id=self.member_id)

    def _receipt_key(self, raw: bytes) -> None:
        """Pass on the receipt key a master answered (the listener keeps the one it holds when
        the answer has none: a master of an older release)."""
        if self.on_receipt_key is not None:
            self.on_receipt_key(raw)

    async def _report_loop(self, stop: asyncio.Event) -> None:
        while not await _wait(stop, self._cfg.eviction_report_interval_s):
            while await self._guarded("eviction_report", self.report_evictions_once(), False):
                pass
            if self._cfg.report_tiers:
                while await self._guarded("tier_report", self.report_tiers_once(), False):
                    pass

    async def report_tiers_once(self) -> bool:
        """Send one batch of tier hints; True when it went and more may be waiting."""
        pending = self._pending_tiers
        if pending is not None and pending.member_id != self.member_id:
            pending = self._pending_tiers = None
        if pending is None:
            if not self.member_id:
                return False
            changes = self._store.take_tier_changes(REPORT_BATCH)
            if not changes:
                return False
            request = master_pb2.ClaimReplicasRequest(
                request_id=secrets.token_bytes(16), member_id=self.member_id, restore=False
            )
            for c in changes:
                request.blocks.add(
                    key=c.key,
                    write_id=c.write_id,
                    version=c.version,
                    size_bytes=c.size_bytes,
                    checksum=c.checksum,
                    tier=int(c.level),
                )
            pending = self._pending_tiers = _PendingClaim(request, self.member_id)
        loop = asyncio.get_running_loop()
        try:
            await self._masters.call(
                "ClaimReplicas",
                pending.request,
                deadline=loop.time() + self._cfg.request_timeout_s,
                leader_only=True,
            )
        except KVPoolError as e:
            if e.retryable:
                return False
            self._log.warning(
                "tier_report_refused", blocks=len(pending.request.blocks), error=e.message
            )
        if self._pending_tiers is pending:
            self._pending_tiers = None
        return True

    # --- warm restart -----------------------------------------------------------------------

    def restore_after_start(self, blocks: list[BlockId]) -> None:
        """Claim these blocks (found on the SSD at start) once registered."""
        self._to_restore = list(blocks)

    async def _restore_loop(self, stop: asyncio.Event) -> None:
        started = self._clock()
        member_id = self.member_id
        backoff = Backoff(base_s=0.05, cap_s=1.0)
        total = len(self._to_restore)
        while self._to_restore and not stop.is_set() and self.member_id == member_id:
            batch = self._to_restore[:REPORT_BATCH]
            try:
                done = await self.restore_once(batch, member_id)
            except KVPoolError as e:
                if e.retryable:
                    await _wait(stop, backoff.next_delay())
                    continue
                self._log.warning("ssd_restore_refused", blocks=len(batch), error=e.message)
                for key, write_id in batch:
                    self._store.delete(key, write_id)
                self.restore_refused += len(batch)
                done = True
            if done:
                del self._to_restore[: len(batch)]
        self._log.info(
            "ssd_blocks_restored",
            claimed=total,
            accepted=self.restored,
            refused=self.restore_refused,
            seconds=round(self._clock() - started, 3),
        )

    async def restore_once(self, batch: list[BlockId], member_id: int) -> bool:
        """Claim one batch; drop what the index refused. Raises the call's error."""
        request = master_pb2.ClaimReplicasRequest(
            request_id=secrets.token_bytes(16), member_id=member_id, restore=True
        )
        claimed: list[BlockId] = []
        for key, write_id in batch:
            block = self._store.block(key, write_id)
            if block is None or block.detached:
                continue  # deleted or evicted meanwhile
            fastest = block.fastest()
            request.blocks.add(
                key=key,
                write_id=write_id,
                version=block.version,
                size_bytes=block.size_bytes,
                checksum=block.checksum,
                tier=int(fastest.level) if fastest is not None else 0,
            )
            claimed.append((key, write_id))
        if not claimed:
            return True
        loop = asyncio.get_running_loop()
        response = await self._masters.call(
            "ClaimReplicas",
            request,
            deadline=loop.time() + self._cfg.request_timeout_s,
            leader_only=True,
        )
        if self.member_id != member_id:
            return True  # re-registered meanwhile: everything was dropped anyway
        accepted = list(response.accepted) + [False] * (len(claimed) - len(response.accepted))
        for (key, write_id), ok in zip(claimed, accepted, strict=False):
            if ok:
                self.restored += 1
            else:
                self._store.delete(key, write_id)
                self.restore_refused += 1
        return True

    async def report_evictions_once(self) -> bool:
        """Send one batch of evictions; True when it went and more may be waiting."""
        pending = self._pending_report
        if pending is not None and pending.member_id != self.member_id:
            self._log.info(
                "eviction_report_dropped", blocks=len(pending.blocks), member_id=pending.member_id
            )
            pending = self._pending_report = None
        if pending is None:
            if not self.member_id:
                return False
            blocks = self._store.take_evicted(REPORT_BATCH)
            if not blocks:
                return False
            self._log.info("blocks_evicted", count=len(blocks), member_id=self.member_id)
            pending = self._pending_report = _PendingReport(
                secrets.token_bytes(16), self.member_id, blocks
            )
        request = master_pb2.ReportEvictionsRequest(
            request_id=pending.request_id,
            member_id=pending.member_id,
            blocks=[master_pb2.EvictedBlock(key=k, write_id=w) for k, w in pending.blocks],
        )
        loop = asyncio.get_running_loop()
        try:
            await self._masters.call(
                "ReportEvictions",
                request,
                deadline=loop.time() + self._cfg.request_timeout_s,
                leader_only=True,
            )
        except KVPoolError as e:
            if e.retryable:
                self._log.debug(
                    "eviction_report_retry", blocks=len(pending.blocks), error=e.message
                )
                return False
            self._log.warning(
                "eviction_report_refused", blocks=len(pending.blocks), error=e.message
            )
        if self._pending_report is pending:
            self._pending_report = None
        return True

    async def _reap_loop(self, stop: asyncio.Event) -> None:
        tick_s = min(1.0, max(self._cfg.staged_ttl_s / 4, 0.01))
        while not await _wait(stop, tick_s):
            await self._guarded("staged_reaper", self.reap_staged_once(), (0, 0))
            await self._guarded("missing_check", self.check_missing_once(), 0)

    async def _guarded(self, what: str, work: Awaitable[T], failed: T) -> T:
        """Run one round of background work; a bug in it is logged, not fatal to the loop."""
        try:
            return await work
        except Exception:
            self._log.exception("background_failed", work=what)
            return failed

    async def reap_staged_once(self) -> tuple[int, int]:
        """Check expired staged blocks against the index; returns (published, freed)."""
        ttl_s = self._cfg.staged_ttl_s
        candidates = self._store.expired_staged(self._clock(), ttl_s, REAP_BATCH)
        if not candidates:
            return 0, 0
        member_id = self.member_id
        entries: dict[str, common_pb2.BlockEntry] | None = None
        if member_id:
            try:
                entries = await self._index_entries(block.key for block in candidates)
            except KVPoolError as e:
                self._log.warning("staged_check_failed", blocks=len(candidates), error=e.message)
        if entries is None or self.member_id != member_id:
            # The index cannot be asked (or we re-registered meanwhile): only the very old go.
            freed = sum(
                self._store.reap(b.key, b.write_id, report=True)
                for b in candidates
                if b.age_s >= FORCE_REAP_TTLS * ttl_s
            )
            if freed:
                self._log.info("staged_reaped", freed=freed, forced=True)
            return 0, freed
        publish, free = staged_verdicts(candidates, entries, member_id)
        published = sum(
            self._store.publish(key, write_id, version).status == Status.OK
            for key, write_id, version in publish
        )
        freed = sum(self._store.reap(key, write_id, report=False) for key, write_id in free)
        self._log.info("staged_reaped", published=published, freed=freed, forced=False)
        return published, freed

    async def _index_entries(self, keys: Iterable[str]) -> dict[str, common_pb2.BlockEntry]:
        """The index's entries of ``keys`` (an internal Lookup: the node's own question)."""
        asked = list(dict.fromkeys(keys))
        response = await self._masters.call(
            "Lookup",
            master_pb2.LookupRequest(keys=asked, internal=True),
            deadline=asyncio.get_running_loop().time() + self._cfg.request_timeout_s,
        )
        return dict(zip(asked, response.entries, strict=False))

    async def check_missing_once(self) -> int:
        """Writes a read missed here ``staged_ttl_s`` ago or more, still not held: those the
        index names on this member are reported gone (a put committed them while its bytes
        were on their way, and they never came: the client died, or could not take the replica
        back). Returns how many."""
        member_id = self.member_id
        if not member_id:
            return 0
        suspects = self._store.expired_suspects(self._clock(), self._cfg.staged_ttl_s, REAP_BATCH)
        if not suspects:
            return 0
        try:
            entries = await self._index_entries(key for key, _ in suspects)
        except KVPoolError as e:  # forgotten: a later read that misses names it again
            self._log.warning("missing_check_failed", blocks=len(suspects), error=e.message)
            return 0
        if self.member_id != member_id:
            return 0
        reported = 0
        for key, write_id in suspects:
            entry = entries.get(key)
            if entry is None or not entry.found or entry.write_id != write_id:
                continue
            if member_id in entry.replicas and self._store.report_missing(key, write_id):
                reported += 1
        if reported:
            self._log.warning("missing_replicas_reported", count=reported, member_id=member_id)
        return reported


async def _wait(stop: asyncio.Event, delay_s: float) -> bool:
    """Sleep ``delay_s`` or until ``stop`` is set; True when stopped."""
    if stop.is_set():
        return True
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=delay_s)
    return stop.is_set()
