"""The simulator is valid and deterministic, and shows each fault the way DESIGN.md's physics does."""

from __future__ import annotations

from collections import defaultdict
from functools import cache

import numpy as np
import pytest

from fleetscope.producers import Fault, SimulatorConfig, parse_fault, simulate
from fleetscope.producers.simulator import MAX_BATCH_EVENTS, METRICS
from fleetscope.schemas import (
    EventBatch,
    EventKind,
    decode_event_batch,
    encode_event_batch,
    parse_step_marker,
)

RANKS = 16
ITERATIONS = 8


@cache
def run(*faults: str, seed: int = 0, clock_skew_ms: float = 0.0) -> tuple[EventBatch, ...]:
    cfg = SimulatorConfig(
        ranks=RANKS,
        iterations=ITERATIONS,
        seed=seed,
        clock_skew_ms=clock_skew_ms,
        faults=tuple(parse_fault(f) for f in faults),
    )
    return tuple(simulate(cfg))


def table(batches: tuple[EventBatch, ...], kind: EventKind) -> dict[int, list[EventBatch]]:
    """rank -> that rank's batches of one kind, in iteration order."""
    out: dict[int, list[EventBatch]] = defaultdict(list)
    for b in batches:
        if b.kind == kind:
            out[b.header.rank].append(b)
    return out


def kernel_durations(batches: tuple[EventBatch, ...], name: str) -> dict[int, np.ndarray]:
    """rank -> durations of every call of one kernel over the run."""
    out = {}
    for rank, bs in table(batches, EventKind.KERNELS).items():
        out[rank] = np.concatenate([b["dur_ns"][b["name_id"] == b.names.index(name)] for b in bs])
    return out


def collective_matrix(batches: tuple[EventBatch, ...], column: str) -> np.ndarray:
    """(rank, collective) matrix of one collective column, collectives in sequence order."""
    rows = []
    for rank in range(RANKS):
        bs = table(batches, EventKind.COLLECTIVES)[rank]
        seq = np.concatenate([b["seq"] for b in bs])
        values = np.concatenate(
            [b[column] if column != "end_ns" else b["start_ns"] + b["dur_ns"] for b in bs]
        )
        rows.append(values[np.argsort(seq)])
    return np.array(rows)


def python_durations(batches: tuple[EventBatch, ...], name: str) -> np.ndarray:
    """(rank, iteration) matrix of a host function's duration."""
    py = table(batches, EventKind.PYTHON)
    return np.array([[b["dur_ns"][b.names.index(name)] for b in py[r]] for r in range(RANKS)], dtype=float)


def nvlink_during_transfers(batches: tuple[EventBatch, ...]) -> dict[int, np.ndarray]:
    """rank -> NVLink samples taken inside transfer phases [last arrival, end] of all collectives."""
    start, end = collective_matrix(batches, "start_ns"), collective_matrix(batches, "end_ns")
    phase_lo, phase_hi = start.max(axis=0), end.max(axis=0)
    out = {}
    for rank, bs in table(batches, EventKind.THROUGHPUT).items():
        t = np.concatenate([b["t_ns"] for b in bs])
        v = np.concatenate([b["value"] for b in bs])
        names = bs[0].names
        metric = np.concatenate([np.array(b.names)[b["metric_id"]] for b in bs])
        assert names == list(METRICS)
        inside = ((t[:, None] >= phase_lo) & (t[:, None] < phase_hi)).any(axis=1)
        out[rank] = v[inside & np.char.startswith(metric.astype(str), "nvlink")]
    return out


def test_same_seed_gives_identical_bytes_and_another_seed_differs() -> None:
    cfg = SimulatorConfig(ranks=4, iterations=3, seed=7)
    a = [encode_event_batch(b) for b in simulate(cfg)]
    b = [encode_event_batch(b) for b in simulate(cfg)]
    c = [encode_event_batch(b) for b in simulate(SimulatorConfig(ranks=4, iterations=3, seed=8))]
    assert a == b
    assert a != c


def test_every_batch_survives_the_codec_round_trip() -> None:
    for batch in run():
        back = decode_event_batch(encode_event_batch(batch))
        assert back.kind == batch.kind and back.header == batch.header and back.names == batch.names
        for column, values in batch.columns.items():
            np.testing.assert_array_equal(back[column], values)


