"""A rank's timeline (``streams/analysis/timeline.py``): built by the windower's summary from the iteration's
collective events and kernels, carried by the pattern record (``patterns.v4``), read back by ``timeline_of``."""

from __future__ import annotations

import io
import re
import socket
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastavro import schemaless_writer
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetscope.producers.rank_recorder import RankIdentity, Recorder, RecorderConfig
from fleetscope.schemas import CATALOG, EventKind, decode, encode
from fleetscope.schemas.vocabulary import OTHER_FUNCTIONS
from fleetscope.streams.analysis.patterns import IterationEvents, size_bucket_label, summarize_iteration
from fleetscope.streams.analysis.timeline import TIMELINE_FIELDS, timeline_of
from fleetscope.streams.analysis.windowing import RankWindower

sys.path.insert(0, str(Path(__file__).parents[3]))
from harness import CollectingPublisher  # noqa: E402
from recorded_jobs import BEFORE_TIMELINES, Recording  # noqa: E402

NAMES = ["gemm", "ncclKernel", "allreduce", "dp0", "relu", "send", "pp0"]
a = np.array


def collectives(rows: list[tuple[int, int, int, int, int, int]]) -> dict[str, np.ndarray]:
    """(start, dur, op id, pg id, seq, nbytes) per call."""
    start, dur, op, pg, seq, nbytes = (a([r[i] for r in rows], dtype=np.int64) for i in range(6))
    return {"start_ns": start, "dur_ns": dur, "name_id": np.ones(start.size, np.int32), "op_id": op,
            "pg_id": pg, "seq": seq, "nbytes": nbytes, "group_size": np.full(start.size, 2, np.int32)}  # fmt: skip


def iteration(kernels: list[tuple[int, int, int]], calls: list[tuple[int, int, int, int, int, int]]) -> IterationEvents:
    ks = {"start_ns": a([k[0] for k in kernels], np.int64), "dur_ns": a([k[1] for k in kernels], np.int64),
          "name_id": a([k[2] for k in kernels], np.int32)}  # fmt: skip
    return IterationEvents(step=3, start_ns=1_000_000, end_ns=1_100_000, names=NAMES, kernels=ks,
                           collectives=collectives(calls))  # fmt: skip


def record_of(ev: IterationEvents, **fields: Any) -> dict[str, Any]:
    _, patterns = summarize_iteration(ev)
    who = {"job": "j", "rank": 0, "host": "h", "world_size": 2, "iteration": ev.step}
    return {**who, **fields, **{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in patterns.items()}}


# DDP-like: two buckets all-reduced while the backward computes, the second entered before the first left;
# then a pipeline send after a stretch of compute. Given out of entry order.
CALLS = [
    (1_060_400, 9_000, 2, 3, 41, 4096),  # dp0 allreduce #41, enters second, overlaps the first
    (1_050_250, 20_000, 2, 3, 40, 4096),  # dp0 allreduce #40
    (1_090_000, 2_500, 5, 6, 7, 1 << 20),  # pp0 send #7
]
KERNELS = [(1_010_000, 30_000, 0), (1_030_000, 25_000, 0), (1_070_000, 15_000, 4)]  # two streams: 10..55, 70..85 us


def test_calls_come_in_entry_order_with_their_identity_and_true_enter_and_leave() -> None:
    record = record_of(iteration(KERNELS, CALLS))
    tl = timeline_of(record)
    assert tl is not None and len(tl) == 3 and tl.iteration_ns == 100_000
    names = [record["function"][f] for f in tl.function]
    assert names == ["nccl:allreduce[pg=dp0,<=4KiB]"] * 2 + ["nccl:send[pg=pp0,<=1MiB]"]
    assert tl.seq.tolist() == [40, 41, 7]
    # floored to the microsecond after the iteration's start; the overlap kept (the second enters first)
    assert tl.enter_ns.tolist() == [50_000, 60_000, 90_000]
    assert tl.leave_ns.tolist() == [70_000, 69_000, 92_000]
    # compute between enters: 10..50 us is 45 us of kernels (two streams overlap 30..40), 50..60 none,
    # 60..90 the 15 us kernel at 70; nothing after the send
    assert tl.compute_ns is not None and tl.compute_ns.tolist() == [40_000, 5_000, 15_000]
    assert tl.tail_compute_ns == 0


def test_the_timeline_survives_both_codecs_and_costs_a_few_bytes_a_call() -> None:
    record = record_of(iteration(KERNELS, CALLS))
    want = timeline_of(record)
    bare = {**record, **{name: [] for name in TIMELINE_FIELDS[:-1]}, "sync_tail_compute_us": -1}
    for fast in (True, False):
        message = encode("patterns", record, fast=fast)
        _, back = decode(message, fast=fast)
        got = timeline_of(back)
        assert got is not None and want is not None
        for field in ("function", "seq", "enter_ns", "leave_ns", "compute_ns"):
            assert np.array_equal(getattr(got, field), getattr(want, field)), field
        assert got.tail_compute_ns == want.tail_compute_ns
        assert len(message) - len(encode("patterns", bare, fast=fast)) <= 10 * len(want)


