"""NCCL Inspector logs: the format's own examples parse field by field, communicators' membership gives the
layout, ``analyze`` names the slow rank of a dp4 x tp2 job and nothing on the healthy one, a bad line costs
that line, and the tailer publishes complete lines only, without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fleetscope.commands.inspector import InspectorTailer
from fleetscope.producers.inspector_gen import InspectorJobSpec, write_inspector_job
from fleetscope.producers.nccl_inspector import (
    InspectorJob,
    LineProblem,
    op_times,
    parse_line,
    read_inspector_file,
)
from fleetscope.schemas import EventBatch, EventKind
from fleetscope.traces_cli import LoadOptions, analyze_traces

EXAMPLES = Path(__file__).parents[2] / "data" / "nccl_inspector" / "readme-examples.log"
"""The two records of NVIDIA/nccl's plugins/profiler/inspector/README.md (plain and verbose), as written."""
SLOW_RANK = 5


def test_the_formats_own_examples_map_field_by_field() -> None:
    plain, verbose = read_inspector_file(EXAMPLES, 1 << 20).ops
    assert (plain.comm, plain.comm_rank, plain.comm_size, plain.comm_name) == ("0x7f8c496ae9f661", 2, 8, "")
    assert (plain.host, plain.pid, plain.op, plain.seq) == ("example-hostname", 1639453, "allreduce", 1407)
    assert (plain.nbytes, plain.exec_ns, plain.busbw_gbs) == (17179869184, 61_974_000, 485.119099)
    assert plain.kernel_start_ns == -1 and plain.dump_ns == 1748030377748202 * 1000
    # reduce-scatter: the Inspector's size is one rank's share; nccl-tests' size is the whole input
    assert (verbose.op, verbose.nbytes, verbose.timing_source) == ("reduce_scatter", 2147483648 * 8, "kernel_gpu")
    assert verbose.kernel_start_ns == 1752867229235181 * 1000 and verbose.host_start_ns == 1752867229235059 * 1000
    start, launch = op_times([plain, verbose])
    assert start == [plain.dump_ns - plain.exec_ns, verbose.kernel_start_ns]  # untraced: it ended by its dump
    assert launch[1] == verbose.host_start_ns


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b'{"header": {"id": "0x1", "rank": 0, "n_ranks": 2}, "metadata": {"dump_ti', "truncated or malformed"),
        (b"[1, 2]", "not an object"),
        (b'{"header": {"id": "0x1", "rank": 3, "n_ranks": 2}, "metadata": {}, "coll_perf": {}}', "outside n_ranks"),
        (b'{"header": {"id": "0x1", "rank": 0, "n_ranks": 2}, "metadata": {"dump_timestamp_us": 5}, '
         b'"coll_perf": {"coll": "AllReduce", "coll_sn": 1, "coll_msg_size_bytes": -4}}', "coll_msg_size_bytes"),
    ],
)  # fmt: skip
def test_a_bad_line_gets_a_one_line_reason(line: bytes, reason: str) -> None:
    with pytest.raises(LineProblem) as exc:
        parse_line(line)
    assert reason in str(exc.value) and "\n" not in str(exc.value)


