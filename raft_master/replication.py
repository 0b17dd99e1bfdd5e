"""The PySyncObj adapter: one replicated entry point, our own deadlines, status, guards.

PySyncObj numbers replicated methods by sorting their names, so the consumer has exactly one,
:meth:`IndexConsumer.apply_command`, taking explicitly encoded command bytes
(:mod:`kvpool.raft_master.commands`); adding a command never renumbers anything.

Guards (see shared/PYSYNCOBJ.md):

- tuning from ``MasterConfig.raft_*`` with ``appendEntriesUseBatch=False`` (sub-millisecond
  commits; batching is our own group commit in the service), ``leaderFallbackTimeout`` 2 s;
- ``password`` is required (peer traffic is pickle); the Raft port's connections are PySyncObj's
  transport with our own connection handling (:mod:`kvpool.raft_master.raft_guard`);
- with a ``data_dir`` both ``journalFile`` and ``fullDumpFile`` are set (a journal without a dump
  comes back empty, never applies, yet votes: :func:`check_persistence` refuses it);
- Raft binds to ``raft_listen`` only (PySyncObj would otherwise bind 0.0.0.0);
- ``propose`` keeps its own timeout; a timed-out command may still apply later, which is why every
  command carries a request id;
- the index is guarded by a lock held during apply and during each read;
- a follower whose match index is stuck gets a forced log compaction (a snapshot is sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pysyncobj import SyncObj, SyncObjConf, SyncObjConsumer, SyncObjException, replicated
from pysyncobj.config import FAIL_REASON
from pysyncobj.pipe_notifier import PipeNotifier

from kvpool.config import MasterConfig
from kvpool.errors import ConfigError, InternalError, UnavailableError
from kvpool.logs import get_logger
from kvpool.raft_master.commands import Command, ErrorResult, Result, encode
from kvpool.raft_master.index import BlockIndex, IndexSnapshot
from kvpool.raft_master.lease import LeasedSyncObj, LeaseTimes, missing_internals
from kvpool.raft_master.loop_tick import (
    LoopPoller,
    LoopTicker,
    poller_for_construction,
    supported,
)
from kvpool.raft_master.raft_guard import (
    GuardLimits,
    GuardStats,
    guarded_transport,
    session_secret,
)

T = TypeVar("T")

JOURNAL_FILE = "raft.journal"
DUMP_FILE = "raft.dump"
_STATUS_PERIOD_S = 0.1
APPEND_ENTRIES_BATCH_BYTES = 1 << 20
SOCKET_BUFFER_BYTES = 1 << 20
_ROLES = {0: "follower", 1: "candidate", 2: "leader"}
_FAIL_NAMES = {
    value: name.lower()
    for name, value in vars(FAIL_REASON).items()
    if not name.startswith("_") and isinstance(value, int)
}


class StartupError(Exception):
    """The master cannot start (bad config, address in use…); the message says why."""


# --- configuration ------------------------------------------------------------------------------


def raft_files(cfg: MasterConfig) -> tuple[str | None, str | None]:
    """``(journalFile, fullDumpFile)``: both in ``data_dir``, or neither in memory mode."""
    if cfg.in_memory:
        return None, None
    if not cfg.data_dir:
        raise ConfigError("data_dir: required unless in_memory is set")
    base = Path(cfg.data_dir)
    return str(base / JOURNAL_FILE), str(base / DUMP_FILE)


def check_persistence(journal_file: str | None, dump_file: str | None) -> None:
    """Refuse a journal without a full dump file: such a master restarts with an empty state,
    never applies, yet keeps voting."""
    if journal_file and not dump_file:
        raise ConfigError(
            "raft persistence: a journal file without a full dump file is refused (after a log "
            "compaction the master would restart empty and never apply, yet vote); set both"
        )


def build_conf(
    cfg: MasterConfig,
    *,
    on_state_changed: Callable[[int, int], None] | None = None,
    max_bind_retries: int = 3,
    bind_retry_s: float = 0.3,
    tick_period_s: float = 0.05,
    auto_tick: bool = True,
) -> SyncObjConf:
    if not cfg.raft_secret:
        raise ConfigError("raft_secret: required; Raft peer traffic must be authenticated")
    journal_file, dump_file = raft_files(cfg)
    check_persistence(journal_file, dump_file)
    conf = SyncObjConf(
        password=cfg.raft_secret,
        autoTick=auto_tick,
        autoTickPeriod=tick_period_s,
        # Group-committed entries reach hundreds of KiB: send them whole, not in 64 KiB
        # "transmission" pieces (measured: twice the entries/s at 100 entries per request).
        appendEntriesBatchSizeBytes=APPEND_ENTRIES_BATCH_BYTES,
        sendBufferSize=SOCKET_BUFFER_BYTES,
        recvBufferSize=SOCKET_BUFFER_BYTES,
        appendEntriesUseBatch=False,
        raftMinTimeout=cfg.raft_min_timeout_s,
        raftMaxTimeout=cfg.raft_max_timeout_s,
        appendEntriesPeriod=cfg.raft_append_period_s,
        leaderFallbackTimeout=cfg.raft_leader_fallback_s,
        connectionTimeout=cfg.raft_connection_timeout_s,
        connectionRetryTime=cfg.raft_connection_retry_s,
        logCompactionMinEntries=cfg.raft_compaction_min_entries,
        logCompactionMinTime=cfg.raft_compaction_min_time_s,
        journalFile=journal_file,
        fullDumpFile=dump_file,
        bindAddress=cfg.raft_listen,
        maxBindRetries=max_bind_retries,
        bindRetryTime=bind_retry_s,
        onStateChanged=on_state_changed,
        dynamicMembershipChange=False,
    )
    check_persistence(conf.journalFile, conf.fullDumpFile)
    try:
        conf.validate()
    except AssertionError as e:  # PySyncObj validates with asserts
        raise ConfigError(f"raft settings rejected by PySyncObj: {e or 'assertion failed'}") from e
    return conf


# --- the replicated state ------------------------------------------------------------------------


class IndexConsumer(SyncObjConsumer):  # type: ignore[misc]
    """Holds the :class:`BlockIndex`; the Raft thread applies entries, other threads read."""

    def __init__(self, index: BlockIndex, *, dedupe_capacity: int, dedupe_max_bytes: int) -> None:
        # Attributes set before SyncObjConsumer.__init__ are not part of the snapshot.
        self.lock = threading.Lock()
        self.index = index
        self._dedupe_capacity = dedupe_capacity
        self._dedupe_max_bytes = dedupe_max_bytes
        self._log = get_logger("kvpool.raft_master.replication")
        super().__init__()

    @replicated  # type: ignore[untyped-decorator]
    def apply_command(self, data: bytes) -> Result:
        """The single replicated entry point. Must never raise: PySyncObj would retry the entry
        on every tick forever."""
        try:
            with self.lock:
                return self.index.apply_encoded(data)
        except Exception as e:  # a bug: keep the Raft thread alive, report it
            self._log.exception("apply_failed", error=str(e))
            return ErrorResult(f"apply failed: {type(e).__name__}: {e}")

    def _serialize(self) -> dict[str, Any]:
        # Cheap on the Raft thread (shares the dicts); the forked child does the pickling.
        return {"kvpool_index": IndexSnapshot(self.index.export_state())}

    def _deserialize(self, data: dict[str, Any]) -> None:
        try:
            state = data["kvpool_index"]
            if isinstance(state, IndexSnapshot):  # in-memory mode may hand back the object
                state = state.state
            index = BlockIndex.import_state(
                state,
                dedupe_capacity=self._dedupe_capacity,
                dedupe_max_bytes=self._dedupe_max_bytes,
            )
        except Exception as e:
            self._log.critical("snapshot_load_failed", error=str(e))
            raise
        with self.lock:
            self.index = index


# --- pure deciders --------------------------------------------------------------------------------


class StuckFollowerWatch:
    """Which followers are behind the commit index without their match index advancing for
    ``stuck_after_s``. Pure: fed observations with a clock value; each report re-arms the
    timer so a still-stuck follower is reported once per ``stuck_after_s``."""

    def __init__(self, stuck_after_s: float) -> None:
        self.stuck_after_s = stuck_after_s
        self._seen: dict[str, tuple[int, float]] = {}

    def reset(self) -> None:
        self._seen.clear()

    def observe(self, now: float, commit_index: int, match_index: Mapping[str, int]) -> list[str]:
        stuck: list[str] = []
        for follower in sorted(match_index):
            match = match_index[follower]
            last = self._seen.get(follower)
            if last is None or last[0] != match or match >= commit_index:
                self._seen[follower] = (match, now)
                continue
            if now - last[1] >= self.stuck_after_s:
                stuck.append(follower)
                self._seen[follower] = (match, now)
        for follower in [f for f in self._seen if f not in match_index]:
            del self._seen[follower]
        return stuck


@dataclass(frozen=True)
class RaftStatus:
    role: str = "follower"
    term: int = 0
    commit_index: int = 0
    last_applied: int = 0
    leader: str = ""  # Raft address of the leader this master knows, "" when none
    log_size: int = 0
    ready: bool = False
    has_quorum: bool = False
    follower_match_index: dict[str, int] = field(default_factory=dict)
    taken_at: float = 0.0  # monotonic time of the snapshot


ELECTION_COUNTS = ("prevotes_started", "votes_refused", "stale_appends_answered", "stepped_down")
"""The counters of :class:`~kvpool.raft_master.lease.LeasedSyncObj` a master exports."""


def status_from_pysyncobj(raw: Mapping[str, Any], ready: bool, now: float) -> RaftStatus:
    leader = raw.get("leader")
    role = _ROLES.get(int(raw.get("state", 0)), "follower")
    match = {
        k.removeprefix("match_idx_server_"): int(v)
        for k, v in raw.items()
        if k.startswith("match_idx_server_")
    }
    return RaftStatus(
        role=role,
        term=int(raw.get("raft_term", 0)),
        commit_index=int(raw.get("commit_idx", 0)),
        last_applied=int(raw.get("last_applied", 0)),
        leader=str(getattr(leader, "id", leader)) if leader is not None else "",
        log_size=int(raw.get("log_len", 0)),
        ready=ready,
        has_quorum=bool(raw.get("has_quorum", False)),
        follower_match_index=match if role == "leader" else {},
        taken_at=now,
    )


def _check_lease_internals(syncobj: SyncObj | None) -> None:
    missing = missing_internals(syncobj)
    if missing:
        raise StartupError(
            "raft_read_lease: the installed pysyncobj lacks what leases build on "
            f"({', '.join(missing)}); install the version pyproject.toml names"
        )


# --- the adapter ----------------------------------------------------------------------------------


class Replicator:
    """One master's Raft member: start, propose (async), read (locked), status, stop."""

    def __init__(
        self,
        cfg: MasterConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_bind_retries: int = 3,
        tick_period_s: float = 0.05,
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self._max_bind_retries = max_bind_retries
        self._tick_period_s = tick_period_s
        self._log = get_logger("kvpool.raft_master.replication")
        self.consumer = IndexConsumer(
            BlockIndex(dedupe_capacity=cfg.dedupe_capacity, dedupe_max_bytes=cfg.dedupe_max_bytes),
            dedupe_capacity=cfg.dedupe_capacity,
            dedupe_max_bytes=cfg.dedupe_max_bytes,
        )
        self._syncobj: SyncObj | None = None
        self.guard_stats = GuardStats()  # what the Raft port refused (raft_guard.py)
        self._status = RaftStatus()
        self._last_status_at = 0.0
        # A group of one master commits an entry on the tick after the one that appended it;
        # nothing else wakes that tick (no follower answers), so without a nudge a commit waits
        # a whole tick period (52 ms measured per put). Proposed/done: one writer each. The
        # nudge: PySyncObj's wake-up pipe for its thread, or a tick asked of the loop ticking it.
        self._wake: Callable[[], None] | None = None
        self._proposed = 0  # the event-loop thread
        self._done = 0  # the Raft thread
        self._woken_for = 0
        self._ticker: LoopTicker | None = None  # Raft ticked on the event loop (raft_tick_on_loop)

    # lifecycle

    def start(self) -> None:
        """Create the SyncObj and wait until Raft is bound. With ``raft_tick_on_loop`` (auto:
        wherever the index has a data_dir) it is ticked on the calling thread's running event
        loop (:mod:`~kvpool.raft_master.loop_tick`); otherwise PySyncObj ticks it on a thread of
        its own, which stops when the calling thread ends (so that thread must outlive it).
        Without a running loop: a thread of its own."""
        loop: asyncio.AbstractEventLoop | None = None
        if self.cfg.ticks_on_loop:
            if supported():
                with contextlib.suppress(RuntimeError):
                    loop = asyncio.get_running_loop()
            elif self.cfg.raft_tick_on_loop:
                raise StartupError(
                    "raft_tick_on_loop: this PySyncObj does not make its poller where kvpool "
                    "can hand it the event loop's; set raft_tick_on_loop = false"
                )
            else:
                self._log.info(
                    "raft_tick_on_thread",
                    reason="this PySyncObj does not let kvpool hand it the event loop's poller",
                )
        conf = build_conf(
            self.cfg,
            max_bind_retries=self._max_bind_retries,
            tick_period_s=self._tick_period_s,
            auto_tick=loop is None,
        )
        peers = [p for p in self.cfg.raft_peers if p != self.cfg.raft_listen]
        poller = LoopPoller(loop) if loop is not None else None
        try:
            with poller_for_construction(poller) if poller else contextlib.nullcontext():
                syncobj = self._make_syncobj(conf, peers)  # binds at once when not auto-ticked
        except SyncObjException as e:
            raise self._cannot_bind(e) from None
        self._syncobj = syncobj
        try:
            syncobj.waitBinded()
        except Exception as e:
            self.stop()
            raise self._cannot_bind(e) from None
        if loop is not None and poller is not None:
            # A tick at once after every Raft socket event and every proposal, and every tenth
            # of PySyncObj's tick period besides (its timers: heartbeats, elections, the lease).
            ticker = LoopTicker(loop, syncobj._onTick, self._tick_period_s / 10, self._log)
            poller.on_event = ticker.request
            if isinstance(syncobj, LeasedSyncObj):  # a follower's tick waits for the timer
                poller.tick_on_events = syncobj.ticks_on_messages
            self._ticker = ticker
            if not peers:
                self._wake = ticker.request
        elif not peers:
            self._wake = PipeNotifier(syncobj._poller).notify
        syncobj.addOnTickCallback(self._on_tick)
        if self._ticker is not None:
            self._ticker.start()

    def _cannot_bind(self, error: Exception) -> StartupError:
        return StartupError(
            f"cannot bind the Raft address {self.cfg.raft_listen} "
            f"(in use, or not an address of this host): {error}"
        )

    def _make_syncobj(self, conf: SyncObjConf, peers: list[str]) -> SyncObj:
        syncobj: SyncObj
        guard = GuardLimits(
            self.cfg.raft_max_message_bytes,
            self.cfg.raft_message_timeout_s,
            compress_level=self.cfg.raft_compress_level,
            session_secret=session_secret(self.cfg.raft_secret),
            send_sessions=self.cfg.raft_session_cipher,
        )
        transport = guarded_transport(guard, self.guard_stats)  # the Raft port's guard
        if self.cfg.raft_read_lease:
            _check_lease_internals(None)
            times = LeaseTimes.for_election_timeout(
                self.cfg.raft_min_timeout_s, self.cfg.raft_append_period_s
            )
            syncobj = LeasedSyncObj(
                self.cfg.raft_listen,
                peers,
                times=times,
                conf=conf,
                consumers=[self.consumer],
                transportClass=transport,
            )
            try:
                _check_lease_internals(syncobj)
            except StartupError:
                syncobj.destroy()
                raise
        else:
            # Followers answer lookups here (with the revision a caller asks for): they must
            # learn each commit at once, so PySyncObj's own commit round stays.
            syncobj = SyncObj(
                self.cfg.raft_listen,
                peers,
                conf=conf,
                consumers=[self.consumer],
                transportClass=transport,
            )
        return syncobj

    def stop(self, timeout_s: float = 5.0) -> None:
        """Destroy the SyncObj (on its loop when ticked there), join its thread if it has one,
        wait for a compaction child (blocking: call it from a worker thread in a server)."""
        syncobj, self._syncobj = self._syncobj, None
        if syncobj is None:
            return
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            # Its sockets are the loop's readers: closed on the loop, whichever thread stops it.
            def destroy() -> None:
                ticker.stop()
                syncobj.destroy()

            ticker.on_loop(destroy, timeout_s)
            self._wait_compaction_child(syncobj, timeout_s)
            return
        syncobj.destroy()
        thread = getattr(syncobj, "_SyncObj__thread", None)
        if isinstance(thread, threading.Thread) and thread is not threading.current_thread():
            thread.join(timeout_s)
        self._wait_compaction_child(syncobj, timeout_s)

    @staticmethod
    def _wait_compaction_child(syncobj: SyncObj, timeout_s: float) -> None:
        """A forked compaction child still holds our listening sockets: let it finish so a quick
        restart can bind (PYSYNCOBJ.md trap 9)."""
        serializer = getattr(syncobj, "_SyncObj__serializer", None)
        pid = getattr(serializer, "_Serializer__pid", 0) if serializer is not None else 0
        if not isinstance(pid, int) or pid <= 0:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return
            if done == pid:
                return
            time.sleep(0.02)

    # Raft-thread callback (must never raise: it runs inside PySyncObj's tick)

    def _on_tick(self) -> None:
        wake = self._wake
        if wake is not None and self._proposed not in (self._done, self._woken_for):
            # Entries appended this tick: tick again now to commit them (once per new proposal,
            # so an entry that cannot commit falls back to the normal tick period, no spin).
            self._woken_for = self._proposed
            try:
                wake()
            except OSError as e:
                self._log.warning("raft_wake_failed", error=str(e))
        now = self._clock()
        if now - self._last_status_at < _STATUS_PERIOD_S:
            return
        self._last_status_at = now
        syncobj = self._syncobj
        if syncobj is None:
            return
        try:
            self._status = status_from_pysyncobj(syncobj.getStatus(), syncobj.isReady(), now)
        except Exception as e:
            self._log.warning("raft_status_failed", error=str(e))

    # proposing

    async def propose(self, command: Command, timeout_s: float) -> Result:
        """Replicate ``command`` and return its result once applied here.

        Raises UnavailableError on a Raft failure (no leader, leader changed…) or when
        ``timeout_s`` passes; the command may still apply later — retry with the same request
        id. Raises InternalError when the entry could not be applied (a bug)."""
        syncobj = self._syncobj
        if syncobj is None:
            raise UnavailableError("this master's Raft member is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[Any, int]] = loop.create_future()

        def resolve(result: Any, error: int) -> None:
            if not future.done():
                future.set_result((result, error))

        ticker = self._ticker

        def on_done(result: Any, error: int) -> None:  # the Raft thread, or the loop's tick
            self._done += 1
            if ticker is not None and ticker.on_loop_thread():
                # Ticked on this loop: resolved now, so the caller's answer goes on this turn
                # of the loop rather than the next (no wake-up through the loop's self-pipe).
                resolve(result, error)
                return
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(resolve, result, error)

        def expire() -> None:
            if not future.done():
                future.set_exception(
                    UnavailableError(
                        f"Raft commit not confirmed within {timeout_s:.2f}s; it may still "
                        "apply, retry with the same request id"
                    )
                )

        self._proposed += 1
        self.consumer.apply_command(encode(command), callback=on_done)
        if ticker is not None:
            ticker.now()  # append it and send it to the followers now
        # A timer on our own future, not asyncio.timeout: that needs a current task, and
        # request handlers start outside one (kvpool.transports.eager).
        timer = loop.call_later(timeout_s, expire)
        try:
            result, error = await future
        finally:
            timer.cancel()
        if error != FAIL_REASON.SUCCESS:
            raise UnavailableError(
                f"Raft commit failed ({_FAIL_NAMES.get(error, error)}); it may still apply, "
                "retry with the same request id"
            )
        if isinstance(result, ErrorResult):
            raise InternalError(f"replicated command not applied: {result.message}")
        assert result is not None
        return result  # type: ignore[no-any-return]

    # reads

    def read(self, fn: Callable[[BlockIndex], T]) -> T:
        """Run a short read of the index under the apply lock."""
        with self.consumer.lock:
            return fn(self.consumer.index)

    def is_leader(self) -> bool:
        syncobj = self._syncobj
        return bool(syncobj is not None and syncobj._isLeader())

    def lease_held(self) -> bool:
        """Leader, holding a read lease: no other master can have acknowledged a write this
        one has not applied (:mod:`kvpool.raft_master.lease`). Always False with leases off."""
        syncobj = self._syncobj
        return isinstance(syncobj, LeasedSyncObj) and syncobj.lease_held()

    def leads(self) -> bool:
        """Leader now and, with read leases, holding its lease: no other master can have taken
        over meanwhile. The loops that decide by time (declaring nodes down, repairs) act only
        while this holds: a leader woken from a pause still believes it leads, and what it
        proposes is forwarded to the real leader, which would apply it."""
        return self.lease_held() if self.cfg.raft_read_lease else self.is_leader()

    def election_counts(self) -> dict[str, int]:
        """What the pre-vote and lease guards counted on this master since it started
        (:class:`~kvpool.raft_master.lease.LeasedSyncObj`; zeros with leases off)."""
        syncobj = self._syncobj
        return {name: int(getattr(syncobj, name, 0)) for name in ELECTION_COUNTS}

    def leader_raft_address(self) -> str | None:
        syncobj = self._syncobj
        leader = syncobj._getLeader() if syncobj is not None else None
        return str(leader.id) if leader is not None else None

    def term(self) -> int:
        syncobj = self._syncobj
        return int(syncobj.raftCurrentTerm) if syncobj is not None else 0

    def is_ready(self) -> bool:
        """A leader is known and this master has applied up to its commit index (once)."""
        syncobj = self._syncobj
        return bool(syncobj is not None and syncobj.isReady() and syncobj._getLeader() is not None)

    @property
    def ticked_on_loop(self) -> bool:
        """Whether Raft is ticked on the event loop (``raft_tick_on_loop``), not a thread."""
        return self._ticker is not None

    def tick_alive(self) -> bool:
        """Raft is being ticked: by this master's event loop (until stopped), or by PySyncObj's
        living thread."""
        syncobj = self._syncobj
        if syncobj is None:
            return False
        if self._ticker is not None:
            return self._ticker.alive()
        return bool(syncobj.tick_thread_alive())

    def status(self) -> RaftStatus:
        """The latest status snapshot (taken on the Raft thread at most every 0.1 s)."""
        return self._status

    def force_compaction(self) -> None:
        if self._syncobj is not None:
            self._syncobj.forceLogCompaction()

    def add_tick_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the Raft thread after each tick (benchmarks)."""
        if self._syncobj is not None:
            self._syncobj.addOnTickCallback(callback)