def test_each_rank_iteration_yields_four_kinds_in_order_with_a_gapless_producer_sequence() -> None:
    batches = run()
    assert len(batches) == RANKS * ITERATIONS * 4
    kinds = [b.kind for b in batches[:4]]
    assert kinds == [EventKind.KERNELS, EventKind.COLLECTIVES, EventKind.PYTHON, EventKind.THROUGHPUT]
    seqs: dict[str, list[int]] = defaultdict(list)
    for b in batches:
        h = b.header
        seqs[h.producer_id].append(h.seq)
        assert h.host == f"node{h.rank // 8:03d}" and h.local_rank == h.rank % 8
        assert h.world_size == h.dp_size == RANKS and h.dp_rank == h.rank and h.gpu_uuid.startswith("GPU-")
        assert len(b) > 0
    assert len(seqs) == RANKS
    assert all(s == list(range(ITERATIONS * 4)) for s in seqs.values())


def test_step_markers_cover_every_iteration_and_contain_its_host_functions() -> None:
    for rank, bs in table(run(), EventKind.PYTHON).items():
        steps = [parse_step_marker(b.names[b["name_id"][0]]) for b in bs]
        assert steps == list(range(ITERATIONS)), rank
        for b in bs:
            start, end = b["start_ns"], b["start_ns"] + b["dur_ns"]
            assert b["depth"][0] == 0 and (b["depth"][1:] == 1).all()
            assert (start[1:] >= start[0]).all() and (end[1:] <= end[0]).all()
    ends = [bs[-1]["start_ns"][0] + bs[-1]["dur_ns"][0] for bs in table(run(), EventKind.PYTHON).values()]
    assert np.ptp(ends) < 1_000_000  # iteration times equalise across ranks


def test_kernels_run_in_order_on_the_compute_stream_after_their_launch() -> None:
    for b in table(run(), EventKind.KERNELS)[3]:
        start, end = b["start_ns"], b["start_ns"] + b["dur_ns"]
        assert (b["launch_ns"] <= start).all()
        assert (start[1:] >= end[:-1]).all()
        assert (b["stream"] == 7).all()


def test_collectives_end_together_in_true_time_and_share_sequence_numbers() -> None:
    end = collective_matrix(run(), "end_ns")
    assert (end == end[0]).all()
    seq = collective_matrix(run(), "seq")
    assert (seq == seq[0]).all() and (np.diff(seq[0]) == 1).all()


def test_slow_gpu_rank_has_slow_kernels_and_the_shortest_collectives() -> None:
    batches = run("slow_gpu:5:1.5")
    gemm = kernel_durations(batches, "ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_nn")
    peers = np.median(np.concatenate([d for r, d in gemm.items() if r != 5]))
    assert np.median(gemm[5]) / peers == pytest.approx(1.5, rel=0.03)
    dur = collective_matrix(batches, "dur_ns")
    assert (dur.argmin(axis=0) == 5).all()  # it never waits
    others = np.delete(dur, 5, axis=0)
    assert np.median(others) > 1.5 * np.median(dur[5])


def test_slow_link_rank_runs_low_and_steady_while_healthy_links_burst_at_peak() -> None:
    peak = SimulatorConfig().link_peak_bytes_per_s
    batches = run("slow_link:12:2")
    nv = nvlink_during_transfers(batches)
    slow, healthy = nv[12], np.concatenate([v for r, v in nv.items() if r != 12])
    assert slow.size > 20
    assert slow.max() <= 0.51 * peak and healthy.max() > 0.95 * peak
    assert slow.std() / slow.mean() < 0.05 < healthy.std() / healthy.mean()
    # Collective durations do not single out the rank: every member's transfer is paced alike.
    dur = collective_matrix(batches, "dur_ns").mean(axis=1)
    assert np.median(dur) * 0.97 < dur[12] < np.median(dur) * 1.03
    healthy_run = collective_matrix(run(), "dur_ns").mean()
    assert dur.mean() > 1.6 * healthy_run


def test_healthy_ranks_look_statistically_alike() -> None:
    batches = run()
    gemm = kernel_durations(batches, "flash_bwd_dq_dk_dv_loop_kernel")
    medians = np.array([np.median(d) for d in gemm.values()])
    assert np.ptp(medians) / medians.mean() < 0.03
    nv = nvlink_during_transfers(batches)
    means = np.array([v.mean() for v in nv.values()])
    assert np.ptp(means) / means.mean() < 0.05


def test_host_slow_stretches_the_named_function_on_that_rank_only() -> None:
    batches = run("host_slow:3:2.5:optimizer.step")
    opt = python_durations(batches, "optimizer.step")
    peers = np.median(np.delete(opt, 3, axis=0))
    assert np.median(opt[3]) / peers == pytest.approx(2.5, rel=0.1)
    fwd = python_durations(batches, "forward")
    assert np.median(fwd[3]) / np.median(fwd) == pytest.approx(1.0, rel=0.05)
    gemm = kernel_durations(batches, "flash_fwd_kernel")
    assert np.median(gemm[3]) / np.median(np.concatenate(list(gemm.values()))) == pytest.approx(1.0, rel=0.03)


