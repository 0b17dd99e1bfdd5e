"""The example engine on an in-memory store: greedy outputs (and logits within float tolerance)
are the same with cached KV, without it, and when the store fails mid-run; the cost model's
skips; the connector's pause after a failure. Skipped without torch/transformers."""

from __future__ import annotations

import importlib.util
import random
from typing import Any

import pytest

from kvpool.client.cost import CostModel, TierSpeed
from kvpool.errors import UnavailableError
from tests.unit.memstore import MemoryStore

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
    reason="the llm extra is not installed (pip install 'kvpool[llm]')",
)

BLOCK = 16
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model() -> Any:
    from kvpool.engine.model import TEST_SPEC

    return TEST_SPEC.build()


def _engines(model: Any, store: Any, cost: CostModel | None = None) -> tuple[Any, Any]:
    from kvpool.engine.engine import Engine
    from kvpool.engine.model import TEST_SPEC

    cached = Engine.create(TEST_SPEC, client=store, block_size=BLOCK, cost_model=cost, model=model)
    plain = Engine.create(TEST_SPEC, model=model)
    return cached, plain


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def _assert_same(a: Any, b: Any) -> None:
    assert a.tokens == b.tokens
    for x, y in zip(a.logits, b.logits, strict=True):
        assert float((x - y).abs().max()) < TOLERANCE


def test_outputs_are_identical_with_and_without_the_cache(model: Any) -> None:
    store = MemoryStore()
    cached, plain = _engines(model, store)
    rng = random.Random(1)
    system = _tokens(rng, 200)
    results = []
    for _ in range(4):
        prompt = system + _tokens(rng, 21)
        a, b = cached.generate(prompt, 12), plain.generate(prompt, 12)
        _assert_same(a, b)
        results.append(a)
    assert results[0].load.loaded_blocks == 0
    for later in results[1:]:
        assert later.load.loaded_blocks == 200 // BLOCK  # the whole shared prompt
        assert later.prefill_tokens == 221 - later.load.tokens
    # The engine really generates from context: another prompt, other tokens.
    assert len({tuple(r.tokens) for r in results}) > 1


def test_a_fully_cached_prompt_still_computes_its_last_token(model: Any) -> None:
    store = MemoryStore()
    cached, plain = _engines(model, store)
    prompt = _tokens(random.Random(2), 4 * BLOCK)  # block-aligned
    cached.generate(prompt, 4)
    again = cached.generate(prompt, 4)
    assert again.load.loaded_blocks == 4
    assert again.load.tokens == 4 * BLOCK - 1
    assert again.prefill_tokens == 1
    _assert_same(again, plain.generate(prompt, 4))


def test_multi_turn_reuses_the_generated_tokens_too(model: Any) -> None:
    store = MemoryStore()
    cached, plain = _engines(model, store)
    rng = random.Random(3)
    history = _tokens(rng, 70)
    fed_before = 0  # tokens whose KV the previous turn computed (and saved, by full blocks)
    for _turn in range(3):
        a, b = cached.generate(history, 10), plain.generate(history, 10)
        _assert_same(a, b)
        assert a.load.tokens == fed_before // BLOCK * BLOCK
        fed_before = len(history) + len(a.tokens) - 1
        history = history + a.tokens + _tokens(rng, 25)


def test_wrong_kv_would_be_caught(model: Any) -> None:
    """The check above can fail: KV of another prompt under this prompt's keys changes the
    logits far beyond the tolerance."""
    store = MemoryStore()
    cached, plain = _engines(model, store)
    rng = random.Random(4)
    prompt, other = _tokens(rng, 80), _tokens(rng, 80)
    cached.generate(other, 1)
    keys_other = cached.connector.keys(other)
    keys_prompt = cached.connector.keys(prompt)
    for src, dst in zip(keys_other, keys_prompt, strict=True):
        store.blocks[dst] = store.blocks[src]  # a "wrong read" planted on purpose
    a, b = cached.generate(prompt, 4), plain.generate(prompt, 4)
    assert a.load.loaded_blocks == 80 // BLOCK
    assert float((a.logits[0] - b.logits[0]).abs().max()) > 100 * TOLERANCE


