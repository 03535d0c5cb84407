"""``analyze`` reads files in worker processes and with a typed decoder: same answers as one by one,
the layout's coordinates (experts included) in its summary, and the stdlib path for odd input."""

from __future__ import annotations

import json
import tarfile
import tempfile
from pathlib import Path

import pytest

from fleetscope.cli import main
from fleetscope.producers.kineto import parse_trace
from fleetscope.producers.kineto_load import load_trace
from fleetscope.producers.tracegen import TraceJob, write_traces
from fleetscope.traces_cli import AnalyzeResult, LoadOptions, analyze_traces


def test_worker_processes_give_what_one_process_gives(tmp_path: Path) -> None:
    write_traces(TraceJob(dp=4, pp=2, steps=4, fault="slow_worker", fault_rank=5, seed=11), tmp_path / "job")
    (tmp_path / "job" / "notes.json").write_text("{}")  # not a trace: skipped in both, in file order
    skipped: list[list[str]] = [[], []]

    def run(workers: int, seen: list[str]) -> AnalyzeResult:
        options = LoadOptions(workers=workers, on_skip=lambda p, _e: seen.append(p.name))
        return analyze_traces([tmp_path / "job"], None, options)

    one, pool = run(1, skipped[0]), run(3, skipped[1])
    assert skipped == [["notes.json"], ["notes.json"]]
    assert one.ranks == pool.ranks and len(one.ranks) == 8
    assert [(f["category"], f["subject"]) for f in one.findings] == [
        (f["category"], f["subject"]) for f in pool.findings
    ]
    assert ("gpu_slow", "rank:5") in [(f["category"], f["subject"]) for f in pool.findings]
    assert one.explanations == pool.explanations


def test_the_summary_shows_the_expert_coordinate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = TraceJob(dp=4, ep=2, steps=3)
    write_traces(job, tmp_path / "moe")
    result = analyze_traces([tmp_path / "moe"])
    assert result.explanations["moe"]["layout"]["sizes"] == {"dp": 4, "ep": 2}
    assert {r.rank: r.ep_rank for r in result.ranks} == {r: job.coordinates(r)["ep"] for r in range(4)}
    assert main(["analyze", str(tmp_path / "moe"), "--quiet"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("job "))
    assert "ep_rank" in header and "dp_rank" in header and "tp_rank" not in header  # tp absent: no column
    assert "moe: 3 iteration(s), layout dp=4 x ep=2" in out


def test_input_the_typed_decoder_refuses_is_read_by_the_stdlib(tmp_path: Path) -> None:
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 10.0, "dur": 5.0, "pid": 0, "tid": 7, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 20.0, "dur": 5.0, "pid": 0, "tid": 7, "args": "odd"},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 30.0, "dur": float("nan"), "pid": 0, "tid": 7},
        17,
    ]
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": 0, "world_size": 1}}))
    doc = load_trace(path)
    assert doc.skipped == 1 and len(doc.traceEvents) == 3 and doc.traceEvents[1].args is None
    trace = parse_trace(path)
    assert trace.kernels == 2 and trace.skipped_events == 2  # the NaN duration and the number
    assert trace.events == 4


def test_a_tar_archive_of_traces_is_read_like_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    write_traces(TraceJob(dp=4, steps=3, seed=5), tmp_path / "src" / "myjob")
    (tmp_path / "src" / "myjob" / "et.json").write_text('{"nodes": []}')  # an execution trace: skipped
    (tmp_path / "in").mkdir()
    with tarfile.open(tmp_path / "in" / "profiles.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "src" / "myjob", arcname="myjob")
    skipped: list[str] = []
    result = analyze_traces([tmp_path / "in"], None, LoadOptions(on_skip=lambda p, _e: skipped.append(p.name)))
    assert [(r.job, r.rank) for r in result.ranks] == [("myjob", r) for r in range(4)]
    assert skipped == ["et.json"]
    assert not list(
        Path(tempfile.gettempdir()).glob("fleetscope-traces-*/profiles.tar.gz")
    )  # unpacked for the run only
