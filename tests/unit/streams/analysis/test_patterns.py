"""The vectorised iteration summary against a plain, loop-by-loop reading of its definition."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import FunctionKind, classify_kernel, encode
from fleetscope.schemas.vocabulary import LAUNCH_WAIT_FUNCTION
from fleetscope.streams.analysis import closed_iterations as closed_module
from fleetscope.streams.analysis.patterns import (
    ACTIVE_SHARE,
    LINK_FAMILIES,
    THROUGHPUT_SUFFIX,
    IterationEvents,
    NameTable,
    _collective_keys,
    _distinct,
    collective_function_name,
    summarize_iteration,
    summarize_iterations,
)
from fleetscope.streams.analysis.windowing import RankWindower, summarize_closed

NAMES = [
    "gemm", "ncclDevKernel_AllReduce_RING_LL", "Memcpy HtoD", "flash_fwd", "forward", "backward",
    "allreduce", "pg0", "pg1", "nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s", "pcie_tx_bytes_per_s",
    "sm_clock_mhz", "all_gather",
]  # fmt: skip
KERNELS = [0, 1, 2, 3]
PYTHON = [4, 5]
OPS, PGS = [6, 13], [7, 8]
METRICS = [9, 10, 11, 12]
Summary = tuple[dict[str, Any], dict[str, Any]]


def union(intervals: list[tuple[int, int]], lo: int, hi: int) -> tuple[int, int]:
    """Covered length of [start, end) intervals clipped to [lo, hi], and the largest uncovered gap."""
    spans = sorted((min(max(s, lo), hi), min(max(e, lo), hi)) for s, e in intervals)
    covered, gap, reach = 0, 0, lo
    for s, e in spans:
        if s > reach:
            gap = max(gap, s - reach)
        covered += max(0, e - max(s, reach))
        reach = max(reach, e)
    return covered, max(gap, hi - reach)


def reference(ev: IterationEvents) -> tuple[dict[str, Any], dict[str, Any]]:
    names, lo, hi = ev.names, ev.start_ns, ev.end_ns
    k, c, p, smp = ev.kernels, ev.collectives, ev.python, ev.samples
    kernel_spans = [
        (int(s), int(s + d), int(i)) for s, d, i in zip(k["start_ns"], k["dur_ns"], k["name_id"], strict=True)
    ]
    comm = [(s, e) for s, e, i in kernel_spans if classify_kernel(names[i]) == FunctionKind.COLLECTIVE]
    comp = [(s, e) for s, e, i in kernel_spans if classify_kernel(names[i]) != FunctionKind.COLLECTIVE]
    comm += [(int(s), int(s + d)) for s, d in zip(c["start_ns"], c["dur_ns"], strict=True)]
    busy, gap = union(comp + comm, lo, hi)
    duration = max(hi - lo, 1)
    figures = {
        "gpu_busy_ns": busy, "compute_ns": union(comp, lo, hi)[0], "collective_ns": union(comm, lo, hi)[0],
        "idle_ns": max(duration - busy, 0), "max_idle_gap_ns": gap, "kernels": len(kernel_spans) + len(c["start_ns"]),
    }  # fmt: skip
    functions: list[tuple[str, int, list[tuple[int, int]], list[tuple[int, int]]]] = []
    for i in sorted({i for _, _, i in kernel_spans}):
        calls = [(s, e) for s, e, j in kernel_spans if j == i]
        functions.append((names[i], int(classify_kernel(names[i])), calls, []))
    keys: dict[tuple[int, int, int], list[int]] = {}
    for row, nbytes in enumerate(c["nbytes"].tolist()):
        exp = math.ceil(math.log2(nbytes)) if nbytes > 0 else 0
        keys.setdefault((int(c["op_id"][row]), int(c["pg_id"][row]), exp), []).append(row)
    for (op, pg, exp), rows in sorted(keys.items()):
        calls = [(int(c["start_ns"][r]), int(c["start_ns"][r] + c["dur_ns"][r])) for r in rows]
        sizes = [(int(c["nbytes"][r]), int(c["group_size"][r])) for r in rows]
        functions.append((collective_function_name(names[op], names[pg], 1 << exp if exp else 0), 2, calls, sizes))
    for i in sorted(set(p["name_id"].tolist())):
        spans = zip(p["start_ns"], p["dur_ns"], p["name_id"], strict=True)
        calls = [(int(s), int(s + d)) for s, d, j in spans if j == i]
        functions.append((names[i], int(FunctionKind.PYTHON), calls, []))
    waits = launch_waits(ev)
    if waits is not None:
        functions.append((LAUNCH_WAIT_FUNCTION, int(FunctionKind.PYTHON), waits, []))
    samples = list(zip(smp["t_ns"].tolist(), smp["metric_id"].tolist(), smp["value"].tolist(), strict=True))
    rows: dict[str, list[Any]] = {}
    for name, kind, calls, _sizes in functions:
        d = np.array([e - s for s, e in calls] or [0], dtype=np.float64)  # a launch wait may have no gap
        row: dict[str, Any] = {
            "function": name, "kind": kind, "calls": len(calls), "total_ns": int(d.sum()), "mean_ns": d.mean(),
            "p50_ns": np.percentile(d, 50), "p99_ns": np.percentile(d, 99), "max_ns": int(d.max()),
            "cv": d.std() / d.mean() if d.mean() > 0 else 0.0, "share": d.sum() / duration,
        }  # fmt: skip
        for family in LINK_FAMILIES:
            if name == LAUNCH_WAIT_FUNCTION:  # an idle GPU's link: no statistics
                row |= {f"{family}_{stat}": math.nan for stat in ("peak_bps", "cv", "mean_bps")}
                continue
            fam = [
                (t, v) for t, m, v in samples if names[m].startswith(family) and names[m].endswith(THROUGHPUT_SUFFIX)
            ]
            top = max((v for _, v in fam), default=0.0)
            inside = [v for s, e in calls for t, v in fam if s <= t <= e]
            active = [v for v in inside if v >= ACTIVE_SHARE * top]
            mean = float(np.mean(inside)) if inside else math.nan
            row[f"{family}_peak_bps"] = max(inside) if inside else math.nan
            row[f"{family}_cv"] = float(np.std(inside)) / mean if inside and mean > 0 else math.nan
            row[f"{family}_mean_bps"] = float(np.mean(active)) if active else math.nan
        for key, value in row.items():
            rows.setdefault(key, []).append(value)
    return figures, rows


def launch_waits(ev: IterationEvents) -> list[tuple[int, int]] | None:
    """The gaps in which the GPU waited for its host, as (start, end) calls: after the step's first kernel, each
    stretch with no GPU work (any stream) that ends at a kernel launched after the stretch began. None when no
    kernel's launch time precedes its start (no launch times known)."""
    spans = [
        (int(s), int(s + d), int(a))
        for cols in (ev.kernels, ev.collectives)
        if cols and "assign_ns" in cols
        for s, d, a in zip(cols["start_ns"], cols["dur_ns"], cols["assign_ns"], strict=True)
    ]
    if not any(a < s for s, _, a in spans):
        return None
    gaps, reach = [], None
    for s, e, a in sorted(spans, key=lambda x: x[0]):
        if reach is not None and s > reach and a > reach:
            gaps.append((reach, s))
        reach = e if reach is None else max(reach, e)
    return gaps