def test_the_store_failing_mid_run_falls_back_to_recompute(model: Any) -> None:
    store = MemoryStore()
    cached, plain = _engines(model, store)
    rng = random.Random(5)
    system = _tokens(rng, 160)
    cached.generate(system + _tokens(rng, 9), 4)

    # Blocks lost between the prefix match and the read (a node died in between).
    def lose_blocks(op: str) -> None:
        if op == "batch_get":
            store.blocks.clear()

    store.before_call = lose_blocks
    prompt = system + _tokens(rng, 9)
    a = cached.generate(prompt, 6)
    assert a.load.matched_blocks == 10
    assert a.load.loaded_blocks == 0
    assert "could not be read" in a.load.failure
    _assert_same(a, plain.generate(prompt, 6))
    store.before_call = None

    # The whole store down.
    store.down = True
    prompt = system + _tokens(rng, 9)
    a = cached.generate(prompt, 6)
    assert a.load.loaded_blocks == 0
    assert a.save is not None
    assert a.save.stored == 0
    _assert_same(a, plain.generate(prompt, 6))


class RaisingStore(MemoryStore):
    """A strict client whose cluster is gone: every call raises."""

    def _enter(self, op: str) -> bool:
        self.calls.append(op)
        if self.down:
            raise UnavailableError("no master answered")
        return True

    def batch_get(self, keys: Any, *, max_tier: str | None = None) -> list[bytes | None]:
        self._enter("batch_get")
        return super().batch_get(keys, max_tier=max_tier)


def test_after_a_store_failure_the_connector_waits_before_trying_again(model: Any) -> None:
    from kvpool.engine.connector import KVConnector
    from kvpool.engine.engine import Engine, namespace_for
    from kvpool.engine.model import TEST_SPEC

    now = [100.0]
    store = RaisingStore()
    spec = TEST_SPEC
    connector = KVConnector(
        store,
        namespace_for(spec, BLOCK),
        kv_shape=(spec.layers, 2, spec.kv_heads, spec.head_dim),
        dtype=spec.dtype,
        retry_after_s=5.0,
        clock=lambda: now[0],
    )
    engine = Engine(model, spec, connector)
    prompt = _tokens(random.Random(6), 100)
    engine.generate(prompt, 2)
    store.down = True
    first = engine.generate(prompt, 2).load
    assert first is not None
    assert "UnavailableError" in first.failure
    calls = len(store.calls)
    second = engine.generate(prompt, 2).load
    assert second is not None
    assert "failed recently" in second.failure
    assert len(store.calls) == calls  # the store was left alone
    store.down = False
    now[0] += 5.0
    third = engine.generate(prompt, 2).load
    assert third is not None
    assert third.loaded_blocks == 6
    assert not third.failure


def test_the_cost_model_skips_blocks_on_a_slow_tier(model: Any) -> None:
    store = MemoryStore()
    speeds = {"cpu": TierSpeed(1e9, 0.0), "ssd": TierSpeed(1e3, 0.0)}  # an absurdly slow SSD
    cost = CostModel(speeds, request_s=0.0, recompute_s_per_token=1e-3)
    cached, plain = _engines(model, store, cost)
    rng = random.Random(7)
    system = _tokens(rng, 128)
    cached.generate(system + _tokens(rng, 5), 2)
    keys = cached.connector.keys(system)
    for key in keys[4:]:
        store.tier[key] = "ssd"
    prompt = system + _tokens(rng, 5)
    a = cached.generate(prompt, 6)
    assert a.load.plan is not None
    assert a.load.plan.max_tier == "cpu"
    assert a.load.loaded_blocks == 4
    assert a.load.skipped_slow_tier == 4
    assert not a.load.failure  # a decision, not a failure
    _assert_same(a, plain.generate(prompt, 6))


def test_the_cost_model_can_skip_the_cache_entirely(model: Any) -> None:
    store = MemoryStore()
    cost = CostModel(request_s=1.0, recompute_s_per_token=1e-6)  # reads dearer than recompute
    cached, _ = _engines(model, store, cost)
    prompt = _tokens(random.Random(8), 100)
    cached.generate(prompt, 2)
    again = cached.generate(prompt, 2)
    assert again.load.plan is not None
    assert not again.load.plan.fetch
    assert "prefix_match" not in store.calls


def test_keys_fingerprint_the_model() -> None:
    from kvpool.engine.engine import namespace_for
    from kvpool.engine.model import TEST_SPEC, ModelSpec

    other = ModelSpec(**{**TEST_SPEC.__dict__, "seed": 1})
    tokens = list(range(64))
    a = namespace_for(TEST_SPEC, BLOCK)
    b = namespace_for(other, BLOCK)
    from kvpool.keys import block_keys

    assert not set(block_keys(a, tokens)) & set(block_keys(b, tokens))
    assert a.kv_layout == "hf-llama:L2,2,H2,T,D16"
