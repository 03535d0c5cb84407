"""Findings of a job that ended close (reason ``job_ended``) through the real broker, worker and store, once
the job has sent nothing for ``streams.job_end_ms``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from harness import isolated_config, wait_until

from fleetscope.demo import publish_simulation
from fleetscope.producers import SimulatorConfig, parse_fault
from fleetscope.progress import Progress
from fleetscope.stack import EmbeddedStack

pytestmark = pytest.mark.integration

SIM = SimulatorConfig(job="ending-job", ranks=8, iterations=12, faults=(parse_fault("slow_gpu:3:1.5"),))


def test_the_findings_of_an_ended_job_close_with_reason_job_ended(
    tmp_path: Path, chdb_path: Path, database: str, broker: str
) -> None:
    config = isolated_config("je", tmp_path, chdb_path, database, broker, {"streams.job_end_ms": 6000})
    query = f"SELECT rank, category, status, reason FROM `{database}`.findings WHERE job = {{job:String}} ORDER BY rank"
    with EmbeddedStack(config) as stack:
        assert stack.client is not None
        publish_simulation(stack.config, SIM, Progress(enabled=False))
        published = time.monotonic()

        rows: list[tuple] = []

        def closed() -> bool:
            rows[:] = [tuple(r) for r in stack.client.query(query, parameters={"job": SIM.job}).result_rows]
            return bool(rows) and rows[0][2] == "closed"

        wait_until(closed, timeout_s=90, interval_s=0.5)
        ended_after_s = time.monotonic() - published
    assert rows == [(3, "gpu_slow", "closed", "job_ended")]
    assert ended_after_s >= 6.0  # not before the job's input stopped for job_end_ms
