"""A slow, lossy or corrupting TCP link: a small proxy of ours (this kernel has no ``tc netem``).

    python -m kvpool.chaos.proxy --listen HOST:PORT --target HOST:PORT --control FILE

It forwards both directions of every connection and applies, chunk by chunk, the behaviour
written in the control file (JSON, re-read every 100 ms; see :class:`LinkBehaviour`): a delay
plus seeded jitter (order kept), a bandwidth cap, a probability of resetting the connection, a
stall (nothing forwarded, connections held open: a black hole) and a probability of flipping one
byte (kvpool's checksums must turn that into a miss, never a wrong read). It writes what it did
to a stats file, including the version of the control file it applied, so a caller can wait
until a new behaviour is in force. It exits on SIGTERM, or when its parent is gone.

:class:`LinkProxy` starts, steers and stops one such process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvpool.config import split_hostport
from kvpool.errors import KVPoolError

CHUNK_BYTES = 64 * 1024
CONTROL_POLL_S = 0.1
APPLY_WAIT_S = 10.0
"""How long a caller waits for the proxy to report a new behaviour in force. It re-reads its
control file every 100 ms, but on two cores busy with a cluster under faults its loop has been
seen to take over 3 s (a `late-commit` run in CI): a fault applied late is still applied."""
QUEUE_CHUNKS = 64


class ProxyError(KVPoolError):
    """The link proxy could not be started, steered or stopped."""

    code = "CHAOS_PROXY"


@dataclass(frozen=True)
class LinkBehaviour:
    """What a link does to each chunk it forwards. All zero / False: a clean link."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0  # uniform in [0, jitter_ms), per chunk, seeded
    bandwidth_bytes_per_s: int = 0  # 0: unlimited; per direction of each connection
    reset_probability: float = 0.0  # per chunk: abort the connection (RST)
    stall: bool = False  # forward nothing, hold every connection open
    corrupt_probability: float = 0.0  # per chunk: flip one byte

    def problems(self) -> list[str]:
        errors = []
        for name in ("delay_ms", "jitter_ms", "bandwidth_bytes_per_s"):
            if getattr(self, name) < 0:
                errors.append(f"{name}: must not be negative")
        for name in ("reset_probability", "corrupt_probability"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                errors.append(f"{name}: must be within [0, 1]")
        return errors

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LinkBehaviour:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(doc) - set(known) - {"version"})
        if unknown:
            raise ProxyError(f"unknown link settings: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, raw in doc.items():
            if name == "version":
                continue
            if name == "stall":
                if not isinstance(raw, bool):
                    raise ProxyError("stall: expected true or false")
                values[name] = raw
            elif isinstance(raw, bool) or not isinstance(raw, int | float):
                raise ProxyError(f"{name}: expected a number, got {raw!r}")
            elif name == "bandwidth_bytes_per_s":
                values[name] = int(raw)
            else:
                values[name] = float(raw)
        behaviour = cls(**values)
        problems = behaviour.problems()
        if problems:
            raise ProxyError("invalid link behaviour: " + "; ".join(problems))
        return behaviour

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def clean(self) -> bool:
        return self == LinkBehaviour()


@dataclass(frozen=True)
class ChunkFate:
    delay_s: float
    reset: bool = False
    corrupt_at: int | None = None  # index of the byte to flip
    corrupt_mask: int = 0xFF


class LinkShaper:
    """Decides each chunk's fate from a seeded generator: one per direction of a connection,
    so a run's decisions do not depend on how the two directions interleave."""

    def __init__(self, seed: int, connection: int, direction: str) -> None:
        self._rng = random.Random(f"{seed}:{connection}:{direction}")

    def decide(self, behaviour: LinkBehaviour, size: int) -> ChunkFate:
        # Always draw the same numbers, whatever the behaviour: a change of one setting does
        # not shift the others' decisions.
        jitter, reset, corrupt, where, mask = (self._rng.random() for _ in range(5))
        delay_s = (behaviour.delay_ms + jitter * behaviour.jitter_ms) / 1000.0
        if reset < behaviour.reset_probability:
            return ChunkFate(delay_s, reset=True)
        if size > 0 and corrupt < behaviour.corrupt_probability:
            return ChunkFate(
                delay_s, corrupt_at=int(where * size), corrupt_mask=1 + int(mask * 255)
            )
        return ChunkFate(delay_s)


# --- the proxy process ------------------------------------------------------------------------


class _Connection:
    def __init__(self, number: int, client: asyncio.StreamWriter) -> None:
        self.number = number
        self.writers: list[asyncio.StreamWriter] = [client]

    def reset(self) -> None:
        """Abort both sides with an RST (SO_LINGER 0), not a polite FIN."""
        for writer in self.writers:
            sock = writer.get_extra_info("socket")
            with contextlib.suppress(OSError):
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()


class ProxyServer:
    def __init__(
        self,
        listen: tuple[str, int],
        target: tuple[str, int],
        control: Path,
        *,
        seed: int = 0,
        stats: Path | None = None,
    ) -> None:
        self.listen = listen
        self.target = target
        self.control = control
        self.seed = seed
        self.stats_path = stats
        self.behaviour = LinkBehaviour()
        self.version = 0
        self.counters = dict.fromkeys(
            ("connections", "active", "bytes_up", "bytes_down", "chunks", "corrupted", "resets"),
            0,
        )
        self._unstalled = asyncio.Event()
        self._unstalled.set()
        self._control_key: tuple[int, int, int] | None = None
        self._connections: dict[int, _Connection] = {}
        self._server: asyncio.Server | None = None
        self._stats_written = ""

    async def start(self) -> str:
        self._reload()
        self._server = await asyncio.start_server(self._handle, self.listen[0], self.listen[1])
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def run(self, stop: asyncio.Event, parent_pid: int = 0) -> None:
        while not stop.is_set():
            self._reload()
            self._write_stats()
            if parent_pid and os.getppid() != parent_pid:
                break  # the harness is gone: so are we
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), CONTROL_POLL_S)
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections.values()):
            conn.reset()
        self._write_stats()

    def _reload(self) -> None:
        try:
            st = self.control.stat()
        except FileNotFoundError:
            return
        key = (st.st_ino, st.st_mtime_ns, st.st_size)  # replaced whole: a new inode each time
        if key == self._control_key:
            return
        self._control_key = key
        try:
            doc = json.loads(self.control.read_text())
            behaviour = LinkBehaviour.from_dict(doc)
        except (OSError, ValueError, KVPoolError) as e:
            print(f"kvpool proxy: ignoring control file {self.control}: {e}", file=sys.stderr)
            return
        self.behaviour = behaviour
        self.version = int(doc.get("version", 0))
        if behaviour.stall:
            self._unstalled.clear()
        else:
            self._unstalled.set()

    def _write_stats(self) -> None:
        if self.stats_path is None:
            return
        doc = json.dumps({"applied_version": self.version, **self.counters}, sort_keys=True)
        if doc == self._stats_written:
            return
        tmp = self.stats_path.with_suffix(".tmp")
        tmp.write_text(doc + "\n")
        tmp.replace(self.stats_path)
        self._stats_written = doc

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.counters["connections"]
        self.counters["connections"] += 1
        conn = _Connection(number, writer)
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.target), timeout=5.0
            )
        except (OSError, TimeoutError):
            conn.reset()
            return
        conn.writers.append(up_writer)
        self._connections[number] = conn
        self.counters["active"] += 1
        try:
            await asyncio.gather(
                self._pump(conn, reader, up_writer, "up"),
                self._pump(conn, up_reader, writer, "down"),
            )
        finally:
            self.counters["active"] -= 1
            del self._connections[number]
            for w in conn.writers:
                w.close()

    async def _pump(
        self,
        conn: _Connection,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        direction: str,
    ) -> None:
        shaper = LinkShaper(self.seed, conn.number, direction)
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(QUEUE_CHUNKS)
        deliver = asyncio.create_task(self._deliver(queue, dst, direction))
        loop = asyncio.get_running_loop()
        last_due = 0.0
        try:
            while True:
                await self._unstalled.wait()
                try:
                    data = await src.read(CHUNK_BYTES)
                except OSError:
                    conn.reset()
                    return
                if not data:
                    await queue.put(None)
                    await deliver
                    return
                fate = shaper.decide(self.behaviour, len(data))
                self.counters["chunks"] += 1
                if fate.reset:
                    self.counters["resets"] += 1
                    conn.reset()
                    return
                if fate.corrupt_at is not None:
                    flipped = bytearray(data)
                    flipped[fate.corrupt_at] ^= fate.corrupt_mask
                    data = bytes(flipped)
                    self.counters["corrupted"] += 1
                last_due = max(last_due, loop.time() + fate.delay_s)  # keep the byte order
                await queue.put((last_due, data))
        finally:
            if not deliver.done():
                deliver.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await deliver

    async def _deliver(
        self,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        dst: asyncio.StreamWriter,
        direction: str,
    ) -> None:
        loop = asyncio.get_running_loop()
        free_at = 0.0  # bandwidth: when the link is free to send the next chunk
        while True:
            item = await queue.get()
            if item is None:
                with contextlib.suppress(OSError):
                    if dst.can_write_eof():
                        dst.write_eof()
                return
            due, data = item
            await self._unstalled.wait()
            bandwidth = self.behaviour.bandwidth_bytes_per_s
            if bandwidth > 0:
                free_at = max(free_at, loop.time()) + len(data) / bandwidth
                due = max(due, free_at)
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            await self._unstalled.wait()  # a stall that began while this chunk waited
            try:
                dst.write(data)
                await dst.drain()
            except OSError:
                return
            self.counters["bytes_" + direction] += len(data)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc) + "\n")
    tmp.replace(path)


