"""A whole kvpool cluster on this host: ``kvpool cluster up`` / ``down``, the demo, the tests and
the chaos harness.

Every process is a real ``python -m kvpool master|node`` child in its own process session
(so a Ctrl-C in the terminal reaches the launcher, which then stops them in order). The launcher
writes ``DIR/cluster.json`` with each process's role, addresses, pid and log file; ``down`` (or
:meth:`LocalCluster.stop`) stops only those pids, and only when the pid still runs a kvpool
command (a pid reused by another program is left alone).

Where each process runs is a :class:`~kvpool.launcher.placement.Placement`: for a process name
it gives the IP the process binds and advertises, an argv prefix (``ip netns exec
kvp-ab12-master-1`` puts it in a network namespace) and extra environment (a fake clock). The
default, :class:`~kvpool.launcher.placement.LoopbackPlacement`, puts everything on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpool.errors import KVPoolError, UnavailableError
from kvpool.launcher.placement import (
    LOOPBACK_HOST,
    MASTER_GRPC_PORT,
    MASTER_RAFT_PORT,
    NODE_ADMIN_PORT,
    NODE_DATA_PORT,
    AdvertiseHook,
    LoopbackPlacement,
    Placement,
    ProcessPlacement,
    free_port,
)
from kvpool.launcher.probe import leader_of, probe_masters
from kvpool.launcher.procfs import (
    pid_runs_kvpool,
    process_start_ticks,
    process_state,
    same_process,
)
from kvpool.security import Security, is_loopback_host, read_token

# pid_runs_kvpool and free_port lived here before placement.py and procfs.py: still exported.
__all__ = ["ClusterError", "LocalCluster", "ProcessInfo", "free_port", "pid_runs_kvpool"]

CLUSTER_FILE = "cluster.json"
SECRET_FILE = "raft.secret"  # noqa: S105 - a file name, not a secret
CLUSTER_TOKEN_FILE = "cluster.token"  # noqa: S105 - a file name, not a secret


class ClusterError(KVPoolError):
    """The local cluster could not be started or stopped as asked."""

    code = "CLUSTER"


@dataclass
class ProcessInfo:
    name: str
    role: str  # "master" | "node"
    argv: list[str]
    log: str
    ready_file: str
    pid: int = 0
    grpc: str = ""  # masters: bound gRPC address; nodes: admin gRPC address
    raft: str = ""  # masters only
    data: str = ""  # nodes only: the data-plane address clients dial (advertised)
    data_dir: str = ""  # masters only, unless in memory
    node_id: str = ""  # nodes only
    host: str = LOOPBACK_HOST  # the IP the process binds
    advertise: str = ""  # masters: gRPC address clients dial, when not ``grpc`` (a proxy)
    extra: dict[str, Any] = field(default_factory=dict)


def _tail(path: str, lines: int = 20) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class LocalCluster:
    """Masters and store nodes as child processes of this host, in ``directory``, placed by
    ``placement`` (default: all on 127.0.0.1)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        masters: int = 3,
        nodes: int = 2,
        cpu_cache_size: str = "256MiB",
        in_memory: bool = False,
        node_timeout_s: float = 3.0,
        heartbeat_interval_s: float = 0.5,
        log_level: str = "info",
        extra_master_flags: Sequence[str] = (),
        extra_node_flags: Sequence[str] = (),
        python: str = sys.executable,
        placement: Placement | None = None,
        advertise_master: AdvertiseHook | None = None,
        advertise_node_data: AdvertiseHook | None = None,
        on_spawn: Callable[[ProcessInfo], None] | None = None,
        metrics: bool = False,
        cluster_token: bool | None = None,
    ) -> None:
        """``cluster_token``: give the cluster a fresh token (True), none (False), or one
        exactly when a process listens beyond loopback (None)."""
        if masters < 1:
            raise ClusterError("a cluster needs at least one master")
        if nodes < 0:
            raise ClusterError("the node count must not be negative")
        self.dir = Path(directory).resolve()
        self.n_masters = masters
        self.n_nodes = nodes
        self.cpu_cache_size = cpu_cache_size
        self.in_memory = in_memory
        self.node_timeout_s = node_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.log_level = log_level
        self.extra_master_flags = list(extra_master_flags)
        self.extra_node_flags = list(extra_node_flags)
        self.python = python
        self.placement: Placement = placement or LoopbackPlacement()
        self.advertise_master = advertise_master
        self.advertise_node_data = advertise_node_data
        self.on_spawn = on_spawn
        # /metrics on a free port per process when asked; off by default, so that the many
        # clusters of a test run do not bind one more ephemeral port each (a port picked for a
        # process not started yet could be taken by another's).
        self.metrics = metrics
        self.secret = ""
        self.want_token = cluster_token
        self.token_file = ""
        """The cluster token's file, when the cluster has one: a cluster reachable beyond
        loopback (network namespaces) gets a fresh token; clients must present it."""
        self.processes: dict[str, ProcessInfo] = {}
        self.started_pids: list[int] = []
        """Every pid this launcher ever started (restarts included), oldest first."""
        self._popen: dict[str, subprocess.Popen[bytes]] = {}
        self._env_of: dict[str, dict[str, str]] = {}
        self._paused: set[str] = set()

    # --- description ---------------------------------------------------------------------

    @property
    def master_addresses(self) -> list[str]:
        """The masters' bound gRPC addresses (what nodes and probes dial)."""
        return [p.grpc for p in self.processes.values() if p.role == "master"]

    @property
    def client_master_addresses(self) -> list[str]:
        """The masters' addresses as clients should dial them (a proxy's, when advertised)."""
        return [p.advertise or p.grpc for p in self.processes.values() if p.role == "master"]

    @property
    def masters(self) -> list[ProcessInfo]:
        return [p for p in self.processes.values() if p.role == "master"]

    @property
    def nodes(self) -> list[ProcessInfo]:
        return [p for p in self.processes.values() if p.role == "node"]

    @property
    def master_names(self) -> list[str]:
        return [p.name for p in self.masters]

    @property
    def node_names(self) -> list[str]:
        return [p.name for p in self.nodes]

    def to_json(self) -> dict[str, Any]:
        return {
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "masters": self.master_addresses,
            "secret_file": str(self.dir / SECRET_FILE),
            "token_file": self.token_file,
            "processes": [asdict(p) for p in self.processes.values()],
        }

    def write_cluster_file(self) -> Path:
        path = self.dir / CLUSTER_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def from_dir(cls, directory: str | Path) -> LocalCluster:
        """The cluster a detached ``kvpool cluster up --dir`` started."""
        path = Path(directory).resolve() / CLUSTER_FILE
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ClusterError(f"no readable {CLUSTER_FILE} in {directory}: {e}") from e
        procs = [ProcessInfo(**p) for p in doc.get("processes", [])]
        cluster = cls(
            directory,
            masters=max(1, sum(p.role == "master" for p in procs)),
            nodes=sum(p.role == "node" for p in procs),
        )
        cluster.processes = {p.name: p for p in procs}
        secret_file = Path(doc.get("secret_file", cluster.dir / SECRET_FILE))
        with contextlib.suppress(OSError):
            cluster.secret = secret_file.read_text().strip()
        cluster.token_file = str(doc.get("token_file", ""))
        return cluster

    @property
    def security(self) -> Security:
        """What a client of this cluster presents (the token, when there is one)."""
        return Security(token=read_token("", self.token_file)) if self.token_file else Security()

    @property
    def client_env(self) -> dict[str, str]:
        """Environment for a process that talks to this cluster (KVPOOL_CLUSTER_TOKEN_FILE)."""
        return {"KVPOOL_CLUSTER_TOKEN_FILE": self.token_file} if self.token_file else {}

    # --- start ---------------------------------------------------------------------------

    def _env(self, name: str) -> dict[str, str]:
        env = dict(os.environ)
        env["KVPOOL_RAFT_SECRET"] = self.secret
        env.update(self.client_env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # grpc reads this at import: no fork handlers when PySyncObj forks to write snapshots.
        env.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
        env.update(self._env_of.get(name, {}))
        return env

    def _command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` behind the placement's prefix. Extra environment goes behind the prefix
        too (``env K=V … python …``), so that a library preloaded for the kvpool process
        (a fake clock) applies to the kvpool process, not to the prefix's own program (``ip``)."""
        placed = self.placement.place(name)
        if placed.argv_prefix and placed.env:
            pairs = [f"{k}={v}" for k, v in sorted(placed.env.items())]
            return [*placed.argv_prefix, "env", *pairs, *argv]
        if placed.env:
            self._env_of[name] = dict(placed.env)
        return [*placed.argv_prefix, *argv]

    def _spawn(self, info: ProcessInfo) -> None:
        with contextlib.suppress(FileNotFoundError):
            Path(info.ready_file).unlink()
        log = open(info.log, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            proc = subprocess.Popen(
                info.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(info.name),
                start_new_session=True,
                cwd=self.dir,
            )
        finally:
            log.close()
        info.pid = proc.pid
        self._popen[info.name] = proc
        self._paused.discard(info.name)
        self.started_pids.append(proc.pid)
        if self.on_spawn is not None:
            self.on_spawn(info)

    def _master_ports(self, placed: ProcessPlacement) -> tuple[int, int]:
        if placed.own_network:
            return MASTER_GRPC_PORT, MASTER_RAFT_PORT
        return free_port(placed.host), free_port(placed.host)

    def _master_info(self, i: int, grpc_ports: list[int], raft: list[str]) -> ProcessInfo:
        name = f"master-{i + 1}"
        host = self.placement.place(name).host
        peers = [r for j, r in enumerate(raft) if j != i]
        data_dir = "" if self.in_memory else str(self.dir / name)
        grpc = f"{host}:{grpc_ports[i]}"
        advertise = self.advertise_master(name, grpc) if self.advertise_master else ""
        argv = [
            self.python, "-m", "kvpool", "master",
            "--listen", grpc,
            "--raft-listen", raft[i],
            "--raft-peers", ",".join(peers),
            "--node-timeout-s", str(self.node_timeout_s),
            "--heartbeat-interval-s", str(self.heartbeat_interval_s),
            "--log-level", self.log_level,
            "--log-format", "json",
            "--ready-file", str(self.dir / f"{name}.ready"),
        ]  # fmt: skip
        if advertise:
            argv += ["--advertise-address", advertise]
        argv += ["--in-memory"] if self.in_memory else ["--data-dir", data_dir]
        argv += [] if self.metrics else ["--metrics-port", "-1"]
        argv += self.extra_master_flags
        return ProcessInfo(
            name=name,
            role="master",
            argv=self._command(name, argv),
            log=str(self.dir / f"{name}.log"),
            ready_file=str(self.dir / f"{name}.ready"),
            grpc=grpc,
            raft=raft[i],
            data_dir=data_dir,
            host=host,
            advertise=advertise,
        )

    def _node_info(self, name: str, advertise_data_address: str | None = None) -> ProcessInfo:
        placed = self.placement.place(name)
        host = placed.host
        if placed.own_network:
            admin_port, data_port = NODE_ADMIN_PORT, NODE_DATA_PORT
        else:
            # A fixed data port when something (a proxy) must know it before the node starts
            # and keep pointing at it across restarts; otherwise any free port.
            needs_port = self.advertise_node_data is not None and advertise_data_address is None
            admin_port, data_port = 0, free_port(host) if needs_port else 0
        bound_data = f"{host}:{data_port}"
        if advertise_data_address is None and self.advertise_node_data is not None:
            advertise_data_address = self.advertise_node_data(name, bound_data)
        argv = [
            self.python, "-m", "kvpool", "node",
            "--node-id", name,
            "--masters", ",".join(self.master_addresses),
            "--listen", f"{host}:{admin_port}",
            "--data-listen", bound_data,
            "--cpu-cache-size", self.cpu_cache_size,
            "--log-level", self.log_level,
            "--log-format", "json",
            "--ready-file", str(self.dir / f"{name}.ready"),
        ]  # fmt: skip
        if advertise_data_address:
            argv += ["--advertise-data-address", advertise_data_address]
        argv += [] if self.metrics else ["--metrics-port", "-1"]
        # ``{name}`` and ``{dir}`` in extra node flags become this node's name and the cluster
        # directory, so that e.g. every node gets its own SSD tier directory.
        argv += [
            flag.replace("{name}", name).replace("{dir}", str(self.dir))
            for flag in self.extra_node_flags
        ]
        return ProcessInfo(
            name=name,
            role="node",
            argv=self._command(name, argv),
            log=str(self.dir / f"{name}.log"),
            ready_file=str(self.dir / f"{name}.ready"),
            node_id=name,
            host=host,
            extra={"data_bound": bound_data} if data_port else {},
        )

    def _make_token(self) -> None:
        """A fresh cluster token when any process listens beyond loopback (kvpool refuses
        to, without one)."""
        names = [f"master-{i + 1}" for i in range(self.n_masters)]
        names += [f"node-{i + 1}" for i in range(self.n_nodes)]
        loopback = all(is_loopback_host(self.placement.place(n).host) for n in names)
        if self.want_token is False or (self.want_token is None and loopback):
            self.token_file = ""
            return
        path = self.dir / CLUSTER_TOKEN_FILE
        path.write_text(secrets.token_hex(32) + "\n")
        path.chmod(0o600)
        self.token_file = str(path)

    def start(self, timeout_s: float = 60.0) -> None:
        """Start every master, wait for a leader, start every node, wait until registered.
        On any failure everything started is stopped and ClusterError says why."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.secret = secrets.token_hex(16)
        secret_path = self.dir / SECRET_FILE
        secret_path.write_text(self.secret + "\n")
        secret_path.chmod(0o600)
        self._make_token()
        try:
            grpc_ports: list[int] = []
            raft: list[str] = []
            for i in range(self.n_masters):
                placed = self.placement.place(f"master-{i + 1}")
                grpc_port, raft_port = self._master_ports(placed)
                grpc_ports.append(grpc_port)
                raft.append(f"{placed.host}:{raft_port}")
            for i in range(self.n_masters):
                info = self._master_info(i, grpc_ports, raft)
                self.processes[info.name] = info
                self._spawn(info)
            deadline = time.monotonic() + timeout_s
            for info in self.masters:
                self._wait_ready(info, deadline)
            self.wait_for_leader(deadline - time.monotonic())
            for i in range(self.n_nodes):
                info = self._node_info(f"node-{i + 1}")
                self.processes[info.name] = info
                self._spawn(info)
            for info in self.nodes:
                self._wait_ready(info, deadline)
            self.write_cluster_file()
        except BaseException:
            self.stop()
            raise

    def add_node(
        self, *, advertise_data_address: str | None = None, timeout_s: float = 30.0
    ) -> ProcessInfo:
        """Start one more store node (``node-<n+1>``) and wait until it is registered.
        ``advertise_data_address`` (``tcp://host:port``, e.g. a proxy's) is what clients are
        told to dial instead of its bound data address."""
        name = f"node-{len(self.nodes) + 1}"
        info = self._node_info(name, advertise_data_address)
        self.processes[name] = info
        self._spawn(info)
        self._wait_ready(info, time.monotonic() + timeout_s)
        self.write_cluster_file()
        return info

    def _wait_ready(self, info: ProcessInfo, deadline: float) -> None:
        path = Path(info.ready_file)
        while time.monotonic() < deadline:
            if path.exists():
                try:
                    ready = json.loads(path.read_text())
                except ValueError:
                    time.sleep(0.05)
                    continue
                if ready.get("pid", info.pid) != info.pid:
                    raise ClusterError(
                        f"{info.name}: the kvpool process has pid {ready.get('pid')}, not the "
                        f"pid {info.pid} the launcher holds (does the argv prefix "
                        f"{info.argv[:4]} exec its command?)"
                    )
                if info.role == "master":
                    if not info.advertise:
                        info.grpc = ready.get("grpc", info.grpc)
                else:
                    info.grpc = ready.get("admin", "")
                    info.data = ready.get("data", "")
                    info.extra["member_id"] = ready.get("member_id", 0)
                if ready.get("metrics"):
                    info.extra["metrics"] = ready["metrics"]  # host:port of /metrics
                return
            proc = self._popen.get(info.name)
            if proc is not None and proc.poll() is not None:
                raise ClusterError(
                    f"{info.name} exited with code {proc.returncode} during start-up; "
                    f"last lines of {info.log}:\n{_tail(info.log)}"
                )
            time.sleep(0.05)
        raise ClusterError(
            f"{info.name} not ready in time; last lines of {info.log}:\n{_tail(info.log)}"
        )

    def wait_for_leader(self, timeout_s: float = 30.0) -> str:
        """The gRPC address of the leader, once one is elected and known to the masters."""
        deadline = time.monotonic() + max(timeout_s, 0.1)
        while True:
            leader = self.find_leader()
            if leader is not None:
                return leader
            if time.monotonic() > deadline:
                raise UnavailableError("no master leader elected in time")
            time.sleep(0.1)

    def find_leader(self, probe_timeout_s: float = 0.5) -> str | None:
        """The gRPC address of the master that says it leads (highest term), or None: one
        round of probes of the running, unpaused masters."""
        alive = [
            p.grpc for p in self.masters if self.is_running(p.name) and p.name not in self._paused
        ]
        probes = probe_masters(alive, timeout_s=probe_timeout_s, security=self.security)
        leader = leader_of(probes) if alive else None
        return leader.address if leader is not None else None

    def wait_caught_up(self, timeout_s: float = 30.0) -> bool:
        """Wait until every running master has applied as far as the leader has committed."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            running = [p.grpc for p in self.masters if self.is_running(p.name)]
            probes = probe_masters(running, timeout_s=0.5, security=self.security)
            statuses = [p.status.master for p in probes if p.status is not None]
            leaders = [m for m in statuses if m.role == "leader"]
            if (
                len(statuses) == len(running)
                and leaders
                and all(m.last_applied >= leaders[0].commit_index for m in statuses)
            ):
                return True
            time.sleep(0.1)
        return False

    # --- roles -----------------------------------------------------------------------------

    def name_of_master(self, address: str) -> str:
        for p in self.masters:
            if address in (p.grpc, p.advertise):
                return p.name
        raise ClusterError(f"{address} is not one of this cluster's masters")

    def leader_name(self, timeout_s: float = 30.0) -> str:
        return self.name_of_master(self.wait_for_leader(timeout_s))

    def follower_names(self, timeout_s: float = 30.0) -> list[str]:
        """The running masters that are not the leader (waits for a leader)."""
        leader = self.leader_name(timeout_s)
        return [p.name for p in self.masters if p.name != leader and self.is_running(p.name)]

    # --- faults and restarts ---------------------------------------------------------------

    def is_running(self, name: str) -> bool:
        proc = self._popen.get(name)
        if proc is not None:
            return proc.poll() is None
        info = self.processes.get(name)
        return info is not None and info.pid > 0 and pid_runs_kvpool(info.pid)

    def is_paused(self, name: str) -> bool:
        return name in self._paused and self.is_running(name)

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to one of our processes (kill -9 is ``signal.SIGKILL``)."""
        info = self.processes[name]
        if not self.is_running(name):
            return
        os.kill(info.pid, sig)
        if sig == signal.SIGKILL:
            self._paused.discard(name)
            self._reap(name, 10.0)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)

    def pause(self, name: str, timeout_s: float = 2.0) -> None:
        """SIGSTOP: the process is alive, holds its sockets and answers nothing. Returns once
        the kernel reports it stopped."""
        if not self.is_running(name):
            raise ClusterError(f"{name} is not running; cannot pause it")
        self.signal(name, signal.SIGSTOP)
        self._paused.add(name)
        self._wait_state(name, stopped=True, timeout_s=timeout_s)

    def resume(self, name: str, timeout_s: float = 2.0) -> None:
        """SIGCONT a paused process; returns once it runs again."""
        self._paused.discard(name)
        self.signal(name, signal.SIGCONT)
        self._wait_state(name, stopped=False, timeout_s=timeout_s)

    def _wait_state(self, name: str, *, stopped: bool, timeout_s: float) -> None:
        pid = self.processes[name].pid
        deadline = time.monotonic() + timeout_s
        while (process_state(pid) in ("T", "t")) != stopped:
            if not self.is_running(name):
                return
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{name} (pid {pid}) did not {'stop' if stopped else 'continue'} in time"
                )
            time.sleep(0.005)

    def terminate(self, name: str, timeout_s: float = 10.0) -> None:
        """SIGTERM one process and wait for it to exit (SIGKILL after ``timeout_s``)."""
        if not self.is_running(name):
            return
        info = self.processes[name]
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signal.SIGCONT)
            os.kill(info.pid, signal.SIGTERM)
        self._paused.discard(name)
        if not self._reap(name, timeout_s):
            self.kill(name)

    def restart(self, name: str, timeout_s: float = 30.0) -> None:
        """Start a stopped or killed process again with the same arguments and data."""
        info = self.processes[name]
        if self.is_running(name):
            raise ClusterError(f"{name} is still running")
        self._spawn(info)
        self._wait_ready(info, time.monotonic() + timeout_s)
        self.write_cluster_file()

    # --- stop ------------------------------------------------------------------------------

    def _reap(self, name: str, timeout_s: float, start_ticks: int | None = None) -> bool:
        """Wait until the process has exited (True) or ``timeout_s`` passed (False). A process
        we did not start (``cluster down`` of a detached cluster) counts as exited only once it
        is gone or a zombie — it holds its ports until then — or its pid belongs to another
        process (``start_ticks``: its start time when it was signalled)."""
        proc = self._popen.get(name)
        if proc is not None:
            try:
                proc.wait(timeout_s)
                return True
            except subprocess.TimeoutExpired:
                return False
        info = self.processes[name]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not same_process(info.pid, start_ticks):
                return True
            time.sleep(0.02)
        return not same_process(info.pid, start_ticks)

    def stop(self, timeout_s: float = 10.0) -> list[str]:
        """SIGTERM the nodes, then the masters; SIGKILL whatever is left after ``timeout_s``;
        return once every one has exited. Returns what was stopped. Only pids that still run
        a kvpool command are signalled."""
        stopped: list[str] = []
        order = [*self.nodes, *self.masters]
        for group in (self.nodes, self.masters):
            started: dict[str, int | None] = {}
            for info in group:
                if info.pid and self.is_running(info.name):
                    started[info.name] = process_start_ticks(info.pid)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(info.pid, signal.SIGCONT)  # a paused process cannot exit
                        os.kill(info.pid, signal.SIGTERM)
                    stopped.append(info.name)
            for info in group:
                if info.name not in started:
                    continue
                ticks = started[info.name]
                if not self._reap(info.name, timeout_s, ticks):
                    if self._popen.get(info.name) is not None or same_process(info.pid, ticks):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(info.pid, signal.SIGKILL)
                    self._reap(info.name, 5.0, ticks)
        self._paused.clear()
        for info in order:
            with contextlib.suppress(FileNotFoundError):
                Path(info.ready_file).unlink()
        return stopped

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_cluster(directory: str | Path, **kwargs: Any) -> Iterator[LocalCluster]:
    cluster = LocalCluster(directory, **kwargs)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
