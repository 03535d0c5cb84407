"""Short traces explain themselves: who arrives last, who computes longest, why no finding opened."""

from __future__ import annotations

import json
import tarfile
from math import nan
from pathlib import Path
from typing import Any

import pytest

from fleetscope.cli import main
from fleetscope.schemas import FunctionKind
from fleetscope.streams.analysis.explain import JobTally
from fleetscope.streams.analysis.signals import ScoringConfig

DLRM_TAR = Path("/work/shared/traces/param_dlrm_kineto_8rank/dlrm_kineto.tar.gz")
LINKS = ("nvlink", "pcie")
C, K = int(FunctionKind.COLLECTIVE), int(FunctionKind.COMPUTE)


def record(rank: int, it: int, compute_ns: float, allreduce_ns: float, stage: int = -1) -> dict[str, Any]:
    return {"job": "j", "rank": rank, "host": f"h{rank}", "iteration": it, "iteration_ns": 10_000_000,
            "pp_rank": stage, "function": ["gemm", "nccl:allreduce[pg=0,<=1MiB]"], "kind": [K, C],
            "calls": [1, 1], "total_ns": [compute_ns, allreduce_ns], "self_ns": [compute_ns, allreduce_ns],
            "mean_ns": [compute_ns, allreduce_ns],
            **{f"{link}_{x}": [nan, nan] for link in LINKS for x in ("mean_bps", "peak_bps", "cv")}}  # fmt: skip


def test_the_rank_that_waits_least_arrives_last_and_the_slowest_computes_longest():
    tally = JobTally("j")
    for it in (0, 1):
        for rank in range(6):
            slow = rank == 4
            tally.add(record(rank, it, 3e6 if slow else 2e6, 1e5 if slow else 1.1e6))
    assert tally.last_arrivals() == [{"function": "nccl:allreduce[pg=0,<=1MiB]", "rank": 4, "iterations": 2, "of": 2}]
    (longest,) = tally.longest_compute()
    assert (longest["rank"], longest["iterations"], longest["compute_ms"], longest["peer_median_ms"]) == (4, 2, 3, 2)
    reasons = tally.reasons(persist_iterations=3, min_peers=4)
    assert len(reasons) == 1 and "only 2 iteration(s)" in reasons[0]
    (signal,) = tally.unopened_signals(ScoringConfig())
    assert (signal["subject"], signal["category"], signal["iterations"]) == ("rank:4", "gpu_slow", 2)


def test_too_few_peers_per_stage_and_no_collectives_are_reasons():
    tally = JobTally("j")
    for rank in range(6):
        rec = record(rank, 0, 2e6, 1e6, stage=rank // 3)
        rec = {k: (v[:1] if isinstance(v, list) else v) for k, v in rec.items()}  # compute only
        tally.add(rec)
    reasons = tally.reasons(persist_iterations=1, min_peers=4)
    assert len(reasons) == 2
    assert "stage 0: 3" in reasons[0] and "stage 1: 3" in reasons[0]
    assert reasons[1].startswith("no collective metadata")
    assert tally.last_arrivals() == []


@pytest.mark.skipif(not DLRM_TAR.exists(), reason="no shared traces")
def test_analyze_on_a_one_iteration_trace_says_who_is_last_and_why_nothing_opened(tmp_path, capsys):
    with tarfile.open(DLRM_TAR) as tar:
        tar.extractall(tmp_path, filter="data")
    folder = str(tmp_path / "dlrm_kineto")
    assert main(["analyze", folder, "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["findings"] == []
    ex = doc["explanations"]["dlrm_kineto"]
    assert ex["iterations"] == 1
    assert any("only 1 iteration(s)" in r for r in ex["reasons"])
    assert ex["last_arrivals"] and all(0 <= a["rank"] < 8 and a["of"] == 1 for a in ex["last_arrivals"])
    assert len(ex["longest_compute"]) == 1 and ex["longest_compute"][0]["compute_ms"] > 0
    assert main(["analyze", folder, "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "last to arrive (waits least)" in text and "no finding could open: only 1 iteration(s)" in text
