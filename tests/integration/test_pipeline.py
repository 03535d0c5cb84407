"""The whole pipeline on the embedded default: real broker, real Faust worker, real chDB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fleetscope.config import load_config
from fleetscope.demo import run_demo
from fleetscope.producers import SimulatorConfig, parse_fault
from fleetscope.progress import Progress
from fleetscope.sinks import connect, table_counts

pytestmark = pytest.mark.integration


def test_sixteen_ranks_with_one_slow_gpu_end_to_end(tmp_path: Path, chdb_path: Path, database: str) -> None:
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path),
            "store.url": f"chdb://{chdb_path}",
            "store.database": database,
            "kafka.topic_prefix": f"it{uuid.uuid4().hex[:6]}",
        },
    )
    sim = SimulatorConfig(job="it-job", ranks=16, iterations=20, faults=(parse_fault("slow_gpu:11:1.5"),))
    result = run_demo(config, sim, Progress(enabled=False), timeout_s=180)

    assert [(f["rank"], f["category"]) for f in result.findings] == [(11, "gpu_slow")]
    finding = result.findings[0]
    assert finding["job"] == "it-job" and finding["host"] == "node001"
    assert finding["value"] > 1.3 * finding["peer_median"]
    assert finding["iteration_first"] == 0 and finding["iteration_last"] == 19

    counts = table_counts(connect(config.store), database)
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
