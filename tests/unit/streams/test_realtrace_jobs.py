"""dp2 x pp4 jobs of a real trace's kernels (``tests/realtrace_jobs.py``), through ``fleetscope analyze``'s path:
healthy ones are silent, a slow worker is named alone, a slow stage is the stage, each priced as it costs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from realtrace_jobs import RealJob, SourceStep, load_source, step_ms, write_job

from fleetscope.traces_cli import analyze_traces

TOLERANCE = 0.20


@pytest.fixture(scope="module")
def source() -> list[SourceStep]:
    return load_source()


def _findings(job: RealJob, source: list[SourceStep], folder: Path) -> list[dict[str, Any]]:
    write_job(job, folder, source)
    return analyze_traces([folder]).findings


def _true_cost_ns(job: RealJob, source: list[SourceStep]) -> float:
    """The step time the fault adds: the same job with and without it."""
    return (step_ms(job, source) - step_ms(dataclasses.replace(job, fault="healthy"), source)) * 1e6


def test_a_healthy_pipeline_whose_stage_rings_move_different_bytes_is_silent(
    source: list[SourceStep], tmp_path: Path
) -> None:
    """Each stage's ring reduces its own layers' buckets (9.9 M, 6.6 M, 6.6 M and 2.4 M floats, last stage
    first), so each ring takes its own time: none is slow, no rank is late, nothing is named."""
    assert _findings(RealJob(dp=2, pp=4, steps=4), source, tmp_path) == []


def test_a_slow_worker_is_named_alone_and_priced(source: list[SourceStep], tmp_path: Path) -> None:
    """Rank 3 (stage 1 of replica 1) computes 2.3x slower: its pipeline partners (1, 5, 7) wait for it in
    their send/recv and its ring partner (2) at the all-reduce; only rank 3 is named, at what it costs."""
    job = RealJob(dp=2, pp=4, steps=4, fault="slow_worker", fault_rank=3)
    findings = _findings(job, source, tmp_path)
    assert [(f["category"], sorted(f["ranks"])) for f in findings] == [("gpu_slow", [3])]
    true = _true_cost_ns(job, source)
    assert true > 10e6 and abs(float(findings[0]["est_loss_ns"]) / true - 1) <= TOLERANCE


def test_a_slow_last_stage_on_both_replicas_is_a_stage_imbalance(source: list[SourceStep], tmp_path: Path) -> None:
    """The last stage computes 1.6x longer on both replicas: stage_imbalance on its two ranks, not gpu_slow on
    one of them, no link_slow on the rings that wait for it, priced within 20 % of its cost."""
    job = RealJob(dp=2, pp=4, steps=4, fault="slow_stage", factor=1.6)
    findings = _findings(job, source, tmp_path)
    assert [(f["category"], sorted(f["ranks"])) for f in findings] == [("stage_imbalance", [6, 7])]
    true = _true_cost_ns(job, source)
    assert true > 10e6 and abs(float(findings[0]["est_loss_ns"]) / true - 1) <= TOLERANCE
