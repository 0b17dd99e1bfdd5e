"""check_convergence on hand-made probe samples and final states: after healing, the masters
agree within the stated time and the hit rate recovers within the stated time."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvpool.chaos import check_convergence, final_state
from kvpool.chaos.final_state import CommitSample, FinalState, HitRateSample, MasterState
from kvpool.chaos.history import CheckContext, CheckResult, History

HEAL_T = 100.0


def sample(t: float, a: int | None, b: int | None, c: int | None) -> CommitSample:
    commits = {"master-1": a, "master-2": b, "master-3": c}
    return CommitSample(HEAL_T + t, commits, dict(commits))


def hit(t: float, rate: float, wrong: int = 0) -> HitRateSample:
    return HitRateSample(HEAL_T + t, rate, 100, int(rate * 100), wrong)


def final(settled_after_s: float | None) -> FinalState:
    masters = [
        MasterState(f"127.0.0.1:{p}", "leader" if p == 1 else "follower", 3, 50, 50, 40)
        for p in (1, 2, 3)
    ]
    settled = None if settled_after_s is None else HEAL_T + settled_after_s
    return FinalState(t=HEAL_T + 20, masters=masters, settled_t=settled)


def run(
    commits: Sequence[CommitSample] = (),
    hits: Sequence[HitRateSample] = (),
    state: FinalState | None = None,
) -> CheckResult:
    context = CheckContext(
        heal_t=HEAL_T,
        final_state=state,
        commit_samples=commits,
        hit_rate_samples=hits,
        converge_within_s=10.0,
        hit_rate_target=0.9,
        hit_rate_within_s=15.0,
    )
    return check_convergence.check(History([]), context)


# --- histories that pass ------------------------------------------------------------------------


def test_masters_that_catch_up_and_a_hit_rate_that_recovers_pass() -> None:
    result = run(
        [sample(0.5, 40, 12, 40), sample(3.0, 44, 30, 44), sample(6.0, 47, 45, 47)],
        [hit(1.0, 0.2), hit(5.0, 0.6), hit(9.0, 0.95)],
        final(12.0 - 10.0),
    )
    assert result.ok, result.details
    assert result.counters["catch_up_s"] == 6.0
    assert result.counters["hit_rate_recovery_s"] == 9.0
    assert result.counters["agree_s"] == 2.0
    assert not result.skipped


def test_samples_before_healing_are_ignored() -> None:
    result = run(
        [sample(-5.0, 10, None, None), sample(1.0, 20, 20, 20)], [hit(-3.0, 0.0), hit(1, 1)]
    )
    assert result.ok, result.details


def test_nothing_to_judge_by_is_skipped() -> None:
    result = run()
    assert result.ok
    assert result.skipped


# --- histories that must fail ------------------------------------------------------------------


def test_a_master_that_never_catches_up_fails() -> None:
    result = run([sample(0.5, 40, 40, 12), sample(5.0, 60, 60, 13), sample(9.0, 70, 70, 13)])
    assert not result.ok
    assert "'master-3': 13" in result.details[0]


def test_a_master_that_does_not_answer_fails() -> None:
    result = run([sample(5.0, 50, 50, None), sample(8.0, 60, 60, None)])
    assert not result.ok


def test_catching_up_only_after_the_stated_time_fails() -> None:
    result = run([sample(0.5, 40, 10, 40), sample(9.0, 41, 20, 41), sample(11.0, 41, 41, 41)])
    assert not result.ok
    assert "within 10.0s" in result.details[0]


def test_masters_that_never_agreed_at_the_end_fail() -> None:
    result = run(state=final(None))
    assert not result.ok
    assert "never agreed" in result.details[0]


def test_masters_that_agreed_too_late_fail() -> None:
    result = run(state=final(10.5))
    assert not result.ok
    assert "agreed only 10.5s after healing" in result.details[0]


def test_agreement_is_timed_from_when_the_collector_began_to_look() -> None:
    state = final(30.0)
    state.started_t = HEAL_T + 25.0  # the runner collected late; they agreed 5 s after
    assert run(state=state).ok
    state.started_t = HEAL_T + 15.0
    assert not run(state=state).ok


def test_a_hit_rate_that_never_recovers_fails() -> None:
    result = run(hits=[hit(1.0, 0.2), hit(10.0, 0.5), hit(14.0, 0.85)])
    assert not result.ok
    assert "best 85.0%" in result.details[0]


def test_a_hit_rate_that_recovers_too_late_fails() -> None:
    result = run(hits=[hit(1.0, 0.2), hit(16.0, 1.0)])
    assert not result.ok


def test_a_wrong_verification_read_fails() -> None:
    result = run(hits=[hit(1.0, 1.0, wrong=1)])
    assert not result.ok
    assert "not a value of their key" in result.details[0]


def test_no_sample_after_healing_fails() -> None:
    result = run(hits=[hit(-1.0, 1.0)])
    assert not result.ok


# --- the probe loop that gathers the samples ----------------------------------------------------


def test_sampling_goes_on_past_a_follower_one_entry_behind_until_the_masters_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A healthy cluster probed mid-replication: master-3 one entry behind at first. One sample
    # would fail the check; the loop samples again and the check passes.
    answers = iter([sample(0.1, 1221, 1221, 1220), sample(0.4, 1221, 1221, 1221)])
    monkeypatch.setattr(final_state, "sample_masters", lambda *a, **k: next(answers))
    samples = final_state.sample_until_agreed(
        {"master-1": "x"}, 20.0, clock=lambda: HEAL_T, sleep=lambda s: None
    )
    assert [s.commit_index["master-3"] for s in samples] == [1220, 1221]
    assert run(samples).ok
    assert not run(samples[:1]).ok


def test_sampling_stops_at_its_deadline_when_a_master_never_catches_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [HEAL_T]
    monkeypatch.setattr(final_state, "sample_masters", lambda *a, **k: sample(0, 9, 9, None))

    def sleep(s: float) -> None:
        now[0] += s

    samples = final_state.sample_until_agreed(
        {"m": "x"}, 2.0, every_s=0.5, clock=lambda: now[0], sleep=sleep
    )
    assert len(samples) == 5  # at +0, +0.5, +1, +1.5, +2
    assert not run(samples).ok
