"""The fuzz suite at every port of a real cluster (issue 16): random, truncated, oversized and
bit-flipped frames and junk gRPC requests to the masters' gRPC, Raft, frame RPC, read and
/metrics ports and the nodes' data port, shared-memory socket, admin gRPC and /metrics. After
the run: every process alive, its memory within a stated margin of where it was, every known
block read back exactly. A short run here; a long one marked slow."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.launcher.cluster import LocalCluster
from tests.fuzzing import hostile, raft_hostile
from tests.hostile_cluster import KnownBlocks, alive, attack_all, memory

pytestmark = pytest.mark.integration

MEMORY_MARGIN_MIB = 48.0
"""How far a process's RSS may end above where it was (allocator slack, lazily built caches)."""


def _inputs(per_port: int, seed: int) -> Callable[[str], list[bytes]]:
    """Examples drawn from the strategies (hypothesis's ``example()`` is for exploration; here
    we draw with a fixed seed through ``find``-free generation)."""
    collected: dict[str, list[bytes]] = {}

    @settings(
        max_examples=per_port,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(frame=hostile(), raft=raft_hostile(), salt=st.just(seed))
    def draw(frame: bytes, raft: bytes, salt: int) -> None:
        collected.setdefault("frame", []).append(frame)
        collected.setdefault("raft", []).append(raft)

    draw()

    def inputs(port: str) -> list[bytes]:
        return collected["raft" if port.endswith("raft") else "frame"]

    return inputs


def _run(tmp_path: Path, per_port: int, deadline_s: float) -> None:
    cluster = LocalCluster(
        tmp_path / "cluster", masters=3, nodes=2, cpu_cache_size="256MiB", metrics=True
    )
    cluster.start()
    try:
        known = KnownBlocks(cluster)
        known.put()
        before = memory(cluster)
        sent = attack_all(cluster, _inputs(per_port, 16), deadline_s=deadline_s)
        assert len(sent) >= 19, f"ports reached: {sorted(sent)}"  # 5 per master, 4 per node
        assert sum(name.endswith(" read") for name in sent) == 3, f"ports reached: {sorted(sent)}"
        after = memory(cluster)
        print(f"\ninputs per port: {sent}")
        print(f"RssAnon MiB before: {before}")
        print(f"RssAnon MiB after:  {after}")
        print(f"VmRSS MiB after (nodes include their CPU tier): {memory(cluster, 'VmRSS')}")
        assert alive(cluster) == list(cluster.processes), "a process died"
        for name, mib in after.items():
            assert mib - before[name] < MEMORY_MARGIN_MIB, f"{name}: {before[name]} -> {mib} MiB"
        same, total = known.read_back()
        assert same == total, f"{total - same} of {total} known blocks not read back exactly"
        for info in cluster.processes.values():
            log = Path(info.log).read_text(errors="replace")
            assert log.count("Traceback") <= 3, f"{info.name} logged tracebacks:\n{log[-3000:]}"
            assert log.count("Exception in callback") == 0, f"{info.name}:\n{log[-3000:]}"
    finally:
        cluster.stop()


def test_every_port_briefly(tmp_path: Path) -> None:
    _run(tmp_path, per_port=60, deadline_s=60.0)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the attack stops itself after 900 s; the suite's 180 s is for others
def test_every_port_long(tmp_path: Path) -> None:
    _run(tmp_path, per_port=2000, deadline_s=900.0)