def test_a_cpu_job_has_calls_and_no_compute() -> None:
    """Gloo: no kernels, so the work between calls is host work and its compute unknown, not zero."""
    tl = timeline_of(record_of(iteration([], CALLS)))
    assert tl is not None and tl.enter_ns.tolist() == [50_000, 60_000, 90_000]
    assert tl.compute_ns is None and tl.tail_compute_ns is None


def test_an_iteration_without_calls_has_no_timeline() -> None:
    assert timeline_of(record_of(iteration(KERNELS, []))) is None


def test_capped_functions_point_at_the_rows_kept_or_the_last() -> None:
    """A rank-iteration over its function cap keeps its longest functions: a call of a folded one points at
    the row that sums the rest, and its sequence numbers still read back."""
    ev = iteration(KERNELS, CALLS)
    ev.max_functions = 3  # gemm and the all-reduce (the longest) kept, relu and the send folded
    record = record_of(ev)
    tl = timeline_of(record)
    assert tl is not None and record["function"][1:] == ["nccl:allreduce[pg=dp0,<=4KiB]", OTHER_FUNCTIONS]
    assert tl.function.tolist() == [1, 1, 2] and tl.seq.tolist() == [40, 41, 7]


def _v3_message(record: dict[str, Any]) -> bytes:
    entry = CATALOG.by_id(603)
    assert entry is not None and entry.version == 3
    buf = io.BytesIO()
    buf.write(struct.pack(">bI", 0, 603))
    schemaless_writer(buf, entry.parsed, record)
    return buf.getvalue()


@pytest.mark.parametrize("fast", [True, False])
def test_older_pattern_records_decode_without_a_timeline(fast: bool) -> None:
    """A patterns.v3 record (before timelines) and a real job's recorded patterns.v2 ones read as no timeline."""
    record = record_of(iteration(KERNELS, CALLS))
    _, back = decode(_v3_message(record), fast=fast)
    assert back["function"] == record["function"] and timeline_of(back) is None
    messages = Recording(BEFORE_TIMELINES, "compute", 1).messages()
    assert all(timeline_of(decode(m, fast=fast)[1]) is None for m in messages[:20])


