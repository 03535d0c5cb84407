"""Findings of a job that ended close (reason ``job_ended``) through the real broker, worker and store, once
the job has sent nothing for ``streams.job_end_ms``."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from fleetscope.config import load_config
from fleetscope.demo import publish_simulation
from fleetscope.producers import SimulatorConfig, parse_fault
from fleetscope.progress import Progress
from fleetscope.stack import EmbeddedStack

pytestmark = pytest.mark.integration

SIM = SimulatorConfig(job="ending-job", ranks=8, iterations=12, faults=(parse_fault("slow_gpu:3:1.5"),))


def test_the_findings_of_an_ended_job_close_with_reason_job_ended(
    tmp_path: Path, chdb_path: Path, database: str, broker: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path), "store.url": f"chdb://{chdb_path}", "store.database": database,
            "kafka.bootstrap_servers": broker, "kafka.topic_prefix": f"je{tag}", "streams.app_id": f"je-{tag}",
            "streams.job_end_ms": 6000,
        },
    )  # fmt: skip
    query = f"SELECT rank, category, status, reason FROM `{database}`.findings WHERE job = {{job:String}} ORDER BY rank"
    with EmbeddedStack(config) as stack:
        assert stack.client is not None
        publish_simulation(stack.config, SIM, Progress(enabled=False))
        published = time.monotonic()
        rows: list[tuple] = []
        while time.monotonic() - published < 90:
            rows = [tuple(r) for r in stack.client.query(query, parameters={"job": SIM.job}).result_rows]
            if rows and rows[0][2] == "closed":
                break
            time.sleep(0.5)
        ended_after_s = time.monotonic() - published
    assert rows == [(3, "gpu_slow", "closed", "job_ended")]
    assert ended_after_s >= 6.0  # not before the job's input stopped for job_end_ms
