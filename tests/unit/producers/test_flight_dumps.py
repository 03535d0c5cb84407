"""Flight Recorder dumps read into the live hang verdict: real gloo dumps (captured from a hung CPU job)
and NCCL-style dumps built field by field as torch's ``fr_trace`` reads them, pickle and JSON."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from fleetscope.cli import main
from fleetscope.dump_analysis import analyze_dumps, split_dumps
from fleetscope.producers.flight_dumps import dump_heartbeats, is_dump, parse_dump, rank_of
from fleetscope.producers.kineto_load import TraceError
from fleetscope.streams.analysis.differential import DifferentialConfig
from fleetscope.streams.analysis.joblevel import JobLevelConfig
from fleetscope.traces_cli import analyze_traces

REAL = Path(__file__).parents[2] / "data" / "flight_recorder"
S = 10**9
T0 = 1_790_000_000 * S
WORLD = 4
FAST = DifferentialConfig(job_level=JobLevelConfig(hang_min_stall_ms=1000))


def fr_entry(record_id: int, seq: int, *, state: str = "completed", name: str = "nccl:all_reduce",
             sizes: list[list[int]] | None = None, dtype: str = "Float", pg: tuple[str, str] = ("0", "default_pg"),
             created_s: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """One entry as ProcessGroupNCCL's recorder writes it (the fields ``fr_trace`` reads)."""
    sizes = sizes if sizes is not None else [[1024]]
    done = state == "completed"
    return {
        "record_id": record_id, "pg_id": int(pg[0]), "process_group": pg, "collective_seq_id": seq,
        "p2p_seq_id": 0, "op_id": seq, "profiling_name": name, "time_created_ns": T0 + int(created_s * S),
        "input_sizes": sizes, "input_dtypes": [dtype] * len(sizes), "output_sizes": sizes,
        "output_dtypes": [dtype] * len(sizes), "state": state,
        "time_discovered_started_ns": T0 + int(created_s * S) + 1000 if state != "scheduled" else None,
        "time_discovered_completed_ns": T0 + int(created_s * S) + 2000 if done else None,
        "retired": done, "timeout_ms": 600_000, "is_p2p": False, "thread_name": "pt_main_thread",
        "thread_id": "1", "frames": [{"name": "all_reduce", "filename": "train.py", "line": 7}],
    }  # fmt: skip


def fr_dump(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "version": "2.10", "comm_lib_version": "2.21.5", "nccl_comm_state": {},
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(WORLD)))}},
        "pg_status": {"0": {"last_enqueued_collective": max((e["collective_seq_id"] for e in entries), default=-1),
                            "last_started_collective": -1, "last_completed_collective": -1}},
        "entries": entries,
    }  # fmt: skip


def as_json(dump: dict[str, Any]) -> bytes:
    """As ``_dump_fr_trace_json`` writes it: sorted keys, lists for tuples, 0 for absent times."""
    for e in dump["entries"]:
        for key in ("time_discovered_started_ns", "time_discovered_completed_ns"):
            e[key] = e[key] or 0
    return json.dumps(dump, sort_keys=True).encode()


def job(tmp_path: Path, per_rank: dict[int, list[dict[str, Any]]], fmt: str = "pickle",
        written_s: float = 30.0) -> Path:  # fmt: skip
    """One file per rank, named as PyTorch names them, written ``written_s`` after T0."""
    folder = tmp_path / "job"
    folder.mkdir(parents=True, exist_ok=True)
    for rank, entries in per_rank.items():
        path = folder / f"nccl_trace_rank_{rank}"
        doc = fr_dump(entries)
        path.write_bytes(pickle.dumps(doc) if fmt == "pickle" else as_json(doc))
        os.utime(path, ns=(T0 + int(written_s * S),) * 2)
    return folder


def verdict(folder: Path, config: DifferentialConfig = FAST) -> tuple[dict[str, Any], list[str]]:
    skipped: list[str] = []
    dumps, rest = split_dumps([folder])
    assert rest == []
    out = analyze_dumps(dumps, config, None, lambda _p, exc: skipped.append(str(exc)))
    return out.verdicts[folder.name], skipped


