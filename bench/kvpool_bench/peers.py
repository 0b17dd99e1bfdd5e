"""``kvpool-bench peers``: kvpool side by side with what its users would otherwise run —
Redis and Mooncake Store — and with the machine's own limits, in one run.

    kvpool-bench peers                 # ~5 min: 5 sizes x single/batched x 1/2 clients x 5 rounds
    kvpool-bench peers --quick         # seconds: a smoke run (CI)
    kvpool-bench peers --json out.json # the table, and every number in out.json
    kvpool-bench peers --modes single,first-read   # a client's own keys vs another's first read
    kvpool-bench peers --modes hand-off,engine     # the P/D hand-off; an engine's query + read

What runs (all on 127.0.0.1, all started and stopped by this command, by pid):

* kvpool: a :class:`~kvpool.launcher.cluster.LocalCluster` (3 masters, 1 store node by
  default) and ``kvpool.Client`` — with ``transport=`` (tcp and shm, separately), ``get_into``,
  ``batch_get_into``, ``AsyncClient`` wherever the client offers them;
* Redis: ``redis-server`` with persistence off, redis-py, GET/SET and pipelined batches;
* Mooncake Store: ``mooncake_master``, one store process contributing a segment, clients that
  contribute none, over TCP: ``put_from``/``get_into`` and ``batch_put_from``/
  ``batch_get_into`` on registered buffers;
* the limits: numpy memcpy, and one loopback TCP stream between two Python processes.

The clients are one or two worker processes (:mod:`kvpool_bench.worker`). The modes:
*single* (one key per call) and *batch* (many keys per call), where each client reads back the
keys it put itself, and *first-read* (one key per call), where one worker puts and the other
reads each block once — the first read by another client, as a decode engine reads what a
prefill engine put; with two clients each worker reads the other's keys. Two more modes run one
writer and one reader whatever the client count (:mod:`kvpool_bench.pair_cells`): *hand-off*,
where the reader reads each block the moment its put returned (misses, latency), and *engine*,
a presence query then a read of the hits per batch, as SGLang and LMCache call a store
(:mod:`kvpool_bench.flows`); their numbers come from :mod:`kvpool_bench.pair_report`. A round visits
every size; at each size every mode and client count; there, every system in turn — the order
rotating from one size and round to the next — so that the machine's noise falls on all of
them alike. The limits are measured at the start of every round. Every byte read is compared
with what was put; the numbers come from :mod:`kvpool_bench.report`.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvpool.errors import ConfigError
from kvpool.units import format_size
from kvpool_bench import pair_report, report
from kvpool_bench.drivers import kvpool_features
from kvpool_bench.flows import engine_queries
from kvpool_bench.machine import round_trip_us
from kvpool_bench.peer_servers import (
    Availability,
    KvpoolServers,
    MooncakeServers,
    RedisServer,
    mooncake_availability,
    redis_availability,
)
from kvpool_bench.worker import WorkerError, WorkerPool

KiB, MiB = 1 << 10, 1 << 20
FULL_SIZES = (4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
QUICK_SIZES = (4 * KiB, 1 * MiB)
PEERS = ("redis", "mooncake")
MODES = report.MODES + pair_report.PAIR_MODES
"""single, batch: each client reads its own keys back; first-read: another client reads them;
hand-off: another client reads each block the moment its put returned; engine: a presence
query per batch, then a read of the hits, by another client."""
PAIR_MODES = pair_report.PAIR_MODES
"""Modes of one writer and one reader process, whatever --clients says."""
ENGINE_BATCH_KEYS = 128
KVPOOL_APIS = ("auto", "sync", "async", "both")
BATCH_BYTES = 32 * MiB
"""A batched call carries at most this much (and at most MAX_BATCH_KEYS keys)."""
ENGINE_BATCH_BYTES = 128 * MiB
"""An engine batch reads at most this much: issue 13's 128 x 1 MiB (with ``--arena`` large
enough to hold it)."""
MIN_ARENA_BYTES = 1 * MiB
MAX_BATCH_KEYS = 256
SCHEMA = "kvpool-bench-peers/1"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PeersOptions:
    quick: bool = False
    sizes: tuple[int, ...] = FULL_SIZES
    rounds: int = 5
    clients: tuple[int, ...] = (1, 2)
    modes: tuple[str, ...] = ("single", "batch")
    peers: tuple[str, ...] = PEERS
    kvpool_masters: int = 3
    kvpool_nodes: int = 1
    kvpool_cpu_cache_size: str = "1GiB"
    kvpool_in_memory: bool = False
    kvpool_transports: tuple[str, ...] | None = None
    """None: tcp and shm when the client takes ``transport=``, else the client's default."""
    kvpool_api: str = "auto"
    """auto: kvpool.Client on every transport, and kvpool.AsyncClient on the first one when
    there is one; sync, async: only that client; both: both on every transport."""
    kvpool_busy_poll_us: int = 0
    """Above 0: every kvpool.Client measured is measured again with this ``busy_poll_us``
    (as ``kvpool-<transport>-busy-poll``)."""
    mooncake_segment_bytes: int = 1 << 30
    gc_freeze: bool = False
    """The client processes freeze what survives a slow full collection (kvpool.gctune)."""
    arena_bytes: int = 64 * MiB
    timeout_s: float = 10.0
    directory: str | None = None
    seed: int = 0
    single_target_bytes: int = 256 * MiB
    single_ops: tuple[int, int] = (16, 128)
    batch_calls: int = 8
    engine_batch_keys: int = ENGINE_BATCH_KEYS
    """Keys per engine batch (fewer where a batch would pass ENGINE_BATCH_BYTES or the
    arena)."""
    limit_tcp_bytes: int = 512 * MiB
    limit_memcpy_bytes: int = 64 * MiB

    @classmethod
    def quick_run(cls, **overrides: Any) -> PeersOptions:
        base = cls(
            quick=True,
            sizes=QUICK_SIZES,
            rounds=1,
            kvpool_cpu_cache_size="256MiB",
            mooncake_segment_bytes=256 * MiB,
            arena_bytes=8 * MiB,
            single_target_bytes=8 * MiB,
            single_ops=(2, 16),
            batch_calls=1,
            limit_tcp_bytes=64 * MiB,
            limit_memcpy_bytes=16 * MiB,
        )
        return replace(base, **overrides)

    def validate(self) -> list[str]:
        errors = []
        if not self.sizes or any(s < 16 for s in self.sizes):
            errors.append("sizes: at least one, each at least 16 bytes")
        if max(self.sizes, default=0) > self.arena_bytes:
            errors.append(
                f"sizes: the largest must fit the arena ({format_size(self.arena_bytes)})"
            )
        if self.engine_batch_keys < 1:
            errors.append("engine batch: at least 1 key")
        if self.arena_bytes < MIN_ARENA_BYTES:
            errors.append(f"arena: at least {format_size(MIN_ARENA_BYTES)}")
        if self.rounds < 1:
            errors.append("rounds: at least 1")
        if not self.clients or any(c not in (1, 2) for c in self.clients):
            errors.append("clients: 1, 2 or 1,2")
        if not self.modes or any(m not in MODES for m in self.modes):
            errors.append(f"modes: a subset of {','.join(MODES)}")
        if any(p not in PEERS for p in self.peers):
            errors.append(f"peers: a subset of {','.join(PEERS)}")
        if self.kvpool_api not in KVPOOL_APIS:
            errors.append(f"kvpool api: one of {', '.join(KVPOOL_APIS)}")
        if self.kvpool_busy_poll_us < 0:
            errors.append("kvpool busy_poll_us: must not be negative")
        return errors


