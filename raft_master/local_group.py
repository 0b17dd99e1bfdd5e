"""A group of master processes on one host, for tests, benchmarks and local clusters.

Each master is a real subprocess (``python -m kvpool.raft_master.server --config-json …``) on
``127.0.0.1`` with free ports picked at start; its log goes to ``<base_dir>/master-<i>.log``.
:meth:`LocalMasterGroup.close` kills every process it started (by pid) and waits for it, so a
``with`` block or a fixture never leaks processes, even when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvpool.errors import KVPoolError
from kvpool.grpcutil import create_channel, unary
from kvpool.launcher.placement import free_port
from kvpool.proto.v1 import master_pb2, master_pb2_grpc


@dataclass
class MasterProc:
    index: int
    raft: str
    grpc: str
    data_dir: Path
    ready_file: Path
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class LocalMasterGroup:
    """``n`` masters forming one Raft group on loopback."""

    def __init__(
        self,
        base_dir: str | Path,
        n: int = 3,
        *,
        in_memory: bool = True,
        secret: str = "local-group-secret",  # noqa: S107 - loopback test groups only
        settings: dict[str, Any] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.base_dir = Path(base_dir)
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.in_memory = in_memory
        self.secret = secret
        self.settings = dict(settings or {})
        self.masters: list[MasterProc] = []
        for i in range(n):
            self.masters.append(
                MasterProc(
                    index=i,
                    raft=f"{host}:{free_port(host)}",
                    grpc=f"{host}:{free_port(host)}",
                    data_dir=self.base_dir / f"master-{i}",
                    ready_file=self.base_dir / f"master-{i}.ready.json",
                    log_path=self.base_dir / f"master-{i}.log",
                )
            )

    # --- lifecycle ---------------------------------------------------------------------------

    def config_for(self, m: MasterProc) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "listen": m.grpc,
            "raft_listen": m.raft,
            "raft_peers": [o.raft for o in self.masters if o is not m],
            "raft_secret": self.secret,
            "ready_file": str(m.ready_file),
            "log_format": "json",
            "log_level": "info",
            "metrics_port": -1,  # no extra ephemeral port: it could take a peer's picked one
        }
        if self.in_memory:
            cfg["in_memory"] = True
        else:
            cfg["data_dir"] = str(m.data_dir)
        cfg.update(self.settings)
        cfg.update(m.extra)
        return cfg

    def launch(self, i: int) -> MasterProc:
        """Start master ``i`` (not waiting for it to be ready)."""
        m = self.masters[i]
        if m.running():
            raise RuntimeError(f"master {i} is already running (pid {m.pid})")
        with contextlib.suppress(FileNotFoundError):
            m.ready_file.unlink()
        env = dict(os.environ)
        env["GRPC_ENABLE_FORK_SUPPORT"] = "false"
        env.pop("KVPOOL_RAFT_SECRET", None)
        argv = [
            sys.executable,
            "-m",
            "kvpool.raft_master.server",
            "--config-json",
            json.dumps(self.config_for(m)),
        ]
        with open(m.log_path, "ab") as log:
            m.popen = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        m.starts += 1
        return m

    def wait_ready_file(self, i: int, timeout_s: float = 30.0) -> dict[str, Any]:
        m = self.masters[i]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if m.popen is not None and m.popen.poll() is not None:
                raise RuntimeError(f"master {i} exited with {m.popen.returncode}:\n{m.log_tail()}")
            try:
                content: dict[str, Any] = json.loads(m.ready_file.read_text())
            except (OSError, ValueError):
                time.sleep(0.02)
                continue
            if content.get("pid") == m.pid:
                return content
            time.sleep(0.02)
        raise TimeoutError(f"master {i} not serving after {timeout_s}s:\n{m.log_tail()}")

    def start(self, timeout_s: float = 30.0) -> None:
        for i in range(len(self.masters)):
            self.launch(i)
        for i in range(len(self.masters)):
            self.wait_ready_file(i, timeout_s)

    def restart(self, i: int, timeout_s: float = 30.0) -> MasterProc:
        self.launch(i)
        self.wait_ready_file(i, timeout_s)
        return self.masters[i]

    def stop(self, i: int, timeout_s: float = 10.0) -> int | None:
        """SIGTERM master ``i`` and wait; SIGKILL when it does not exit in time."""
        m = self.masters[i]
        if m.popen is None:
            return None
        if m.popen.poll() is None:
            m.popen.send_signal(signal.SIGTERM)
            try:
                m.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                m.popen.kill()
                m.popen.wait(5)
        return m.popen.returncode

    def kill(self, i: int) -> None:
        """SIGKILL master ``i`` (a crash) and reap it."""
        m = self.masters[i]
        if m.popen is not None and m.popen.poll() is None:
            m.popen.kill()
            m.popen.wait(10)

    def pause(self, i: int) -> None:
        """SIGSTOP master ``i`` (a stalled process: it keeps its sockets, answers nothing)."""
        m = self.masters[i]
        if m.popen is not None and m.popen.poll() is None:
            m.popen.send_signal(signal.SIGSTOP)

    def resume(self, i: int) -> None:
        """SIGCONT master ``i``."""
        m = self.masters[i]
        if m.popen is not None and m.popen.poll() is None:
            m.popen.send_signal(signal.SIGCONT)

    def close(self) -> None:
        for m in self.masters:
            if m.popen is not None and m.popen.poll() is None:
                m.popen.kill()
        for m in self.masters:
            if m.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    m.popen.wait(10)

    def __enter__(self) -> LocalMasterGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- views ---------------------------------------------------------------------------------

    @property
    def grpc_addresses(self) -> list[str]:
        return [m.grpc for m in self.masters]

    def logs(self) -> str:
        return "\n".join(f"--- master {m.index} ---\n{m.log_tail()}" for m in self.masters)

    async def status(self, i: int, timeout_s: float = 1.0) -> master_pb2.ClusterStatusResponse:
        async with create_channel(self.masters[i].grpc) as channel:
            stub = master_pb2_grpc.MasterStub(channel)
            response: master_pb2.ClusterStatusResponse = await unary(
                stub.ClusterStatus,
                master_pb2.ClusterStatusRequest(),
                timeout_s=timeout_s,
                address=self.masters[i].grpc,
            )
            return response

    async def wait_leader(self, timeout_s: float = 15.0, *, exclude: tuple[int, ...] = ()) -> int:
        """Index of the master that reports itself leader, has announced its gRPC address and
        is ready (its first entry of the term applied)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for m in self.masters:
                if m.index in exclude or not m.running():
                    continue
                try:
                    st = await self.status(m.index, timeout_s=0.5)
                except KVPoolError:
                    continue
                if st.master.role == "leader" and st.master.ready and st.master.leader_grpc_address:
                    return m.index
            await asyncio.sleep(0.05)
        raise TimeoutError(f"no leader within {timeout_s}s:\n{self.logs()}")

    async def wait_joined(self, timeout_s: float = 15.0) -> int:
        """Index of the leader, once every running master names it by both its Raft and its
        gRPC address (a follower that has not heard from the leader, or has not yet applied
        the entry announcing its gRPC address, refuses reads without naming it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            leader = await self.wait_leader(max(0.1, deadline - time.monotonic()))
            expected = (self.masters[leader].raft, self.masters[leader].grpc)
            named = []
            for m in self.masters:
                if not m.running():
                    continue
                try:
                    st = (await self.status(m.index, 0.5)).master
                    named.append((st.leader_raft_address, st.leader_grpc_address))
                except KVPoolError:
                    named.append(("", ""))
            if all(n == expected for n in named):
                return leader
            await asyncio.sleep(0.05)
        raise TimeoutError(
            f"not every master joined the leader within {timeout_s}s:\n{self.logs()}"
        )