def assert_close(got: Any, want: Any, key: str) -> None:
    got, want = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    assert got.shape == want.shape, key
    assert np.allclose(got, want, rtol=1e-9, atol=1e-9, equal_nan=True), (key, got, want)


def check(ev: IterationEvents) -> None:
    figures, patterns = summarize_iteration(ev)
    want_figures, want_rows = reference(ev)
    for key, value in want_figures.items():
        assert figures[key] == value, key
    assert patterns["function"] == want_rows.get("function", [])
    assert list(patterns["kind"]) == want_rows.get("kind", [])
    for key in ("calls", "total_ns", "max_ns", "mean_ns", "p50_ns", "p99_ns", "share"):
        assert_close(patterns[key], want_rows.get(key, []), key)
    assert_close(patterns["cv"], want_rows.get("cv", []), "cv")
    for family in LINK_FAMILIES:
        for stat in ("peak_bps", "mean_bps"):
            assert_close(patterns[f"{family}_{stat}"], want_rows.get(f"{family}_{stat}", []), stat)
        # the CV pools sums of squares: compare it loosely where the spread is tiny
        got, want = np.asarray(patterns[f"{family}_cv"]), np.asarray(want_rows.get(f"{family}_cv", []), dtype=float)
        assert np.allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True), (family, got, want)


