"""``kvpool-bench index``: the master's measurements still run, at small sizes."""

from __future__ import annotations

import pytest

from kvpool_bench import index

pytestmark = pytest.mark.integration


def test_bench_functions_run_at_small_sizes() -> None:
    memory = index.index_memory(2000)
    assert 50 < memory["bytes_per_entry"] < 2000
    assert index.apply_throughput(2000, per_command=100)["entries_per_s"] > 0
    stall = index.compaction_stall(3000, per_command=1000, baseline_s=0.2)
    assert stall["dump_bytes"] > 0
    assert len(stall["raft_thread_blocked_in_fork_ms"]) >= 1
    latency = index.sync_commit_latency(commits=20)
    assert 0 < latency["p50_ms"] <= latency["max_ms"]
    throughput = index.group_commit_throughput(concurrency=8, entries_per_request=4, duration_s=0.5)
    assert throughput["entries_per_s"] == pytest.approx(throughput["requests_per_s"] * 4, rel=0.01)
