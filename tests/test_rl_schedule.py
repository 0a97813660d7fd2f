"""The training run's schedule, difficulty filter and evaluation statistics (pure functions)."""

from __future__ import annotations

import math
from itertools import combinations

import pytest

from service.control.evaluation import paired_difference, pass_at_k, solved_fractions, summarize, wilson
from service.control.schedule import GroupOutcome, epoch_order, eval_due, schedule_length, skip_reason, slot
from service.worker.config import FilterConfig, TrainingConfig


def test_each_epoch_is_a_permutation_fixed_by_the_seed_and_different_between_epochs():
    orders = [epoch_order(50, e, seed=7) for e in range(4)]
    assert all(sorted(o) == list(range(50)) for o in orders)
    assert orders == [epoch_order(50, e, seed=7) for e in range(4)]
    assert len({tuple(o) for o in orders}) == 4
    assert epoch_order(50, 0, seed=8) != orders[0]


def test_slots_cover_every_task_once_per_epoch():
    seen = [slot(s, 7, seed=1) for s in range(21)]
    for epoch in range(3):
        assert sorted(i for e, i in seen if e == epoch) == list(range(7))


def test_schedule_length_is_the_tighter_of_epochs_and_max_groups():
    assert schedule_length(TrainingConfig(steps=1, epochs=3), 10) == 30
    assert schedule_length(TrainingConfig(steps=1, epochs=3, max_groups=12), 10) == 12
    assert schedule_length(TrainingConfig(steps=1), 10) is None


def test_the_filter_skips_always_and_never_solved_tasks_only_after_enough_groups():
    solved, unsolved, mixed = GroupOutcome(4, 4), GroupOutcome(4, 0), GroupOutcome(4, 2)
    both = FilterConfig(skip_solved=True, skip_unsolved=True, min_groups=2, retry_prob=0.0)
    assert skip_reason([solved], both, 0, 0) is None  # one group is not enough
    assert skip_reason([solved, solved], both, 0, 0) == "always solved: 8/8 in 2 groups"
    assert skip_reason([unsolved, unsolved], both, 0, 0) == "never solved: 0/8 in 2 groups"
    assert skip_reason([mixed, solved], both, 0, 0) is None
    assert skip_reason([solved, solved], FilterConfig(skip_unsolved=True, retry_prob=0.0), 0, 0) is None
    # groups without a graded sample do not count; only the newest `window` do
    assert skip_reason([GroupOutcome(0, 0), solved], both, 0, 0) is None
    windowed = FilterConfig(skip_solved=True, min_groups=2, window=2, retry_prob=0.0)
    assert skip_reason([solved, solved, unsolved], windowed, 0, 0) is not None


def test_retries_follow_the_probability_and_the_seed():
    cfg = FilterConfig(skip_solved=True, min_groups=1, retry_prob=0.25)
    history = [GroupOutcome(2, 2)]
    retried = [skip_reason(history, cfg, seq, seed=3) is None for seq in range(4000)]
    assert retried == [skip_reason(history, cfg, seq, seed=3) is None for seq in range(4000)]
    # 4000 Bernoulli(0.25) draws: the count lies within 5 standard deviations of 1000
    assert abs(sum(retried) - 1000) < 5 * math.sqrt(4000 * 0.25 * 0.75)
    assert all(skip_reason(history, cfg.model_copy(update={"retry_prob": 1.0}), s, 0) is None for s in range(50))


def test_evaluations_are_due_at_zero_every_nth_and_the_last_version():
    assert [v for v in range(8) if eval_due(v, 3, last=7)] == [0, 3, 6, 7]
    assert [v for v in range(5) if eval_due(v, 1, last=4)] == [0, 1, 2, 3, 4]


def test_pass_at_k_is_the_unbiased_estimator():
    # by definition: the chance that a random k-subset of the n samples holds a passing one
    n, c = 6, 2
    samples = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 1, 1) == 0.25


def test_wilson_interval_contains_the_rate_and_stays_in_bounds():
    assert wilson(0, 0) is None
    low, high = wilson(0, 10)
    assert low == 0.0 and 0.2 < high < 0.35  # the rule of three's neighbourhood: 0.278
    low, high = wilson(10, 10)
    assert high == pytest.approx(1.0, abs=1e-12) and 0.65 < low < 0.8
    low, high = wilson(50, 100)
    assert low < 0.5 < high and high - low == pytest.approx(2 * 1.96 * math.sqrt(0.25 / 100), rel=0.02)


def test_summary_averages_tasks_not_samples():
    summary = summarize({"a": [1.0, 1.0, 1.0, 1.0], "b": [0.0, 0.0], "c": []}, k=2)
    assert summary["pass_at_1"] == 0.5  # (1 + 0) / 2: the empty task is not counted
    assert summary["pass_at_k"] == 0.5 and summary["tasks"] == 2 and summary["samples"] == 6
    low, high = summary["pass_at_1_ci"]
    assert low < 4 / 6 < high
    assert summarize({}, k=4)["pass_at_1"] is None


def test_a_paired_difference_sees_a_gain_that_separate_intervals_miss():
    """64 tasks of mixed difficulty, the second policy solving 2 more samples of 8 on a quarter of
    them: +0.0625, clear when each task is compared with itself, though the two Wilson intervals
    over 512 samples overlap."""
    import random

    rng = random.Random(0)
    before = {f"t{i}": rng.choice([0, 0, 1, 2, 4, 6, 8]) / 8 for i in range(64)}
    after = {t: min(1.0, v + (0.25 if i % 4 == 0 else 0.0)) for i, (t, v) in enumerate(before.items())}
    d = paired_difference(before, after)
    assert d["difference"] == pytest.approx(sum(after.values()) / 64 - sum(before.values()) / 64)
    assert 0 < d["ci"][0] <= d["difference"] <= d["ci"][1] and d["worse"] == 0 and d["tasks"] == 64
    a, b = (wilson(round(sum(x.values()) * 8), 512) for x in (before, after))
    assert b[0] < a[1]  # the separate intervals overlap
    assert paired_difference(before, before)["ci"] == (0.0, 0.0)
    assert paired_difference({"x": 1.0}, {"y": 0.0}) is None
    swapped = paired_difference(after, before)  # the same resamples: the interval mirrors
    assert swapped["difference"] == pytest.approx(-d["difference"])
    assert swapped["ci"] == pytest.approx((-d["ci"][1], -d["ci"][0]))


def test_solved_fractions_count_full_rewards_only():
    assert solved_fractions({"a": [1.0, 0.5, 0.0, 1.0], "b": [], "c": [0.0]}) == {"a": 0.5, "c": 0.0}