@st.composite
def iterations(draw: st.DrawFn) -> IterationEvents:
    lo = draw(st.integers(0, 1000))
    hi = lo + draw(st.integers(0, 2000))
    times = st.integers(lo - 300, hi + 300)
    durations = st.integers(0, 400)

    def spans(n: int, ids: list[int]) -> dict[str, np.ndarray]:
        return {
            "start_ns": np.array(draw(st.lists(times, min_size=n, max_size=n)), dtype=np.int64),
            "dur_ns": np.array(draw(st.lists(durations, min_size=n, max_size=n)), dtype=np.int64),
            "name_id": np.array(draw(st.lists(st.sampled_from(ids), min_size=n, max_size=n)), dtype=np.int32),
        }

    kernels = spans(draw(st.integers(0, 25)), KERNELS)
    python = spans(draw(st.integers(0, 6)), PYTHON)
    nc = draw(st.integers(0, 8))
    collectives = spans(nc, [1])
    collectives |= {
        "op_id": np.array(draw(st.lists(st.sampled_from(OPS), min_size=nc, max_size=nc)), dtype=np.int32),
        "pg_id": np.array(draw(st.lists(st.sampled_from(PGS), min_size=nc, max_size=nc)), dtype=np.int32),
        "nbytes": np.array(draw(st.lists(st.integers(0, 2**40), min_size=nc, max_size=nc)), dtype=np.int64),
        "group_size": np.array(draw(st.lists(st.integers(1, 16), min_size=nc, max_size=nc)), dtype=np.int32),
    }
    ns = draw(st.integers(0, 60))
    t = sorted(draw(st.lists(times, min_size=ns, max_size=ns)))
    samples = {
        "t_ns": np.array(t, dtype=np.int64),
        "metric_id": np.array(draw(st.lists(st.sampled_from(METRICS), min_size=ns, max_size=ns)), dtype=np.int32),
        # NVML counts KB/s: a sample is 0 or at least 1 B/s (subnormal rates only test float underflow)
        "value": np.array(draw(st.lists(st.sampled_from([0.0, 1e6, 3e9, 2.5e10]) | st.floats(1.0, 3e10),
                                        min_size=ns, max_size=ns))),
    }  # fmt: skip
    return IterationEvents(step=1, start_ns=lo, end_ns=hi, names=NAMES, kernels=kernels,
                           collectives=collectives, python=python, samples=samples)  # fmt: skip


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(iterations())
def test_the_summary_matches_the_definition_on_random_iterations(ev: IterationEvents) -> None:
    check(ev)


@st.composite
def launched_iterations(draw: st.DrawFn) -> IterationEvents:
    """``iterations()`` whose GPU work carries launch times: before its start, at it, or (odd clocks) after.
    The work starts inside the step: the summary counts the GPU's reach from the step's start on, so a gap
    between work that ended before the step and work at its start is none of its waits (``reference`` and
    ``launch_waits`` read every gap)."""
    ev = draw(iterations())

    def launched(cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = cols["start_ns"].size
        lead = draw(st.lists(st.integers(-50, 300) | st.just(0), min_size=n, max_size=n))
        start = np.maximum(cols["start_ns"], ev.start_ns)
        return {**cols, "start_ns": start, "assign_ns": start - np.array(lead, dtype=np.int64)}

    return dataclasses.replace(ev, kernels=launched(ev.kernels), collectives=launched(ev.collectives))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(launched_iterations())
def test_the_summary_with_launch_times_matches_the_definition(ev: IterationEvents) -> None:
    check(ev)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(launched_iterations() | iterations(), st.integers(-(2**50), 2**50)), min_size=1, max_size=6))
def test_iterations_with_and_without_launch_waits_summarized_together_equal_each_alone(drawn: list[Any]) -> None:
    """Overlapping, disjoint, far apart and empty iterations, with launch times and without: the batch's time
    shifts change nothing, and a launch wait is one more function at the end of its iteration's block, wherever
    it sits in the batch."""
    evs = [_shifted(ev, by, step) for step, (ev, by) in enumerate(drawn)]
    for ev, summary in zip(evs, summarize_iterations(evs), strict=True):
        assert_same_summary(summary, summarize_iteration(ev))


