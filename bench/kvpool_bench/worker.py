"""The benchmark client processes of ``kvpool-bench peers``: :func:`worker_main` runs in each,
:class:`WorkerPool` starts and drives them from the orchestrator.

The orchestrator starts two of these (``multiprocessing``, spawned) and sends them
commands over a pipe; each holds one client of every measured system, a source arena and a
destination arena (numpy, registered with Mooncake once), and answers with raw samples. All
deciding — what to run, medians, ratios — happens in the orchestrator.

A *cell* is one system at one block size in one mode (single-key, batched or first-read; the
hand-off and engine cells are in :mod:`kvpool_bench.pair_cells`, over :attr:`Worker.link`). A
single-key or batched cell runs a few passes; each pass:

1. stamps every value's first 16 bytes with (cell, pass, worker, slot), so that no two keys
   ever hold the same bytes and a stale or misplaced block cannot pass for the right one;
2. puts the keys (timed), then poisons the destination arena;
3. gets the keys (timed) — into the destination arena where the API allows;
4. compares every byte read with what was put (untimed), counting misses and wrong blocks;
5. removes the keys (untimed), so that no store fills up and evicts during the run.

With two workers, both pass through a shared barrier before each timed loop, so that their
loops overlap and the orchestrator can time them as one.

A *first-read* cell always involves both workers: a writer puts its keys, and the other worker
— whose client has never seen those keys, so whatever it caches (kvpool's index entries) is
cold — reads each block exactly once, one key per call, as a decode engine reads what a prefill
engine put. The message names each worker's part: ``write`` (put this worker's own keys) and
``read_from`` (the index of the worker whose keys to read, or None). With one client, worker 0
writes and worker 1 reads; with two, each writes its own keys and reads the other's, both
readers together. Per pass, the workers meet at three barriers: before the puts, after every
put has returned (the keys are acknowledged; only then does a read start), and after every
read (only then does the writer remove its keys).

How the reader checks the writer's bytes without being sent them: every worker's source arena
is drawn from a seeded generator (``seed + worker index``), so a reader draws the writer's
arena too (:meth:`Worker.arena_of`, once, on its first first-read cell), stamps the slots with
the writer's (cell, pass, writer, slot) exactly as the writer did, and compares every byte it
read with that copy. Every stamp is undone after its pass (:func:`stamped`), so between passes
both arenas are exactly as drawn, whatever cells ran before. Nothing but the cell's message
crosses between the workers, and a block from another key, pass, cell or writer differs at
least in its stamp.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import struct
import sys
import traceback
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.gctune import freeze_after_slow_collections
from kvpool_bench.drivers import (
    Array,
    Driver,
    MooncakeDriver,
    PassResult,
    RedisDriver,
    make_kvpool_driver,
)
from kvpool_bench.machine import TcpSink, memcpy_gbps, tcp_send_gbps

POISON = 0x5A
STAMP = struct.Struct("<IIII")
BARRIER_TIMEOUT_S = 300.0
CELL_TIMEOUT_S = 600.0


def _redirect_output(log_path: str) -> None:
    """Send this process's stdout and stderr (C libraries' too: Mooncake logs through glog)
    to ``log_path``; the orchestrator's terminal stays readable."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def bytes_like(value: object) -> bytes | bytearray | memoryview:
    if isinstance(value, bytes | bytearray | memoryview):
        return value
    raise TypeError(f"a get returned {type(value).__name__}, not bytes")


@contextlib.contextmanager
def stamped(blocks: Sequence[Array], uid: int, pass_no: int, writer: int) -> Iterator[None]:
    """Each block's first 16 bytes hold (cell, pass, writer, slot) inside the block, and what
    they held before afterwards: between passes an arena is exactly as it was drawn, so that a
    reader's copy of a writer's arena matches whatever cells either ran before."""
    saved = [block[: STAMP.size].copy() for block in blocks]
    for j, block in enumerate(blocks):
        block[: STAMP.size] = np.frombuffer(STAMP.pack(uid, pass_no, writer, j), np.uint8)
    try:
        yield
    finally:
        for block, old in zip(blocks, saved, strict=True):
            block[: STAMP.size] = old


def slots(arena: Array, size_bytes: int, count: int) -> list[Array]:
    return [arena[j * size_bytes : (j + 1) * size_bytes] for j in range(count)]


