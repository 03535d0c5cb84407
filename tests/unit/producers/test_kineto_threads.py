"""Self time on traces with several threads: the work of the autograd engine's thread is not the time of
the annotation that waits for it, and an annotation that works itself still stands out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleetscope.producers import parse_trace
from fleetscope.producers.kineto_threads import busy_outside_spans
from fleetscope.schemas import THREAD_BUSY_DEPTH, EventKind
from fleetscope.streams.analysis.hostspans import host_self_ns
from fleetscope.streams.offline import OfflinePipeline

BASE_NS = 1_711_964_646_000_000_000
MAIN, AUTOGRAD = 1, 2
RANKS, STEPS, STEP_US = 8, 8, 6000.0


def x(cat: str, name: str, ts: float, dur: float, tid: int = MAIN, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def step_events(step: int, culprit: str, jitter: np.random.Generator) -> list[dict[str, Any]]:
    """One step: ``## forward ##`` runs its ops on the main thread; ``## backward ##`` on the main thread
    waits while the autograd thread runs the backward's ops. ``culprit``: "" (healthy), "waits" (the
    autograd thread works 3.4x longer, the annotation only waits for it) or "works" (the annotation's own
    thread does 1.9 ms of CPU work besides)."""
    t = step * STEP_US
    j = jitter.uniform(0.97, 1.03, 4)
    grad_us = 850 * j[0] * (3.4 if culprit == "waits" else 1.0)
    own_us = 1900 * j[1] if culprit == "works" else 0.0
    bwd_end = 1050 + max(grad_us, own_us) + 100 * j[2]
    events = [
        x("user_annotation", f"ProfilerStep#{step}", t, STEP_US - 10),
        x("user_annotation", "## forward ##", t + 100, 800 * j[3]),
        x("cpu_op", "aten::mm", t + 120, 700 * j[3]),
        x("user_annotation", "## backward ##", t + 1000, bwd_end - 1000),
        x("cpu_op", "aten::ones_like", t + 1005, 20),
        x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", t + 1050, grad_us, tid=AUTOGRAD),
        x("cpu_op", "aten::mm", t + 1060, grad_us - 20, tid=AUTOGRAD),
        x("cuda_runtime", "cudaLaunchKernel", t + 1070, 5, tid=AUTOGRAD, correlation=2 * step + 1),
        x("kernel", "gemm_fwd", t + 150, 900, tid=7, stream=7, correlation=2 * step),
        x("kernel", "gemm_bwd", t + 1100, 1000, tid=7, stream=7, correlation=2 * step + 1),
    ]
    if own_us:
        events.append(x("cpu_op", "aten::index_add_", t + 1040, own_us))
    return events


def write_job(root: Path, culprit: str, culprit_rank: int = 5) -> Path:
    rng = np.random.default_rng(3)
    for rank in range(RANKS):
        events = [e for step in range(STEPS) for e in step_events(step, culprit if rank == culprit_rank else "", rng)]
        doc = {"baseTimeNanoseconds": BASE_NS, "distributedInfo": {"rank": rank, "world_size": RANKS},
               "traceEvents": events}  # fmt: skip
        (root / f"rank-{rank}.pt.trace.json").write_text(json.dumps(doc))
    return root


def analyse(root: Path) -> tuple[dict[int, list[float]], list[dict[str, Any]]]:
    """Per rank, ``## backward ##``'s self time (µs) in each step; and the findings."""
    pipeline = OfflinePipeline(keep_patterns=True)
    for path in sorted(root.glob("*.json")):
        for batch in parse_trace(path, job="j").batches:
            pipeline.add(batch)
    findings = pipeline.finish().findings
    own: dict[int, list[float]] = {}
    for p in pipeline.patterns:
        self_ns = dict(zip(p["function"], p["self_ns"], strict=True))
        own.setdefault(p["rank"], []).append(self_ns["## backward ##"] / 1e3)
    return own, findings