def history(n: int = 4) -> list[dict[str, Any]]:
    return [fr_entry(i, i + 1, created_s=i * 0.1) for i in range(n)]


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_the_rank_that_never_entered_the_collective_is_named(tmp_path: Path, fmt: str) -> None:
    waiting = fr_entry(4, 5, state="started", created_s=1.0)
    folder = job(tmp_path, {0: [*history(), waiting], 1: [*history(), waiting], 2: history(), 3: [*history(), waiting]},
                 fmt)  # fmt: skip
    v, skipped = verdict(folder)
    assert skipped == []
    assert (v["verdict"], v["not_entered"], v["entered"], v["seq"], v["op"]) == (
        "rank never joined", [2], [0, 1, 3], 5, "allreduce")  # fmt: skip
    assert v["nbytes"] == 4096 and v["waiting_ns"] == 29 * S  # as of the dumps' time, on the waiters' clocks


def test_a_size_mismatch_names_the_size_and_the_rank_that_called_it_differently(tmp_path: Path) -> None:
    inside = [fr_entry(4, 5, state="started", created_s=1.0) for _ in range(WORLD)]
    inside[3] = fr_entry(4, 5, state="started", created_s=1.0, sizes=[[2048]])
    v, _ = verdict(job(tmp_path, {r: [*history(), inside[r]] for r in range(WORLD)}, "json"))
    assert (v["verdict"], v["mismatch"], v["kind"]) == ("metadata mismatch", ["size"], "desync")
    assert v["calls"] == {"allreduce/4096/Float/[[1024]]": [0, 1, 2], "allreduce/8192/Float/[[2048]]": [3]}


def test_a_dtype_or_op_mismatch_is_named_as_such(tmp_path: Path) -> None:
    inside = {r: fr_entry(4, 5, state="started", created_s=1.0) for r in range(WORLD)}
    inside[1] = fr_entry(4, 5, state="started", created_s=1.0, dtype="BFloat16")
    v, _ = verdict(job(tmp_path / "a", {r: [*history(), e] for r, e in inside.items()}))
    assert v["mismatch"] == ["dtype"] and v["calls"]["allreduce/2048/BFloat16/[[1024]]"] == [1]
    inside[1] = fr_entry(4, 5, state="started", created_s=1.0, name="nccl:_all_gather_base")
    v, _ = verdict(job(tmp_path / "b", {r: [*history(), e] for r, e in inside.items()}))
    assert v["mismatch"] == ["op"] and v["calls"]["allgather/4096/Float/[[1024]]"] == [1]
    many = [[8]] * 40  # a coalesced call of 40 tensors: its shapes summed up, still compared
    inside = {r: fr_entry(4, 5, state="started", created_s=1.0, sizes=many[: 40 - (r == 2)]) for r in range(WORLD)}
    v, _ = verdict(job(tmp_path / "c", {r: [*history(), e] for r, e in inside.items()}))
    assert v["mismatch"] == ["size"] and v["calls"]["allreduce/1248/Float/39 tensors of 312 elements"] == [2]


def test_every_member_inside_the_same_call_is_stuck_inside(tmp_path: Path) -> None:
    waiting = fr_entry(4, 5, state="started", created_s=1.0)
    v, _ = verdict(job(tmp_path, {r: [*history(), waiting] for r in range(WORLD)}))
    assert (v["verdict"], v["entered"], v["not_entered"]) == ("stuck inside", [0, 1, 2, 3], [])


def test_completed_dumps_and_a_collective_still_inside_its_threshold_give_no_hang(tmp_path: Path) -> None:
    v, _ = verdict(job(tmp_path / "done", {r: history() for r in range(WORLD)}))
    assert v["verdict"] == "no hang" and "completed" in v["reason"]
    # dumped on demand mid-step: rank 0 is 0.2 s into an all-reduce the others already left
    per_rank = {r: history(5) for r in range(WORLD)}
    per_rank[0] = [*history(4), fr_entry(4, 5, state="started", created_s=0.5)]
    v, _ = verdict(job(tmp_path / "busy", per_rank, written_s=0.7))
    assert v["verdict"] == "no hang" and "none for 1 s" in v["reason"]


