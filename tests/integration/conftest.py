"""Fixtures of the multi-worker, restart, split-stage and chaos tests (their runs: ``worker_runs.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetscope.stack import StreamWorkerProcess
from tests.integration.worker_runs import MOVING_JOB, Outcome, run_config, run_pipeline


@pytest.fixture(scope="session")
def one_worker_run(tmp_path_factory: pytest.TempPathFactory, chdb_path: Path, broker: str) -> Outcome:
    """``MOVING_JOB`` through one worker running both stages, nothing moving: what every run that moves
    partitions, kills or restarts workers, or splits the stages must store too. Run once per session."""
    config = run_config(tmp_path_factory.mktemp("one-worker"), broker, f"chdb://{chdb_path}")
    outcome = run_pipeline(config, MOVING_JOB, [StreamWorkerProcess(config, name="worker-1")])
    assert outcome.counts["iterations"] == MOVING_JOB.expected_rows
    assert ("gpu_slow", 5) in outcome.categories(), outcome.findings
    return outcome
