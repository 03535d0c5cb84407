"""A job's iterations scored apart from its history (``score_records``: pure) and tracked in order
(``JobDifferential.apply``) give what scoring them as they complete gives: the cut that lets a job's
iterations be scored by other processes."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.streams.analysis.differential import DifferentialConfig, JobDifferential, score_records
from fleetscope.streams.offline import OfflinePipeline

JOBS = {
    "gpu+host, flat": dict(ranks=16, faults=("slow_gpu:6:1.4", "host_slow:11:1.5")),
    "link+pcie, tp2 pp2": dict(ranks=16, tp=2, pp=2, faults=("slow_link:9:1.3", "pcie_downgrade:12:1.5")),
    "stage + stall, pp4": dict(ranks=16, pp=4, faults=("stage_imbalance:2:1.3", "dataloader_stall:5:1.5")),
    "healthy, dp2 tp2 pp2": dict(ranks=8, tp=2, pp=2, faults=()),
}


def patterns(name: str) -> list[dict[str, Any]]:
    spec = JOBS[name]
    cfg = SimulatorConfig(
        job="cut", iterations=24, seed=7, **{**spec, "faults": tuple(map(parse_fault, spec["faults"]))}
    )
    pipeline = OfflinePipeline(keep_patterns=True).add_all(simulate(cfg))
    pipeline.finish()
    return pipeline.patterns


def _updates(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in u.items() if k != "emitted_ns"} for u in found]


@pytest.mark.parametrize("name", list(JOBS))
def test_iterations_scored_out_of_order_elsewhere_and_tracked_in_order_find_what_inline_scoring_finds(
    name: str,
) -> None:
    records = patterns(name)
    inline = JobDifferential("cut")
    expected = [u for rec in records for u in inline.add(rec)] + inline.flush()
    if "healthy" not in name:
        assert any(u["status"] == "open" for u in expected)  # a fault to find: the comparison compares something
    by_iteration: dict[int, list[dict[str, Any]]] = {}
    for rec in records:
        by_iteration.setdefault(int(rec["iteration"]), []).append(rec)
    config = DifferentialConfig()
    # newest first, each through pickle (as to another process and back)
    scores = {
        it: pickle.loads(pickle.dumps(score_records(pickle.loads(pickle.dumps(recs)), config)))
        for it, recs in sorted(by_iteration.items(), reverse=True)
    }
    tracked = JobDifferential("cut")
    got = [u for it in sorted(scores) for u in tracked.apply(it, scores[it])] + tracked.flush()
    assert _updates(got) == _updates(expected)
    assert tracked.iterations_scored == 0 and inline.iterations_scored == len(by_iteration)
