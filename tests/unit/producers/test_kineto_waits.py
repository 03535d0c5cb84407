"""Blocking calls in a Kineto trace become host spans, so the annotations around them show no own work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fleetscope.producers import parse_trace
from fleetscope.streams.offline import OfflinePipeline

BASE_NS = 1_711_964_646_000_000_000


def x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_an_annotation_that_waits_in_a_sync_call_has_only_its_own_time_as_self_time(tmp_path: Path) -> None:
    events = [x("user_annotation", "ProfilerStep#1", 0, 2000), x("user_annotation", "## backward ##", 100, 1000),
              x("cuda_runtime", "cudaStreamSynchronize", 200, 800), x("cpu_op", "aten::item", 1500, 300),
              x("cpu_op", "aten::mm", 1500, 10), x("user_annotation", "ProfilerStep#2", 2000, 2000),
              x("kernel", "gemm", 150, 1700, tid=7, stream=7, correlation=1),
              x("kernel", "gemm", 2100, 1700, tid=7, stream=7, correlation=2)]  # fmt: skip
    path = tmp_path / "rank-0.pt.trace.json"
    path.write_text(json.dumps({"baseTimeNanoseconds": BASE_NS, "traceEvents": events}))
    trace = parse_trace(path, job="j")
    pipeline = OfflinePipeline(keep_patterns=True)
    for batch in trace.batches:
        pipeline.add(batch)
    pipeline.finish()
    first = next(p for p in pipeline.patterns if p["iteration"] == 1)
    own = dict(zip(first["function"], first["self_ns"], strict=True))
    total = dict(zip(first["function"], first["total_ns"], strict=True))
    assert total["## backward ##"] == 1_000_000 and own["## backward ##"] == 200_000
    assert own["cudaStreamSynchronize"] == 0 and own["aten::item"] == 0
    assert "aten::mm" not in own  # other CPU ops stay out: the bulk of a trace
