"""Running one chaos scenario end to end.

1. A :class:`~kvpool.chaos.harness.ChaosHarness` starts 3 masters and 2 store nodes (in network
   namespaces when run as root, else on loopback), with link proxies and fake clocks when the
   scenario wants them.
2. Workload processes (``python -m kvpool.chaos.workload``) run for the whole duration in this
   (the root) namespace, each writing its history.
3. The nemesis follows the scenario's seeded schedule: inject, hold, heal.
4. After the last heal and the end of the workload, the runner probes until the masters agree
   and the verification reads recover (or the stated limits pass), reads the final index state,
   and runs every checker on the merged history.

Everything the run started — workload processes, cluster processes, proxies, namespaces — is
stopped at the end, also on a failure or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.chaos.checks import Verdict, run_all
from kvpool.chaos.final_state import (
    HitRateSample,
    collect_final_state,
    fault_windows,
    live_member_ids,
    logged_evictions,
    sample_until_agreed,
    verify_reads,
)
from kvpool.chaos.harness import ChaosHarness
from kvpool.chaos.history import CheckContext, History, load_history
from kvpool.chaos.nemesis import FAULTS, HEALABLE, FaultEvent, Nemesis
from kvpool.chaos.netns import NamespaceNetwork
from kvpool.chaos.scenarios import Scenario, Step
from kvpool.chaos.workload import key_space
from kvpool.client.sync import Client
from kvpool.errors import KVPoolError
from kvpool.logs import get_logger

CONVERGE_WITHIN_S = 20.0
"""Stated limit: after the last heal, every master reaches the same commit index within this."""
HIT_RATE_WITHIN_S = 20.0
"""Stated limit: verification reads of acknowledged keys reach the scenario's hit_rate_target
(90 % unless the scenario is capacity-bound by design) within this."""
DEADLINE_MARGIN_S = 1.0
"""Stated margin: every call returns within its deadline plus this (a loaded 2-core machine)."""

Progress = Callable[[str], None]


class ChaosRunError(KVPoolError):
    """The run could not be carried out (not a checker failure)."""

    code = "CHAOS"


@dataclass
class RunResult:
    scenario: str
    seed: int
    duration_s: float
    network: str
    skipped_reasons: dict[str, str]
    schedule: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    verdict: Verdict
    failover_s: list[float]
    latency: dict[str, dict[str, float | int]]
    setup_s: float
    directory: str
    started_t: float = 0.0  # time.monotonic() when the workload started
    counts: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.verdict.ok

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "seed": self.seed,
            "duration_s": self.duration_s,
            "network": self.network,
            "ok": self.ok,
            "operations": self.counts,
            "schedule": self.schedule,
            "faults": self.faults,
            "skipped_reasons": self.skipped_reasons,
            "failover_s": self.failover_s,
            "latency": self.latency,
            "setup_s": self.setup_s,
            "started_t": self.started_t,
            "checks": self.verdict.to_json(),
            "directory": self.directory,
        }


# --- measurements from the history ------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency_by_phase(history: History, events: list[FaultEvent]) -> dict[str, dict[str, Any]]:
    """p50/p99 call latency (ms) of calls invoked while a fault was active, and of the rest."""
    windows = [(w.start_t, w.end_t) for w in fault_windows(events)]
    during: list[float] = []
    outside: list[float] = []
    for op in history.ops:
        if op.complete_t is None:
            continue
        latency = op.complete_t - op.invoke_t
        active = any(start <= op.invoke_t <= (end or float("inf")) for start, end in windows)
        (during if active else outside).append(latency)
    out: dict[str, dict[str, Any]] = {}
    for name, values in (("during_faults", during), ("outside_faults", outside)):
        out[name] = (
            {
                "calls": len(values),
                "p50_ms": round(_percentile(values, 0.5) * 1e3, 2),
                "p99_ms": round(_percentile(values, 0.99) * 1e3, 2),
            }
            if values
            else {"calls": 0}
        )
    return out


LEADER_FAULT_KINDS = {"kill", "pause", "isolate"}


def failover_times(history: History, events: list[FaultEvent]) -> list[float]:
    """For each fault that hit the leader: seconds from the moment the fault was in force (the
    kill, pause or cut done) until the first put invoked after it was acknowledged."""
    puts = sorted(
        (op for op in history.ops if op.kind in ("put", "batch_put") and op.outcome == "ok"),
        key=lambda op: op.end_t,
    )
    out = []
    for ev in events:
        if ev.phase != "inject" or not ev.ok or ev.selector != "leader":
            continue
        if ev.kind not in LEADER_FAULT_KINDS:
            continue
        in_force = ev.monotonic_s + ev.duration_s
        first = next((op for op in puts if op.invoke_t >= in_force), None)
        if first is not None and first.complete_t is not None:
            out.append(round(first.complete_t - in_force, 3))
    return out


# --- the run ------------------------------------------------------------------------------------


class _Workloads:
    """The workload processes of a run; stopped (by pid) whatever happens."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.paths: list[Path] = []

    def start(
        self,
        *,
        scenario: Scenario,
        masters: list[str],
        seed: int,
        duration_s: float,
        directory: Path,
        processes: int,
    ) -> None:
        for pid in range(1, processes + 1):
            path = directory / f"history-{pid}.jsonl"
            argv = [
                sys.executable, "-m", "kvpool.chaos.workload",
                "--masters", ",".join(masters),
                "--process-id", str(pid),
                "--seed", str(seed),
                "--duration", str(duration_s),
                "--keys", str(scenario.keys),
                "--out", str(path),
                "--timeout-s", str(scenario.timeout_s),
            ]  # fmt: skip
            if scenario.mix:
                argv += ["--mix", scenario.mix]
            if scenario.content_keys:
                argv.append("--content-keys")
            argv += scenario.workload_args
            log = open(directory / f"workload-{pid}.log", "wb")  # noqa: SIM115 - given to the child
            try:
                self.procs.append(
                    subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=directory)
                )
            finally:
                log.close()
            self.paths.append(path)

    def lines_written(self) -> int:
        total = 0
        for path in self.paths:
            with contextlib.suppress(OSError), open(path, "rb") as fh:
                total += sum(1 for _ in fh)
        return total

    def wait(self, timeout_s: float) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        return [p.poll() for p in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


class _Ticker:
    """A live progress line, once a second, from its own thread."""

    def __init__(self, progress: Progress | None, describe: Callable[[], str]) -> None:
        self._progress = progress
        self._describe = describe
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-progress", daemon=True)

    def __enter__(self) -> _Ticker:
        if self._progress is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        assert self._progress is not None
        while not self._stop.wait(1.0):
            with contextlib.suppress(Exception):  # a progress line must never break a run
                self._progress(self._describe())


def _follow_schedule(
    nemesis: Nemesis,
    schedule: list[Step],
    t0: float,
    state: dict[str, Any],
    stop: threading.Event,
) -> None:
    for step in schedule:
        if stop.wait(max(0.0, t0 + step.at_s - time.monotonic())):
            return
        fault = FAULTS[step.fault]
        state["active"] = step.fault
        event = nemesis.inject(fault)
        if fault.kind in HEALABLE and event.outcome != "skipped":
            stop.wait(max(0.0, t0 + step.at_s + step.hold_s - time.monotonic()))
            nemesis.heal(event)
        state["active"] = ""
        state["done"] += 1


@contextlib.contextmanager
def _run_directory(directory: str | Path | None, keep: bool) -> Iterator[Path]:
    if directory is not None:
        path = Path(directory).resolve()
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="kvpool-chaos-"))
    try:
        yield path
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def run_scenario(
    scenario: Scenario,
    *,
    seed: int | None = None,
    duration_s: float = 60.0,
    directory: str | Path | None = None,
    network: str = "auto",
    processes: int | None = None,
    progress: Progress | None = None,
    keep: bool = False,
) -> RunResult:
    """Run ``scenario`` for ``duration_s`` seconds and judge it. Raises ChaosRunError when the
    run itself could not be carried out; a checker failure is in the result (``ok`` False)."""
    seed = scenario.default_seed if seed is None else seed
    duration_s = max(duration_s, scenario.min_duration_s)
    schedule = scenario.schedule(duration_s, seed)
    log = get_logger("kvpool.chaos.runner").bind(scenario=scenario.name, seed=seed)
    with _run_directory(directory, keep) as root:
        harness = ChaosHarness(
            root / "cluster",
            masters=3,
            nodes=scenario.nodes,
            network=network,
            proxies=scenario.proxies,
            fake_clocks=scenario.fake_clocks,
            seed=seed,
            cpu_cache_size=scenario.cpu_cache_size,
            node_timeout_s=scenario.node_timeout_s,
            heartbeat_interval_s=0.4,
            log_level="info",
            extra_master_flags=scenario.extra_master_flags,
            extra_node_flags=scenario.extra_node_flags,
        )
        workloads = _Workloads()
        stop = threading.Event()
        state: dict[str, Any] = {"active": "", "done": 0}
        try:
            with harness.handle_signals():
                harness.start()
                nemesis = Nemesis(harness, random.Random(seed))
                log.info("chaos_run_started", network=harness.network_mode, faults=len(schedule))
                workloads.start(
                    scenario=scenario,
                    masters=harness.masters_for_clients(),
                    seed=seed,
                    duration_s=duration_s,
                    directory=root,
                    processes=processes or scenario.processes,
                )
                t0 = time.monotonic()

                def describe() -> str:
                    elapsed = time.monotonic() - t0
                    active = state["active"] or "-"
                    return (
                        f"[{scenario.name}] {min(elapsed, duration_s):5.1f}/{duration_s:.0f}s  "
                        f"ops {workloads.lines_written():6d}  faults {state['done']}/"
                        f"{len(schedule)}  now: {active}"
                    )

                with _Ticker(progress, describe):
                    _follow_schedule(nemesis, schedule, t0, state, stop)
                    nemesis.heal_all()
                    workloads.wait(max(0.0, t0 + duration_s - time.monotonic()) + 30)
                    workloads.stop()
                    # Convergence is timed from here: every fault healed and the writes stopped
                    # (while the workload runs on through the quiet tail, the commit index moves
                    # and "all masters agree" cannot be observed).
                    heal_t = time.monotonic()
                    result = _judge(
                        harness=harness,
                        scenario=scenario,
                        workloads=workloads,
                        nemesis=nemesis,
                        heal_t=heal_t,
                        progress=progress,
                    )
                return RunResult(
                    scenario=scenario.name,
                    seed=seed,
                    duration_s=duration_s,
                    network=(
                        "netns" if isinstance(harness.network, NamespaceNetwork) else "loopback"
                    ),
                    skipped_reasons=_skips(nemesis.events),
                    schedule=[s.__dict__ for s in schedule],
                    faults=[e.to_json() for e in nemesis.events],
                    verdict=result[0],
                    failover_s=failover_times(result[1], list(nemesis.events)),
                    latency=latency_by_phase(result[1], list(nemesis.events)),
                    setup_s=round(harness.setup_s, 2),
                    directory=str(root) if (keep or directory) else "",
                    started_t=t0,
                    counts=result[1].counts(),
                )
        finally:
            stop.set()
            workloads.stop()
            harness.close()