def windowed(config: SimulatorConfig, ranks: set[int]) -> list[IterationEvents]:
    """The iterations the windower cut from ``ranks`` of a simulated job, as it hands them to the summary."""
    windowers = {rank: RankWindower() for rank in ranks}
    closed = [c for b in simulate(config) if b.header.rank in ranks for c in windowers[b.header.rank].add(b, 0)]
    closed += [c for w in windowers.values() for c in w.flush()]
    captured: list[IterationEvents] = []
    original = closed_module.summarize_iterations

    def capture(evs: list[IterationEvents]) -> list[Summary]:
        captured.extend(evs)
        return original(evs)

    with patch.object(closed_module, "summarize_iterations", capture):
        summarize_closed(closed)
    return captured


def assert_same_summary(
    got: tuple[dict[str, Any], dict[str, Any]], want: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    """Bit for bit: the same figures, the same columns with the same dtypes and values (NaN where NaN)."""
    assert got[0] == want[0]
    assert got[1].keys() == want[1].keys()
    for key, value in want[1].items():
        a, b = np.asarray(got[1][key]), np.asarray(value)
        assert a.dtype == b.dtype, key
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), key


def test_the_summary_matches_the_definition_on_simulated_iterations() -> None:
    captured = windowed(SimulatorConfig(job="ref", ranks=2, iterations=4, tp=2), {0})
    assert len(captured) == 4
    for ev in captured:
        check(ev)


def test_huge_iteration_spans_take_the_unshifted_union() -> None:
    ev = IterationEvents(
        step=0, start_ns=-(2**62), end_ns=2**62, names=NAMES,
        kernels={"start_ns": np.array([0, 5, 100]), "dur_ns": np.array([10, 10, 1]), "name_id": np.array([0, 1, 0])},
    )  # fmt: skip
    figures, _ = summarize_iteration(ev)
    assert (figures["gpu_busy_ns"], figures["compute_ns"], figures["collective_ns"]) == (16, 11, 10)
    assert figures["max_idle_gap_ns"] == 2**62
    plain = IterationEvents(step=1, start_ns=0, end_ns=1000, names=NAMES, kernels=ev.kernels)
    together = summarize_iterations([plain, ev, plain])  # too wide to shift: one by one
    assert_same_summary(together[1], (figures, summarize_iteration(ev)[1]))
    assert_same_summary(together[0], summarize_iteration(plain))


def test_a_name_table_kept_across_iterations_gives_the_same_summary() -> None:
    captured = windowed(SimulatorConfig(job="t", ranks=2, iterations=3), {1})
    assert len(captured) == 3 and all(ev.table is captured[0].table for ev in captured)
    for ev in captured:
        kept = summarize_iteration(ev)
        fresh = summarize_iteration(dataclasses.replace(ev, table=None))
        assert kept[0] == fresh[0]
        for key, value in kept[1].items():
            assert np.array_equal(np.asarray(value), np.asarray(fresh[1][key]), equal_nan=key != "function"), key
    assert NameTable().update(captured[0].names).kind.size == len(captured[0].names)
    # The table keeps each step's function plan: a step like one before takes it, one with other names not.
    table = captured[0].table
    assert table is not None and len(table.plans) > 0
    kept_plans = len(table.plans)
    summarize_iteration(captured[-1])
    assert len(table.plans) == kept_plans
    kernels = captured[1].kernels
    renamed = dataclasses.replace(captured[1], kernels={**kernels, "name_id": np.roll(kernels["name_id"], 1)})
    assert_same_summary(summarize_iteration(renamed), summarize_iteration(dataclasses.replace(renamed, table=None)))
    assert len(table.plans) == kept_plans + 1


def test_iterations_of_many_ranks_summarized_together_equal_each_summarized_alone() -> None:
    """What the worker does with a take: one batch, in any order, of iterations of ranks with their own names."""
    config = SimulatorConfig(job="b", ranks=8, iterations=6, tp=2, seed=4, flush_interval_ms=500,
                             faults=(parse_fault("slow_link:3:2.0"), parse_fault("slow_gpu:5:1.5")))  # fmt: skip
    captured = windowed(config, set(range(8)))
    assert len(captured) == 48 and len({id(ev.names) for ev in captured}) == 8
    alone = {id(ev): summarize_iteration(ev) for ev in captured}
    batch = list(np.random.default_rng(3).permutation(np.array(captured, dtype=object)))
    for ev, summary in zip(batch, summarize_iterations(batch), strict=True):
        assert_same_summary(summary, alone[id(ev)])


