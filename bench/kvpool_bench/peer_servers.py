"""The servers ``kvpool-bench peers`` measures, started for the run and stopped after it, each
by the pid it started (never by name):

* kvpool — a :class:`~kvpool.launcher.cluster.LocalCluster` (masters + store nodes);
* Redis — Debian's ``redis-server`` on 127.0.0.1 with a free port, persistence off;
* Mooncake Store — the ``mooncake_master`` binary from the ``mooncake-transfer-engine-non-cuda``
  wheel on 127.0.0.1, and one store process contributing a segment
  (:mod:`kvpool_bench.mooncake_store`).

A peer that is not installed is skipped with a line saying how to install it
(:func:`redis_availability`, :func:`mooncake_availability`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvpool.launcher.cluster import LocalCluster
from kvpool.launcher.placement import free_port
from kvpool.units import parse_size

INSTALL_PEERS = "pip install -e 'bench[peers]'"  # in a kvpool checkout
INSTALL_REDIS = f"apt-get install redis-server && {INSTALL_PEERS}"
INSTALL_MOONCAKE = f"apt-get install libibverbs1 && {INSTALL_PEERS}"
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Availability:
    """Whether a peer can run here; if not, why, and the command that installs it."""

    ok: bool
    reason: str = ""
    install: str = ""


def redis_availability() -> Availability:
    if shutil.which("redis-server") is None:
        return Availability(False, "redis-server is not installed", INSTALL_REDIS)
    if importlib.util.find_spec("redis") is None:
        return Availability(False, "the Python package redis is not installed", INSTALL_PEERS)
    return Availability(True)


def _mooncake_dir() -> Path | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def mooncake_availability(timeout_s: float = 60.0) -> Availability:
    """Installed, its master binary present, and ``import mooncake.store`` works — tried in a
    child process, since a missing system library (libibverbs1) fails at import."""
    package = _mooncake_dir()
    if package is None:
        return Availability(
            False,
            "the Python package mooncake-transfer-engine-non-cuda is not installed",
            INSTALL_MOONCAKE,
        )
    if not os.access(package / "mooncake_master", os.X_OK):
        return Availability(False, f"no executable mooncake_master in {package}", INSTALL_PEERS)
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if probe.returncode != 0:
        lines = [ln for ln in probe.stderr.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit code {probe.returncode}"
        install = "apt-get install libibverbs1" if "ibverbs" in last else INSTALL_MOONCAKE
        return Availability(False, f"import mooncake.store failed: {last}", install)
    return Availability(True)


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s:.0f}s")


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM the process we started, SIGKILL it if it does not go."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(STOP_TIMEOUT_S)


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


class KvpoolServers:
    """A local kvpool cluster for the run."""

    def __init__(
        self,
        directory: Path,
        *,
        masters: int,
        nodes: int,
        cpu_cache_size: str,
        in_memory: bool,
    ) -> None:
        self.cluster = LocalCluster(
            directory,
            masters=masters,
            nodes=nodes,
            cpu_cache_size=cpu_cache_size,
            in_memory=in_memory,
            log_level="warning",
        )
        self.info = {
            "masters": masters,
            "nodes": nodes,
            "cpu_cache_size": cpu_cache_size,
            "index": "in memory" if in_memory else "journal on disk (no fsync)",
        }

    def start(self) -> None:
        self.cluster.start()
        wait_prefaulted(self.cluster)

    @property
    def masters(self) -> list[str]:
        return self.cluster.client_master_addresses

    def stop(self) -> None:
        self.cluster.stop()


def wait_prefaulted(cluster: LocalCluster, timeout_s: float = 120.0) -> bool:
    """Wait until every node has faulted its CPU tier in: a node does that on a thread at start
    (``cpu_tier_prefault``), which competes for the CPUs with what is measured (2 GiB took
    ~1.9 s on a 2-core VM). Read from each node's shared memory in ``/proc`` (``RssShmem``
    reaching the tier's size), which does not depend on the log level. False, with a line on
    stderr, if a node has not by ``timeout_s``."""
    want = parse_size(cluster.cpu_cache_size)
    deadline = time.monotonic() + timeout_s
    pending = [n for n in cluster.nodes if n.pid]
    while pending:
        pending = [n for n in pending if _shared_rss(n.pid) < want]
        if not pending:
            return True
        if time.monotonic() >= deadline:
            names = ", ".join(n.name for n in pending)
            print(f"kvpool-bench: {names} still prefaulting after {timeout_s:.0f} s",
                  file=sys.stderr)  # fmt: skip
            return False
        time.sleep(0.1)
    return True


def _shared_rss(pid: int) -> int:
    """The process's resident shared memory in bytes; unbounded where /proc cannot say (gone,
    or not Linux): then nothing is waited for."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 1 << 62


