"""Acceptance 4 of issue 16, offline: a 12-iteration trace with a 20 % job-wide slowdown from iteration 6
opens job_regression; the same length with +-10 % noise and no step opens nothing."""

import numpy as np
import pytest

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.streams.analysis.differential import JobDifferential
from fleetscope.streams.offline import OfflinePipeline

_TIME_FIELDS = ("iteration_ns", "total_ns", "mean_ns", "min_ns", "max_ns", "p50_ns", "p95_ns", "std_ns")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_20_percent_slowdown_from_iteration_6_of_12_opens_job_regression(seed):
    cfg = SimulatorConfig(ranks=8, iterations=12, seed=seed, faults=(parse_fault("job_slowdown:-:1.2@6"),))
    result = OfflinePipeline().add_all(simulate(cfg)).finish()
    opened = [u for u in result.finding_updates if u["status"] == "open"]
    assert [u["category"] for u in opened] == ["job_regression"]
    assert 6 <= opened[0]["iteration_last"] <= 10  # within 5 iterations of the onset
    assert sorted(opened[0]["ranks"]) == list(range(8))


def scaled(record: dict, factor: float) -> dict:
    out = dict(record)
    for name in _TIME_FIELDS:
        if name in out:
            value = out[name]
            out[name] = [v * factor for v in value] if isinstance(value, list) else value * factor
    return out


@pytest.mark.parametrize("seed", range(10))
def test_12_iterations_with_10_percent_job_wide_noise_and_no_step_open_nothing(seed):
    sim = OfflinePipeline(keep_patterns=True)
    sim.add_all(simulate(SimulatorConfig(ranks=8, iterations=12, seed=seed))).finish()
    noise = 1 + np.random.default_rng(seed).uniform(-0.10, 0.10, 12)
    job = JobDifferential("demo")
    updates = []
    for record in sim.patterns:
        updates += job.add(scaled(record, float(noise[int(record["iteration"])])))
    updates += job.flush()
    assert job.iterations_scored == 12
    assert updates == []


def test_a_slowdown_a_slow_rank_explains_is_that_ranks_finding_not_a_job_regression():
    cfg = SimulatorConfig(ranks=8, iterations=16, faults=(parse_fault("slow_gpu:2:1.5@6"),))
    result = OfflinePipeline().add_all(simulate(cfg)).finish()
    assert [(f["rank"], f["category"]) for f in result.findings] == [(2, "gpu_slow")]