def test_a_real_gloo_ranks_timeline_is_its_collective_events() -> None:
    """A real torch rank (gloo, DDP's bucket all-reduce and a plain one per step) through the hook and the
    windower: each iteration's timeline lists exactly the collective events that started in it, in entry
    order, with their function, sequence number and enter/leave (to the microsecond); no kernels, no compute."""
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    import fleetscope.producers.torch_hook as fs

    publisher = CollectingPublisher()
    recorder = Recorder(RankIdentity(job="tl", rank=0, world_size=1, host="h"), publisher,
                        RecorderConfig(flush_interval_ms=10_000))  # fmt: skip
    monitor = fs.Monitor(recorder)
    monitor.start()
    fs._monitor = monitor
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            model(torch.ones(4, 64)).sum().backward()
            opt.step()
            dist.all_reduce(torch.ones(1024))
            dist.all_reduce(torch.ones(16))
            fs.step()
    finally:
        dist.destroy_process_group()
        fs._monitor = None
        monitor.stop()
    recorder._flush()
    windower = RankWindower()
    batches = sorted(publisher.batches, key=lambda b: b.kind is EventKind.HOST)  # steps close after their events
    closed = [c for b in batches for c in windower.add(b, 0)] + windower.flush()
    coll = [b for b in publisher.batches if b.kind is EventKind.COLLECTIVES]
    start = np.concatenate([b["start_ns"] for b in coll])
    end = start + np.concatenate([b["dur_ns"] for b in coll])
    seq = np.concatenate([b["seq"] for b in coll])
    ops = [b.names[i] for b in coll for i in b["op_id"]]
    checked = 0
    for c in closed:
        record = c.patterns
        tl = timeline_of(decode(encode("patterns", {**record, "job": "tl", "host": "h"}))[1])
        lo, hi = record["iteration_start_ns"], record["iteration_start_ns"] + record["iteration_ns"]
        mine = np.flatnonzero((start >= lo) & (start < hi))
        if not mine.size:
            assert tl is None
            continue
        assert tl is not None and tl.compute_ns is None and len(tl) == mine.size
        mine = mine[np.argsort(start[mine], kind="stable")]
        assert tl.enter_ns.tolist() == ((start[mine] - lo) // 1000 * 1000).tolist()
        assert tl.leave_ns.tolist() == ((end[mine] - lo) // 1000 * 1000).tolist()
        assert tl.seq.tolist() == seq[mine].tolist()
        assert [record["function"][f].split("[")[0] for f in tl.function] == [f"nccl:{ops[j]}" for j in mine]
        checked += len(tl)
    assert checked == start.size == 12  # the bucket and two all-reduces a step: each call in one timeline


def _union_before(kernels: list[tuple[int, int, int]], lo: int, t: int) -> int:
    """Kernel time (their union) from ``lo`` up to ``t``, point by point: the definition, slowly."""
    covered = np.zeros(max(t - lo, 0), dtype=bool)
    for start, dur, _ in kernels:
        covered[max(start - lo, 0) : max(start + dur - lo, 0)] = True
    return int(covered.sum())


A_KERNEL = st.tuples(st.integers(1_000_000, 1_100_000), st.integers(0, 30_000), st.just(0))
A_CALL = st.tuples(
    st.integers(990_000, 1_100_000), st.integers(0, 20_000), st.sampled_from([2, 5]), st.sampled_from([3, 6]),
    st.integers(-1, 2**40), st.integers(2, 2**30) | st.just(0),
)  # fmt: skip
"""(start, dur, op, pg, seq, nbytes); 1 byte shares 0 bytes' size class in function names (not the reference's)."""


@settings(max_examples=80, deadline=None)
@given(st.lists(A_KERNEL, max_size=6), st.lists(A_CALL, max_size=12))
def test_the_timeline_matches_its_definition_on_random_calls(kernels: list[Any], calls: list[Any]) -> None:
    """Entry order (ties as given), the identity of each call, enter/leave floored to the microsecond, and
    the compute between enters, against a slow reading of the events, through the wire."""
    ev = iteration(kernels, calls)
    record = record_of(ev)
    tl = timeline_of(decode(encode("patterns", record))[1])
    if not calls:
        assert tl is None
        return
    assert tl is not None
    lo = ev.start_ns
    order = sorted(range(len(calls)), key=lambda j: calls[j][0])
    assert tl.enter_ns.tolist() == [(calls[j][0] - lo) // 1000 * 1000 for j in order]
    assert tl.leave_ns.tolist() == [(calls[j][0] + calls[j][1] - lo) // 1000 * 1000 for j in order]
    assert tl.seq.tolist() == [calls[j][4] for j in order]
    assert [record["function"][f] for f in tl.function] == [
        f"nccl:{NAMES[calls[j][2]]}[pg={NAMES[calls[j][3]]},<={size_bucket_label(calls[j][5])}]" for j in order
    ]
    if not kernels:
        assert tl.compute_ns is None and tl.tail_compute_ns is None
        return
    cum = [_union_before(kernels, lo, min(calls[j][0], ev.end_ns)) // 1000 for j in order]
    assert tl.compute_ns is not None and tl.compute_ns.tolist() == [
        1000 * (b - a) for a, b in zip([0, *cum[:-1]], cum, strict=True)
    ]
    assert tl.tail_compute_ns == 1000 * (_union_before(kernels, lo, ev.end_ns) // 1000 - cum[-1])


def test_an_iteration_too_wide_to_shift_has_its_timeline_too() -> None:
    """Summarized alone (its own union, unshifted), an iteration of an absurd span still partitions its compute."""
    ev = IterationEvents(
        step=0, start_ns=-(2**62), end_ns=2**62, names=NAMES,
        kernels={"start_ns": a([0, 50_000]), "dur_ns": a([10_000, 10_000]), "name_id": a([0, 0], np.int32)},
        collectives=collectives([(20_000, 10_000, 2, 3, 1, 64), (70_000, 5_000, 2, 3, 2, 64)]),
    )  # fmt: skip
    tl = timeline_of(record_of(ev))
    assert tl is not None and (tl.leave_ns - tl.enter_ns).tolist() == [10_000, 5_000]
    assert tl.enter_ns[1] - tl.enter_ns[0] == 50_000 and tl.seq.tolist() == [1, 2]
    assert tl.compute_ns is not None and tl.compute_ns.tolist() == [10_000, 10_000] and tl.tail_compute_ns == 0


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ({"sync_gap_us": [0, 1]}, "timeline of 3 calls has 2 entries in sync_gap_us"),
        ({"sync_compute_less_gap_us": [1]}, "timeline of 3 calls has 1 entries in sync_compute_less_gap_us"),
        ({"sync_function": [99, 0, 0]}, "timeline calls a function outside the record's"),
        ({"sync_function": [-1, 0, 0]}, "timeline calls a function outside the record's"),
        ({"sync_dur_us": [5, -1, 2]}, "timeline has a negative duration or compute"),
    ],
)
def test_a_timeline_no_windower_writes_is_refused_with_its_reason(damage: dict[str, Any], reason: str) -> None:
    record = record_of(iteration(KERNELS, CALLS))
    assert timeline_of(record) is not None
    with pytest.raises(ValueError, match=re.escape(reason)):
        timeline_of({**record, **damage})