def test_membership_gives_the_layout_and_a_world_communicator_the_ranks(tmp_path: Path) -> None:
    paths = write_inspector_job(InspectorJobSpec(iterations=2), tmp_path / "job")
    job = InspectorJob("job")
    for p in paths:
        job.note(str(p), read_inspector_file(p, 1 << 30).ops)
    ranks = job.ranks()
    assert [ranks[str(p)] for p in paths] == list(range(8))  # no world communicator: (host, pid) order
    layout = job.layout(ranks)
    assert layout.sources == {"tp": "membership", "dp": "membership"}
    assert [(layout.role(r).tp_rank, layout.role(r).dp_rank) for r in range(8)] == [(r % 2, r // 2) for r in range(8)]
    # A communicator over all 8 processes numbers them: its ranks win over the file order.
    world = json.loads(paths[0].read_text().splitlines()[0])
    for i, p in enumerate(paths):
        line = {**world, "header": {**world["header"], "id": "0xworld", "rank": 7 - i, "n_ranks": 8}}
        job.note(str(p) + "-", [])  # an unrelated name: nothing to note
        job.note(str(p), [parse_line(json.dumps(line))])
    job.given.clear()
    assert [job.ranks()[str(p)] for p in paths] == list(range(7, -1, -1))


def _findings(folder: Path) -> tuple[list[tuple[str, str]], list[dict[str, str]], dict[int, int]]:
    result = analyze_traces([folder], None, LoadOptions(on_skip=lambda _p, _e: None))
    found = [(f["category"], f["subject"]) for f in result.findings]
    return found, result.skipped, {r.rank: r.collectives for r in result.ranks}


def test_analyze_names_the_slow_rank_and_nothing_on_the_healthy_job(tmp_path: Path) -> None:
    write_inspector_job(InspectorJobSpec(slow_rank=SLOW_RANK, slow_factor=1.3, seed=3), tmp_path / "slow")
    write_inspector_job(InspectorJobSpec(seed=3), tmp_path / "healthy")
    found, skipped, _ = _findings(tmp_path / "slow")
    assert found == [("straggler", f"rank:{SLOW_RANK}")] and skipped == []
    found, _, per_rank = _findings(tmp_path / "healthy")
    assert found == [] and len(per_rank) == 8


def test_a_malformed_and_a_truncated_line_are_skipped_and_the_rest_kept(tmp_path: Path) -> None:
    paths = write_inspector_job(InspectorJobSpec(slow_rank=SLOW_RANK, slow_factor=1.3, seed=3), tmp_path / "slow")
    _, _, before = _findings(tmp_path / "slow")
    lines = paths[2].read_text().splitlines(keepends=True)
    paths[2].write_text("".join(lines[:5]) + '{"header": oops}\n' + "".join(lines[5:]) + lines[0][:70])
    found, skipped, after = _findings(tmp_path / "slow")
    reasons = [s["reason"] for s in skipped]
    assert len(reasons) == 2 and reasons[0].startswith("line 6: not JSON (Expecting value")
    assert reasons[1].startswith(f"line {len(lines) + 2}: no newline at the end (truncated): not JSON")
    assert after == before and found == [("straggler", f"rank:{SLOW_RANK}")]


def test_the_tailer_publishes_complete_lines_and_dead_letters_a_truncated_end(tmp_path: Path) -> None:
    paths = write_inspector_job(InspectorJobSpec(iterations=3), tmp_path / "job")
    lines = paths[0].read_text().splitlines(keepends=True)
    paths[0].write_text("".join(lines[:10]) + lines[10][:40])  # the writer is mid-line
    batches: list[EventBatch] = []
    letters: list[tuple[str, bytes, dict[str, str]]] = []
    tailer = InspectorTailer([tmp_path / "job"], None, lambda b: batches.append(b) or True,
                             lambda k, v, h: letters.append((k, v, h)))  # fmt: skip
    tailer.poll()
    mine = [b for b in batches if b.header.producer_id.endswith(paths[0].name)]
    assert sum(len(b) for b in mine) == 10 and letters == []  # the partial line waits
    assert {b.header.rank for b in batches} == set(range(8)) and all(b.kind is EventKind.COLLECTIVES for b in batches)
    assert {(b.header.tp_size, b.header.dp_size) for b in batches} == {(2, 4)}
    with open(paths[0], "a") as f:
        f.write(lines[10][40:] + "".join(lines[11:20]) + lines[20][:40])
    tailer.poll(final=True)
    mine = [b for b in batches if b.header.producer_id.endswith(paths[0].name)]
    assert sum(len(b) for b in mine) == 20 and [b.header.seq for b in mine] == [0, 1]
    assert all(np.all(np.diff(b["launch_ns"]) >= 0) for b in mine)  # each batch in launch order
    ((key, value, headers),) = letters
    assert key == f"job/{paths[0].name}" and value == lines[20][:40].encode()
    assert headers["line"] == "21" and headers["reason"].startswith("inspector: no newline at the end (truncated)")


def test_the_tailer_process_imports_no_torch() -> None:
    code = "import sys, fleetscope.cli, fleetscope.commands.inspector; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
