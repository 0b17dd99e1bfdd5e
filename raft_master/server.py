"""The master process: PySyncObj + the gRPC service + failure detection, until SIGTERM.

    python -m kvpool.raft_master.server --config-json '{"listen": "127.0.0.1:7300", ...}'

(``--config FILE.toml`` reads the ``[master]`` section first; ``KVPOOL_*`` variables apply.)
Launch it with ``GRPC_ENABLE_FORK_SUPPORT=false`` in the environment: PySyncObj forks a child to
write snapshots, and gRPC's fork handlers (read when grpc is imported, so this process cannot
turn them off itself) only log "skipping fork() handlers" for a child that pickles and exits.
:func:`main` blocks; it returns 0 after a graceful stop, 2 when the master cannot start (bad
configuration, an address in use, a data directory held by another master), 1 when the Raft
thread died. One log line per lifecycle event (``master_started``, ``master_ready``,
``became_leader``, ``lost_leadership``, ``master_stopped``…), each with the node id.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from kvpool.config import MasterConfig, load_config, split_hostport
from kvpool.errors import ConfigError, KVPoolError
from kvpool.gctune import freeze_after_slow_collections
from kvpool.grpcutil import ServerHandle, start_server
from kvpool.logs import OncePer, bind_process, configure_logging, get_logger
from kvpool.metrics import MetricsServer, register_collector, start_metrics
from kvpool.proto.v1 import master_pb2_grpc
from kvpool.raft_master.failure import FailureDetector, FailureLoop
from kvpool.raft_master.master_metrics import master_families
from kvpool.raft_master.read_port import ReadPort
from kvpool.raft_master.replica_loop import ReplicaLoop
from kvpool.raft_master.replica_rpc import ReplicaRpc
from kvpool.raft_master.replication import Replicator, StartupError, StuckFollowerWatch
from kvpool.raft_master.rpc_port import RpcPort
from kvpool.raft_master.service import MasterService, check_keys, check_request_id
from kvpool.tracing import setup_tracing

MONITOR_PERIOD_S = 0.1
MAINTAIN_PERIOD_S = 0.2
STUCK_CHECK_PERIOD_S = 1.0
GRPC_GRACE_S = 1.0
LOCK_WAIT_S = 5.0
EXIT_OK = 0
EXIT_RAFT_DIED = 1
EXIT_STARTUP = 2


def main(cfg: MasterConfig) -> int:
    """Run one master until SIGTERM/SIGINT; see the module docstring for exit codes."""
    try:
        configure_logging(cfg.log_level, cfg.log_format)
    except ValueError as e:
        print(f"kvpool master: {e}", file=sys.stderr)
        return EXIT_STARTUP
    bind_process(role="master", node_id=cfg.raft_listen)
    setup_tracing("master")
    log = get_logger("kvpool.master")
    freeze_after_slow_collections(
        on_freeze=lambda ms, frozen: log.info(
            "gc_frozen", full_collection_ms=round(ms, 1), frozen=frozen
        )
    )
    try:
        return asyncio.run(MasterProcess(cfg).run())
    except (StartupError, ConfigError) as e:
        message = e.message if isinstance(e, KVPoolError) else str(e)
        print(f"kvpool master {cfg.raft_listen}: cannot start: {message}", file=sys.stderr)
        return EXIT_STARTUP


def advertised_grpc_address(cfg: MasterConfig, bound_port: int) -> str:
    if cfg.advertise_address:
        return cfg.advertise_address
    host, _ = split_hostport(cfg.listen)
    if host in ("0.0.0.0", "::", ""):
        raise StartupError(
            f"listen {cfg.listen} is a wildcard address: set advertise_address to the address "
            "clients and nodes should dial"
        )
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{bound_port}"


def write_ready_file(path: str, content: dict[str, Any]) -> None:
    """Write JSON atomically (temp file in the same directory, then rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(content, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def lock_data_dir(data_dir: str, wait_s: float = LOCK_WAIT_S) -> int:
    """Hold ``data_dir/LOCK`` for the life of the process (one master per data directory).

    A forked compaction child inherits the lock (and our listening sockets) and keeps it until
    it exits, so once the lock is ours the previous run's sockets are free too
    (PYSYNCOBJ.md trap 9). Waits ``wait_s`` for such a child."""
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(os.path.join(data_dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise StartupError(
                    f"data_dir {data_dir} is in use by another master process (or by the "
                    "snapshot writer of a previous run, still finishing)"
                ) from None
            time.sleep(0.1)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


@dataclass
class _Watch:
    """What the monitor saw on its last check."""

    led_term: int | None = None  # the term this master was last seen leading
    was_ready: bool | None = None
    last_stuck_check: float = 0.0


class MasterProcess:
    """Assembles one master; :meth:`run` serves until :meth:`request_stop` or a signal."""

    def __init__(self, cfg: MasterConfig) -> None:
        self.cfg = cfg
        self.log = get_logger("kvpool.raft_master")
        self.security = cfg.security()
        self.replicator = Replicator(cfg)
        self.detector = FailureDetector(cfg.node_timeout_s)
        self.service = MasterService(
            cfg, self.replicator, self.detector, grpc_address=cfg.advertise_address or cfg.listen
        )
        self.replica_loop = ReplicaLoop(
            cfg, self.replicator, established=self.service.leader_established
        )
        self.service.replicas = self.replica_loop
        self.service.replica_rpc = ReplicaRpc(
            cfg,
            self.replicator,
            self.replica_loop,
            require_leader=self.service.require_leader,
            propose=self.service.propose,
            check_keys=check_keys,
            check_request_id=check_request_id,
        )
        self.failure_loop = FailureLoop(
            self.replicator,
            self.detector,
            commit_timeout_s=cfg.commit_timeout_s,
            established=self.service.leader_established,
            restore_grace_s=cfg.restore_grace_s,
            hold_purge=self.replica_loop.hold_purge,
        )
        self.stuck_watch = StuckFollowerWatch(cfg.stuck_follower_s)
        self._stop: asyncio.Event | None = None
        self._exit_code = EXIT_OK
        self._handle: ServerHandle | None = None
        self._rpc: RpcPort | None = None
        self._read: ReadPort | None = None
        self._lock_fd: int | None = None
        self._metrics: MetricsServer | None = None
        self._unregister: Callable[[], None] | None = None
        self.metrics_address = ""

    def request_stop(self, exit_code: int = EXIT_OK) -> None:
        self._exit_code = max(self._exit_code, exit_code)
        if self._stop is not None:
            self._stop.set()

    async def run(self) -> int:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            if not cfg.in_memory:
                self._lock_fd = lock_data_dir(cfg.data_dir)
            try:
                self._handle = await start_server(
                    cfg.listen,
                    [
                        (
                            master_pb2_grpc.add_MasterServicer_to_server,
                            self.service,
                            "kvpool.v1.Master",
                        )
                    ],
                    security=self.security,
                    max_receive_bytes=cfg.max_request_size,
                    max_connections=cfg.max_connections,
                )
            except (KVPoolError, RuntimeError) as e:
                raise StartupError(f"cannot bind the gRPC address {cfg.listen}: {e}") from None
            self.service.grpc_address = advertised_grpc_address(cfg, self._handle.port)
            self._start_rpc_port()
            await self._start_metrics()
            self.replicator.start()  # on this (the main) thread: PySyncObj ties its thread to it
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            if cfg.ready_file:
                write_ready_file(
                    cfg.ready_file,
                    {
                        "role": "master",
                        "pid": os.getpid(),
                        "grpc": self.service.grpc_address,
                        "raft": cfg.raft_listen,
                        "rpc": self.service.rpc_address,
                        "read": self.service.read_address,
                        "metrics": self.metrics_address,
                    },
                )
            self.log.info(
                "master_started",
                grpc=self.service.grpc_address,
                raft=cfg.raft_listen,
                rpc=self.service.rpc_address or None,
                read=self.service.read_address or None,
                peers=list(cfg.raft_peers),
                data_dir=cfg.data_dir if not cfg.in_memory else None,
                in_memory=cfg.in_memory,
                raft_tick="loop" if self.replicator.ticked_on_loop else "thread",
                pid=os.getpid(),
                grpc_fork_support=os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "default"),
            )
            tasks = [
                loop.create_task(self._monitor(), name="monitor"),
                loop.create_task(self._maintain(), name="maintain"),
                loop.create_task(self.failure_loop.run(), name="failure"),
                loop.create_task(self.replica_loop.run(), name="replicas"),
            ]
            try:
                await self._stop.wait()
            finally:
                self.log.info("master_stopping", exit_code=self._exit_code)
                await self._shutdown(tasks)
                await self.replica_loop.close()
            self.log.info("master_stopped", exit_code=self._exit_code)
            return self._exit_code
        except BaseException:
            await self._cleanup_after_failed_start()
            raise
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def _start_rpc_port(self) -> None:
        """The frame RPC port (rpc_port.py), offered only to clients that dial this master
        directly (no advertise_address: nothing in front of it)."""
        cfg = self.cfg
        if cfg.rpc_listen == "off":
            return
        if cfg.rpc_listen == "auto":
            if cfg.advertise_address:
                return
            if self.security.tls.serves_tls:
                return  # with TLS, index traffic stays on the encrypted gRPC port unless asked
            host, port = split_hostport(cfg.listen)[0], 0
        else:
            host, port = split_hostport(cfg.rpc_listen)
        self._rpc = RpcPort(
            self.service, self.log, token=self.security.token, limits=self.cfg.ingress_limits()
        )
        try:
            bound = self._rpc.start(host, port)
        except OSError as e:
            raise StartupError(f"rpc_listen: cannot listen on {host}:{port}: {e}") from None
        shown = f"[{host}]" if ":" in host else host
        self.service.rpc_address = f"{shown}:{bound}"
        # Index reads have a port of their own, served by threads (read_port.py), offered
        # with the RPC port (which serves the same reads to clients that do not use it).
        if cfg.read_listen == "off":
            return
        read_host, read_port = (
            (host, 0) if cfg.read_listen == "auto" else split_hostport(cfg.read_listen)
        )
        self._read = ReadPort(
            self.service,
            self.log,
            token=self.security.token,
            limits=self.cfg.ingress_limits(),
            max_connections=cfg.read_threads,
        )
        try:
            read_bound = self._read.start(read_host, read_port)
        except OSError as e:
            self._read = None
            raise StartupError(
                f"read_listen: cannot listen on {read_host}:{read_port}: {e}"
            ) from None
        shown = f"[{read_host}]" if ":" in read_host else read_host
        self.service.read_address = f"{shown}:{read_bound}"

    def _close_rpc_ports(self) -> None:
        self.service.read_address = ""
        for port in (self._read, self._rpc):
            if port is not None:
                port.close()
        self._read = self._rpc = None

    async def _start_metrics(self) -> None:
        """``/metrics`` on the gRPC host (``metrics_port``; see :mod:`kvpool.metrics`)."""
        host = split_hostport(self.cfg.listen)[0]
        try:
            self._metrics = await start_metrics(host, self.cfg.metrics_port, "master")
        except OSError as e:
            raise StartupError(f"metrics_port: cannot listen on {host}: {e}") from None
        if self._metrics is not None:
            shown = f"[{host}]" if ":" in host else host
            self.metrics_address = f"{shown}:{self._metrics.port}"
            self._unregister = register_collector(
                partial(master_families, self.service, self.replica_loop)
            )

    async def _stop_metrics(self) -> None:
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        if self._metrics is not None:
            await self._metrics.close()
            self._metrics = None

    async def _cleanup_after_failed_start(self) -> None:
        await self._stop_metrics()
        self._close_rpc_ports()
        if self._handle is not None:
            with contextlib.suppress(Exception):
                await self._handle.stop(0)
            self._handle = None
        await asyncio.to_thread(self.replicator.stop)

    async def _shutdown(self, tasks: list[asyncio.Task[None]]) -> None:
        await self._stop_metrics()
        self._close_rpc_ports()
        handle, self._handle = self._handle, None
        if handle is not None:
            with contextlib.suppress(Exception):
                await handle.set_ready(False)
            await handle.stop(GRPC_GRACE_S)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.replicator.stop)
        if self.cfg.ready_file:
            with contextlib.suppress(OSError):
                os.unlink(self.cfg.ready_file)

    async def _monitor(self) -> None:
        """Role changes, readiness, Raft thread liveness, stuck followers. A check that fails is
        logged (at most once a minute) and the next one comes: a monitor that ended would leave
        readiness and the Raft thread's death unwatched for good."""
        watch = _Watch()
        once = OncePer(self.log)
        while True:
            await asyncio.sleep(MONITOR_PERIOD_S)
            if not self.replicator.tick_alive():
                self.log.critical("raft_thread_died")
                self.request_stop(EXIT_RAFT_DIED)
                return
            try:
                await self._watch_once(watch)
            except Exception as e:
                once.warning("monitor_check_failed", "monitor", error=repr(e))

    async def _watch_once(self, watch: _Watch) -> None:
        leader = self.replicator.is_leader()
        term = self.replicator.term()
        if watch.led_term is not None and (not leader or term != watch.led_term):
            self.log.info(
                "lost_leadership", term=watch.led_term, leader=self.replicator.leader_raft_address()
            )
            self.stuck_watch.reset()
            watch.led_term = None
        if leader and watch.led_term is None:
            self.log.info("became_leader", term=term)
            watch.led_term = term
        ready = self.replicator.is_ready()
        if ready != watch.was_ready and self._handle is not None:
            await self._handle.set_ready(ready)
            if ready:
                self.log.info("master_ready", leader=self.replicator.leader_raft_address())
            elif watch.was_ready is not None:
                self.log.warning("master_not_ready")
            watch.was_ready = ready
        now = time.monotonic()
        if leader and now - watch.last_stuck_check >= STUCK_CHECK_PERIOD_S:
            watch.last_stuck_check = now
            self._check_stuck_followers(now)

    def _check_stuck_followers(self, now: float) -> None:
        status = self.replicator.status()
        if status.role != "leader":
            return
        stuck = self.stuck_watch.observe(now, status.commit_index, status.follower_match_index)
        for follower in stuck:
            self.log.warning(
                "follower_stuck",
                follower=follower,
                match_index=status.follower_match_index.get(follower),
                commit_index=status.commit_index,
                action="force_log_compaction",
            )
        if stuck:
            self.replicator.force_compaction()

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(MAINTAIN_PERIOD_S)
            try:
                await self.service.maintain()
            except asyncio.CancelledError:
                raise
            except KVPoolError as e:
                self.log.debug("maintain_deferred", error=e.message)
            except Exception:
                self.log.exception("maintain_failed")


# --- command line ---------------------------------------------------------------------------------


def _parse_args(argv: list[str]) -> MasterConfig:
    parser = argparse.ArgumentParser(prog="python -m kvpool.raft_master.server")
    parser.add_argument("--config", help="TOML file (its [master] section)")
    parser.add_argument("--config-json", help="settings as a JSON object (override the rest)")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.config_json:
        try:
            loaded = json.loads(args.config_json)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config-json: not JSON: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError("--config-json: expected a JSON object")
        overrides = loaded
    return load_config(MasterConfig, toml_path=args.config, section="master", overrides=overrides)


def cli(argv: list[str] | None = None) -> int:
    try:
        cfg = _parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"kvpool master: {e.message}", file=sys.stderr)
        return EXIT_STARTUP
    return main(cfg)


if __name__ == "__main__":
    sys.exit(cli())
