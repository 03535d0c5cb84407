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
            "mean_ns": [compute_ns, allreduce_ns], "max_ns": [compute_ns, allreduce_ns], "nbytes": [0, 1 << 20],
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


def slowed_nccl_copy(source: Path, dest: Path, rank: int, factor: float) -> Path:
    """A copy of a trace folder with one rank's NCCL kernels ``factor`` times longer (start kept)."""
    dest.mkdir(parents=True)
    for f in sorted(source.glob("*.json")):
        doc = json.loads(f.read_text())
        if factor != 1.0 and doc["distributedInfo"]["rank"] == rank:
            for e in doc["traceEvents"]:
                if e.get("cat") == "kernel" and str(e.get("name", "")).startswith("ncclKernel"):
                    e["dur"] = round(e["dur"] * factor)
        (dest / f.name).write_text(json.dumps(doc))
    return dest


def test_link_samples_lift_the_link_limit():
    tally = JobTally("j")
    for rank in range(4):
        tally.add(record(rank, 0, 2e6, 1e6 if rank else 2e5))
    (limit,) = tally.limits()
    # transfer = the shortest member's kernel: 4 x 0.2 ms of 3.2 ms in all
    assert "link_slow cannot be judged" in limit and "is 25% of the NCCL kernel time" in limit
    rec = record(4, 0, 2e6, 1e6)
    rec["nvlink_peak_bps"] = [nan, 2e11]
    tally.add(rec)
    assert tally.limits() == []


@pytest.mark.skipif(not DLRM_TAR.exists(), reason="no shared traces")
@pytest.mark.parametrize("factor", [1.0, 1.75])
def test_a_slowed_nccl_transfer_on_one_dlrm_rank_gives_no_finding_and_says_why(tmp_path, capsys, factor):
    with tarfile.open(DLRM_TAR) as tar:
        tar.extractall(tmp_path, filter="data")
    folder = slowed_nccl_copy(tmp_path / "dlrm_kineto", tmp_path / "job", rank=3, factor=factor)
    assert main(["analyze", str(folder), "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["findings"] == []  # one iteration: nothing can open (a reason says so)
    ex = doc["explanations"]["job"]
    # the rank's longer NCCL kernels read as waiting: no link signal, nothing new on rank 3 or any other
    signals = {(s["category"], s["subject"]) for s in ex["unopened_signals"]}
    assert not any(category == "link_slow" for category, _ in signals)
    assert ("straggler", "rank:7") in signals and not any(
        subject == "rank:3" and c != "host_slow" for c, subject in signals
    )
    (limit,) = ex["limits"]
    share = float(limit.split("shortest kernel) is ")[1].split("%")[0])
    assert 0 < share < 20  # DLRM's NCCL kernels are mostly waiting for the last rank
