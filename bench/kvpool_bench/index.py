"""Measurements of the master (``kvpool-bench index`` calls these; each returns a dict).

- :func:`index_memory`: bytes per entry of the index (tracemalloc, and the RSS delta).
- :func:`apply_throughput`: entries/s the Raft thread applies (decode + apply) for CommitPuts
  commands of ``per_command`` entries, and what encoding them costs the caller.
- :func:`compaction_stall`: a single file-mode master with ``n_entries`` keys forced to compact:
  how long the Raft thread is blocked (building the snapshot data and forking) and the worst
  commit latency seen while the child serialises, against the same stream without compaction.
- :func:`sync_commit_latency`: one CommitPuts after another through a 3-master group (gRPC).
- :func:`group_commit_throughput`: many concurrent CommitPuts through a 3-master group.

Big defaults are for real runs; tests call them with small sizes.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpool.config import MasterConfig, load_config
from kvpool.launcher.placement import free_port
from kvpool.mastercall import MasterClient
from kvpool.proto.v1 import master_pb2
from kvpool.raft_master.commands import (
    CommitPuts,
    PutItem,
    RegisterMember,
    RegisterMemberResult,
    decode,
    encode,
)
from kvpool.raft_master.index import BlockIndex
from kvpool.raft_master.local_group import LocalMasterGroup
from kvpool.raft_master.replication import Replicator

KEY_PREFIX = "llama3-8b:bf16:paged16:tp0/"


def bench_key(i: int) -> str:
    """A realistic KV-cache block key: a model namespace and a 128-bit chained hash in hex."""
    return f"{KEY_PREFIX}{i * 0x9E3779B97F4A7C15 % (1 << 128):032x}"


def _puts(start: int, count: int, ring_version: int, replicas: tuple[int, ...]) -> CommitPuts:
    items = tuple(
        PutItem(bench_key(i), i + 1, 1 << 20, i * 31 + 7, replicas)
        for i in range(start, start + count)
    )
    return CommitPuts(os.urandom(16), ring_version, items)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _percentiles(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000

    return {
        "p50_ms": round(pct(0.50), 3),
        "p90_ms": round(pct(0.90), 3),
        "p99_ms": round(pct(0.99), 3),
        "max_ms": round(ordered[-1] * 1000, 3),
    }


def _index_with_members(n_members: int) -> BlockIndex:
    index = BlockIndex()
    for m in range(n_members):
        index.apply(
            RegisterMember(os.urandom(16), f"node-{m}", 1, f"tcp://10.0.0.{m}:1", "", 1, "")
        )
    return index


# --- pure index ------------------------------------------------------------------------------


def index_memory(
    n_entries: int = 1_000_000, replicas: int = 1, per_command: int = 1000
) -> dict[str, Any]:
    """Memory of ``n_entries`` keys with ``replicas`` replicas each (reverse index included;
    the dedupe table of the commands is reported apart)."""
    gc.collect()
    rss_before = _rss_bytes()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = _index_with_members(max(replicas, 1))
    members = tuple(range(1, replicas + 1))
    for start in range(0, n_entries, per_command):
        index.apply(_puts(start, min(per_command, n_entries - start), index.ring_version, members))
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    rss_delta = _rss_bytes() - rss_before
    dedupe_bytes = index._dedupe_bytes  # estimate of the request-id table (bounded)
    per_entry = (traced - dedupe_bytes) / n_entries
    return {
        "entries": n_entries,
        "replicas": replicas,
        "key_bytes": len(bench_key(1)),
        "traced_bytes": traced,
        "dedupe_bytes_estimate": dedupe_bytes,
        "bytes_per_entry": round(per_entry, 1),
        "mib_per_million_entries": round(per_entry * 1_000_000 / 2**20, 1),
        "rss_delta_bytes": rss_delta,
    }


def apply_throughput(total_entries: int = 200_000, per_command: int = 100) -> dict[str, Any]:
    """Entries/s through decode + apply (what the Raft thread does per log entry)."""
    index = _index_with_members(3)
    commands = [
        encode(_puts(start, per_command, index.ring_version, (1, 2)))
        for start in range(0, total_entries, per_command)
    ]
    started = time.perf_counter()
    for data in commands:
        index.apply_encoded(data)
    apply_s = time.perf_counter() - started
    sample = [_puts(i * per_command, per_command, 1, (1, 2)) for i in range(100)]
    started = time.perf_counter()
    for cmd in sample:
        encode(cmd)
    encode_s = (time.perf_counter() - started) / len(sample)
    started = time.perf_counter()
    for data in commands[:100]:
        decode(data)
    decode_s = (time.perf_counter() - started) / min(100, len(commands))
    return {
        "entries": total_entries,
        "per_command": per_command,
        "entries_per_s": round(total_entries / apply_s),
        "commands_per_s": round(len(commands) / apply_s),
        "encode_ms_per_command": round(encode_s * 1000, 3),
        "decode_ms_per_command": round(decode_s * 1000, 3),
    }


# --- compaction, in process ------------------------------------------------------------------


def compaction_stall(
    n_entries: int = 1_000_000,
    *,
    per_command: int = 8192,
    data_dir: str | None = None,
    baseline_s: float = 1.5,
) -> dict[str, Any]:
    """Fill a single file-mode master, then force a compaction while a stream of small commits
    runs; report how long the Raft thread was blocked and the worst commit latency."""
    own_dir = data_dir is None
    base = Path(data_dir or tempfile.mkdtemp(prefix="kvpool-bench-compaction-"))
    raft = f"127.0.0.1:{free_port()}"
    cfg = load_config(
        MasterConfig,
        env={},
        overrides={
            "raft_listen": raft,
            "listen": f"127.0.0.1:{free_port()}",
            "data_dir": str(base),
            "raft_secret": "bench",
            "raft_compaction_min_entries": 10**9,
            "raft_compaction_min_time_s": 10**6,
            "commit_timeout_s": 60.0,
        },
    )
    # A 5 ms tick: a lone master commits on its next tick, so this sets the resolution.
    replicator = Replicator(cfg, tick_period_s=0.005)
    serialize_calls: list[float] = []
    try:
        replicator.start()
        syncobj = replicator._syncobj
        serializer = getattr(syncobj, "_SyncObj__serializer", None)
        original = serializer.serialize if serializer is not None else None

        def timed_serialize(*args: Any, **kwargs: Any) -> Any:  # runs on the Raft thread
            started = time.perf_counter()
            try:
                return original(*args, **kwargs) if original else None
            finally:
                serialize_calls.append(time.perf_counter() - started)

        if serializer is not None:
            serializer.serialize = timed_serialize

        def compaction_done() -> bool:
            pid = getattr(serializer, "_Serializer__pid", 0)
            return bool(serialize_calls) and pid == 0

        result = asyncio.run(
            _compaction_run(
                replicator,
                n_entries,
                per_command,
                base,
                compaction_done=compaction_done,
                baseline_s=baseline_s,
            )
        )
        result["raft_thread_blocked_in_fork_ms"] = [round(s * 1000, 1) for s in serialize_calls]
        return result
    finally:
        replicator.stop(timeout_s=120)
        if own_dir:
            shutil.rmtree(base, ignore_errors=True)


async def _compaction_run(
    replicator: Replicator,
    n_entries: int,
    per_command: int,
    base: Path,
    *,
    compaction_done: Callable[[], bool],
    baseline_s: float,
) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while not replicator.is_leader():
        if time.monotonic() > deadline:
            raise TimeoutError("single master did not become leader")
        await asyncio.sleep(0.02)
    reg = await replicator.propose(
        RegisterMember(os.urandom(16), "bench-node", 1, "tcp://h:1", "", 1, ""), 10
    )
    assert isinstance(reg, RegisterMemberResult)
    fill_started = time.perf_counter()
    for start in range(0, n_entries, per_command):
        count = min(per_command, n_entries - start)
        await replicator.propose(_puts(start, count, reg.ring_version, (reg.member_id,)), 60)
    fill_s = time.perf_counter() - fill_started

    async def stream(duration_s: float) -> list[float]:
        latencies = []
        i = n_entries
        end = time.monotonic() + duration_s
        while time.monotonic() < end:
            started = time.perf_counter()
            await replicator.propose(_puts(i, 1, reg.ring_version, (reg.member_id,)), 60)
            latencies.append(time.perf_counter() - started)
            i += 1
        return latencies

    baseline = await stream(baseline_s)
    dump = base / "raft.dump"
    replicator.force_compaction()
    compacting_started = time.monotonic()
    during = []
    while not compaction_done() and time.monotonic() - compacting_started < 300:
        during.extend(await stream(0.1))
    child_s = time.monotonic() - compacting_started
    return {
        "entries": n_entries,
        "fill_s": round(fill_s, 2),
        "fill_entries_per_s": round(n_entries / fill_s),
        "dump_bytes": dump.stat().st_size if dump.exists() else 0,
        "child_serialise_s": round(child_s, 2),
        "commit_latency_baseline": _percentiles(baseline),
        "commit_latency_during_compaction": _percentiles(during),
        "note": "single master, 5 ms Raft tick: a commit waits for the next tick",
    }


# --- through a 3-master group -----------------------------------------------------------------


async def _with_group(
    fn: Callable[[LocalMasterGroup, MasterClient, master_pb2.RegisterNodeResponse], Any],
    settings: dict[str, Any] | None = None,
) -> Any:
    base = tempfile.mkdtemp(prefix="kvpool-bench-group-")
    group = LocalMasterGroup(
        base, 3, settings={"node_timeout_s": 3600.0, "log_level": "warning", **(settings or {})}
    )
    try:
        await asyncio.to_thread(group.start)
        await group.wait_leader()
        client = MasterClient(group.grpc_addresses)
        try:
            loop = asyncio.get_running_loop()
            node = await client.call(
                "RegisterNode",
                master_pb2.RegisterNodeRequest(
                    request_id=os.urandom(16),
                    node_id="bench-node",
                    incarnation=1,
                    data_address="tcp://127.0.0.1:1",
                    capacity_bytes=1 << 40,
                ),
                deadline=loop.time() + 10,
                leader_only=True,
            )
            return await fn(group, client, node)
        finally:
            await client.close()
    finally:
        group.close()
        shutil.rmtree(base, ignore_errors=True)


def _commit_request(
    keys: list[str], node: master_pb2.RegisterNodeResponse
) -> master_pb2.CommitPutsRequest:
    return master_pb2.CommitPutsRequest(
        request_id=os.urandom(16),
        ring_version=node.ring_version,
        entries=[
            master_pb2.PutEntry(
                key=k, write_id=i + 1, size_bytes=1 << 20, checksum=i, replicas=[node.member_id]
            )
            for i, k in enumerate(keys)
        ],
    )


def sync_commit_latency(
    commits: int = 1000, entries_per_commit: int = 1, settings: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Sequential CommitPuts (client → leader → Raft quorum → reply) in a 3-master group
    (``settings``: the masters' config, over the defaults)."""

    async def run(
        group: LocalMasterGroup, client: MasterClient, node: master_pb2.RegisterNodeResponse
    ) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        latencies = []
        for c in range(commits + 20):
            keys = [bench_key(c * entries_per_commit + i) for i in range(entries_per_commit)]
            started = time.perf_counter()
            await client.call(
                "CommitPuts",
                _commit_request(keys, node),
                deadline=loop.time() + 10,
                leader_only=True,
            )
            if c >= 20:  # warm-up excluded
                latencies.append(time.perf_counter() - started)
        return {
            "commits": commits,
            "entries_per_commit": entries_per_commit,
            "commits_per_s": round(len(latencies) / sum(latencies)),
            **_percentiles(latencies),
        }

    result: dict[str, Any] = asyncio.run(_with_group(run, settings))
    return result


