"""A whole kvpool cluster on this host: ``kvpool cluster up`` / ``down``, the demo and the tests.

Every process is a real ``python -m kvpool master|node`` child in its own process session
(so a Ctrl-C in the terminal reaches the launcher, which then stops them in order). The launcher
writes ``DIR/cluster.json`` with each process's role, addresses, pid and log file; ``down`` (or
:meth:`LocalCluster.stop`) stops only those pids, and only when the pid still runs a kvpool
command (a pid reused by another program is left alone).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpool.errors import KVPoolError, UnavailableError
from kvpool.launcher.probe import leader_of, probe_masters

CLUSTER_FILE = "cluster.json"
SECRET_FILE = "raft.secret"  # noqa: S105 - a file name, not a secret


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
    grpc: str = ""  # masters: gRPC address; nodes: admin gRPC address
    raft: str = ""  # masters only
    data: str = ""  # nodes only: data-plane address
    data_dir: str = ""  # masters only, unless in memory
    node_id: str = ""  # nodes only
    extra: dict[str, Any] = field(default_factory=dict)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pid_runs_kvpool(pid: int) -> bool:
    """True when ``pid`` is alive and its command line is a kvpool process."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if not cmdline:  # a zombie
        return False
    return b"kvpool" in cmdline


def _tail(path: str, lines: int = 20) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class LocalCluster:
    """Masters and store nodes as child processes on 127.0.0.1, in ``directory``."""

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
    ) -> None:
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
        self.secret = ""
        self.processes: dict[str, ProcessInfo] = {}
        self._popen: dict[str, subprocess.Popen[bytes]] = {}

    # --- description ---------------------------------------------------------------------

    @property
    def master_addresses(self) -> list[str]:
        return [p.grpc for p in self.processes.values() if p.role == "master"]

    @property
    def masters(self) -> list[ProcessInfo]:
        return [p for p in self.processes.values() if p.role == "master"]

    @property
    def nodes(self) -> list[ProcessInfo]:
        return [p for p in self.processes.values() if p.role == "node"]

    def to_json(self) -> dict[str, Any]:
        return {
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "masters": self.master_addresses,
            "secret_file": str(self.dir / SECRET_FILE),
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
        return cluster

    # --- start ---------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KVPOOL_RAFT_SECRET"] = self.secret
        env.setdefault("PYTHONUNBUFFERED", "1")
        # grpc reads this at import: no fork handlers when PySyncObj forks to write snapshots.
        env.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
        return env

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
                env=self._env(),
                start_new_session=True,
                cwd=self.dir,
            )
        finally:
            log.close()
        info.pid = proc.pid
        self._popen[info.name] = proc

    def _master_info(self, i: int, raft_ports: list[int]) -> ProcessInfo:
        name = f"master-{i + 1}"
        raft = f"127.0.0.1:{raft_ports[i]}"
        peers = [f"127.0.0.1:{p}" for j, p in enumerate(raft_ports) if j != i]
        data_dir = "" if self.in_memory else str(self.dir / name)
        grpc_port = free_port()
        argv = [
            self.python, "-m", "kvpool", "master",
            "--listen", f"127.0.0.1:{grpc_port}",
            "--raft-listen", raft,
            "--raft-peers", ",".join(peers),
            "--node-timeout-s", str(self.node_timeout_s),
            "--heartbeat-interval-s", str(self.heartbeat_interval_s),
            "--log-level", self.log_level,
            "--log-format", "json",
            "--ready-file", str(self.dir / f"{name}.ready"),
        ]  # fmt: skip
        argv += ["--in-memory"] if self.in_memory else ["--data-dir", data_dir]
        argv += self.extra_master_flags
        return ProcessInfo(
            name=name,
            role="master",
            argv=argv,
            log=str(self.dir / f"{name}.log"),
            ready_file=str(self.dir / f"{name}.ready"),
            grpc=f"127.0.0.1:{grpc_port}",
            raft=raft,
            data_dir=data_dir,
        )

    def _node_info(self, i: int) -> ProcessInfo:
        name = f"node-{i + 1}"
        argv = [
            self.python, "-m", "kvpool", "node",
            "--node-id", name,
            "--masters", ",".join(self.master_addresses),
            "--listen", "127.0.0.1:0",
            "--data-listen", "127.0.0.1:0",
            "--cpu-cache-size", self.cpu_cache_size,
            "--log-level", self.log_level,
            "--log-format", "json",
            "--ready-file", str(self.dir / f"{name}.ready"),
            *self.extra_node_flags,
        ]  # fmt: skip
        return ProcessInfo(
            name=name,
            role="node",
            argv=argv,
            log=str(self.dir / f"{name}.log"),
            ready_file=str(self.dir / f"{name}.ready"),
            node_id=name,
        )

    def start(self, timeout_s: float = 60.0) -> None:
        """Start every master, wait for a leader, start every node, wait until registered.
        On any failure everything started is stopped and ClusterError says why."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.secret = secrets.token_hex(16)
        secret_path = self.dir / SECRET_FILE
        secret_path.write_text(self.secret + "\n")
        secret_path.chmod(0o600)
        raft_ports = [free_port() for _ in range(self.n_masters)]
        try:
            for i in range(self.n_masters):
                info = self._master_info(i, raft_ports)
                self.processes[info.name] = info
                self._spawn(info)
            deadline = time.monotonic() + timeout_s
            for info in self.masters:
                self._wait_ready(info, deadline)
            self.wait_for_leader(deadline - time.monotonic())
            for i in range(self.n_nodes):
                info = self._node_info(i)
                self.processes[info.name] = info
                self._spawn(info)
            for info in self.nodes:
                self._wait_ready(info, deadline)
            self.write_cluster_file()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, info: ProcessInfo, deadline: float) -> None:
        path = Path(info.ready_file)
        while time.monotonic() < deadline:
            if path.exists():
                try:
                    ready = json.loads(path.read_text())
                except ValueError:
                    time.sleep(0.05)
                    continue
                if info.role == "master":
                    info.grpc = ready.get("grpc", info.grpc)
                else:
                    info.grpc = ready.get("admin", "")
                    info.data = ready.get("data", "")
                    info.extra["member_id"] = ready.get("member_id", 0)
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
            alive = [p.grpc for p in self.masters if self.is_running(p.name)]
            leader = leader_of(probe_masters(alive, timeout_s=0.5)) if alive else None
            if leader is not None:
                return leader.address
            if time.monotonic() > deadline:
                raise UnavailableError("no master leader elected in time")
            time.sleep(0.1)

    # --- faults and restarts ---------------------------------------------------------------

    def is_running(self, name: str) -> bool:
        proc = self._popen.get(name)
        if proc is not None:
            return proc.poll() is None
        info = self.processes.get(name)
        return info is not None and info.pid > 0 and pid_runs_kvpool(info.pid)

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to one of our processes (kill -9 is ``signal.SIGKILL``)."""
        info = self.processes[name]
        if not self.is_running(name):
            return
        os.kill(info.pid, sig)
        if sig == signal.SIGKILL:
            self._reap(name, 10.0)

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)

    def terminate(self, name: str, timeout_s: float = 10.0) -> None:
        """SIGTERM one process and wait for it to exit (SIGKILL after ``timeout_s``)."""
        if not self.is_running(name):
            return
        info = self.processes[name]
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signal.SIGCONT)
            os.kill(info.pid, signal.SIGTERM)
        if not self._reap(name, timeout_s):
            self.kill(name)

    def leader_name(self, timeout_s: float = 30.0) -> str:
        address = self.wait_for_leader(timeout_s)
        for p in self.masters:
            if p.grpc == address:
                return p.name
        raise ClusterError(f"leader {address} is not one of this cluster's masters")

    def restart(self, name: str, timeout_s: float = 30.0) -> None:
        """Start a stopped or killed process again with the same arguments and data."""
        info = self.processes[name]
        if self.is_running(name):
            raise ClusterError(f"{name} is still running")
        self._spawn(info)
        self._wait_ready(info, time.monotonic() + timeout_s)
        self.write_cluster_file()

    # --- stop ------------------------------------------------------------------------------

    def _reap(self, name: str, timeout_s: float) -> bool:
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
            if not pid_runs_kvpool(info.pid):
                return True
            time.sleep(0.05)
        return False

    def stop(self, timeout_s: float = 10.0) -> list[str]:
        """SIGTERM the nodes, then the masters; SIGKILL whatever is left after ``timeout_s``.
        Returns what was stopped. Only pids that still run a kvpool command are signalled."""
        stopped: list[str] = []
        order = [*self.nodes, *self.masters]
        for group in (self.nodes, self.masters):
            for info in group:
                if info.pid and self.is_running(info.name):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(info.pid, signal.SIGCONT)  # a paused process cannot exit
                        os.kill(info.pid, signal.SIGTERM)
                    stopped.append(info.name)
            for info in group:
                if info.name in stopped and not self._reap(info.name, timeout_s):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(info.pid, signal.SIGKILL)
                    self._reap(info.name, 5.0)
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
