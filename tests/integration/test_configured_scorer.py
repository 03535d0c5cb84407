"""The scorer named in the configuration is the one the live worker scores with (real broker, worker, chDB)."""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import pytest

from fleetscope.config import load_config
from fleetscope.demo import run_demo
from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.progress import Progress
from fleetscope.streams.analysis.differential import DifferentialConfig
from fleetscope.streams.offline import OfflinePipeline

pytestmark = pytest.mark.integration


def test_the_live_worker_scores_with_the_configured_mean_z(tmp_path: Path, chdb_path: Path, database: str) -> None:
    """mean_z reads a rank against the mean and deviation it is part of: a slow GPU among 32 ranks scores at
    most sqrt(31) (robust_z: ~50) against a centre the slow rank pulls up. The worker's finding has both marks."""
    ranks = 32
    sim = SimulatorConfig(job="mz-job", ranks=ranks, iterations=12, faults=(parse_fault("slow_gpu:11:1.5"),))
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path),
            "store.url": f"chdb://{chdb_path}",
            "store.database": database,
            "kafka.topic_prefix": f"mz{uuid.uuid4().hex[:6]}",
            "streams.differential.scorer": "mean_z",
        },
    )
    live = run_demo(config, sim, Progress(enabled=False), timeout_s=240).findings

    robust = OfflinePipeline().add_all(simulate(sim)).finish().findings
    mean = OfflinePipeline(differential=DifferentialConfig(scorer="mean_z")).add_all(simulate(sim)).finish().findings
    assert [(f["rank"], f["category"]) for f in live] == [(11, "gpu_slow")]
    assert (
        [(f["rank"], f["category"]) for f in robust] == [(11, "gpu_slow")] == [(f["rank"], f["category"]) for f in mean]
    )
    assert live[0]["score"] <= math.sqrt(ranks - 1) + 1e-9 < 10 < robust[0]["score"]
    assert live[0]["peer_median"] > robust[0]["peer_median"], "the centre includes the slow rank"
    assert math.isclose(live[0]["score"], mean[0]["score"], rel_tol=1e-6)
