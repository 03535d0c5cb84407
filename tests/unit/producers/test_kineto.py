"""The Kineto parser reads old and new traces alike, and bad files fail with one line naming the file."""

from __future__ import annotations

import gzip
import json
import os
import tarfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetscope.cli import main
from fleetscope.producers import TraceError, TraceRank, parse_trace
from fleetscope.schemas import (
    EventBatch,
    EventKind,
    FunctionKind,
    classify_kernel,
    decode_event_batch,
    encode_event_batch,
    parse_step_marker,
)
from fleetscope.traces_cli import find_traces

TRACES = Path(os.environ.get("FLEETSCOPE_TRACES_DIR", "/work/shared/traces"))
HTA = TRACES / "hta_kineto_samples"
NCCL_DATA = HTA / "nccl_parser_config" / "nccl_data.json.gz"
TRACE_FILTER = sorted((HTA / "trace_filter").glob("*.json.gz"))
DLRM_TAR = TRACES / "param_dlrm_kineto_8rank" / "dlrm_kineto.tar.gz"
needs_traces = pytest.mark.skipif(not DLRM_TAR.exists() or not NCCL_DATA.exists(), reason="no shared traces")
DTYPE_BYTES = {"Float": 4, "Long": 8, "BFloat16": 2, "Half": 2, "Double": 8, "Int": 4}
BASE_NS = 1_711_964_646_000_000_000


@pytest.fixture(scope="module")
def dlrm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dlrm")
    with tarfile.open(DLRM_TAR) as tar:
        tar.extractall(out, filter="data")
    return out / "dlrm_kineto"


def load_events(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)["traceEvents"]


def rows(trace: TraceRank, kind: EventKind) -> Iterator[tuple[EventBatch, int]]:
    for b in trace.batches:
        if b.kind is kind:
            yield from ((b, i) for i in range(len(b)))