class RedisServer:
    """``redis-server`` on 127.0.0.1, a free port, no RDB snapshots, no AOF."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.info: dict[str, Any] = {}

    def start(self, timeout_s: float = 15.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        version = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, check=False, timeout=10
        ).stdout.strip()
        self.port = free_port()
        argv = [
            binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--daemonize", "no",
            "--logfile", "",
        ]  # fmt: skip
        self._log = (self.dir / "redis.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        _wait_port(self.port, self.proc, timeout_s, "redis-server")
        redis: Any = importlib.import_module("redis")
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout_s)
        try:
            client.ping()
        finally:
            client.close()
        self.info = {"server": version.split(" sha=")[0], "persistence": "off (no RDB, no AOF)"}

    def stop(self) -> None:
        _stop(self.proc)
        if self._log is not None:
            self._log.close()


class MooncakeServers:
    """``mooncake_master`` plus one store process contributing ``segment_bytes``."""

    def __init__(self, directory: Path, *, segment_bytes: int) -> None:
        self.dir = directory
        self.segment_bytes = segment_bytes
        self.port = 0
        self.master: subprocess.Popen[bytes] | None = None
        self.store: subprocess.Popen[bytes] | None = None
        self._logs: list[IO[bytes]] = []
        self.info: dict[str, Any] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        package = _mooncake_dir()
        if package is None:
            raise RuntimeError("mooncake is not installed")
        self.port = free_port()
        argv = [
            str(package / "mooncake_master"),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={free_port()}",
            "--enable_metric_reporting=false",
        ]
        master_log = self.dir / "mooncake-master.log"
        self._logs.append(master_log.open("ab"))
        self.master = subprocess.Popen(argv, stdout=self._logs[-1], stderr=subprocess.STDOUT)
        try:
            _wait_port(self.port, self.master, 15.0, "mooncake_master")
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {_tail(master_log)}") from None
        ready = self.dir / "mooncake-store.ready"
        store_log = self.dir / "mooncake-store.log"
        self._logs.append(store_log.open("ab"))
        self.store = subprocess.Popen(
            [
                sys.executable, "-m", "kvpool_bench.mooncake_store",
                "--master", self.address,
                "--segment-bytes", str(self.segment_bytes),
                "--ready-file", str(ready),
            ],
            stdout=self._logs[-1],
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.store.poll() is not None:
                raise RuntimeError(
                    f"the Mooncake store process exited with code {self.store.returncode}: "
                    f"{_tail(store_log)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Mooncake store was not ready within {timeout_s:.0f}s")
            time.sleep(0.05)
        json.loads(ready.read_text())
        version = "?"
        try:
            from importlib.metadata import version as dist_version

            version = dist_version("mooncake-transfer-engine-non-cuda")
        except Exception:  # noqa: S110 - another Mooncake wheel; the version is informative
            pass
        self.info = {
            "package": f"mooncake-transfer-engine-non-cuda {version}",
            "master": "mooncake_master on 127.0.0.1 (no HA, metadata over P2PHANDSHAKE)",
            "store": f"one store process contributing a {self.segment_bytes >> 20} MiB segment",
            "protocol": "tcp",
            "MC_STORE_MEMCPY": os.environ.get("MC_STORE_MEMCPY", "(unset: Mooncake's default)"),
        }

    def stop(self) -> None:
        _stop(self.store)
        _stop(self.master)
        for log in self._logs:
            log.close()
