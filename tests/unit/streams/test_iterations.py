"""Iteration detection without step markers: learned host sequences and collective periods."""

from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import EventBatch, EventKind, parse_step_marker
from fleetscope.streams.analysis.iterations import CollectivePeriodDetector, HostSequenceDetector
from fleetscope.streams.offline import OfflinePipeline


def host_stream(durations, loaders=1, optimizers=1):
    names, start, end, t = [], [], [], 0
    for d in durations:
        for _ in range(loaders):
            names.append("dataloader.next"), start.append(t), end.append(t + 3)
            t += 5
        names.append("forward"), start.append(t), end.append(t + d)
        t += d + 1
        for _ in range(optimizers):
            names.append("Optimizer.step#AdamW.step"), start.append(t), end.append(t + 2)
            t += 4
    return names, np.array(start), np.array(end)


@given(st.lists(st.integers(10, 1000), min_size=12, max_size=40), st.integers(1, 3), st.integers(1, 2))
def test_host_sequence_is_learned_after_ten_repeats_and_cuts_every_iteration(durations, loaders, optimizers):
    names, start, end = host_stream(durations, loaders, optimizers)
    det = HostSequenceDetector()
    spans = []
    for i in range(0, len(names), 7):  # arbitrary batch boundaries
        spans += det.feed(names[i : i + 7], start[i : i + 7], end[i : i + 7])
    spans += det.finish()
    assert [s[0] for s in spans] == list(range(len(durations)))
    assert det.signature == (loaders, optimizers)
    for (_, _, e), (_, s, _) in zip(spans, spans[1:], strict=False):
        assert e == s  # contiguous: iteration k ends where k+1 begins


def test_host_sequence_relearns_after_many_unmatched_events():
    names, start, end = host_stream([50] * 12)
    det = HostSequenceDetector(relearn_events=20)
    det.feed(names, start, end)
    assert det.signature == (1, 1)
    names2, start2, end2 = host_stream([50] * 20, loaders=2)  # the code path changed
    det.feed(names2, start2 + end[-1] + 10, end2 + end[-1] + 10)
    assert det.signature == (2, 1)


@settings(max_examples=60)
@given(st.integers(1, 12), st.integers(6, 12), st.integers(0, 50), st.booleans())
def test_collective_period_groups_iterations_by_sequence_number(p, iterations, seq0, all_alike):
    pattern = np.zeros(p, dtype=np.int64) if all_alike else np.arange(p, dtype=np.int64)
    keys = np.tile(pattern, iterations)
    seq = np.arange(seq0, seq0 + keys.size)
    # collectives of one iteration are 1 ms apart; iterations are separated by a 50 ms forward pass
    it = np.repeat(np.arange(iterations), p)
    within = np.tile(np.arange(p), iterations)
    start = it * (50_000_000 + p * 1_000_000) + 50_000_000 + within * 1_000_000
    end = start + 500_000
    det = CollectivePeriodDetector()
    spans = det.feed(keys, seq, start, end)
    assert det.period == p
    numbers = [s[0] for s in spans]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert len(spans) == iterations - 1  # the first group has no previous boundary
    for _, s, e in spans:
        assert np.sum((start >= s) & (end <= e)) == p


def strip(batches, drop_kinds=()):
    out = []
    for b in batches:
        if b.kind in drop_kinds:
            continue
        if b.kind is EventKind.HOST:
            keep = np.array([parse_step_marker(b.names[i]) is None for i in b["name_id"]])
            b = EventBatch(
                kind=b.kind,
                header=b.header,
                names=b.names,
                columns={k: v[keep] for k, v in b.columns.items()},
            )
        streams = tuple(s for s in b.header.streams if s not in {k.value for k in drop_kinds})
        out.append(replace(b, header=replace(b.header, streams=streams)))
    return out


def test_without_step_markers_the_optimizer_sequence_cuts_iterations_and_detection_still_works():
    cfg = SimulatorConfig(ranks=8, iterations=20, faults=(parse_fault("slow_gpu:3:1.4"),))
    result = OfflinePipeline().add_all(strip(simulate(cfg))).finish()
    by = {i["detected_by"] for i in result.iterations}
    assert by == {"optimizer_sequence"}
    assert len(result.iterations) == 8 * 20
    assert [(f["rank"], f["category"]) for f in result.findings] == [(3, "gpu_slow")]


def test_without_any_host_stream_the_collective_period_cuts_iterations():
    cfg = SimulatorConfig(ranks=8, iterations=12, faults=(parse_fault("slow_link:5"),))
    result = OfflinePipeline().add_all(strip(simulate(cfg), drop_kinds=(EventKind.HOST,))).finish()
    assert {i["detected_by"] for i in result.iterations} == {"collective_period"}
    per_rank = {}
    for i in result.iterations:
        per_rank.setdefault(i["rank"], []).append(i["iteration"])
    numbers = set(map(tuple, per_rank.values()))
    assert len(numbers) == 1  # every rank numbers its iterations alike (sequence numbers)
    assert len(next(iter(numbers))) >= 12 - 2
    assert [(f["rank"], f["category"]) for f in result.findings] == [(5, "link_slow")]
