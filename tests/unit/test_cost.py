"""The read-or-recompute cost model (kvpool.client.cost)."""

from __future__ import annotations

import pytest

from kvpool.client.cost import CostModel, TierSpeed
from kvpool.errors import InvalidArgumentError

SPEEDS = {
    "cpu": TierSpeed(bytes_per_s=1e9, per_block_s=0.0),  # 1 MB: 1 ms
    "ssd": TierSpeed(bytes_per_s=0.25e9, per_block_s=0.0),  # 1 MB: 4 ms
}


def _model(recompute_s_per_token: float | None) -> CostModel:
    return CostModel(SPEEDS, request_s=0.0, recompute_s_per_token=recompute_s_per_token)


def test_without_a_measurement_every_tier_is_read() -> None:
    plan = _model(None).plan(blocks=10, block_bytes=1_000_000, block_tokens=100)
    assert plan.fetch
    assert plan.max_tier is None
    assert plan.skipped_tiers == ()
    assert "no prefill measured" in plan.describe()


def test_expensive_recompute_reads_every_tier() -> None:
    plan = _model(1e-3).plan(blocks=10, block_bytes=1_000_000, block_tokens=100)  # 100 ms
    assert (plan.fetch, plan.max_tier, plan.skipped_tiers) == (True, "ssd", ())


def test_recompute_between_cpu_and_ssd_skips_the_ssd() -> None:
    plan = _model(2e-5).plan(blocks=10, block_bytes=1_000_000, block_tokens=100)  # 2 ms
    assert (plan.fetch, plan.max_tier, plan.skipped_tiers) == (True, "cpu", ("ssd",))
    assert "skip ssd" in plan.describe()


def test_cheap_recompute_skips_the_cache() -> None:
    plan = _model(1e-6).plan(blocks=10, block_bytes=1_000_000, block_tokens=100)  # 0.1 ms
    assert not plan.fetch
    assert "skip the cache" in plan.describe()


def test_request_overhead_can_outweigh_a_short_prompt() -> None:
    model = CostModel(SPEEDS, request_s=0.05, recompute_s_per_token=2e-4)  # 20 ms per block
    assert not model.plan(blocks=1, block_bytes=1_000_000, block_tokens=100).fetch
    assert model.plan(blocks=10, block_bytes=1_000_000, block_tokens=100).fetch


def test_tiers_are_a_leading_run() -> None:
    # An SSD configured faster than the CPU tier cannot be read while the CPU is skipped.
    speeds = {"cpu": TierSpeed(1e8, 0.0), "ssd": TierSpeed(1e10, 0.0)}
    model = CostModel(speeds, request_s=0.0, recompute_s_per_token=2e-5)
    assert not model.plan(blocks=4, block_bytes=1_000_000, block_tokens=100).fetch


def test_measurements_move_the_estimates() -> None:
    model = _model(None)
    model.observe_recompute(1000, 1.0)
    assert model.recompute_s_per_token == pytest.approx(1e-3)
    model.observe_recompute(1000, 2.0)
    assert 1e-3 < model.recompute_s_per_token < 2e-3  # type: ignore[operator]
    model.observe_recompute(0, 1.0)  # ignored
    model.observe_read("cpu", blocks=4, nbytes=4_000_000, seconds=0.024)  # 4 ms of transfer
    assert model.request_s == pytest.approx(0.3 * 0.020)
    for _ in range(30):
        model.observe_read("cpu", blocks=4, nbytes=4_000_000, seconds=0.024)
    assert model.request_s == pytest.approx(0.020, rel=1e-3)
    model.observe_read("nvme", blocks=1, nbytes=1, seconds=1.0)  # unknown tier: ignored
    assert set(model.tier_speeds) == {"cpu", "ssd"}


def test_a_slow_store_round_trip_makes_the_cache_not_worth_it() -> None:
    model = _model(1e-5)  # recompute: 1 ms per block of 100 tokens
    plan = model.plan(blocks=10, block_bytes=100_000, block_tokens=100)
    assert plan.fetch  # 0.1 ms per block read, no overhead known yet
    for _ in range(30):
        model.observe_read("cpu", blocks=10, nbytes=1_000_000, seconds=0.051)  # 50 ms fixed
    assert not model.plan(blocks=10, block_bytes=100_000, block_tokens=100).fetch


def test_bad_settings_raise() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown tiers"):
        CostModel({"tape": TierSpeed(1.0, 1.0)})
    with pytest.raises(InvalidArgumentError, match="smoothing"):
        CostModel(smoothing=0)