def _shifted(ev: IterationEvents, by: int, step: int) -> IterationEvents:
    def move(cols: dict[str, np.ndarray], column: str) -> dict[str, np.ndarray]:
        return {**cols, column: cols[column] + by} if cols else cols

    return dataclasses.replace(
        ev, step=step, start_ns=ev.start_ns + by, end_ns=ev.end_ns + by, kernels=move(ev.kernels, "start_ns"),
        collectives=move(ev.collectives, "start_ns"), python=move(ev.python, "start_ns"),
        samples=move(ev.samples, "t_ns"),
    )  # fmt: skip


@pytest.mark.parametrize("size", [64, 1 << 23])
@pytest.mark.parametrize("n", [0, 1, 500])
def test_distinct_keys_are_numpys_unique(size: int, n: int) -> None:
    keys = np.random.default_rng(size + n).integers(0, 64, n) * (size // 64)
    uniq, inverse = _distinct(keys, size)
    want_uniq, want_inverse = np.unique(keys, return_inverse=True)
    assert np.array_equal(uniq, want_uniq) and np.array_equal(inverse, want_inverse)
    assert inverse.dtype == np.int64 and uniq.dtype == keys.dtype


def test_collective_keys_of_huge_name_lists_sort_the_same_rows() -> None:
    rng = np.random.default_rng(0)
    it, op, pg, exp = (rng.integers(0, hi, 200) for hi in (5, 7, 3, 40))
    small = _collective_keys(it, op, pg, exp, 8)
    huge = _collective_keys(it, op, pg, exp, 2**31)  # keys would overflow: sorted rows instead
    assert np.array_equal(small[0], huge[0]) and np.array_equal(small[1], huge[1])
    assert small[0].shape[1] == 4 and np.array_equal(small[0][small[1]], np.column_stack((it, op, pg, exp)))


@pytest.mark.parametrize("shuffle", [False, True])
def test_batches_with_events_out_of_time_order_close_to_the_same_iterations(shuffle: bool) -> None:
    """The windower slices buffers in time order, and masks them otherwise: both give the same records."""
    batches = [b for b in simulate(SimulatorConfig(job="o", ranks=2, iterations=4, seed=3)) if b.header.rank == 0]
    rng = np.random.default_rng(7)
    if shuffle:
        for b in batches:
            order = rng.permutation(len(b))
            for name, col in b.columns.items():
                if col.size == len(b):
                    b.columns[name] = col[order]
    w = RankWindower()
    closed = [c for b in batches for c in w.add(b, 0)] + w.flush()
    plain = RankWindower()
    base = [b for b in simulate(SimulatorConfig(job="o", ranks=2, iterations=4, seed=3)) if b.header.rank == 0]
    expected = [c for b in base for c in plain.add(b, 0)] + plain.flush()
    assert [c.iteration for c in closed] == [c.iteration for c in expected]
    for got, want in zip(closed, expected, strict=True):
        assert got.patterns.keys() == want.patterns.keys()
        for key, value in want.patterns.items():
            if isinstance(value, list) and value and isinstance(value[0], float):
                assert np.allclose(got.patterns[key], value, rtol=1e-9, equal_nan=True), key
            else:
                assert got.patterns[key] == value, key


def test_an_iteration_whose_summary_fails_costs_itself_not_the_batch() -> None:
    config = SimulatorConfig(job="f", ranks=2, iterations=4, seed=2)
    windowers = {rank: RankWindower() for rank in range(2)}
    closed = [c for b in simulate(config) for c in windowers[b.header.rank].add(b, 0)]
    closed += [c for w in windowers.values() for c in w.flush()]
    bad = closed[3]
    original = closed_module.summarize_iterations

    def failing(evs: list[IterationEvents]) -> list[Summary]:
        if any(ev.step == bad.step and ev.names is windowers[bad.rank]._names for ev in evs):
            raise FloatingPointError("odd events")
        return original(evs)

    with patch.object(closed_module, "summarize_iterations", failing):
        failed = summarize_closed(closed)
    assert failed == [bad] and bad.error is not None and "odd events" in bad.error
    with pytest.raises(RuntimeError, match="odd events"):
        _ = bad.patterns
    good = [c for c in closed if c is not bad]
    assert len(good) == 7 and all(c.error is None and c.iteration["iteration"] == c.step for c in good)


def test_the_launch_wait_counts_only_the_gaps_the_host_left() -> None:
    """The GPU's idle stretches after the step's first kernel that end at a kernel launched after they began:
    a dependency wait (a kernel queued long before) and overlap on another stream are no launch wait."""
    a = np.array
    kernels = {  # gemm on stream 1; flash_fwd on another stream overlapping the collective
        "start_ns": a([100, 250, 400, 550, 900]), "dur_ns": a([100, 50, 100, 300, 50]),
        "name_id": a([0, 0, 0, 3, 0]), "assign_ns": a([10, 240, 50, 520, 870]),
    }  # fmt: skip
    collectives = {
        "start_ns": a([500]), "dur_ns": a([200]), "op_id": a([6]), "pg_id": a([7]), "nbytes": a([1024]),
        "group_size": a([4]), "assign_ns": a([450]),
    }  # fmt: skip
    none = a([], np.int64)
    python = {"start_ns": none, "dur_ns": none, "name_id": none, "depth": none}
    samples = {"t_ns": none, "metric_id": none, "value": a([], np.float64)}
    ev = IterationEvents(step=1, start_ns=0, end_ns=1000, names=NAMES, kernels=kernels, collectives=collectives,
                         python=python, samples=samples)  # fmt: skip
    _, patterns = summarize_iteration(ev)
    at = patterns["function"].index(LAUNCH_WAIT_FUNCTION)
    # 200..250 (launched at 240) and 850..900 (launched at 870); 0..100 is before the first kernel, 300..400
    # waited for a kernel queued at 50
    assert (patterns["calls"][at], patterns["total_ns"][at], patterns["self_ns"][at]) == (2, 100, 100)
    assert (patterns["max_ns"][at], patterns["kind"][at], patterns["share"][at]) == (50, FunctionKind.PYTHON, 0.1)
    check(ev)
    unknown = {**kernels, "assign_ns": kernels["start_ns"]}  # no launch times: nothing known, no function
    _, plain = summarize_iteration(dataclasses.replace(ev, kernels=unknown, collectives={**collectives,
                                                       "assign_ns": collectives["start_ns"]}))  # fmt: skip
    assert LAUNCH_WAIT_FUNCTION not in plain["function"]


PINNED_JOBS = {
    "ddp": SimulatorConfig(job="a", ranks=4, iterations=6, seed=5, faults=(parse_fault("slow_gpu:3:1.5"),),
                           flush_interval_ms=500),
    "tp2_pp2": SimulatorConfig(job="b", ranks=4, iterations=3, seed=3, tp=2, pp=2, microbatches=3),
    "host_noise": SimulatorConfig(job="c", ranks=2, iterations=6, seed=1, gc_rate=0.5, glitch_rate=0.2,
                                  pause_rate=0.2, flush_interval_ms=200),
}  # fmt: skip
PINNED_DIGESTS = {
    "ddp": "2c169325a9df40061b72955b8d1f3d6076dd2ee23d6f49a0538732815307454f",
    "tp2_pp2": "16bc996187419a4c99f2cd9f441b3824fe0a44e13e7e23a6e1f87cb5f5a500b0",
    "host_noise": "a18dd59730d4ef9564dc04fd5e96f24427d539e58200b32584b428ecbb6ac705",
}
"""SHA-256 of every iteration and pattern record (Avro) of each job, in closing order: pinned so that a change
made for speed is seen to keep the windower's output bit for bit. A change of the simulator, the schemas or a
rule changes them on purpose: re-pin from this test's message."""


@pytest.mark.parametrize("job", sorted(PINNED_JOBS))
def test_the_windowers_records_of_simulated_jobs_are_pinned_bit_for_bit(job: str) -> None:
    """Per message (the iterations one batch closes summarized together) and 7 messages at a time, the same."""
    digests = []
    for every in (1, 7):
        windowers: dict[int, RankWindower] = {}
        closed: list[Any] = []
        pending: list[Any] = []
        for i, batch in enumerate(simulate(PINNED_JOBS[job])):
            pending += windowers.setdefault(batch.header.rank, RankWindower()).add(batch, 0)
            if (i + 1) % every == 0:
                summarize_closed(pending)
                closed, pending = closed + pending, []
        pending += [c for w in windowers.values() for c in w.flush()]
        summarize_closed(pending)
        digest = hashlib.sha256()
        for c in closed + pending:
            digest.update(encode("iterations", c.iteration) + encode("patterns", c.patterns))
        digests.append(digest.hexdigest())
    assert digests[0] == digests[1], "summarized per message and 7 at a time, the records differ"
    assert digests[0] == PINNED_DIGESTS[job], f"{job}: records changed, digest now {digests[0]}"
