"""The differential finds the same whether a pattern record's columns reach it as numpy arrays (the numpy
decoder, and the windower offline) or as lists (fastavro): the rules must not depend on the container."""

from __future__ import annotations

from typing import Any

import pytest

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import codec, decode, encode
from fleetscope.streams.differential import DifferentialStage
from fleetscope.streams.offline import OfflinePipeline

JOBS = {
    "gpu+host, flat": dict(ranks=16, faults=("slow_gpu:6:1.4", "host_slow:11:1.5")),
    "link+pcie, tp2 pp2": dict(ranks=16, tp=2, pp=2, faults=("slow_link:9:1.3", "pcie_downgrade:12:1.5")),
    "stage + stall, pp4": dict(ranks=16, pp=4, faults=("stage_imbalance:2:1.3", "dataloader_stall:5:1.5")),
}


def finding_updates(messages: list[bytes], fast: bool) -> list[dict[str, Any]]:
    stage = DifferentialStage()
    updates: list[dict[str, Any]] = []
    for message in messages:
        taken = stage.apply(*decode(message, fast=fast), None)
        assert taken.reason is None
        updates += taken.findings
    for job in stage.jobs:
        updates += stage.flush(job)
    return [{k: v for k, v in u.items() if k != "emitted_ns"} for u in updates]


@pytest.mark.parametrize("name", list(JOBS))
def test_findings_from_numpy_decoded_records_equal_those_from_fastavros_lists(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(codec, "COLUMNS_FROM_BYTES", 0)  # the simulator's records are small: arrays all the same
    spec = JOBS[name]
    cfg = SimulatorConfig(
        job="dec", iterations=10, seed=5, **{**spec, "faults": tuple(map(parse_fault, spec["faults"]))}
    )
    pipeline = OfflinePipeline(keep_patterns=True).add_all(simulate(cfg))
    pipeline.finish()
    messages = [encode("patterns", p) for p in pipeline.patterns]
    as_lists = finding_updates(messages, fast=False)
    assert as_lists  # every job has a fault to find: the comparison compares something
    assert finding_updates(messages, fast=True) == as_lists
