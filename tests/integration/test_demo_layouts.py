"""``demo`` runs the layouts it is given: a 4-stage pipeline with a slow stage is found as that stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_demo_with_a_pipeline_finds_the_slow_stage(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE")}
    env |= {"FLEETSCOPE__EMBEDDED__BROKER_PORT": "0", "FLEETSCOPE__EMBEDDED__STORE_PORT": "0"}
    res = subprocess.run(
        [sys.executable, "-m", "fleetscope", "demo", "--quiet", "--json", "--pp", "4", "--ranks", "16",
         "--iterations", "24", "--fault", "stage_imbalance:2:1.3", "--data-dir", str(tmp_path / "fs")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    findings = json.loads(res.stdout)
    assert [(f["category"], f["subject"]) for f in findings] == [("stage_imbalance", "stage:2")]