def _skips(events: Any) -> dict[str, str]:
    return {e.fault: e.reason for e in events if e.outcome == "skipped" and e.phase == "inject"}


def _judge(
    *,
    harness: ChaosHarness,
    scenario: Scenario,
    workloads: _Workloads,
    nemesis: Nemesis,
    heal_t: float,
    progress: Progress | None,
) -> tuple[Verdict, History]:
    masters = harness.cluster.master_addresses
    names = {m.name: m.grpc for m in harness.cluster.masters}
    if progress:
        progress(f"[{scenario.name}] healed; waiting for the masters to agree and reads to recover")
    commit_samples = sample_until_agreed(names, CONVERGE_WITHIN_S + 5)
    history = load_history(workloads.paths)
    hit_samples: list[HitRateSample] = []
    live = live_member_ids(masters)
    acknowledged = history.acknowledged_keys(live)
    with Client(masters, timeout_s=2.0) as client:
        deadline = time.monotonic() + HIT_RATE_WITHIN_S + 5
        while time.monotonic() < deadline:
            sample_hits = verify_reads(client, acknowledged)
            hit_samples.append(sample_hits)
            if sample_hits.hit_rate >= scenario.hit_rate_target:
                break
            time.sleep(0.5)
    keys = key_space(scenario.keys, content=scenario.content_keys)
    final = collect_final_state(masters, keys, settle_timeout_s=15)
    context = CheckContext(
        timeout_s=scenario.timeout_s,
        margin_s=DEADLINE_MARGIN_S,
        final_state=final,
        faults=fault_windows(nemesis.events),
        heal_t=heal_t,
        commit_samples=commit_samples,
        hit_rate_samples=hit_samples,
        converge_within_s=CONVERGE_WITHIN_S,
        hit_rate_target=scenario.hit_rate_target,
        hit_rate_within_s=HIT_RATE_WITHIN_S,
        replica_target=scenario.replica_target,
        evicted_members=logged_evictions(n.log for n in harness.cluster.nodes),
    )
    return run_all(history, context), history


def write_result(result: RunResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result.to_json(), indent=2, default=str) + "\n")


def env_is_root() -> bool:
    return os.geteuid() == 0
