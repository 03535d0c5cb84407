"""The run-to-run diff: a run against itself or a rerun lists nothing, one function slowed by 30 % on every
rank is the first change of every role, warm-up and different run lengths change nothing, absence counts as
zero within a role; through the simulator and the offline stages, and through trace folders by the CLI."""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleetscope.cli import main
from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.producers.tracegen import TraceJob, write_traces
from fleetscope.streams.analysis.rundiff import (
    DiffConfig,
    FunctionMoments,
    RoleIterations,
    RunSteps,
    StepTable,
    diff_runs,
    run_steps,
    steady_window,
)
from fleetscope.streams.offline import OfflinePipeline

SLOWED = "forward"
FORWARD_SHARE = 31.0 / 232.0
"""The simulator's ``forward`` host span is about 31 ms of a 232 ms healthy iteration (tp2 x pp2, 8 ranks)."""


@cache
def simulated(seed: int, iterations: int = 20, slowed_by: float = 0.0) -> RunSteps:
    """A tp2 x pp2 job of 8 ranks through the offline stages; ``slowed_by``: every rank's ``forward`` takes
    that much longer (``host_slow`` adds its factor - 1 of the healthy iteration to the function)."""
    faults = ()
    if slowed_by:
        factor = 1.0 + slowed_by * FORWARD_SHARE
        faults = tuple(parse_fault(f"host_slow:{r}:{factor}:{SLOWED}") for r in range(8))
    cfg = SimulatorConfig(job="j", ranks=8, tp=2, pp=2, iterations=iterations, seed=seed, faults=faults)
    pipeline = OfflinePipeline(keep_patterns=True)
    pipeline.add_all(simulate(cfg)).finish()
    table = StepTable()
    for record in pipeline.patterns:
        table.add(record)
    return run_steps(f"seed{seed}", table.role_iterations(), table.moments)


def test_a_simulated_job_against_itself_lists_nothing() -> None:
    run = simulated(0)
    diff = diff_runs(run, run)
    assert diff.changes == [] and not diff.iteration.significant and diff.iteration.delta_ns == 0
    assert run.skipped_warmup == 1, "the simulator's first iteration (pipeline filling) is its warm-up"
    assert diff.as_dict()["changes"] == []


@pytest.mark.parametrize("seed", [1, 2])
def test_a_rerun_of_the_same_job_of_another_length_lists_nothing(seed: int) -> None:
    diff = diff_runs(simulated(0), simulated(seed, iterations=26))
    assert diff.changes == [], [c.as_dict() for c in diff.changes]
    assert not diff.iteration.significant
    assert diff.b.iteration_ns.size == 25


def test_one_function_slowed_by_30_percent_is_the_first_change_of_every_role() -> None:
    diff = diff_runs(simulated(0), simulated(0, slowed_by=0.30))
    roles = {(pp, tp) for pp in (0, 1) for tp in (0, 1)}
    assert [c.function for c in diff.changes] == [SLOWED] * 4, [c.as_dict() for c in diff.changes]
    assert {c.role for c in diff.changes} == roles, "one row per stage and tensor slot"
    for c in diff.changes:
        assert c.kind == "python" and 0.27 < c.relative < 0.33 and c.delta_ns > 20 * c.noise_ns
        assert c.a_calls == c.b_calls == 4.0, "4 microbatches: the calls did not change, their time did"
    # against a rerun too (other noise, other length): still that function, and only it
    rerun = diff_runs(simulated(2, iterations=26), simulated(0, slowed_by=0.30))
    assert [c.function for c in rerun.changes] == [SLOWED] * 4


def _steps(
    name: str, values: dict[str, list[float]], iteration_ns: list[float], first: int = 0, stages: int = 1
) -> RunSteps:
    """A run of one rank per stage from per-iteration function times (NaN: the function did not run that
    iteration), every stage alike."""
    table = StepTable()
    for i, it_ns in enumerate(iteration_ns):
        present = [(f, v[i]) for f, v in values.items() if not math.isnan(v[i])]
        for stage in range(stages):
            pp = stage if stages > 1 else -1
            table.add({"rank": stage, "iteration": first + i, "iteration_ns": it_ns, "pp_rank": pp, "tp_rank": -1,
                       "function": [f for f, _ in present], "kind": [0] * len(present),
                       "total_ns": [v for _, v in present], "calls": [1] * len(present)})  # fmt: skip
    return run_steps(name, table.role_iterations(), table.moments)


def test_warm_up_is_skipped_and_a_new_or_sparse_function_counts_zero_where_absent() -> None:
    rng = np.random.default_rng(5)
    n = 30
    noise = list(100e6 + rng.normal(0, 0.2e6, n))
    gemm = list(20e6 + rng.normal(0, 0.1e6, n))
    a = _steps("a", {"gemm": gemm}, noise)
    warm = [400e6, 250e6, *noise[2:]]  # compiling, then caches warming
    b_values = {"gemm": [60e6, 40e6, *gemm[2:]], "ckpt": [math.nan if i % 2 else 8e6 for i in range(n)]}
    b = _steps("b", b_values, warm, first=100)
    assert b.skipped_warmup == 2 and b.first_iteration == 102
    diff = diff_runs(a, b)
    assert [(c.function, round(c.a_ns), round(c.b_ns)) for c in diff.changes] == [("ckpt", 0, 4_000_000)]
    assert not diff.iteration.significant and math.isinf(diff.changes[0].relative)
    two_stages = diff_runs(a, _steps("c", {"gemm": gemm}, noise, stages=2))
    assert two_stages.changes == [] and two_stages.unmatched_roles == [("a", (-1, -1)), ("b", (0, -1)), ("b", (1, -1))]
    assert steady_window(noise, DiffConfig()) == 0, "a steady run has no warm-up"
    assert steady_window(noise, DiffConfig(warmup_iterations=3)) == 3


def test_a_replayed_record_adds_nothing_and_a_short_run_is_refused_with_a_reason() -> None:
    table = StepTable()
    record: dict[str, Any] = {"rank": 0, "iteration": 0, "iteration_ns": 10, "pp_rank": 0, "tp_rank": 0,
                              "function": ["k"], "kind": [0], "total_ns": [4], "calls": [1]}  # fmt: skip
    table.add(record)
    table.add(record)
    assert table.role_iterations() == [RoleIterations((0, 0), 0, 1, 10.0)]
    assert table.moments(0, 0) == [FunctionMoments((0, 0), "k", "compute", 1, 4.0, 16.0, 1.0)]
    short = run_steps("short", table.role_iterations(), table.moments)
    with pytest.raises(ValueError, match="run 'short' has 1 steady iteration"):
        diff_runs(short, short)
    with pytest.raises(ValueError, match="z must be >= 0"):
        DiffConfig(z=-1)


def test_the_cli_diffs_two_trace_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = TraceJob(dp=2, tp=2, pp=2, steps=8)
    write_traces(job, tmp_path / "monday")
    write_traces(TraceJob(dp=2, tp=2, pp=2, steps=10, seed=1), tmp_path / "tuesday")
    args = ["diff", str(tmp_path / "monday"), str(tmp_path / "tuesday"), "--quiet", "--data-dir", str(tmp_path)]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["changes"] == [] and out["iteration"]["significant"] is False
    assert out["a"]["roles"] == 4 and out["b"]["steady_iterations"] >= 8, "tp2 x pp2 roles from the traces"
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "no function or kernel changed beyond both runs' iteration-to-iteration noise" in text
    assert text.splitlines()[2].startswith("iteration time: ")
