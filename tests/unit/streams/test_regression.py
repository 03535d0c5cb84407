"""PerfTracker's trigger: slowdown against the recent best, and the stall rule."""

import numpy as np
import pytest

from fleetscope.streams.analysis.regression import TriggerConfig, check_trigger

MS = 1_000_000


def steady(n: int, ms: float = 100.0) -> np.ndarray:
    return np.full(n, ms * MS)


def test_a_steady_job_does_not_trigger() -> None:
    v = check_trigger(steady(200), last_event_ns=10 * MS, now_ns=11 * MS)
    assert not v.triggered and v.reason == ""
    assert v.ratio == pytest.approx(1.0) and v.recent_mean_ns == pytest.approx(100 * MS)


def test_a_ten_percent_slowdown_triggers_once_it_dominates_the_recent_mean() -> None:
    d = np.concatenate([steady(100), steady(50, 110.0)])
    assert check_trigger(d, 0, 0).slow
    # 20 slow iterations out of 50: mean = 104 ms, under 1.05 x 100 ms
    assert not check_trigger(d[:120], 0, 0).slow
    assert check_trigger(d[:130], 0, 0).reason == "slow"  # 30 of 50: 106 ms


def test_too_few_iterations_are_not_judged() -> None:
    v = check_trigger(np.concatenate([steady(10), steady(30, 200.0)]), 0, 0)
    assert not v.slow and np.isnan(v.best_ns)


def test_the_best_is_only_recent() -> None:
    d = np.concatenate([steady(10, 50.0), steady(300, 100.0)])
    assert check_trigger(d, 0, 0, TriggerConfig(best_window=1000)).slow
    assert not check_trigger(d, 0, 0, TriggerConfig(best_window=200)).slow


def test_window_mean_baseline_ignores_one_short_iteration_that_the_literal_rule_reacts_to() -> None:
    d = steady(200)
    d[57] = 90 * MS
    assert check_trigger(d, 0, 0).slow
    assert not check_trigger(d, 0, 0, TriggerConfig(baseline="window_mean")).slow


def test_stall_after_five_mean_iterations_without_an_event() -> None:
    d = steady(20)
    assert not check_trigger(d, last_event_ns=0, now_ns=499 * MS).stalled
    v = check_trigger(d, last_event_ns=0, now_ns=500 * MS)
    assert v.stalled and v.reason == "stalled" and v.idle_ns == 500 * MS


def test_no_stall_verdict_without_enough_iterations_for_a_mean() -> None:
    assert not check_trigger(steady(3), 0, 10**12).stalled
    assert not check_trigger([], 0, 10**12).triggered


def test_config_errors_are_reported_together() -> None:
    with pytest.raises(ValueError, match="window.*threshold"):
        TriggerConfig(window=0, threshold=1.0)