def group_commit_throughput(
    concurrency: int = 64,
    entries_per_request: int = 16,
    duration_s: float = 5.0,
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``concurrency`` callers each committing ``entries_per_request`` entries in a loop
    (``settings``: the masters' config, over the defaults)."""

    async def run(
        group: LocalMasterGroup, client: MasterClient, node: master_pb2.RegisterNodeResponse
    ) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        leader = await group.wait_leader()
        before = (await group.status(leader)).master.commit_index
        counter = iter(range(10**12))
        lock = threading.Lock()
        done_requests = 0
        latencies: list[float] = []
        end = time.monotonic() + duration_s

        async def worker() -> None:
            nonlocal done_requests
            while time.monotonic() < end:
                with lock:
                    first = next(counter) * entries_per_request
                keys = [bench_key(first + i) for i in range(entries_per_request)]
                started = time.perf_counter()
                await client.call(
                    "CommitPuts",
                    _commit_request(keys, node),
                    deadline=loop.time() + 10,
                    leader_only=True,
                )
                latencies.append(time.perf_counter() - started)
                done_requests += 1

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - started
        after = (await group.status(leader)).master.commit_index
        raft_entries = after - before
        return {
            "concurrency": concurrency,
            "entries_per_request": entries_per_request,
            "requests_per_s": round(done_requests / elapsed),
            "entries_per_s": round(done_requests * entries_per_request / elapsed),
            "raft_commits_per_s": round(raft_entries / elapsed),
            "requests_per_raft_entry": round(done_requests / max(raft_entries, 1), 1),
            "latency": _percentiles(latencies),
        }

    result: dict[str, Any] = asyncio.run(_with_group(run, settings))
    return result


def run_all(quick: bool = False) -> dict[str, Any]:
    """Every measurement; ``quick`` shrinks them to seconds (smoke runs)."""
    if quick:
        return {
            "index_memory": index_memory(20_000),
            "apply_throughput": apply_throughput(20_000),
            "compaction_stall": compaction_stall(20_000, per_command=5000),
            "sync_commit_latency": sync_commit_latency(100),
            "group_commit_throughput": group_commit_throughput(16, 16, 1.0),
        }
    return {
        "index_memory": index_memory(),
        "apply_throughput": apply_throughput(),
        "compaction_stall": compaction_stall(),
        "sync_commit_latency": sync_commit_latency(),
        "group_commit_throughput": group_commit_throughput(),
    }