def _new_put() -> dict[str, Any]:
    return {"passes": [], "durations_us": [], "failures": 0, "errors": []}


def _new_get() -> dict[str, Any]:
    return {
        "passes": [],
        "durations_us": [],
        "misses": 0,
        "wrong": 0,
        "bytes_read": 0,
        "bytes_verified": 0,
        "errors": [],
    }


def verify(
    got: Sequence[object], srcs: Sequence[Array], size_bytes: int, out: dict[str, Any]
) -> None:
    """Count misses, wrong blocks, bytes read and bytes verified (equal to what was put)."""
    for res, src in zip(got, srcs, strict=True):
        if res is None:
            out["misses"] += 1
            continue
        arr = res if isinstance(res, np.ndarray) else np.frombuffer(bytes_like(res), np.uint8)
        out["bytes_read"] += int(arr.nbytes)
        if arr.nbytes == size_bytes and np.array_equal(arr, src):
            out["bytes_verified"] += size_bytes
        else:
            out["wrong"] += 1


class Worker:
    def __init__(self, index: int, barrier: Any, link: Connection | None = None) -> None:
        self.index = index
        self.barrier = barrier
        self.link = link
        """This worker's end of the pipe to the other worker (hand-off cells)."""
        self.drivers: dict[str, Driver] = {}
        self.src: Array = np.zeros(0, dtype=np.uint8)
        self.dst: Array = np.zeros(0, dtype=np.uint8)
        self.seed = 0
        self._peer_arenas: dict[int, Array] = {}
        self.sink: TcpSink | None = None

    # --- commands ------------------------------------------------------------------------

    def handle(self, msg: dict[str, Any]) -> Any:
        cmd = msg["cmd"]
        if cmd == "setup":
            return self.setup(msg)
        if cmd == "cell":
            return self.cell(msg)
        if cmd == "memcpy":
            return memcpy_gbps(int(msg["size_bytes"]), int(msg["repeats"]))
        if cmd == "tcp_listen":
            self.sink = TcpSink()
            return {"port": self.sink.port}
        if cmd == "tcp_recv":
            assert self.sink is not None, "tcp_listen first"
            try:
                return self.sink.receive(int(msg["bytes"]))
            finally:
                self.sink.close()
                self.sink = None
        if cmd == "tcp_send":
            return tcp_send_gbps(int(msg["port"]), int(msg["bytes"]))
        raise ValueError(f"unknown command {cmd!r}")

    def setup(self, msg: dict[str, Any]) -> dict[str, Any]:
        arena = int(msg["arena_bytes"])
        self.seed = int(msg["seed"])
        self._peer_arenas.clear()
        self.src = self._draw_arena(self.index, arena)
        self.dst = np.full(arena, POISON, dtype=np.uint8)
        out: dict[str, Any] = {}
        for spec in msg["systems"]:
            name = spec["system"]
            try:
                self.drivers[name] = self._driver(spec)
                out[name] = {"api": self.drivers[name].api}
            except Exception as e:
                out[name] = {"error": f"{type(e).__name__}: {e}"}
        return out

    def _draw_arena(self, worker: int, arena_bytes: int) -> Array:
        rng = np.random.default_rng(self.seed + worker)
        return rng.integers(0, 256, arena_bytes, dtype=np.uint8)

    def arena_of(self, worker: int) -> Array:
        """Worker ``worker``'s source arena as it was drawn (stamps aside): this worker's own,
        or a copy drawn from the same seed (kept for the next cells)."""
        if worker == self.index:
            return self.src
        if worker not in self._peer_arenas:
            self._peer_arenas[worker] = self._draw_arena(worker, self.src.nbytes)
        return self._peer_arenas[worker]

    def _driver(self, spec: dict[str, Any]) -> Driver:
        kind = spec["kind"]
        if kind == "kvpool":
            return make_kvpool_driver(
                spec["masters"],
                transport=spec.get("transport"),
                timeout_s=float(spec["timeout_s"]),
                api=spec.get("api", "sync"),
                busy_poll_us=int(spec.get("busy_poll_us", 0)),
            )
        if kind == "redis":
            return RedisDriver(spec["host"], int(spec["port"]), timeout_s=float(spec["timeout_s"]))
        if kind == "mooncake":
            return MooncakeDriver(spec["master"], [self.src, self.dst])
        raise ValueError(f"unknown system kind {kind!r}")

    def _sync(self, together: bool) -> None:
        if together:
            self.barrier.wait(BARRIER_TIMEOUT_S)

    def cell(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Run one cell's passes; raw samples out. On an exception the barrier is broken so
        that a partner worker stops waiting too."""
        try:
            return self._cell(msg)
        except Exception:
            if msg.get("together"):
                self.barrier.abort()
            raise

    def _cell(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("mode") == "first-read":
            return self._first_read(msg)
        if msg.get("mode") in ("hand-off", "engine"):
            from kvpool_bench import pair_cells  # it builds on this module

            run = pair_cells.hand_off if msg["mode"] == "hand-off" else pair_cells.engine
            return run(self, msg)
        drv = self.drivers[msg["system"]]
        size = int(msg["size_bytes"])
        keys_per_pass = int(msg["keys_per_pass"])
        batch = int(msg["batch"])
        uid = int(msg["uid"])
        together = bool(msg.get("together"))
        if keys_per_pass * size > self.src.nbytes:
            raise ValueError("a pass does not fit the arena")
        srcs = slots(self.src, size, keys_per_pass)
        dsts = slots(self.dst, size, keys_per_pass)
        put, get = _new_put(), _new_get()
        for p in range(int(msg["passes"])):
            keys = _keys(msg, self.index, p, keys_per_pass)
            with stamped(srcs, uid, p, self.index):
                self._sync(together)
                pr = drv.put_pass(keys, srcs, batch)
                self.dst[: keys_per_pass * size].fill(POISON)
                self._record(put, pr, size, ok_keys=sum(pr.ok))
                put["failures"] += len(pr.ok) - sum(pr.ok)
                self._sync(together)
                gr = drv.get_pass(keys, dsts, batch)
                before = get["bytes_verified"]
                verify(gr.got, srcs, size, get)
                self._record(get, gr, size, ok_keys=(get["bytes_verified"] - before) // size)
            drv.remove(keys)
        return {"put": put, "get": get}

    def _first_read(self, msg: dict[str, Any]) -> dict[str, Any]:
        """One first-read cell (see the module's docstring): ``put`` samples if this worker
        wrote, ``get`` samples if it read; only the reads are verified, against the writer's
        arena as drawn and stamped."""
        drv = self.drivers[msg["system"]]
        size = int(msg["size_bytes"])
        n = int(msg["keys_per_pass"])
        uid = int(msg["uid"])
        write = bool(msg["write"])
        read_from = msg.get("read_from")
        if n * size > self.src.nbytes:
            raise ValueError("a pass does not fit the arena")
        srcs = slots(self.src, size, n)
        dsts = slots(self.dst, size, n)
        expected = slots(self.arena_of(int(read_from)), size, n) if read_from is not None else []
        put, get = _new_put(), _new_get()
        for p in range(int(msg["passes"])):
            own = _keys(msg, self.index, p, n)
            if read_from is not None:
                self.dst[: n * size].fill(POISON)
            self.barrier.wait(BARRIER_TIMEOUT_S)
            if write:
                with stamped(srcs, uid, p, self.index):
                    pr = drv.put_pass(own, srcs, 0)
                self._record(put, pr, size, ok_keys=sum(pr.ok))
                put["failures"] += len(pr.ok) - sum(pr.ok)
            self.barrier.wait(BARRIER_TIMEOUT_S)  # every put has returned
            if read_from is not None:
                gr = drv.get_pass(_keys(msg, int(read_from), p, n), dsts, 0)
                before = get["bytes_verified"]
                with stamped(expected, uid, p, int(read_from)):
                    verify(gr.got, expected, size, get)
                self._record(get, gr, size, ok_keys=(get["bytes_verified"] - before) // size)
            self.barrier.wait(BARRIER_TIMEOUT_S)  # every read is done
            if write:
                drv.remove(own)
        out: dict[str, Any] = {}
        if write:
            out["put"] = put
        if read_from is not None:
            out["get"] = get
        return out

    @staticmethod
    def _record(out: dict[str, Any], pr: PassResult, size: int, ok_keys: int) -> None:
        out["passes"].append(
            {"start": pr.start, "end": pr.end, "keys": ok_keys, "bytes": ok_keys * size}
        )
        out["durations_us"].extend(round(d * 1e6, 2) for d in pr.durations_s)
        for e in pr.errors:
            if e not in out["errors"] and len(out["errors"]) < 5:
                out["errors"].append(e)

    def close(self) -> None:
        for drv in self.drivers.values():
            with contextlib.suppress(Exception):  # closing goes on; the process ends next
                drv.close()
        if self.sink is not None:
            self.sink.close()


def bench_keys(run: object, uid: object, writer: int, unit: int, count: int) -> list[str]:
    """The keys worker ``writer`` puts in pass (or unit) ``unit`` of cell ``uid`` of run
    ``run``, in the form of kvpool's key scheme (``kv1/<32 hex>/<32 hex>``, what engines send
    through kvpool's keys module: the cell's hash and the writer, then the unit and the slot,
    in hex) — every
    key is put once, with one value, so each names its content as an engine's do, and kvpool
    reads them as it reads an engine's."""
    cell = hashlib.blake2b(f"kvpb/{run}/{uid}".encode(), digest_size=12).hexdigest()
    return [f"kv1/{cell}{writer:08x}/{unit:016x}{j:016x}" for j in range(count)]


def key_slot(key: str) -> int:
    """The slot (``j``) of a key of :func:`bench_keys`."""
    return int(key[-16:], 16)


def key_writer(key: str) -> int:
    """The writer of a key of :func:`bench_keys`."""
    return int(key[28:36], 16)


def _keys(msg: dict[str, Any], writer: int, pass_no: int, count: int) -> list[str]:
    """The keys worker ``writer`` puts in pass ``pass_no`` of the cell ``msg``."""
    return bench_keys(msg["run"], msg["uid"], writer, pass_no, count)


def worker_main(
    index: int,
    conn: Connection,
    barrier: Any,
    log_path: str,
    gc_freeze: bool = False,
    *,
    link: Connection | None = None,
) -> None:
    """The process body: answer commands until ``stop`` or the pipe closes. ``gc_freeze``:
    freeze what survives a slow full collection (kvpool.gctune), for every client measured;
    ``link``: this worker's end of the pipe to the other worker."""
    _redirect_output(log_path)
    if gc_freeze:
        freeze_after_slow_collections()
    worker = Worker(index, barrier, link)
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg["cmd"] == "stop":
                break
            try:
                conn.send({"ok": True, "result": worker.handle(msg)})
            except Exception:
                conn.send({"ok": False, "error": traceback.format_exc()})
    finally:
        worker.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Peer libraries may leave non-daemon threads behind; nothing here needs them.
        os._exit(0)


class WorkerPool:
    """The benchmark client processes (spawned, so no lock or thread is inherited)."""

    def __init__(self, directory: Path, *, gc_freeze: bool = False) -> None:
        self.dir = directory
        self.gc_freeze = gc_freeze
        self.ctx = multiprocessing.get_context("spawn")
        self.barrier = self.ctx.Barrier(2)
        self.links = self.ctx.Pipe()
        """Between the two workers, for hand-offs: worker i holds end i."""
        self.conns: list[Connection] = []
        self.procs: list[Any] = []

    def start(self, count: int) -> None:
        for i in range(count):
            parent, child = self.ctx.Pipe()
            log = str(self.dir / f"worker-{i}.log")
            proc = self.ctx.Process(
                target=worker_main,
                args=(i, child, self.barrier, log, self.gc_freeze),
                kwargs={"link": self.links[i % 2]},
                name=f"bench-worker-{i}",
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def send(self, i: int, msg: dict[str, Any]) -> None:
        self.conns[i].send(msg)

    def recv(self, i: int, timeout_s: float = CELL_TIMEOUT_S) -> Any:
        if not self.conns[i].poll(timeout_s):
            raise RuntimeError(f"bench worker {i} did not answer within {timeout_s:.0f}s")
        try:
            reply = self.conns[i].recv()
        except EOFError:
            raise RuntimeError(
                f"bench worker {i} died (exit code {self.procs[i].exitcode})"
            ) from None
        if not reply["ok"]:
            raise WorkerError(reply["error"])
        return reply["result"]

    def call(self, i: int, msg: dict[str, Any], timeout_s: float = CELL_TIMEOUT_S) -> Any:
        self.send(i, msg)
        return self.recv(i, timeout_s)

    def stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send({"cmd": "stop"})
        for proc in self.procs:
            proc.join(15)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for conn in [*self.conns, *self.links]:
            conn.close()


class WorkerError(RuntimeError):
    """A worker's command raised; the message is its traceback."""