def test_a_truncated_or_garbled_dump_is_skipped_with_one_line_and_the_rest_is_read(tmp_path: Path) -> None:
    waiting = fr_entry(4, 5, state="started", created_s=1.0)
    folder = job(tmp_path, {0: [*history(), waiting], 1: [*history(), waiting], 2: history(), 3: [*history(), waiting]})
    good = (folder / "nccl_trace_rank_1").read_bytes()
    (folder / "nccl_trace_rank_1").write_bytes(good[: len(good) // 2])  # truncated
    (folder / "nccl_trace_rank_3").write_bytes(b"\x00garbage\xff" * 20)  # not a dump at all, named as one
    (folder / "nccl_trace_rank_5").write_bytes(pickle.dumps(TraceError("x")))  # names a class
    v, skipped = verdict(folder)
    assert len(skipped) == 3 and all("\n" not in s for s in skipped), skipped
    assert "nccl_trace_rank_1: not a readable pickle" in skipped[0]
    assert "nccl_trace_rank_3: neither a pickle nor JSON" in skipped[1]
    assert "refers to fleetscope" in skipped[2]
    assert v["not_entered"] == [1, 2, 3] and v["unreported"] == [1, 3] and v["entered"] == [0]


def test_real_gloo_dumps_of_a_hung_job_name_the_rank_and_its_healthy_dumps_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Captured from a 3-rank CPU gloo job (tests/integration/test_flight_dumps.py): gloo leaves every
    entry ``scheduled`` and writes no usable pg_config; ``retired`` tells what completed."""
    result = analyze_traces([REAL / "gloo_hung", REAL / "gloo_healthy"])
    (finding,) = result.findings
    assert (finding["job"], finding["category"], finding["rank"]) == ("gloo_hung", "hang", 1)
    evidence = json.loads(finding["evidence"])
    assert (evidence["not_entered"], evidence["entered"], evidence["seq"]) == ([1], [0, 2], 3)
    assert result.dump_verdicts["gloo_healthy"]["verdict"] == "no hang" and result.ranks == []
    assert len(result.dumps) == 6 and result.skipped == []
    assert main(["analyze", str(REAL / "gloo_hung"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "gloo_hung: flight recorder: rank never joined: rank(s) 1 never entered allreduce #3 of group 0" in out


def test_dumps_are_told_from_kineto_traces_by_content_and_ranks_from_names() -> None:
    assert is_dump(pickle.dumps({"version": "2.10"}, protocol=4))
    assert is_dump(b'{"comm_lib_version":"2.21.5","entries":[{"collective_seq_id":1')
    assert not is_dump(b'{"schemaVersion": 1, "distributedInfo": {"rank": 0, "pg_config": []}, "traceEvents": [')
    assert [rank_of(n) for n in ("nccl_trace_rank_12", "rank3.json", "trace.json")] == [12, 3, None]
    with pytest.raises(TraceError, match="no rank at the end of its name"):
        parse_dump(pickle.dumps(fr_dump([])), "dump", 0)
    with pytest.raises(TraceError, match=r"entry 0 unreadable .*process_group"):
        parse_dump(pickle.dumps(fr_dump([dict(fr_entry(0, 1), process_group="0")])), "r0", 0)


def test_a_send_is_matched_with_no_other_rank_and_a_subgroup_without_pg_config_is_its_ranks() -> None:
    send = dict(fr_entry(0, 0, state="started", name="nccl:send 0->1"), is_p2p=True, p2p_seq_id=1)
    tp = fr_entry(0, 1, state="started", pg=("1", "tp"))
    dumps = [parse_dump(pickle.dumps(fr_dump([send])), "r0", T0), parse_dump(pickle.dumps(fr_dump([tp])), "r1", T0),
             parse_dump(pickle.dumps(fr_dump([dict(tp, state="completed", retired=True)])), "r2", T0)]  # fmt: skip
    latest = dump_heartbeats(dumps, "j")
    assert (latest[0]["collective_pg"], latest[0]["collective_group_ranks"]) == ("0:p2p:0", [0])
    assert latest[1]["collective_group_ranks"] == [1, 2] and latest[1]["in_collective"]
    assert not latest[2]["in_collective"]