def write(path: Path, doc: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def x(cat: str, name: str, ts: float, dur: float, pid: int = 1, tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


# -- real traces ------------------------------------------------------------------------------------


@needs_traces
def test_analyze_parses_the_dlrm_and_hta_traces(dlrm_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["analyze", str(dlrm_dir), *map(str, TRACE_FILTER), str(NCCL_DATA), "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert rc == 0 and "skipped" not in err
    ranks = json.loads(out)["ranks"]
    by_job = Counter(r["job"] for r in ranks)
    assert by_job == {"dlrm_kineto": 8, "trace_filter": 2, "nccl_parser_config": 1}
    dlrm = [r for r in ranks if r["job"] == "dlrm_kineto"]
    assert [r["rank"] for r in dlrm] == list(range(8))
    assert all(r["steps"] == [10] and r["iterations"] == 1 and r["collectives"] == 8 for r in dlrm)
    assert all(0 < r["gpu_busy_pct"] <= 100 and r["mean_iteration_ms"] > 10 for r in dlrm)
    nccl = next(r for r in ranks if r["job"] == "nccl_parser_config")
    assert nccl["steps"] == [4, 5, 6] and nccl["iterations"] == 3 and nccl["collectives"] == 21
    assert [r["steps"] for r in ranks if r["job"] == "trace_filter"] == [[551, 552], [551, 552]]


@needs_traces
def test_kernel_totals_match_an_independent_sum_over_the_json(dlrm_dir: Path) -> None:
    for path in [*sorted(dlrm_dir.glob("*.json")), *TRACE_FILTER, NCCL_DATA]:
        events = load_events(path)
        kernels = [e for e in events if e.get("cat") == "kernel"]
        memory = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
        want_ns = sum(round(e["dur"] * 1000) for e in kernels)
        trace = parse_trace(path)
        emitted = [
            int(b["dur_ns"][i])
            for b, i in rows(trace, EventKind.KERNELS)
            if classify_kernel(b.names[b["name_id"][i]]) is not FunctionKind.MEMORY
        ]
        emitted += [int(b["dur_ns"][i]) for b, i in rows(trace, EventKind.COLLECTIVES)]
        assert (len(emitted), sum(emitted)) == (len(kernels), want_ns), path.name
        assert (trace.kernels, trace.kernel_ns) == (len(kernels), want_ns)
        assert trace.count(EventKind.KERNELS) == len(kernels) + len(memory) - trace.collectives
        assert sum(e["dur"] for e in kernels) * 1000 == pytest.approx(want_ns, abs=len(kernels))


@needs_traces
def test_nccl_data_has_21_collectives_with_sizes_from_the_kernel_args() -> None:
    events = sorted(load_events(NCCL_DATA), key=lambda e: e["ts"])
    want = [
        (e["args"]["Collective name"], e["args"]["In msg nelems"] * DTYPE_BYTES[e["args"]["dtype"]])
        for e in events
        if e.get("cat") == "kernel" and e["name"].startswith("ncclKernel_")
    ]
    trace = parse_trace(NCCL_DATA)
    got = [(b.names[b["op_id"][i]], int(b["nbytes"][i])) for b, i in rows(trace, EventKind.COLLECTIVES)]
    assert len(got) == 21 and Counter(op for op, _ in got) == {"allreduce": 15, "broadcast": 6}
    assert got == want and all(n > 0 for _, n in got)
    coll = next(b for b in trace.batches if b.kind is EventKind.COLLECTIVES)
    assert set(coll["group_size"].tolist()) == {2} and {coll.names[i] for i in coll["pg_id"]} == {"0"}
    assert coll["seq"].tolist() == list(range(21))  # no Seq arg: ordinal within the process group
    assert (coll["launch_ns"] < coll["start_ns"]).all()
    longest = int(np.argmax(coll["dur_ns"]))  # HTA's reference: the longest is a 2,049,000-float all-reduce
    assert coll.names[coll["op_id"][longest]] == "allreduce" and coll["nbytes"][longest] == 2049000 * 4
    assert trace.time_base == "base_time_ns"
    assert trace.batches[0].header.world_size == 2


@needs_traces
def test_old_traces_take_collective_sizes_from_the_cpu_annotation(dlrm_dir: Path) -> None:
    trace = parse_trace(dlrm_dir / "worker0_step_12.1694128201545.pt.trace.json")
    assert (trace.job, trace.rank, trace.world_size, trace.time_base) == ("dlrm_kineto", 0, 8, "epoch_us")
    got = [(b.names[b["op_id"][i]], int(b["nbytes"][i])) for b, i in rows(trace, EventKind.COLLECTIVES)]
    assert Counter(op for op, _ in got) == {"all_to_all": 5, "allreduce": 3}
    # nccl:all_to_all Input Dims [[6144]] float, nccl:all_reduce [[394241]] float (see the trace's README)
    assert got[0] == ("all_to_all", 6144 * 4) and ("allreduce", 394241 * 4) in got
    sampled = parse_trace(TRACE_FILTER[0])
    ops = Counter(b.names[b["op_id"][i]] for b, i in rows(sampled, EventKind.COLLECTIVES))
    assert ops == {"all_to_all": 4, "allreduce": 4, "allgather": 2}  # nccl:_all_gather_base included


@needs_traces
def test_batches_round_trip_through_the_codec_with_their_own_dictionaries() -> None:
    trace = parse_trace(NCCL_DATA, job="j", batch_events=500)
    kinds = Counter(b.kind for b in trace.batches)
    assert kinds[EventKind.KERNELS] == -(-trace.count(EventKind.KERNELS) // 500)
    assert [b.header.seq for b in trace.batches] == list(range(len(trace.batches)))
    for b in trace.batches:
        assert b.header.job == "j" and set(b.header.streams) == {"kernels", "collectives", "python"}
        assert len(b.names) == len(set(b.names))
        back = decode_event_batch(encode_event_batch(b))
        assert back.names == b.names and all(np.array_equal(back[c], b[c]) for c in b.columns)
    k = [b for b in trace.batches if b.kind is EventKind.KERNELS]
    launch = np.concatenate([b["launch_ns"] for b in k])
    assert launch.size == trace.count(EventKind.KERNELS) and (np.diff(launch) >= 0).all()


# -- hand-written traces ----------------------------------------------------------------------------


def test_old_absolute_microsecond_timestamps(tmp_path: Path) -> None:
    ts = 1_694_128_201_429_795
    doc = {
        "distributedInfo": {"rank": 3, "world_size": 4},
        "traceEvents": [
            x("user_annotation", "ProfilerStep#7", ts, 100),
            x("cuda_runtime", "cudaLaunchKernel", ts + 10, 2, correlation=5),
            x("kernel", "gemm", ts + 20, 30.5, pid=0, tid=7, correlation=5, stream=7),
        ],
    }
    trace = parse_trace(write(tmp_path / "job1" / "t.json", doc))
    (kb,) = [b for b in trace.batches if b.kind is EventKind.KERNELS]
    assert kb["start_ns"].tolist() == [(ts + 20) * 1000] and kb["dur_ns"].tolist() == [30_500]
    assert kb["launch_ns"].tolist() == [(ts + 10) * 1000] and kb["stream"].tolist() == [7]
    assert (trace.rank, trace.world_size, trace.job, trace.time_base) == (3, 4, "job1", "epoch_us")
    assert trace.steps == (7,)


def test_new_relative_timestamps_with_base_time(tmp_path: Path) -> None:
    doc = {
        "baseTimeNanoseconds": BASE_NS,
        "distributedInfo": {"rank": 0, "world_size": 2},
        "traceEvents": [
            x("user_annotation", "ProfilerStep#4", 4458676416788.066, 222442.191),
            x("kernel", "gemm", 4458677009853.422, 2636.669, pid=0, tid=7),
        ],
    }
    trace = parse_trace(write(tmp_path / "t.json.gz", doc))  # gzip is detected by content, not by name
    (kb,) = [b for b in trace.batches if b.kind is EventKind.KERNELS]
    assert kb["start_ns"].tolist() == [BASE_NS + 4458677009853422] and kb["dur_ns"].tolist() == [2636669]
    assert kb["launch_ns"].size == 0  # no cuda_runtime event: launch time unknown
    (pb,) = [b for b in trace.batches if b.kind is EventKind.HOST]
    assert pb["start_ns"].tolist() == [BASE_NS + 4458676416788066] and trace.time_base == "base_time_ns"
    gz = write(tmp_path / "z" / "t.json", {})
    gz.write_bytes(gzip.compress(json.dumps(doc).encode()))
    assert parse_trace(gz).kernel_ns == 2636669


def test_collective_metadata_on_the_kernel(tmp_path: Path) -> None:
    meta = {"Collective name": "_allgather_base", "In msg nelems": 1024, "Out msg nelems": 4096,
            "Group size": 4, "dtype": "BFloat16", "Process Group Name": "3", "Seq": 17}  # fmt: skip
    doc = {
        "distributedInfo": {"rank": 1, "world_size": 8},
        "traceEvents": [x("kernel", "ncclDevKernel_AllGather_RING_LL(x)", 10, 5, pid=0, correlation=1, **meta)],
    }
    (b,) = parse_trace(write(tmp_path / "t.json", doc)).batches
    assert b.kind is EventKind.COLLECTIVES
    assert (b.names[b["op_id"][0]], b.names[b["pg_id"][0]]) == ("allgather", "3")
    assert (b["nbytes"][0], b["group_size"][0], b["seq"][0]) == (4096 * 2, 4, 17)  # S = Out x elem


def test_collective_metadata_only_on_the_cpu_op(tmp_path: Path) -> None:
    events = [
        # old style: nccl:* annotation with Input Dims, linked through the launch on the same thread
        x("cpu_op", "record_param_comms", 100, 50, tid=9, **{"External id": 1, "Input Dims": [[]]}),
        x("user_annotation", "nccl:all_reduce", 110, 30, tid=9,
          **{"External id": 2, "Input Dims": [[1000]], "Input type": ["float"]}),
        x("cuda_runtime", "cudaLaunchKernel", 120, 3, tid=9, correlation=77, **{"External id": 77}),
        x("kernel", "ncclKernel_AllReduce_RING_LL_Sum_float(x)", 130, 40, pid=0, tid=3,
          correlation=77, **{"External id": 77}),
        # newer style: record_param_comms args, linked by External id
        x("cpu_op", "record_param_comms", 300, 50, tid=9, **{"External id": 42, "Process Group Name": "5",
          "Collective name": "broadcast", "In msg nelems": 10, "Out msg nelems": 10, "dtype": "Long"}),
        x("kernel", "ncclKernel_Broadcast_RING_LL_Sum_int8_t(x)", 400, 5, pid=0, tid=3,
          correlation=78, **{"External id": 42}),
        # nothing known but the kernel name
        x("kernel", "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 500, 5, pid=0, tid=3),
        x("kernel", "ncclKernel_AllReduce_RING_LL_Sum_float(x)", 600, 5, pid=0, tid=3),
    ]  # fmt: skip
    doc = {"distributedInfo": {"rank": 0, "world_size": 8}, "traceEvents": events}
    trace = parse_trace(write(tmp_path / "t.json", doc))
    (b,) = [b for b in trace.batches if b.kind is EventKind.COLLECTIVES]
    got = [(b.names[b["op_id"][i]], b.names[b["pg_id"][i]], int(b["nbytes"][i]), int(b["seq"][i])) for i in range(4)]
    assert got == [("allreduce", "0", 4000, 0), ("broadcast", "5", 80, 0), ("reduce_scatter", "0", 0, 1),
                   ("allreduce", "0", 0, 2)]  # fmt: skip
    assert b["group_size"].tolist() == [8, 8, 8, 8]  # from distributedInfo.world_size
    assert b["launch_ns"].tolist()[0] == 120_000 and b["start_ns"].tolist()[0] == 130_000


def test_host_spans_and_memory_ops(tmp_path: Path) -> None:
    events = [
        x("user_annotation", "ProfilerStep#3", 0, 1000),
        x("user_annotation", "## forward ##", 10, 500),
        x("python_function", "model.py(12): forward", 20, 100),
        x("cpu_op", "aten::mm", 30, 10),  # an aten op: not a host function
        x("gpu_user_annotation", "## forward ##", 40, 500, pid=0),  # GPU projection: skipped
        x("python_function", "train.py(5): step", 5, 3, tid=2),  # another thread: its own nesting
        x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 2, pid=0, tid=7),
        x("gpu_memset", "Memset (Device)", 60, 1, pid=0, tid=7),
    ]
    trace = parse_trace(write(tmp_path / "trace_rank-2.json", {"traceEvents": events}))
    assert trace.rank == 2 and trace.host == "trace_rank-2" and trace.memory_ops == 2 and trace.kernels == 0
    (pb,) = [b for b in trace.batches if b.kind is EventKind.HOST]
    depth = {pb.names[n]: int(d) for n, d in zip(pb["name_id"], pb["depth"], strict=True)}
    assert depth == {
        "ProfilerStep#3": 0,
        "## forward ##": 1,
        "model.py(12): forward": 2,
        "train.py(5): step": 0,
    }
    assert [parse_step_marker(n) for n in pb.names].count(3) == 1
    (kb,) = [b for b in trace.batches if b.kind is EventKind.KERNELS]
    assert {classify_kernel(n) for n in kb.names} == {FunctionKind.MEMORY}
    assert trace.streams == ("kernels", "python")


@pytest.mark.parametrize(
    ("name", "rank"), [("rank-5.json", 5), ("x_rank_12.json", 12), ("rank7.pt.trace.json", 7), ("r.json", 9)]
)
def test_rank_from_the_file_name_then_the_argument(tmp_path: Path, name: str, rank: int) -> None:
    doc = {"hostname": "node-a", "traceEvents": [x("user_annotation", "a", 0, 1)]}
    trace = parse_trace(write(tmp_path / name, doc), rank=9, world_size=16, job="J")
    assert (trace.rank, trace.world_size, trace.host, trace.job) == (rank, 16, "node-a", "J")


BAD_FILES = {
    "garbage.json": b"\x00\x01not json at all",
    "truncated.json": b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1',
    "truncated.json.gz": gzip.compress(b'{"traceEvents": []}' * 50)[:40],
    "list.json": b"[1, 2, 3]",
    "no_events.json": b'{"schemaVersion": 1, "traceEvents": {"a": 1}}',
    "empty_events.json": b'{"distributedInfo": {"rank": 0}, "traceEvents": [{"ph": "M", "name": "p"}]}',
    "no_rank.json": json.dumps({"traceEvents": [x("user_annotation", "a", 0, 1)]}).encode(),
    "utf16.json": '{"traceEvents": []}'.encode("utf-16-le")[1:],
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_raise_one_line_naming_the_file(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(BAD_FILES[name])
    with pytest.raises(TraceError) as info:
        parse_trace(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)
    with pytest.raises(TraceError, match="cannot read"):
        parse_trace(tmp_path / "missing.json")


def test_analyze_skips_bad_files_and_analyses_the_rest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = {"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": [x("user_annotation", "s", 0, 1)]}
    write(tmp_path / "d" / "sub" / "good.json", good)
    for name in ("garbage.json", "truncated.json", "list.json"):
        (tmp_path / "d" / name).write_bytes(BAD_FILES[name])
    (tmp_path / "d" / "notes.txt").write_text("not a trace name: ignored")
    assert len(find_traces([tmp_path / "d"])) == 4
    assert main(["analyze", str(tmp_path / "d"), "--json", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert [r["rank"] for r in json.loads(out)["ranks"]] == [0]
    lines = err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("fleetscope analyze: skipped ") for line in lines)
    named = {line.split()[3].rstrip(":") for line in lines}
    assert named == {str(tmp_path / "d" / n) for n in ("garbage.json", "truncated.json", "list.json")}
    assert main(["analyze", str(tmp_path / "d" / "garbage.json"), "--quiet"]) == 1
    capsys.readouterr()
    assert main(["analyze", str(tmp_path / "d" / "sub"), "--quiet"]) == 0
    out, _ = capsys.readouterr()
    assert "no findings" in out and "mean_iteration_ms" in out


def test_replay_without_a_broker_is_a_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS", raising=False)
    assert main(["replay", str(tmp_path), "--quiet"]) == 2
    assert "replay needs a broker" in capsys.readouterr().err


# -- property: nothing but TraceError ---------------------------------------------------------------

SEED_EVENTS = [
    x("user_annotation", "ProfilerStep#1", 0.5, 100.25),
    x("user_annotation", "nccl:all_reduce", 0.7, 3, **{"Input Dims": [[4]], "Input type": ["float"]}),
    x("cpu_op", "record_param_comms", 0.6, 4, **{"External id": 9, "Collective name": "allreduce"}),
    x("cuda_runtime", "cudaLaunchKernel", 1, 2, correlation=3),
    x("kernel", "ncclKernel_AllReduce_RING_LL_Sum_float", 5, 10, pid=0, correlation=3,
      **{"In msg nelems": 4, "dtype": "Float", "Collective name": "allreduce", "External id": 9}),
    x("kernel", "gemm", 20, 1.5, pid=0, tid=7, correlation=4),
]  # fmt: skip
SEED_TRACE = json.dumps(
    {
        "baseTimeNanoseconds": BASE_NS,
        "distributedInfo": {"rank": 0, "world_size": 2},
        "traceEvents": SEED_EVENTS,
    }
).encode()
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ("ph", "cat", "name", "ts", "dur", "pid", "tid", "args")
ARGS = ("correlation", "External id", "Collective name", "In msg nelems", "Out msg nelems", "dtype",
        "Group size", "Process Group Name", "Seq", "Input Dims", "Input type", "stream",
        "device")  # fmt: skip
# A real event with a few fields (or args) replaced by any JSON value, or any JSON value at all.
mutated_events = st.builds(
    lambda e, patch, args: {**e, **patch, "args": {**e["args"], **args}},
    st.sampled_from(SEED_EVENTS),
    st.dictionaries(st.sampled_from(FIELDS[:-1]), json_values, max_size=2),
    st.dictionaries(st.sampled_from(ARGS), json_values | st.integers(-(2**70), 2**70), max_size=3),
)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def parses_or_trace_error(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    try:
        trace = parse_trace(path, rank=0)
    except TraceError as exc:
        assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc)
        return
    for b in trace.batches:
        decode_event_batch(encode_event_batch(b))


@settings(max_examples=150, deadline=None)
@given(
    data=st.binary(max_size=300)
    | st.builds(
        lambda i, b: SEED_TRACE[:i] + b + SEED_TRACE[i + len(b) :],
        st.integers(0, len(SEED_TRACE)),
        st.binary(min_size=1, max_size=6),
    )
)
def test_random_and_mutated_bytes_raise_nothing_but_trace_error(scratch: Path, data: bytes) -> None:
    parses_or_trace_error(scratch / "t.json", data)
    parses_or_trace_error(scratch / "t.json.gz", gzip.compress(data)[: max(len(data) // 2, 1)])


@settings(max_examples=150, deadline=None)
@given(
    top=st.dictionaries(st.sampled_from(["distributedInfo", "baseTimeNanoseconds", "hostname"]), json_values),
    events=st.lists(mutated_events | json_values, max_size=8),
)
def test_wrongly_typed_fields_raise_nothing_but_trace_error(
    scratch: Path, top: dict[str, Any], events: list[Any]
) -> None:
    parses_or_trace_error(scratch / "s.json", json.dumps({**top, "traceEvents": events}).encode())


@needs_traces
def test_real_traces_without_layout_groups_keep_every_rank_a_peer(dlrm_dir: Path) -> None:
    """The HTA trace lists only the default group; old DLRM traces have no pg_config: no coordinates."""
    from fleetscope.producers.trace_layout import job_layouts, with_layout

    nccl = parse_trace(NCCL_DATA)
    assert [(g.desc, g.ranks) for g in nccl.groups] == [("default_pg", (0, 1))]
    assert "allreduce" in nccl.groups[0].ops
    dlrm = [parse_trace(p) for p in sorted(dlrm_dir.glob("*.json"))]
    layouts = job_layouts([nccl, *dlrm])
    assert not any(layout.known for layout in layouts.values())
    assert with_layout(dlrm[0], layouts[dlrm[0].job]).batches[0].header.pp_rank == -1
