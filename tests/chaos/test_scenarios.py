"""Every chaos scenario, briefly (CI), and for a minute each (``make test-slow``, the
pre-release check). A run passes when every checker passes: nothing wrong read, nothing
acknowledged lost, every call inside its deadline, reads monotonic, the cluster converged."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from kvpool.chaos.runner import run_scenario
from kvpool.chaos.scenarios import SCENARIOS

BRIEF_S = 8.0
LONG_S = 60.0


def _run(name: str, duration_s: float, tmp_path: Path) -> None:
    result = run_scenario(SCENARIOS[name], duration_s=duration_s, directory=tmp_path)
    from kvpool.chaos.report import render_run

    report = render_run(result)
    assert result.ok, report
    injected = [f for f in result.faults if f["phase"] == "inject"]
    assert injected, report
    if os.geteuid() == 0:
        # As root every fault can be injected: none may be skipped or fail.
        assert all(f["outcome"] == "ok" for f in injected), report
    counts = result.counts
    assert sum(c.get("ok", 0) for c in counts.values()) > 50, report


@pytest.mark.chaos
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_briefly(name: str, tmp_path: Path) -> None:
    _run(name, BRIEF_S, tmp_path)


def _directory_reads(root: Path) -> int:
    """Reads the nodes' shared directories served, from the lines they log on stopping."""
    reads = 0
    for log in root.rglob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if "shm_directory_closed" in line:
                try:
                    reads += int(json.loads(line).get("reads", 0))
                except (ValueError, AttributeError):
                    continue
    return reads


@pytest.mark.chaos
@pytest.mark.parametrize("name", ["node-pause", "node-kill"])
def test_same_host_reads_with_no_message_under_node_faults(name: str, tmp_path: Path) -> None:
    """On loopback the workload's clients map the nodes' memory and read the blocks the nodes
    list in their directories with no message (namespaces, the suite's default, have no shared
    memory): paused and killed nodes, and still nothing wrong, lost or stale."""
    result = run_scenario(
        SCENARIOS[name], duration_s=BRIEF_S, directory=tmp_path, network="loopback"
    )
    from kvpool.chaos.report import render_run

    assert result.ok, render_run(result)
    assert _directory_reads(tmp_path) > 0, "no read went through a node's directory"


KNOWN_GAPS: dict[str, str] = {}
"""Scenarios whose minute-long run fails for a known, open reason (name → the reason; not
strict xfails: remove the entry when the gap is closed). ``node-drain`` was one until the
draining mark was replicated (issue 6)."""


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_GAPS[n], strict=False))
        if n in KNOWN_GAPS
        else n
        for n in SCENARIOS
    ],
)
def test_scenario_for_a_minute(name: str, tmp_path: Path) -> None:
    _run(name, LONG_S, tmp_path)


def test_schedules_replay_from_their_seed() -> None:
    for scenario in SCENARIOS.values():
        assert scenario.schedule(30, 5) == scenario.schedule(30, 5)
        steps = scenario.schedule(30, 5)
        assert steps
        assert all(0 < s.at_s < 30 for s in steps)
        # Faults never overlap: each is healed before the next is injected.
        for a, b in itertools.pairwise(steps):
            assert a.at_s + a.hold_s < b.at_s
        # A fault that is injected is drawn from the scenario's own pool.
        assert {s.fault for s in steps} <= set(scenario.faults)


def test_random_mix_draws_different_faults_from_different_seeds() -> None:
    mix = SCENARIOS["random-mix"]
    assert mix.schedule(120, 1) != mix.schedule(120, 2)
    assert len({s.fault for s in mix.schedule(120, 1)}) > 3
