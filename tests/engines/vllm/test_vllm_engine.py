"""kvpool's KV connector inside a real vLLM engine (the CPU build), against a real kvpool cluster.

Engines are processes of their own (``kvpool.engine.vllm_runner``: a small Llama with vLLM's
dummy weights, token-id prompts, greedy decoding), started together to save time and always
stopped. Run by ``make test-engines-vllm`` in its own environment (``.venv-vllm``); skipped
where vLLM is not installed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-engines-vllm builds it)")

from kvpool.client.sync import Client
from kvpool.engine.vllm_runner import EngineProcess, TinyLlama, write_model_config
from kvpool.integrations.vllm_blocks import HashChain, PagedLayout, paged_layout
from kvpool.launcher.cluster import LocalCluster

pytestmark = pytest.mark.timeout(1800)

SPEC = TinyLlama()
BLOCK = 128  # vLLM's CPU default
MODEL_ID = "kvpool-test-vllm"
TIMEOUT_S = 1.0


def documented_layout() -> PagedLayout:
    """The layout docs/engines/vllm.md says this engine's blocks have (computed here, from the
    page, not from vLLM)."""
    head = SPEC.hidden_size // SPEC.heads
    return paged_layout(
        model=MODEL_ID, revision="", dtype="bfloat16", block_size=BLOCK,
        layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(SPEC.layers)],
        page_bytes=SPEC.kv_heads * BLOCK * 2 * head * 2, physical_layout="LBHNC:NONE",
        page_shape=(SPEC.kv_heads, BLOCK, head, head), tp_size=1, extra="load_format=dummy",
    )  # fmt: skip


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model_dir(root: Path) -> Path:
    return write_model_config(root / "model", SPEC)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path / "cluster", masters=3, nodes=2, cpu_cache_size="256MiB",
                     in_memory=True)  # fmt: skip
    try:
        c.start()
        yield c
    finally:
        c.stop()


def kvpool_settings(cluster: LocalCluster, **extra: Any) -> dict[str, Any]:
    return {
        "masters": ",".join(cluster.client_master_addresses),
        "timeout_s": TIMEOUT_S,
        "model": MODEL_ID,
        **extra,
    }


def start_all(engines: list[EngineProcess], env: dict[str, str]) -> None:
    with ThreadPoolExecutor(len(engines)) as pool:
        for f in [pool.submit(e.start, 900.0, env) for e in engines]:
            f.result()


def prompts(seed: int, prefix_tokens: int, n: int, suffix: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, SPEC.vocab_size) for _ in range(prefix_tokens)]
    return [
        prefix + [rng.randrange(3, SPEC.vocab_size) for _ in range(suffix + i)] for i in range(n)
    ]


def tokens(answer: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for o in answer["outputs"]]


def cached(answer: dict[str, Any]) -> list[int]:
    return [o["cached_tokens"] for o in answer["outputs"]]


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[EngineProcess]]:
    started: list[EngineProcess] = []
    try:
        yield started
    finally:
        for e in started:
            e.stop()


def test_kvpool_engines_give_the_tokens_of_a_plain_engine_and_a_second_one_reads_the_first(
    cluster: LocalCluster, model_dir: Path, tmp_path: Path, engines: list[EngineProcess]
) -> None:
    kv = kvpool_settings(cluster)
    base = {"model_dir": str(model_dir)}
    writer = EngineProcess({**base, "kvpool": kv, "prefix_caching": True}, log=tmp_path / "w.log")
    reader = EngineProcess({**base, "kvpool": kv, "prefix_caching": False}, log=tmp_path / "r.log")
    plain = EngineProcess({**base, "kvpool": None}, log=tmp_path / "p.log")
    engines += [writer, reader, plain]
    start_all(engines, cluster.client_env)

    batch = prompts(1, 600, 4)  # 4 requests in one batch sharing 4 full blocks + their own
    lone = prompts(2, 300, 1)  # and one of its own
    expected = tokens(plain.generate(batch + lone, 8))

    first = writer.generate(batch + lone, 8)
    assert tokens(first) == expected

    # The blocks are in kvpool under the keys docs/engines/vllm.md gives.
    layout = documented_layout()
    chain = HashChain(layout)
    chain.extend(batch[0], 4)
    keys = layout.match_keys(chain.chains, 0, 4)
    with Client(cluster.client_master_addresses, timeout_s=5.0) as kvc:
        deadline = time.monotonic() + 10
        while kvc.prefix_match(keys) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.2)  # saves are off the forward pass: they land shortly after
        assert kvc.prefix_match(keys) == len(keys)

    # A second engine process (its own prefix cache off: anything cached came from kvpool)
    # reads the 4 shared blocks (512 tokens) and the lone prompt's 2, and skips that prefill.
    second = reader.generate(batch + lone, 8)
    assert tokens(second) == expected
    assert cached(second) == [512, 512, 512, 512, 256]

    # The loaded KV is really used: noise written over a prompt's pages in kvpool changes
    # the reader's output (the writer saved it; the reader has never seen it).
    fresh = prompts(3, 600, 1)
    assert tokens(writer.generate(fresh, 8)) == tokens(plain.generate(fresh, 8))
    chain = HashChain(layout)
    chain.extend(fresh[0], 4)
    noise = np.random.default_rng(0).standard_normal(layout.page_bytes // 2).astype(np.float32)
    garbage = (noise.view(np.uint32) >> 16).astype(np.uint16).tobytes()  # bfloat16 N(0, 1)
    with Client(cluster.client_master_addresses, timeout_s=5.0) as kvc:
        time.sleep(1.0)
        for h in chain.chains[0]:
            for key in layout.block_keys(0, h):
                assert kvc.exists(key)
                assert kvc.put(key, garbage)
    noisy = reader.generate(fresh, 8)
    assert cached(noisy) == [512]
    assert tokens(noisy) != tokens(plain.generate(fresh, 8))


def test_every_request_completes_correctly_when_the_store_dies_mid_run(
    cluster: LocalCluster, model_dir: Path, tmp_path: Path, engines: list[EngineProcess]
) -> None:
    kv = kvpool_settings(cluster)
    base = {"model_dir": str(model_dir), "prefix_caching": False}
    engine = EngineProcess({**base, "kvpool": kv}, log=tmp_path / "k.log")
    plain = EngineProcess({**base, "kvpool": None}, log=tmp_path / "p.log")
    engines += [engine, plain]
    start_all(engines, cluster.client_env)

    def both(batch: list[list[int]]) -> tuple[dict[str, Any], dict[str, Any], float]:
        expected = plain.generate(batch, 6)
        started = time.monotonic()
        answer = engine.generate(batch, 6, timeout_s=120)
        return answer, expected, time.monotonic() - started

    warm, expected, _ = both(prompts(5, 700, 3))
    assert tokens(warm) == tokens(expected)
    time.sleep(1.0)  # the saves land
    loaded, expected, _ = both(prompts(5, 700, 3))
    assert tokens(loaded) == tokens(expected)
    assert cached(loaded) == [640, 640, 640]

    for name in cluster.node_names:
        cluster.kill(name)
    # The masters still list the blocks: vLLM is offered them, the reads fail, vLLM is told
    # which blocks failed and recomputes them.
    dead_nodes, expected, wall = both(prompts(5, 700, 3))
    assert tokens(dead_nodes) == tokens(expected)
    assert wall < expected["wall_s"] + 10 * TIMEOUT_S
    log = (tmp_path / "k.log").read_text(errors="replace")
    assert "kv_load_failed_blocks" in log

    for name in cluster.master_names:
        cluster.kill(name)
    for _ in range(2):  # the first waits for the deadline, the next skip the dead store
        no_masters, expected, wall = both(prompts(6, 700, 2))
        assert tokens(no_masters) == tokens(expected)
        assert cached(no_masters) == [0, 0]
        assert wall < expected["wall_s"] + 10 * TIMEOUT_S


def test_a_misspelt_setting_stops_the_engine_with_the_settings_name(
    cluster: LocalCluster, model_dir: Path, tmp_path: Path, engines: list[EngineProcess]
) -> None:
    from kvpool.engine.vllm_runner import EngineError

    bad = {"mastrs": ",".join(cluster.client_master_addresses)}
    engine = EngineProcess({"model_dir": str(model_dir), "kvpool": bad}, log=tmp_path / "b.log")
    engines.append(engine)
    with pytest.raises(EngineError):
        engine.start(900.0, cluster.client_env)
    log = (tmp_path / "b.log").read_text(errors="replace")
    assert "kv_transfer_config.kv_connector_extra_config['mastrs']: unknown setting" in log