@dataclass(frozen=True)
class CellPlan:
    batch: int  # 0: one key per call
    keys_per_pass: int
    passes: int


def plan_cell(opts: PeersOptions, size: int, mode: str) -> CellPlan:
    """How many keys a pass holds (it must fit the arena) and how many passes a cell runs."""
    fit = max(1, opts.arena_bytes // size)
    if mode == "engine":
        batch = max(1, min(opts.engine_batch_keys, ENGINE_BATCH_BYTES // size, fit))
        calls_per_pass = max(1, min(4, fit // batch))
        return CellPlan(batch, batch * calls_per_pass, math.ceil(opts.batch_calls / calls_per_pass))
    if mode in ("single", "first-read", "hand-off"):
        lo, hi = opts.single_ops
        target = min(hi, max(lo, opts.single_target_bytes // size))
        per_pass = min(fit, 64, target)
        return CellPlan(0, per_pass, math.ceil(target / per_pass))
    batch = max(1, min(MAX_BATCH_KEYS, BATCH_BYTES // size, fit))
    calls_per_pass = max(1, min(4, fit // batch))
    passes = max(1, math.ceil(opts.batch_calls / calls_per_pass))
    return CellPlan(batch, batch * calls_per_pass, passes)


def first_read_parts(msg: dict[str, Any], clients: int) -> list[dict[str, Any]]:
    """Each worker's part of a first-read cell (both workers always take part): with one
    client, worker 0 writes and worker 1 reads; with two, each writes and reads the other's."""
    if clients == 1:
        return [
            {**msg, "together": True, "write": True, "read_from": None},
            {**msg, "together": True, "write": False, "read_from": 0},
        ]
    return [
        {**msg, "together": True, "write": True, "read_from": 1},
        {**msg, "together": True, "write": True, "read_from": 0},
    ]


def pair_parts(msg: dict[str, Any]) -> list[dict[str, Any]]:
    """Each worker's part of a hand-off or engine cell: worker 0 writes, worker 1 reads."""
    return [
        {**msg, "together": True, "role": "write", "partner": 1},
        {**msg, "together": True, "role": "read", "partner": 0},
    ]


@dataclass
class SystemState:
    name: str
    kind: str
    status: str = "measured"  # measured | skipped | failed
    reason: str = ""
    install: str = ""
    spec: dict[str, Any] = field(default_factory=dict)
    setup: dict[str, Any] = field(default_factory=dict)
    api: dict[str, str] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        self.status = "failed"
        self.reason = reason

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "status": self.status}
        if self.reason:
            out["reason"] = self.reason
        if self.install:
            out["install"] = self.install
        if self.api:
            out["api"] = self.api
        if self.setup:
            out["setup"] = self.setup
        return out


class _InterruptShield:
    """While everything is being stopped, Ctrl-C is ignored (each stop is bounded by its own
    timeouts), so that a second Ctrl-C cannot leave processes behind; then the previous
    handler comes back. Only the main thread can change signal handlers."""

    def __init__(self) -> None:
        self.main = threading.current_thread() is threading.main_thread()
        self.previous = signal.getsignal(signal.SIGINT) if self.main else None

    def raise_shield(self) -> None:
        if self.main:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def lower_shield(self) -> None:
        if self.main and self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _quiet(_line: str) -> None:
    return None


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else text


class PeersBench:
    def __init__(self, opts: PeersOptions, progress: Progress = _quiet) -> None:
        self.opts = opts
        self.progress = progress
        self.run_id = secrets.token_hex(4)
        self.systems: dict[str, SystemState] = {}
        self.records: list[dict[str, Any]] = []
        self.limits: list[dict[str, Any]] = []
        self.problems: list[str] = []
        self._uid = 0

    # --- start ---------------------------------------------------------------------------

    def _kvpool_systems(self, masters: list[str], features: dict[str, Any]) -> None:
        """One system per (transport, client API) measured: see ``PeersOptions.kvpool_api``."""
        transports: tuple[str | None, ...]
        if self.opts.kvpool_transports is not None:
            transports = self.opts.kvpool_transports
        elif features["transport_arg"]:
            transports = ("tcp", "shm")
        else:
            transports = (None,)
        api = self.opts.kvpool_api
        pairs: list[tuple[str | None, str]] = []
        for i, t in enumerate(transports):
            if api in ("sync", "both", "auto"):
                pairs.append((t, "sync"))
            if api in ("async", "both") or (api == "auto" and i == 0 and features["async_client"]):
                pairs.append((t, "async"))
        poll = self.opts.kvpool_busy_poll_us
        runs = [(t, kind, 0) for t, kind in pairs]
        runs += [(t, kind, poll) for t, kind in pairs if poll and kind == "sync"]
        for t, kind, busy_poll_us in runs:
            name = ("kvpool" if t is None else f"kvpool-{t}") + (
                "-async" if kind == "async" else ""
            )
            spec: dict[str, Any] = {
                "kind": "kvpool",
                "masters": masters,
                "transport": t,
                "timeout_s": self.opts.timeout_s,
                "api": kind,
            }
            if busy_poll_us:
                name += "-busy-poll"
                spec["busy_poll_us"] = busy_poll_us
            state = SystemState(name, "kvpool", spec=spec)
            if kind == "async" and not features["async_client"]:
                state.fail("this kvpool has no AsyncClient")
            self.systems[name] = state

    def _start_peer(
        self, name: str, avail: Availability, start: Callable[[], dict[str, Any]]
    ) -> None:
        state = SystemState(name, name)
        self.systems[name] = state
        if not avail.ok:
            state.status, state.reason, state.install = "skipped", avail.reason, avail.install
            self.progress(f"{name}: skipped, {avail.reason} (install: {avail.install})")
            return
        try:
            state.spec = start()
        except Exception as e:
            state.fail(f"could not start: {e}")
            self.progress(f"{name}: {state.reason}")

    # --- cells ---------------------------------------------------------------------------

    def _measure_limits(self, pool: WorkerPool, rnd: int) -> None:
        mem = pool.call(
            0, {"cmd": "memcpy", "size_bytes": self.opts.limit_memcpy_bytes, "repeats": 8}
        )
        port = pool.call(0, {"cmd": "tcp_listen"})["port"]
        pool.send(0, {"cmd": "tcp_recv", "bytes": self.opts.limit_tcp_bytes})
        pool.send(1, {"cmd": "tcp_send", "port": port, "bytes": self.opts.limit_tcp_bytes})
        recv = pool.recv(0)
        sent = pool.recv(1)
        trip = round_trip_us(request_bytes=(64,), calls=500)
        self.limits.append(
            {
                "round": rnd,
                "memcpy_GBps": mem["GBps"],
                "loopback_tcp_GBps": sent["GBps"],
                "loopback_tcp_receiver_GBps": recv["received_bytes"] / recv["receive_s"] / 1e9,
                "round_trip_us": trip["64B_p50_us"],
            }
        )

    def _cell(
        self, pool: WorkerPool, system: str, size: int, *, mode: str, clients: int, rnd: int
    ) -> None:
        plan = plan_cell(self.opts, size, mode)
        self._uid += 1
        msg = {
            "cmd": "cell",
            "mode": mode,
            "system": system,
            "size_bytes": size,
            "batch": plan.batch,
            "keys_per_pass": plan.keys_per_pass,
            "passes": plan.passes,
            "uid": self._uid,
            "run": self.run_id,
            "together": clients == 2,
        }
        if mode == "engine":
            state = self.systems[system]
            msg["queries"] = list(engine_queries(state.kind, state.spec.get("api", "sync")))
            if not msg["queries"]:
                return  # the engine mode drives sync clients (kvpool's AsyncClient: none)
        if mode in PAIR_MODES:
            msgs = pair_parts(msg)
        elif mode == "first-read":
            msgs = first_read_parts(msg, clients)
        else:
            msgs = [msg] * clients
        for i, part in enumerate(msgs):
            pool.send(i, part)
        results, errors = [], []
        for i in range(len(msgs)):
            try:
                results.append(pool.recv(i))
            except WorkerError as e:
                errors.append(str(e))
        if errors:
            if len(msgs) == 2:
                pool.barrier.reset()
            state = self.systems[system]
            state.fail(f"{mode} {format_size(size)} x{clients}: {_last_line(errors[0])}")
            self.problems.append(f"{system} failed and was not measured further: {state.reason}")
            self.progress(f"{system}: FAILED, {state.reason}")
            return
        self.records.append(
            {
                "system": system,
                "mode": mode,
                "size_bytes": size,
                "clients": clients,
                "batch": plan.batch,
                "round": rnd,
                "workers": results,
            }
        )

    def _round(self, pool: WorkerPool, rnd: int) -> None:
        self._measure_limits(pool, rnd)
        names = list(self.systems)
        for si, size in enumerate(self.opts.sizes):
            t = time.monotonic()
            for mode in self.opts.modes:
                for clients in (1,) if mode in PAIR_MODES else self.opts.clients:
                    shift = (rnd + si) % len(names)
                    for name in names[shift:] + names[:shift]:
                        if self.systems[name].status == "measured":
                            self._cell(pool, name, size, mode=mode, clients=clients, rnd=rnd)
            self.progress(
                f"round {rnd + 1}/{self.opts.rounds}: {format_size(size)} done "
                f"in {time.monotonic() - t:.1f}s"
            )

    # --- the run -------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        opts = self.opts
        started = time.time()
        root = Path(opts.directory or tempfile.mkdtemp(prefix="kvpool-bench-peers-")).resolve()
        root.mkdir(parents=True, exist_ok=True)
        features = kvpool_features()
        kv = KvpoolServers(
            root / "kvpool",
            masters=opts.kvpool_masters,
            nodes=opts.kvpool_nodes,
            cpu_cache_size=opts.kvpool_cpu_cache_size,
            in_memory=opts.kvpool_in_memory,
        )
        redis = RedisServer(root / "redis")
        mooncake = MooncakeServers(root / "mooncake", segment_bytes=opts.mooncake_segment_bytes)
        pool = WorkerPool(root, gc_freeze=opts.gc_freeze)
        shield = _InterruptShield()
        with contextlib.ExitStack() as stack:
            # Unwound in reverse, each step even if one before it raised or was interrupted.
            stack.callback(shield.lower_shield)
            if opts.directory is None:
                stack.callback(shutil.rmtree, root, ignore_errors=True)
            stack.callback(kv.stop)
            stack.callback(redis.stop)
            stack.callback(mooncake.stop)
            stack.callback(pool.stop)
            stack.callback(shield.raise_shield)
            kv.start()
            self.progress(f"kvpool: {opts.kvpool_masters} masters + {opts.kvpool_nodes} node(s) up")
            self._kvpool_systems(kv.masters, features)
            if "redis" in opts.peers:

                def start_redis() -> dict[str, Any]:
                    redis.start()
                    self.systems["redis"].setup = redis.info
                    return {
                        "kind": "redis",
                        "host": "127.0.0.1",
                        "port": redis.port,
                        "timeout_s": opts.timeout_s,
                    }

                self._start_peer("redis", redis_availability(), start_redis)
            if "mooncake" in opts.peers:

                def start_mooncake() -> dict[str, Any]:
                    mooncake.start()
                    self.systems["mooncake"].setup = mooncake.info
                    return {"kind": "mooncake", "master": mooncake.address}

                self._start_peer("mooncake", mooncake_availability(), start_mooncake)
            pool.start(2)
            self._setup_workers(pool, max(opts.clients), features, kv)
            for rnd in range(opts.rounds):
                self._round(pool, rnd)
        return self._document(started, features)

    def _setup_workers(
        self, pool: WorkerPool, clients: int, features: dict[str, Any], kv: KvpoolServers
    ) -> None:
        specs = [
            {"system": s.name, **s.spec} for s in self.systems.values() if s.status == "measured"
        ]
        msg = {
            "cmd": "setup",
            "systems": specs,
            "arena_bytes": self.opts.arena_bytes,
            "seed": self.opts.seed,
        }
        for i in range(2):
            pool.send(i, msg)
        answers = [pool.recv(i, 120.0) for i in range(2)]
        for spec in specs:
            state = self.systems[spec["system"]]
            for answer in answers[:clients]:
                got = answer[spec["system"]]
                if "error" in got:
                    state.fail(f"client setup failed: {got['error']}")
                    self.progress(f"{state.name}: {state.reason}")
                    break
                state.api = got["api"]
            if state.kind == "kvpool":
                state.setup = {**kv.info, "kvpool": features["version"]}

    def _document(self, started: float, features: dict[str, Any]) -> dict[str, Any]:
        apis = {name: s.api for name, s in self.systems.items()}
        cells = report.summarize_cells(
            [r for r in self.records if r["mode"] not in PAIR_MODES], apis
        )
        handoffs = pair_report.summarize_handoffs(self.records)
        engine = pair_report.summarize_engine(self.records)
        pairs = pair_report.pair_verification(handoffs, engine)
        report.add_ratios(cells, self.limits)
        gets = [c for c in cells if c["op"] == "get"]
        puts = [c for c in cells if c["op"] == "put"]
        verification = {
            "bytes_read": sum(c["bytes_read"] for c in gets),
            "bytes_verified": sum(c["bytes_verified"] for c in gets),
            "wrong": sum(c["wrong"] for c in gets),
            "misses": sum(c["misses"] for c in gets),
            "put_failures": sum(c["failures"] for c in puts),
        }
        for k, v in pairs.items():
            verification[k] += v
        verification["all_bytes_verified"] = (
            verification["wrong"] == 0
            and verification["bytes_read"] == verification["bytes_verified"]
        )
        self.problems[:0] = pair_report.pair_problems(handoffs, engine)
        if verification["wrong"]:
            self.problems.append(f"{verification['wrong']} block(s) read WRONG (see cells)")
        for c in gets:
            if c["mode"] == "first-read" and c["misses"]:
                self.problems.append(
                    f"{c['system']} first read {c['size']} x{c['clients']}: {c['misses']} of "
                    f"{c['misses'] + c['keys']} acknowledged block(s) not found by the reader"
                )
        limits = {
            "memcpy_GBps": report.median(x["memcpy_GBps"] for x in self.limits),
            "memcpy_size_bytes": self.opts.limit_memcpy_bytes,
            "loopback_tcp_GBps": report.median(x["loopback_tcp_GBps"] for x in self.limits),
            "loopback_tcp_bytes": self.opts.limit_tcp_bytes,
            "round_trip_us": report.median(x["round_trip_us"] for x in self.limits),
            "rounds": self.limits,
        }
        opts = asdict(self.opts)
        return {
            "schema": SCHEMA,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "duration_s": round(time.time() - started, 1),
            "host": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "options": opts,
            "kvpool_features": features,
            "systems": {n: s.to_json() for n, s in self.systems.items()},
            "limits": limits,
            "cells": cells,
            "handoffs": handoffs,
            "engine": engine,
            "verification": verification,
            "targets": report.evaluate_targets(cells),
            "problems": self.problems,
        }


def run_peers(opts: PeersOptions, progress: Progress = _quiet) -> dict[str, Any]:
    """Run the whole comparison and return its document (see the module's docstring)."""
    errors = opts.validate()
    if errors:
        raise ConfigError("kvpool-bench peers: " + "; ".join(errors))
    return PeersBench(opts, progress).run()