def test_a_thread_s_dropped_ops_are_sent_as_its_busy_time_outside_its_spans(tmp_path: Path) -> None:
    write_job(tmp_path, "")
    trace = parse_trace(tmp_path / "rank-0.pt.trace.json")
    rows = [(b.names[b["name_id"][i]], int(b["start_ns"][i]), int(b["dur_ns"][i]), int(b["depth"][i]))
            for b in trace.batches if b.kind is EventKind.HOST for i in range(len(b))]  # fmt: skip
    busy = [r for r in rows if r[3] == THREAD_BUSY_DEPTH]
    # the autograd thread's outermost op, once per step; the main thread's ops lie inside its spans
    assert len(busy) == STEPS
    first = min(busy, key=lambda r: r[1])
    assert first[1] == BASE_NS + 1_050_000 and 0.97 * 850_000 <= first[2] <= 1.03 * 850_000
    assert {r[0] for r in rows if r[3] >= 0} == {f"ProfilerStep#{s}" for s in range(STEPS)} | {
        "## forward ##", "## backward ##"}  # fmt: skip
    assert trace.host_spans == 3 * STEPS  # spans only: the busy rows are no host spans


def test_an_annotation_that_waits_for_another_thread_is_no_host_excess(tmp_path: Path) -> None:
    own, findings = analyse(write_job(tmp_path, "waits"))
    peers = [v for r, vs in own.items() if r != 5 for v in vs]
    # ~150 µs of its own (before and after the autograd thread's op), on the culprit as on its peers,
    # against a duration of ~3 ms on the culprit
    assert max(own[5]) < 1.5 * np.median(peers) and np.median(peers) < 200
    assert not [f for f in findings if f["category"] == "host_slow"]


def test_an_annotation_that_works_itself_is_flagged(tmp_path: Path) -> None:
    own, findings = analyse(write_job(tmp_path, "works"))
    peers = [v for r, vs in own.items() if r != 5 for v in vs]
    assert min(own[5]) > 1000 > 200 > np.median(peers)
    host = [(f["category"], f["subject"]) for f in findings if f["category"] == "host_slow"]
    assert host == [("host_slow", "rank:5")]


def test_busy_stretches_union_a_thread_s_ops_and_leave_out_its_spans() -> None:
    a = np.array
    # thread 0: ops [0, 10) with a nested [2, 4), [8, 20), [30, 40) and [40, 45) touching it; its span
    # [15, 35). Thread 1: op [5, 6), no span (thread 0's spans never cover thread 1's time)
    start, end, thread = busy_outside_spans(
        a([0, 2, 8, 30, 40, 5]), a([10, 4, 20, 40, 45, 6]), a([0, 0, 0, 0, 0, 1]), a([15, 5]), a([35, 6]), a([0, 7])
    )
    assert list(zip(start.tolist(), end.tolist(), thread.tolist(), strict=True)) == [
        (0, 15, 0), (35, 45, 0), (5, 6, 1)]  # fmt: skip


@pytest.mark.parametrize("n", [0, 1])
def test_busy_stretches_of_no_or_one_op(n: int) -> None:
    ops = np.arange(n, dtype=np.int64)
    start, end, thread = busy_outside_spans(ops, ops + 5, ops, ops[:0], ops[:0], ops[:0])
    assert start.tolist() == ops.tolist() and end.tolist() == (ops + 5).tolist() and thread.tolist() == ops.tolist()


def test_a_busy_stretch_has_no_self_time_and_is_taken_out_of_the_span_it_falls_in() -> None:
    # `## backward ##` [0, 100) at depth 1 (its step marker is taken out by the windower); the only
    # outermost row of the iteration is the autograd thread's busy stretch [10, 90)
    it, depth = np.zeros(2, dtype=np.int64), np.array([1, THREAD_BUSY_DEPTH], dtype=np.int32)
    start, dur = np.array([0, 10], dtype=np.int64), np.array([100, 80], dtype=np.int64)
    assert host_self_ns(it, start, dur, depth, np.zeros(2, dtype=bool)).tolist() == [20, 0]
