"""Acceptance 3 of issue 16, sized for 2 cores: 20 concurrent 16-rank simulated jobs plus one 512-rank job,
published at once through the embedded stack (a backlog the worker works off), find nothing; a fault in one
more job is that job's only finding."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from harness import isolated_config, publish_at_once, wait_until

from fleetscope.producers import SimulatorConfig, parse_fault
from fleetscope.sinks import current_findings
from fleetscope.stack import EmbeddedStack

pytestmark = [pytest.mark.integration, pytest.mark.alone]


def test_twenty_jobs_a_512_rank_job_and_a_faulty_one_at_once_find_only_the_faulty_jobs_finding(
    tmp_path: Path, chdb_path: Path, database: str, broker: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    config = isolated_config("cj", tmp_path, chdb_path, database, broker)
    jobs = [SimulatorConfig(job=f"j{i:02d}-{tag}", ranks=16, iterations=8, seed=i) for i in range(20)]
    jobs.append(SimulatorConfig(job=f"big-{tag}", ranks=512, iterations=4, seed=99, layers=8))
    fault = (parse_fault("slow_gpu:5:1.5"),)
    faulty = SimulatorConfig(job=f"faulty-{tag}", ranks=16, iterations=8, seed=7, faults=fault)
    jobs.append(faulty)
    expected = sum(j.ranks * j.expected_iterations for j in jobs)
    with EmbeddedStack(config) as stack:
        assert stack.sink is not None and stack.client is not None
        sink = stack.sink
        t0 = time.monotonic()
        published_s = publish_at_once(stack.config, jobs)
        wait_until(lambda: sink.stats["iterations"] >= expected, timeout_s=240, interval_s=0.5)
        assert sink.stats["iterations"] == expected, "every rank-iteration of every job is stored"
        time.sleep((config.streams.job_idle_ms + config.streams.windower.idle_close_ms) / 1000 + 2.0)
        findings = current_findings(stack.client, database)
        print(f"published in {published_s:.1f} s, analysed in {time.monotonic() - t0:.1f} s")
    # only the faulty job's rank is named (its late arrivals may be reported beside its slow kernels)
    assert {(f["job"], f["rank"]) for f in findings} == {(faulty.job, 5)}
    assert "gpu_slow" in {f["category"] for f in findings}
