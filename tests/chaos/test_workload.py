"""The chaos workload: its seeded plan, how it classifies what the client answered, and (marker
``chaos``) two workload processes against a real local cluster, judged by every checker."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kvpool import Client
from kvpool.chaos.checks import run_all
from kvpool.chaos.final_state import (
    collect_final_state,
    live_member_ids,
    sample_until_agreed,
    verify_reads,
)
from kvpool.chaos.history import CheckContext, HistoryWriter, Op, load_history
from kvpool.chaos.values import (
    CONTENT_WRITER,
    ValueId,
    computed_writer,
    decode_value,
    make_value,
)
from kvpool.chaos.workload import (
    Executor,
    Mix,
    PlannedOp,
    Planner,
    WorkloadConfig,
    key_space,
    run_workload,
)
from kvpool.client.core import PutReceipt
from kvpool.errors import (
    BlockMissError,
    DeadlineExceededError,
    InvalidKeyError,
    UnavailableError,
)
from kvpool.keys import is_scheme_key
from kvpool.launcher.cluster import LocalCluster


def config(process_id: int = 1, seed: int = 7, **kwargs: object) -> WorkloadConfig:
    base: dict[str, object] = {
        "masters": ("127.0.0.1:1",),
        "process_id": process_id,
        "seed": seed,
        "duration_s": 1.0,
        "keys": 16,
        "out": Path("unused"),
    }
    base.update(kwargs)
    return WorkloadConfig(**base)  # type: ignore[arg-type]


# --- the plan -----------------------------------------------------------------------------------


def test_a_plan_replays_from_its_seed_and_process_id() -> None:
    def plan(pid: int, seed: int) -> list[PlannedOp]:
        planner = Planner(config(pid, seed))
        return [planner.next() for _ in range(200)]

    assert plan(1, 7) == plan(1, 7)
    assert plan(1, 7) != plan(2, 7)
    assert plan(1, 7) != plan(1, 8)


def test_processes_share_the_key_space_and_never_share_value_ids() -> None:
    planners = {pid: Planner(config(pid)) for pid in (1, 2)}
    ops = {pid: [p.next() for _ in range(300)] for pid, p in planners.items()}
    keys = {pid: {k for op in plan for k in op.keys} for pid, plan in ops.items()}
    assert keys[1] & keys[2]  # overlaps: concurrent puts of one key happen
    assert keys[1] | keys[2] <= set(key_space(16))
    written = [v for plan in ops.values() for op in plan for v in op.written if v is not None]
    assert len(written) == len(set(written))
    kinds = {op.kind for op in ops[1]}
    assert kinds == {"put", "get", "remove", "get_or_compute", "batch_put", "batch_get"}
    for op in ops[1]:
        if op.kind == "get_or_compute":
            assert op.written[0] is not None
            assert op.written[0].writer == computed_writer(1)
        if op.kind in ("batch_put", "batch_get"):
            assert len(set(op.keys)) == len(op.keys) == 4


def test_content_keys_are_of_the_key_scheme_and_each_has_one_value() -> None:
    planners = {pid: Planner(config(pid, content_keys=True)) for pid in (1, 2)}
    ops = [op for p in planners.values() for op in (p.next() for _ in range(300))]
    space = key_space(16, content=True)
    assert all(is_scheme_key(k) for k in space)
    assert len(set(space)) == 16
    values: dict[str, set[tuple[ValueId, int]]] = {}
    for op in ops:
        assert set(op.keys) <= set(space)
        for key, value, size in zip(op.keys, op.written, op.sizes, strict=True):
            if value is not None:
                values.setdefault(key, set()).add((value, size))
    assert values
    for found in values.values():  # one value and one size per key, whoever writes it
        assert len(found) == 1
        assert next(iter(found))[0] == ValueId(CONTENT_WRITER, 0)


def test_a_mix_parses_and_refuses_nonsense() -> None:
    mix = Mix.parse("put=1,get=3")
    assert (mix.put, mix.get, mix.remove, mix.batch) == (1.0, 3.0, 0.0, 0.0)
    planner = Planner(config(mix=mix))
    assert {planner.next().kind for _ in range(100)} == {"put", "get"}
    for bad in ("put", "walk=1", "put=x", "put=0", "put=-1,get=2"):
        with pytest.raises(ValueError, match="mix"):
            Mix.parse(bad)


# --- classifying what the client answered ------------------------------------------------------


class FakeClient:
    """Answers with what a test sets; records values put."""

    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}
        self.error: Exception | None = None
        self.version = 0

    def _maybe_raise(self) -> None:
        if self.error is not None:
            raise self.error

    def put_receipt(self, key: str, value: bytes) -> PutReceipt | None:
        self._maybe_raise()
        self.stored[key] = value
        self.version += 1
        return PutReceipt(key, self.version, 99, self.version, ("node-1",), (1,))

    def batch_put_receipts(self, items: Sequence[tuple[str, bytes]]) -> list[PutReceipt | None]:
        self._maybe_raise()
        out: list[PutReceipt | None] = []
        for i, (key, value) in enumerate(items):
            out.append(self.put_receipt(key, value) if i % 2 == 0 else None)
        return out

    def get(self, key: str) -> bytes | None:
        self._maybe_raise()
        if key not in self.stored:
            raise BlockMissError("absent", reason="absent")
        return self.stored[key]

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        self._maybe_raise()
        return [self.stored.get(k) for k in keys]

    def remove(self, key: str) -> bool:
        self._maybe_raise()
        return self.stored.pop(key, None) is not None

    def get_or_compute(self, key: str, fn: Callable[[], bytes]) -> bytes | None:
        self._maybe_raise()
        return self.stored.get(key) or fn()


def planned(kind: str, keys: tuple[str, ...], written: tuple[ValueId | None, ...]) -> PlannedOp:
    return PlannedOp(1, kind, keys, written, tuple(100 for _ in keys))  # type: ignore[arg-type]


def test_an_acknowledged_put_carries_its_receipt_and_its_invocation_is_announced() -> None:
    client = FakeClient()
    invoked: list[Op] = []
    op = Executor(client, 1).execute(planned("put", ("k",), (ValueId(1, 1),)), invoked.append)
    assert op.outcome == "ok"
    assert op.results[0].receipt is not None
    assert op.results[0].receipt.version == 1
    assert decode_value("k", client.stored["k"]) == ValueId(1, 1)
    assert invoked[0].outcome == "unknown"
    assert invoked[0].invoke_t == op.invoke_t
    assert op.complete_t is not None
    assert op.complete_t >= op.invoke_t


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (InvalidKeyError("bad key"), "fail"),
        (DeadlineExceededError("slow"), "unknown"),
        (UnavailableError("no leader"), "unknown"),
        (RuntimeError("a bug"), "unknown"),
    ],
)
def test_a_put_error_is_fail_only_when_it_proves_nothing_happened(
    error: Exception, outcome: str
) -> None:
    client = FakeClient()
    client.error = error
    op = Executor(client, 1).execute(planned("put", ("k",), (ValueId(1, 1),)))
    assert op.outcome == outcome
    assert op.results[0].outcome == outcome
    assert type(error).__name__ in op.error


def test_reads_record_values_misses_corruption_and_failures() -> None:
    client = FakeClient()
    executor = Executor(client, 1)
    client.stored["k"] = make_value("k", 2, 5, 300)
    client.stored["x"] = make_value("y", 2, 6, 300)  # another key's bytes under x
    (hit,) = executor.execute(planned("get", ("k",), (None,))).results
    assert hit.read == ValueId(2, 5)
    (miss,) = executor.execute(planned("get", ("nope",), (None,))).results
    assert (miss.outcome, miss.read, miss.miss) == ("ok", None, "absent")
    (bad,) = executor.execute(planned("get", ("x",), (None,))).results
    assert bad.corruption is not None
    assert bad.corruption.reason == "wrong_key"
    batch = executor.execute(planned("batch_get", ("k", "nope"), (None, None)))
    assert [r.read for r in batch.results] == [ValueId(2, 5), None]
    client.error = DeadlineExceededError("slow")
    failed = executor.execute(planned("get", ("k",), (None,)))
    assert failed.outcome == "fail"


def test_batch_put_items_not_committed_are_unknown() -> None:
    op = Executor(FakeClient(), 1).execute(
        planned("batch_put", ("a", "b", "c"), (ValueId(1, 1), ValueId(1, 2), ValueId(1, 3)))
    )
    assert op.outcome == "ok"
    assert [r.outcome for r in op.results] == ["ok", "unknown", "ok"]


def test_remove_and_get_or_compute_are_recorded() -> None:
    client = FakeClient()
    executor = Executor(client, 3)
    client.stored["k"] = make_value("k", 1, 1, 100)
    removed = executor.execute(planned("remove", ("k",), (None,)))
    assert removed.results[0].removed is True
    mine = ValueId(computed_writer(3), 4)
    op = executor.execute(planned("get_or_compute", ("k",), (mine,)))
    assert op.outcome == "ok"
    assert op.results[0].read == mine == op.results[0].written
    client.error = UnavailableError("store failed")
    assert executor.execute(planned("remove", ("k",), (None,))).outcome == "unknown"


# --- against a real cluster ---------------------------------------------------------------------

DURATION_S = 5.0
TIMEOUT_S = 2.0
KEYS = 48


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("chaos-cluster"), masters=3, nodes=2)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@contextlib.contextmanager
def workloads(
    cluster: LocalCluster, out_dir: Path, pids: Sequence[int], duration_s: float
) -> Iterator[tuple[list[subprocess.Popen[bytes]], list[Path]]]:
    procs: list[subprocess.Popen[bytes]] = []
    paths = [out_dir / f"history-{pid}.jsonl" for pid in pids]
    try:
        for pid, path in zip(pids, paths, strict=True):
            argv = [
                sys.executable, "-m", "kvpool.chaos.workload",
                "--masters", ",".join(cluster.master_addresses),
                "--process-id", str(pid), "--seed", "11", "--duration", str(duration_s),
                "--keys", str(KEYS), "--out", str(path), "--timeout-s", str(TIMEOUT_S),
                "--size-max", "256KiB",
            ]  # fmt: skip
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        yield procs, paths
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.mark.chaos
def test_two_workloads_on_a_healthy_cluster_pass_every_checker(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    with workloads(cluster, tmp_path, [1, 2], DURATION_S) as (procs, paths):
        for proc in procs:
            out, err = proc.communicate(timeout=DURATION_S + 60)
            assert proc.returncode == 0, err.decode()[-2000:]
            summary = json.loads(out.decode().strip().splitlines()[-1])
            assert summary["ops"] > 20
    healed_t = time.monotonic()
    history = load_history(paths)
    assert history.ended == {1, 2}
    assert history.malformed_lines == 0
    counts = history.counts()
    assert set(counts) == {"put", "get", "remove", "get_or_compute", "batch_put", "batch_get"}
    assert counts["put"]["ok"] > 5
    # Both processes wrote some key: concurrent writers of one key happened.
    writers: dict[str, set[int]] = {}
    for w in history.writes():
        writers.setdefault(w.key, set()).add(w.op.process)
    assert any(len(ps) == 2 for ps in writers.values())

    final = collect_final_state(cluster.master_addresses, key_space(KEYS), settle_timeout_s=15)
    commits = sample_until_agreed({m.name: m.grpc for m in cluster.masters}, 20.0)
    with Client(cluster.master_addresses, timeout_s=TIMEOUT_S) as client:
        acknowledged = history.acknowledged_keys(live_member_ids(cluster.master_addresses))
        hits = verify_reads(client, acknowledged)
    assert acknowledged
    assert len(final.nodes) == 2
    assert final.leader is not None
    context = CheckContext(
        timeout_s=TIMEOUT_S,
        margin_s=1.5,
        final_state=final,
        heal_t=healed_t,
        commit_samples=commits,
        hit_rate_samples=[hits],
        converge_within_s=20.0,
        hit_rate_target=0.99,
        hit_rate_within_s=20.0,
        replica_target=1,
    )
    verdict = run_all(history, context)
    assert verdict.ok, verdict.to_text()
    assert not any(r.skipped for r in verdict.results), verdict.to_text()
    wrong = verdict.results[0]
    assert wrong.counters["hits"] > 0
    lost = verdict.results[1]
    assert lost.counters["kept"] > 0


@pytest.mark.chaos
def test_sigterm_ends_a_workload_cleanly_with_its_history(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    with workloads(cluster, tmp_path, [5], 120.0) as (procs, paths):
        time.sleep(3.0)
        procs[0].send_signal(signal.SIGTERM)
        _, err = procs[0].communicate(timeout=TIMEOUT_S + 10)
        assert procs[0].returncode == 0, err.decode()[-2000:]
    history = load_history(paths)
    assert history.ended == {5}
    assert len(history) > 0
    assert all(op.complete_t is not None for op in history.ops)


def test_history_files_flush_invocations_before_the_call(tmp_path: Path) -> None:
    # What a SIGKILLed workload leaves: every write it may have made is in the file.
    path = tmp_path / "h.jsonl"
    writer = HistoryWriter(path, flush_interval_s=3600)
    client = FakeClient()
    executor = Executor(client, 1)
    op = executor.execute(planned("put", ("k",), (ValueId(1, 1),)), writer.invoke)
    writer.complete(op)
    loaded = load_history([path])
    assert loaded.writes_of("k", ValueId(1, 1))
    writer.close()


def test_run_workload_writes_a_complete_history_and_stops_when_told(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    stop = threading.Event()
    cfg = config(3, out=path, duration_s=0.3, rate=200.0)
    summary = run_workload(cfg, stop, client=FakeClient())
    assert summary["ops"] > 10
    assert summary["ops"] <= 0.3 * 200 + 1  # the rate holds
    history = load_history([path])
    assert history.ended == {3}
    assert history.meta[3]["seed"] == 7
    assert len(history) == summary["ops"]
    stop.set()
    assert run_workload(config(3, out=path, duration_s=60.0), stop, client=FakeClient())["ops"] == 0
