"""The example engine on a real local cluster: identical greedy outputs with KV from kvpool,
without it, and with store nodes and masters SIGKILLed mid-run; and `kvpool demo chat --quick`
end to end. Skipped without torch/transformers."""

from __future__ import annotations

import importlib.util
import random
import time
from typing import Any

import pytest

from kvpool.client.sync import Client
from kvpool.launcher.cluster import LocalCluster
from tests.integration.conftest import ClusterFactory

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None
        or importlib.util.find_spec("transformers") is None,
        reason="the llm extra is not installed (pip install 'kvpool[llm]')",
    ),
]

BLOCK = 16


class KillingClient:
    """A client that SIGKILLs the store nodes right before its first batched read: the blocks
    the prefix match just promised are gone when the engine reads them."""

    def __init__(self, client: Client, cluster: LocalCluster) -> None:
        self._client = client
        self._cluster = cluster
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def batch_get(self, keys: Any, *, max_tier: str | None = None) -> list[bytes | None]:
        if self.armed:
            self.armed = False
            for name in self._cluster.node_names:
                self._cluster.kill(name)
            # Dead, not dying: a node killed an instant ago may still answer from its memory
            # (over shared memory, through its directory) — right bytes, but not this test's.
            deadline = time.monotonic() + 10
            while any(self._cluster.is_running(n) for n in self._cluster.node_names):
                assert time.monotonic() < deadline, "the killed nodes did not exit"
                time.sleep(0.01)
        return self._client.batch_get(keys, max_tier=max_tier)


def _same(a: Any, b: Any) -> bool:
    close = all(float((x - y).abs().max()) < 1e-4 for x, y in zip(a.logits, b.logits, strict=True))
    return bool(a.tokens == b.tokens and close)


def test_identical_outputs_with_the_cache_without_it_and_with_the_store_killed(
    cluster_factory: ClusterFactory,
) -> None:
    from kvpool.engine.engine import Engine
    from kvpool.engine.model import TEST_SPEC

    cluster = cluster_factory(masters=1, nodes=2, cpu_cache_size="64MiB", in_memory=True)
    model = TEST_SPEC.build()
    rng = random.Random(11)
    system = [rng.randrange(256) for _ in range(300)]

    def prompt() -> list[int]:
        return system + [rng.randrange(256) for _ in range(20)]

    with Client(cluster.client_master_addresses, timeout_s=1.0, strict=True) as kv:
        killing = KillingClient(kv, cluster)
        cached = Engine.create(TEST_SPEC, client=killing, block_size=BLOCK, model=model)
        plain = Engine.create(TEST_SPEC, model=model)

        first = cached.generate(prompt(), 8)
        assert first.save is not None
        assert first.save.stored == first.save.blocks > 0
        p = prompt()
        warm = cached.generate(p, 8)
        assert warm.load is not None
        assert warm.load.loaded_blocks == 300 // BLOCK
        assert warm.load.bytes == 300 // BLOCK * BLOCK * TEST_SPEC.kv_bytes_per_token
        assert _same(warm, plain.generate(p, 8))

        killing.armed = True  # the nodes die between prefix_match and the read
        p = prompt()
        killed = cached.generate(p, 8)
        assert killed.load is not None
        assert killed.load.matched_blocks == 300 // BLOCK
        assert killed.load.loaded_blocks == 0
        assert killed.load.failure
        assert _same(killed, plain.generate(p, 8))

        for name in cluster.master_names:
            cluster.kill(name)
        p = prompt()
        no_masters = cached.generate(p, 8)
        assert no_masters.load is not None
        assert no_masters.load.loaded_blocks == 0
        assert no_masters.ttft_s < 1.0 + 2.0  # one deadline, then recompute
        assert _same(no_masters, plain.generate(p, 8))


@pytest.mark.timeout(240)
def test_demo_chat_quick_end_to_end(tmp_path: Any) -> None:
    from dataclasses import replace

    from kvpool.engine.chat import QUICK, run_chat

    lines: list[str] = []
    report = run_chat(replace(QUICK, requests=3), directory=str(tmp_path), say=lines.append)
    text = "\n".join(lines)
    summary = report["summary"]
    assert summary["compared_outputs"] == len(report["requests"]) >= 10
    assert summary["identical_outputs"] == summary["compared_outputs"], text
    sections = {r["section"] for r in report["requests"]}
    assert sections == {"shared", "multi_turn", "slow_tier", "killed"}
    killed = [r for r in report["requests"] if r["section"] == "killed"][1:]
    # Each is a recompute: a read that failed, or (once the dead nodes were declared down, a
    # matter of seconds on a loaded machine) an honest miss in the index.
    assert all(r["loaded_blocks"] == 0 for r in killed), text
    assert all(r["failure"] or r["matched_blocks"] == 0 for r in killed), text
    assert killed[0]["failure"], text  # the first one found the blocks and could not read them
    slow = next(r for r in report["requests"] if r["label"] == "SSD declared slow")
    assert slow["skipped_slow_tier"] > 0, text  # blocks on the SSD tier, skipped, recomputed
    assert "skip ssd" in slow["plan"]
    assert "Summary" in text
    assert "identical greedy outputs" in text
