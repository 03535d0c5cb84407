"""The whole pipeline on the embedded default: real broker, real Faust worker, real chDB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import SLOW_GPU_RANK, SlowGpuRun

from fleetscope.sinks import connect, table_counts

pytestmark = pytest.mark.integration


def test_sixteen_ranks_with_one_slow_gpu_end_to_end(slow_gpu_demo: SlowGpuRun) -> None:
    config, sim, result = slow_gpu_demo.config, slow_gpu_demo.sim, slow_gpu_demo.result
    assert (sim.ranks, sim.iterations) == (16, 20)

    assert [(f["rank"], f["category"]) for f in result.findings] == [(SLOW_GPU_RANK, "gpu_slow")]
    finding = result.findings[0]
    assert finding["job"] == sim.job and finding["host"] == "node001"
    assert finding["value"] > 1.3 * finding["peer_median"]
    assert finding["iteration_first"] == 0 and finding["iteration_last"] == 19

    counts = table_counts(connect(config.store), config.store.database)
    assert counts["iterations"] == 16 * 20
    assert counts["findings"] == 1
    functions_per_rank = finding["evidence"]["compared_functions"]
    assert counts["function_patterns"] >= 16 * 20 * functions_per_rank


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE__")}
    return subprocess.run(
        [sys.executable, "-m", "fleetscope", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_demo_without_fault_reports_nothing_and_the_store_answers_sql(tmp_path: Path) -> None:
    run = _cli("demo", "--ranks", "8", "--iterations", "10", "--json", "--quiet", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []

    count = _cli("sql", "SELECT count() FROM findings", cwd=tmp_path)
    assert count.returncode == 0, count.stderr
    assert count.stdout.strip() == "0"
    patterns = _cli("sql", "SELECT count() FROM function_patterns", cwd=tmp_path)
    assert int(patterns.stdout.strip()) > 8 * 10
    refused = _cli("sql", "DROP TABLE findings", cwd=tmp_path)
    assert refused.returncode != 0