async def _serve(args: argparse.Namespace) -> int:
    listen = split_hostport(args.listen)
    target = split_hostport(args.target)
    server = ProxyServer(
        listen,
        target,
        Path(args.control),
        seed=args.seed,
        stats=Path(args.stats) if args.stats else None,
    )
    try:
        address = await server.start()
    except OSError as e:
        print(f"kvpool proxy: cannot listen on {args.listen}: {e}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.ready_file:
        _write_json(Path(args.ready_file), {"pid": os.getpid(), "listen": address})
    await server.run(stop, parent_pid=args.parent_pid)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool.chaos.proxy", description=__doc__)
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept on (port 0: any)")
    parser.add_argument("--target", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--control", required=True, help="JSON file with the link behaviour")
    parser.add_argument("--seed", type=int, default=0, help="seed of jitter, resets, flips")
    parser.add_argument("--stats", default="", help="JSON file the proxy reports counters to")
    parser.add_argument("--ready-file", default="", help="JSON file written once listening")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this parent dies")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(_serve(args))
    except ValueError as e:
        print(f"kvpool proxy: {e}", file=sys.stderr)
        return 2


# --- the handle the harness holds ---------------------------------------------------------------


class LinkProxy:
    """One proxy process: ``listen_host`` (port picked by the proxy) → ``target``."""

    def __init__(
        self,
        name: str,
        *,
        listen_host: str,
        target: str,
        directory: str | Path,
        seed: int = 0,
        python: str = sys.executable,
    ) -> None:
        self.name = name
        self.listen_host = listen_host
        self.target = target
        self.dir = Path(directory).resolve()
        self.seed = seed
        self.python = python
        self.address = ""
        self.pid = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._behaviour = LinkBehaviour()
        self._version = 0

    @property
    def control_file(self) -> Path:
        return self.dir / f"{self.name}.control.json"

    @property
    def stats_file(self) -> Path:
        return self.dir / f"{self.name}.stats.json"

    @property
    def ready_file(self) -> Path:
        return self.dir / f"{self.name}.ready"

    @property
    def behaviour(self) -> LinkBehaviour:
        return self._behaviour

    def start(self, timeout_s: float = 15.0) -> LinkProxy:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_control(LinkBehaviour())
        with contextlib.suppress(FileNotFoundError):
            self.ready_file.unlink()
        argv = [
            self.python, "-m", "kvpool.chaos.proxy",
            "--listen", f"{self.listen_host}:0",
            "--target", self.target,
            "--control", str(self.control_file),
            "--stats", str(self.stats_file),
            "--ready-file", str(self.ready_file),
            "--seed", str(self.seed),
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        with open(self.dir / f"{self.name}.log", "ab") as log:
            self._proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        self.pid = self._proc.pid
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ProxyError(f"proxy {self.name} exited with code {self._proc.returncode}")
            with contextlib.suppress(OSError, ValueError):
                self.address = json.loads(self.ready_file.read_text())["listen"]
                return self
            time.sleep(0.02)
        self.stop()
        raise ProxyError(f"proxy {self.name} did not start in {timeout_s} s")

    def set(self, behaviour: LinkBehaviour, *, wait_s: float = APPLY_WAIT_S) -> None:
        """Apply ``behaviour``; returns once the proxy reports it in force (or raises), or at
        once with ``wait_s=0``."""
        problems = behaviour.problems()
        if problems:
            raise ProxyError("invalid link behaviour: " + "; ".join(problems))
        version = self._write_control(behaviour)
        if wait_s <= 0:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.stats().get("applied_version", -1) >= version:
                return
            if not self.is_running():
                raise ProxyError(f"proxy {self.name} is not running")
            time.sleep(0.02)
        raise ProxyError(f"proxy {self.name} did not apply its new behaviour in {wait_s} s")

    def heal(self) -> None:
        self.set(LinkBehaviour())

    def stats(self) -> dict[str, int]:
        """The proxy's counters (``connections``, ``active``, ``bytes_up``, ``bytes_down``,
        ``chunks``, ``corrupted``, ``resets``, ``applied_version``), as of its last report
        (every 100 ms)."""
        try:
            doc = json.loads(self.stats_file.read_text())
        except (OSError, ValueError):
            return {}
        return {k: int(v) for k, v in doc.items()}

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)

    def _write_control(self, behaviour: LinkBehaviour) -> int:
        self._version += 1
        tmp = self.control_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": self._version, **behaviour.to_dict()}) + "\n")
        tmp.replace(self.control_file)
        self._behaviour = behaviour
        return self._version


if __name__ == "__main__":
    sys.exit(main())
