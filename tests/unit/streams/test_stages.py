"""The stage classes the worker and the offline path share: what they refuse, what they guard against, and
the scorer the configuration names."""

from __future__ import annotations

import functools
import math
import pickle
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from fleetscope.config import ConfigError, load_config
from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import encode, encode_event_batch
from fleetscope.streams.analysis.differential import DifferentialConfig, JobDifferential
from fleetscope.streams.analysis.signals import SCORERS, ScoringConfig, scorer_named
from fleetscope.streams.analysis.stats import F64, RobustScores, mean_std_scores, robust_scores
from fleetscope.streams.differential import DifferentialStage
from fleetscope.streams.offline import OfflinePipeline
from fleetscope.streams.windower import WindowerStage
from fleetscope.wiring import stream_app_config

WALL_NS = 1_767_225_600_000_000_000 + 30 * 86_400 * 10**9  # a month after the simulator's default start
SLOW_GPU = SimulatorConfig(job="stg", ranks=16, iterations=20, faults=(parse_fault("slow_gpu:11:1.5"),))


@functools.cache
def _patterns(sim: SimulatorConfig = SLOW_GPU) -> tuple[dict[str, Any], ...]:
    pipeline = OfflinePipeline(keep_patterns=True).add_all(simulate(sim))
    pipeline.finish()
    return tuple(pipeline.patterns)


def _categories(findings: list[dict[str, Any]]) -> set[tuple[int, str]]:
    return {(int(f["rank"]), str(f["category"])) for f in findings}


def test_the_windower_stage_refuses_what_does_not_decode_or_is_implausible_and_windows_the_rest() -> None:
    stage = WindowerStage()
    assert (stage.take(b"\x00\x00\x00\x01junk", 0, WALL_NS).reason or "").startswith("schema:")
    batches = list(simulate(SimulatorConfig(job="w", ranks=2, iterations=6)))
    bad = batches[0]
    outside = replace(bad, header=replace(bad.header, rank=bad.header.world_size))
    refused = stage.take(encode_event_batch(outside), 0, WALL_NS)
    assert refused.reason is not None and refused.reason.startswith("header: rank")
    closed = [c for b in batches for c in stage.take(encode_event_batch(b), 0, WALL_NS).closed]
    assert closed and {c.rank for c in closed} == {0, 1}
    assert set(stage.windowers) == {("w", 0), ("w", 1)}


def test_the_offline_path_refuses_the_batches_the_worker_refuses() -> None:
    batches = list(simulate(SimulatorConfig(job="off", ranks=4, iterations=8)))
    b = batches[3]
    broken = replace(b, header=replace(b.header, world_size=0))
    result = OfflinePipeline().add_all([*batches[:3], broken, *batches[3:]]).finish()
    assert result.dead_letters == ["header: world size 0 < 1"]
    assert result.iterations == OfflinePipeline().add_all(batches).finish().iterations


def test_the_differential_stage_dead_letters_bad_messages_and_keeps_going() -> None:
    stage = DifferentialStage()
    assert (stage.take(b"garbage", None).reason or "").startswith("schema:")
    iteration = OfflinePipeline().add_all(simulate(SimulatorConfig(job="it", ranks=2, iterations=2))).finish()
    wrong = stage.take(encode("iterations", iteration.iterations[0]), None)
    assert wrong.reason == "subject: expected patterns, pattern_batch, stall or heartbeat, got iterations"
    records = _patterns()
    taken = stage.take(encode("patterns", records[0]), None)
    assert taken.reason is None and taken.subject == "patterns" and taken.job == SLOW_GPU.job
    assert taken.iteration == int(records[0]["iteration"])


def test_an_analysis_failure_costs_one_message_not_the_stage() -> None:
    calls = {"n": 0}

    def failing(x: F64, abs_scale_floor: float = 0.0) -> RobustScores:
        calls["n"] += 1
        raise RuntimeError("scorer bug")

    stage = DifferentialStage(scorer=failing)
    records = _patterns()
    assert all(stage.take(encode("patterns", rec), None, source=i).reason is None for i, rec in enumerate(records))
    refused = stage.rejected
    assert calls["n"] > 0 and refused and all(t.reason == "differential: scorer bug" for t in refused)
    assert len(refused) == SLOW_GPU.iterations  # one per iteration, on the record that completed it
    completing = [max(i for i, r in enumerate(records) if r["iteration"] == t.iteration) for t in refused]
    assert [t.source for t in refused] == completing
    assert stage.jobs[SLOW_GPU.job].iterations_scored == SLOW_GPU.iterations

    idle = DifferentialStage(scorer=failing)  # a timer's flush of an incomplete iteration: logged, no raise
    for rec in _patterns()[: SLOW_GPU.ranks - 1]:
        assert idle.take(encode("patterns", rec), None).reason is None
    before = calls["n"]
    assert idle.flush(SLOW_GPU.job) == [] and idle.end(SLOW_GPU.job) == [] and calls["n"] == before + 1


def test_mean_z_is_masked_by_the_outlier_it_looks_for() -> None:
    for n in (8, 16, 64):
        x = np.full((n, 1), 100.0)
        x[3, 0] = 1000.0
        assert math.isclose(float(mean_std_scores(x, 0.0).z[3, 0]), math.sqrt(n - 1), rel_tol=1e-9)
        assert float(robust_scores(x).z[3, 0]) > 100  # the median and MAD ignore it
    x = np.array([[1.0, np.nan], [2.0, np.nan], [3.0, 5.0]])
    assert np.isnan(mean_std_scores(x).z[:, 1]).all(), "too few peers: no score"


def test_the_differential_uses_the_scorer_its_configuration_names() -> None:
    robust = OfflinePipeline().add_all(simulate(SLOW_GPU)).finish()
    assert _categories(robust.findings) == {(11, "gpu_slow")}
    mean = OfflinePipeline(differential=DifferentialConfig(scorer="mean_z")).add_all(simulate(SLOW_GPU)).finish()
    # the mean/std z of one slow rank among 16 stays under the threshold (sqrt(15)): no kernel is gpu_slow; the
    # rank's late arrival, judged without a scorer, may still name it, and only it: a straggler, or gpu_slow on
    # its compute where that is what it is late by (JobNoise._own_cause)
    assert all(f["category"] == "straggler" or f["function"] == "compute" for f in mean.findings), mean.findings
    assert {r for r, _ in _categories(mean.findings)} <= {11} and len(mean.iterations) == len(robust.iterations)
    x = np.array([[1.0], [1.1], [0.9], [1.0], [9.0]])
    for name, factory in SCORERS.items():
        assert scorer_named(name, ScoringConfig())(x).z.shape == x.shape, factory


def test_an_unknown_scorer_is_a_configuration_error_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"streams.differential.scorer": "zscore"})
    assert "streams.differential" in str(info.value) and "mean_z, robust_z" in str(info.value)
    with pytest.raises(ValueError, match="mean_z, robust_z"):
        scorer_named("zscore", ScoringConfig())


def test_the_configured_scorer_reaches_the_worker_and_survives_a_state_record() -> None:
    config = load_config(env={}, overrides={"streams.differential.scorer": "mean_z", "kafka.bootstrap_servers": "x"})
    app_config = stream_app_config(config)
    assert app_config.differential.scorer == "mean_z"
    stage = DifferentialStage(app_config.differential)
    assert stage.job("j").config.scorer == "mean_z"
    restored = pickle.loads(pickle.dumps(JobDifferential("j", app_config.differential)))
    assert restored.config.scorer == "mean_z" and restored.scorer is None
