"""Profiler windows cannot feed on themselves: the iterations they overlap are marked ``profiled``, the
window's span is no host function, its held-back events make no stall, and the differential compares
profiled iterations only with iterations profiled on every rank."""

from dataclasses import replace

import numpy as np

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import EventBatch, EventKind, FunctionKind
from fleetscope.schemas.vocabulary import PROFILING_WINDOW
from fleetscope.streams.analysis.differential import JobDifferential
from fleetscope.streams.analysis.windowing import RankWindower, WindowerConfig
from fleetscope.streams.offline import OfflinePipeline


def job_batches(iterations: int = 10, ranks: int = 4, **kw):
    return list(simulate(SimulatorConfig(ranks=ranks, iterations=iterations, **kw)))


def window_batch(like: EventBatch, start_ns: int, dur_ns: int) -> EventBatch:
    cols = {"start_ns": np.array([start_ns]), "dur_ns": np.array([dur_ns]), "name_id": np.array([0]),
            "depth": np.array([0])}  # fmt: skip
    return EventBatch(kind=EventKind.HOST, header=like.header, names=[PROFILING_WINDOW], columns=cols)


def step_spans(batches, rank: int = 0) -> dict[int, tuple[int, int]]:
    w = RankWindower()
    out = {}
    for b in batches:
        if b.header.rank == rank:
            for c in w.add(b, 0):
                out[c.step] = (c.iteration["start_ns"], c.iteration["end_ns"])
    for c in w.flush():
        out[c.step] = (c.iteration["start_ns"], c.iteration["end_ns"])
    return out


def with_window(batches, ranks, start_ns: int, end_ns: int):
    """The window's span first (as the producer publishes it), then the rank's events."""
    out = []
    for rank in ranks:
        first = next(b for b in batches if b.header.rank == rank and b.kind is EventKind.HOST)
        out.append(window_batch(first, start_ns, end_ns - start_ns))
    return out + batches


def test_iterations_overlapping_a_window_are_profiled_and_the_span_is_no_host_function():
    batches = job_batches()
    spans = step_spans(batches)
    start, end = spans[4][0] + 1, spans[6][1] - 1
    w = RankWindower()
    closed = []
    for b in with_window(batches, [0], start, end):
        if b.header.rank == 0:
            closed += w.add(b, 0)
    closed += w.flush()
    assert {c.step: c.iteration["profiled"] for c in closed} == {i: i in (4, 5, 6) for i in range(10)}
    assert all(c.patterns["profiled"] == c.iteration["profiled"] for c in closed)
    assert all(PROFILING_WINDOW not in c.patterns["function"] for c in closed)


def test_silence_inside_a_window_is_no_stall():
    batches = [b for b in job_batches(iterations=12) if b.header.rank == 0]
    spans = step_spans(batches)
    mean = spans[1][1] - spans[0][1]
    before = [b for b in batches if b.columns.get("start_ns", b.columns.get("t_ns")).max() < spans[5][1]]
    # the window opens after step 5 and lasts 20 mean iterations; its events arrive when it closes
    samples = [b for b in batches if b.kind is EventKind.SAMPLES]
    late_clock = replace(samples[-1], columns={**samples[-1].columns, "t_ns": samples[-1]["t_ns"] + 20 * mean})

    def stalls(window: bool):
        w = RankWindower(WindowerConfig(stall_factor=5.0, stall_silence_ms=0))
        feed = before + ([window_batch(batches[0], spans[5][1], 25 * mean)] if window else []) + [late_clock]
        for b in feed:
            w.add(b, 0)
        return [r["stalled"] for r in w.take_stalls()]

    assert stalls(window=False) == [True]  # the same silence without a window: a stalled rank
    assert stalls(window=True) == []


def test_a_profiling_window_on_every_rank_makes_no_finding_and_no_regression():
    batches = job_batches(iterations=40, ranks=8)
    spans = step_spans(batches)
    start, end = spans[20][0] + 1, spans[27][1] - 1
    result = OfflinePipeline().add_all(with_window(batches, range(8), start, end)).finish()
    profiled = {(it["rank"], it["iteration"]) for it in result.iterations if it["profiled"]}
    assert profiled == {(r, i) for r in range(8) for i in range(20, 28)}
    assert result.finding_updates == []


def slowed(record: dict, factor: float) -> dict:
    times = {name: [t * factor for t in record[name]] for name in ("total_ns", "mean_ns")}
    return dict(record, profiled=True, iteration_ns=record["iteration_ns"] * factor, **times)


def test_iterations_profiled_on_some_ranks_only_are_not_compared_across_ranks():
    sim = OfflinePipeline(keep_patterns=True)
    sim.add_all(simulate(SimulatorConfig(ranks=8, iterations=30))).finish()
    job = JobDifferential("demo")
    updates = []
    for rec in sim.patterns:
        # ranks 0 and 1 open a window from iteration 10 on (a local `fleetscope.profile`): 2x slower there
        profiled = int(rec["rank"]) < 2 and int(rec["iteration"]) >= 10
        updates += job.add(slowed(rec, 2.0) if profiled else rec)
    updates += job.flush()
    assert updates == [] and job.skipped_profiled == 20 and job.iterations_scored == 30


def test_samples_read_ahead_of_a_lagging_partition_are_a_backlog_not_a_stall():
    batches = [b for b in job_batches(iterations=40) if b.header.rank == 0]
    samples = [b for b in batches if b.kind is EventKind.SAMPLES]
    progress = [b for b in batches if b.kind is not EventKind.SAMPLES]

    def stalls(gap_ns: int) -> list[bool]:
        """The first iterations, then every sample batch at once, then the lagging host and GPU batches,
        ``gap_ns`` of processing time apart."""
        w = RankWindower()
        head = [b for b in progress if b.columns["start_ns"].max() < samples[3]["t_ns"].min()]
        now = 0
        for b in head:
            w.add(b, now)
        for b in samples:
            now += gap_ns
            w.add(b, now)
        return [r["stalled"] for r in w.take_stalls()]

    assert stalls(gap_ns=10**6) == []  # the rank's other partitions are still being read: a backlog
    assert stalls(gap_ns=2 * 10**9) == [True]  # nothing else came for seconds: the rank stopped


def host_ops_slowed(record: dict, factor: float) -> dict:
    host = [k == FunctionKind.PYTHON for k in record["kind"]]
    times = {n: [t * factor if h else t for t, h in zip(record[n], host, strict=True)] for n in ("total_ns", "mean_ns")}
    return dict(record, **times)


def test_host_times_under_a_window_on_every_rank_neither_flag_nor_clear_host_findings():
    sim = OfflinePipeline(keep_patterns=True)
    faults = (parse_fault("host_slow:2:1.5"),)
    sim.add_all(simulate(SimulatorConfig(ranks=8, iterations=40, faults=faults))).finish()
    job = JobDifferential("demo")
    updates = []
    for rec in sim.patterns:
        it, rank = int(rec["iteration"]), int(rec["rank"])
        if 10 <= it < 30:  # a window on every rank: the profiler makes rank 5's host ops 3x slower
            rec = dict(rec, profiled=True)
            if rank == 5:
                rec = host_ops_slowed(rec, 3.0)
        updates += job.add(rec)
    updates += job.flush()
    by_status = [(u["status"], u["rank"], u["category"]) for u in updates if u["status"] != "update"]
    assert by_status == [("open", 2, "host_slow")]  # opened before the window, not closed by it, no rank 5