def test_default_host_slow_starves_the_gpu_at_iteration_start_and_makes_the_rank_arrive_last() -> None:
    batches = run("host_slow:9")
    dl = python_durations(batches, "dataloader.next")
    assert np.median(dl[9]) / np.median(np.delete(dl, 9, axis=0)) == pytest.approx(3.0, rel=0.1)
    start = collective_matrix(batches, "start_ns")
    assert (start.argmax(axis=0) == 9).all()


def test_clock_skew_shifts_every_timestamp_of_a_host_by_one_offset() -> None:
    plain, skewed = run(), run(clock_skew_ms=5.0)
    offsets: dict[str, set[int]] = defaultdict(set)
    for a, b in zip(plain, skewed, strict=True):
        time_col = "t_ns" if a.kind == EventKind.THROUGHPUT else "start_ns"
        diff = np.unique(b[time_col] - a[time_col])
        assert diff.size == 1
        offsets[a.header.host].add(int(diff[0]))
        if a.kind != EventKind.THROUGHPUT:
            np.testing.assert_array_equal(a["dur_ns"], b["dur_ns"])
    assert all(len(s) == 1 for s in offsets.values())
    values = [s.pop() for s in offsets.values()]
    assert all(abs(v) <= 5_000_000 for v in values) and len(set(values)) == len(values)


def test_large_batches_are_split_and_keep_the_sequence() -> None:
    cfg = SimulatorConfig(ranks=2, iterations=1, layers=520, buckets=8)
    batches = list(simulate(cfg))
    kernels = [b for b in batches if b.kind == EventKind.KERNELS and b.header.rank == 0]
    assert len(kernels) == 2 and all(len(b) <= MAX_BATCH_EVENTS for b in kernels)
    assert sum(len(b) for b in kernels) == 1 + 8 * 520 + 4
    rank0 = [b for b in batches if b.header.rank == 0]
    assert all(len(b) <= MAX_BATCH_EVENTS for b in rank0)
    assert [b.header.seq for b in rank0] == list(range(len(rank0)))


def test_first_step_numbers_markers_and_collective_sequence() -> None:
    batches = list(simulate(SimulatorConfig(ranks=2, iterations=2, first_step=100, buckets=3)))
    py = [b for b in batches if b.kind == EventKind.PYTHON and b.header.rank == 1]
    assert [b.names[0] for b in py] == ["ProfilerStep#100", "ProfilerStep#101"]
    coll = [b for b in batches if b.kind == EventKind.COLLECTIVES and b.header.rank == 1]
    assert coll[0]["seq"].tolist() == [300, 301, 302]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("slow_gpu:7:1.5", Fault(kind="slow_gpu", rank=7, factor=1.5)),
        ("slow_link:12", Fault(kind="slow_link", rank=12, factor=2.0)),
        ("host_slow:3", Fault(kind="host_slow", rank=3, factor=3.0, function="dataloader.next")),
        (
            "host_slow:3:2.5:optimizer.step",
            Fault(kind="host_slow", rank=3, factor=2.5, function="optimizer.step"),
        ),
    ],
)
def test_parse_fault_reads_cli_specs(spec: str, expected: Fault) -> None:
    assert parse_fault(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("slow_disk:1", "unknown kind 'slow_disk' (valid: slow_gpu, slow_link, host_slow)"),
        ("slow_gpu:x", "rank 'x' is not an integer"),
        ("slow_gpu:-1", "rank must be an integer >= 0"),
        ("slow_gpu:1:0.9", "factor must be a finite slowdown > 1"),
        ("slow_gpu:1:fast", "factor 'fast' is not a number"),
        ("host_slow:1:2:tokenizer", "unknown host function 'tokenizer'"),
        ("slow_gpu:1:2:forward", "function applies to host_slow faults only"),
        ("slow_gpu", "expected kind:rank[:factor[:function]]"),
        ("slow_gpu:1:2:forward:x", "expected kind:rank[:factor[:function]]"),
    ],
)
def test_parse_fault_names_the_spec_and_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match="bad fault spec") as info:
        parse_fault(spec)
    assert message in str(info.value) and repr(spec) in str(info.value)


def test_config_validation_reports_every_problem_at_once() -> None:
    with pytest.raises(ValueError) as info:
        SimulatorConfig(
            ranks=1,
            buckets=0,
            jitter=-1.0,
            faults=(Fault(kind="slow_gpu", rank=4), Fault(kind="slow_gpu", rank=4)),
        )
    text = str(info.value)
    for part in (
        "ranks must be >= 2",
        "buckets must be in 1..layers",
        "jitter must be",
        "targets rank 4",
        "duplicate slow_gpu fault on rank 4",
    ):
        assert part in text
    assert SimulatorConfig(ranks=2).expected_iterations == 40
