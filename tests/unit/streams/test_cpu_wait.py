"""Run-queue wait (``cpu_wait_ns``): the windower gives each iteration the wait its producer published for
the step, and ``job_regression`` is judged on the iteration time less it, so a job slowed by other
processes taking the CPU is no regression while one whose own work grew still is."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from fleetscope.producers import SimulatorConfig, simulate
from fleetscope.producers.cpu_wait import CpuWaitClock, SpanWaits
from fleetscope.schemas import CPU_WAIT, SPAN_CPU_WAIT_DEPTH, THREAD_BUSY_DEPTH, EventBatch, EventKind
from fleetscope.schemas.vocabulary import CPU_WAIT_FUNCTION, ITERATION_LESS_CPU_WAIT
from fleetscope.streams.analysis.differential import IterationTimes, JobDifferential, iteration_times
from fleetscope.streams.analysis.hostspans import host_self_ns
from fleetscope.streams.analysis.windowing import RankWindower
from fleetscope.verdict import sentence


def _wait_batch(like: EventBatch, spans: list[tuple[int, int]]) -> EventBatch:
    cols = {"start_ns": np.array([s for s, _ in spans]), "dur_ns": np.array([w for _, w in spans]),
            "name_id": np.zeros(len(spans), dtype=np.int32), "depth": np.zeros(len(spans), dtype=np.int32)}  # fmt: skip
    return EventBatch(kind=EventKind.HOST, header=like.header, names=[CPU_WAIT], columns=cols)


def _closed(batches: list[EventBatch]) -> list[Any]:
    w = RankWindower()
    out = [c for b in batches for c in w.add(b, 0)]
    return out + w.flush()


def test_each_iteration_gets_the_wait_published_at_its_start_and_the_span_is_no_host_function() -> None:
    batches = [b for b in simulate(SimulatorConfig(ranks=2, iterations=8)) if b.header.rank == 0]
    plain = {c.step: c for c in _closed(batches)}
    assert all(c.iteration["cpu_wait_ns"] == -1 == c.patterns["cpu_wait_ns"] for c in plain.values())
    starts = {step: c.iteration["start_ns"] for step, c in plain.items()}
    first = next(b for b in batches if b.kind is EventKind.HOST)
    waits = [(starts[step], 1_000 * (step + 1)) for step in sorted(starts) if step != 3]
    closed = {c.step: c for c in _closed([_wait_batch(first, waits), *batches])}
    assert {s: c.iteration["cpu_wait_ns"] for s, c in closed.items()} == {
        s: -1 if s == 3 else 1_000 * (s + 1) for s in starts
    }
    assert all(c.patterns["cpu_wait_ns"] == c.iteration["cpu_wait_ns"] for c in closed.values())
    assert all(CPU_WAIT not in c.patterns["function"] for c in closed.values())
    assert [c.patterns["function"] for c in closed.values()] == [c.patterns["function"] for c in plain.values()]


def _record(rank: int, it: int, wall_ms: float, wait_ms: float) -> dict[str, Any]:
    """One rank's patterns of a 4-rank CPU job: its step time, its run-queue wait, one host function."""
    return {
        "job": "j", "rank": rank, "host": "h", "world_size": 4, "tp_rank": -1, "pp_rank": -1, "dp_rank": -1,
        "iteration": it, "iteration_start_ns": it * 100_000_000, "iteration_ns": int(wall_ms * 1e6),
        "function": ["optimizer.step"], "kind": [3], "calls": [1], "total_ns": [300_000],
        "self_ns": [300_000], "mean_ns": [3e5], "p50_ns": [3e5], "p99_ns": [3e5], "max_ns": [300_000],
        "cv": [0.0], "share": [0.003], "nbytes": [0], "algbw_gbps": [0.0], "busbw_gbps": [0.0],
        "nvlink_mean_bps": [np.nan], "nvlink_cv": [np.nan], "nvlink_peak_bps": [np.nan],
        "pcie_mean_bps": [np.nan], "pcie_cv": [np.nan], "pcie_peak_bps": [np.nan], "profiled": False,
        "cpu_wait_ns": int(wait_ms * 1e6) if wait_ms >= 0 else -1,
    }  # fmt: skip


def _job(extra_ms: float, extra_is_wait: bool, seed: int, wait_known: bool = True) -> list[dict[str, Any]]:
    """Finding records of a job whose steps (80 ms, 25 of them run-queue wait) take ``extra_ms`` more from
    iteration 20 to 45: as run-queue wait (other processes took the CPU) or as the job's own work."""
    rng = np.random.default_rng(seed)
    diff = JobDifferential("j")
    out: list[dict[str, Any]] = []
    for it in range(60):
        extra = extra_ms if 20 <= it < 45 else 0.0
        for rank in range(4):
            wait = 25.0 + rng.normal(0.0, 2.0) + (extra if extra_is_wait else 0.0)
            wall = 80.0 + rng.normal(0.0, 2.0) + extra
            out += diff.add(_record(rank, it, wall, wait if wait_known else -1.0))
    return out + diff.flush()


def test_a_job_slowed_by_waiting_for_the_cpu_is_no_regression_one_whose_own_work_grew_is() -> None:
    """Its finding says so: the metric is the steps' time less their wait, the evidence has both, and the
    sentence a user reads says the wait was left out."""
    for seed in range(3):
        assert _job(40.0, extra_is_wait=True, seed=seed) == [], seed
        own, unmeasured = _job(40.0, extra_is_wait=False, seed=seed), _job(40.0, True, seed, wait_known=False)
        for found, metric in ((own, ITERATION_LESS_CPU_WAIT), (unmeasured, "iteration_ns")):
            opened = [f for f in found if f["status"] == "open"]
            assert [(f["category"], f["rank"], f["metric"]) for f in opened] == [("job_regression", -1, metric)]
            assert 20 <= opened[0]["iteration_last"] <= 25, opened
        evidence = json.loads(next(f for f in own if f["status"] == "open")["evidence"])
        assert evidence["iteration_ns"] > 110e6 and 20e6 < evidence["cpu_wait_ns"] < 30e6, evidence
        assert "CPU wait left out" in sentence(own, 100e6), sentence(own, 100e6)
        assert "CPU wait" not in sentence(unmeasured, 100e6)


def test_iteration_times_less_the_waits_the_paced_the_shortest_the_work_less_collectives_unknown_unmeasured() -> None:
    """Own: the median rank's time less its wait; paced: the shortest such; work: the least rank's less its
    wait and its collectives (none here: its host function stays in); unmeasured waits: the median time."""
    records = [_record(r, 0, wall, wait) for r, (wall, wait) in enumerate([(80, 20), (90, 40), (100, 10), (85, 5)])]
    assert iteration_times(records) == IterationTimes(70e6, 50e6, 50e6, 15e6)
    records[2]["cpu_wait_ns"] = -1
    assert iteration_times(records) == IterationTimes(87.5e6, 87.5e6, 80e6, -1.0)


def test_the_clock_reads_this_threads_growing_wait_or_none_where_the_kernel_does_not_say(tmp_path: Any) -> None:
    clock = CpuWaitClock()
    first = clock.read()
    assert first is not None and first >= 0  # Linux with schedstat, as on every CI machine
    sum(range(200_000))
    second = clock.read()
    assert second is not None and second >= first
    clock.close()
    absent = CpuWaitClock(str(tmp_path / "none"))
    assert absent.read() is None and absent.read() is None


class _Clock(CpuWaitClock):
    def __init__(self, readings: list[int]) -> None:
        super().__init__()
        self.readings = readings

    def read(self) -> int | None:
        return self.readings.pop(0)


def test_a_spans_own_wait_leaves_out_the_wait_of_the_spans_that_ended_inside_it() -> None:
    """outer marks at 100, inner at 110 and ends at 125 (15 of its own), a collection inside outer gave 5
    more; outer ends at 160: 60 waited in all, 40 of them its own. Off the thread that made it: no mark."""
    waits = SpanWaits(_Clock([100, 110, 125, 160]))
    outer = waits.mark()
    inner = waits.mark()
    assert outer is not None and inner is not None
    assert waits.own(inner) == 15
    waits.give(5)
    assert waits.own(outer) == 60 - 15 - 5
    marks: list[object] = []
    thread = threading.Thread(target=lambda: marks.append(waits.mark()))
    thread.start()
    thread.join()
    assert marks == [None]


def test_self_time_leaves_out_each_spans_own_wait_row_and_a_wait_row_is_no_span() -> None:
    """``optimizer.step`` [0, 100) (name 0) with a nested ``dataloader.next`` [10, 40) (name 1), both depth 0
    as the torch hook sends them; waits: 15 in the step's own time, 5 in the loader's; a row with no span of
    its name and start, and the next iteration's span of the same name and start, get nothing."""
    it = np.array([0, 0, 0, 0, 0, 1, 0], dtype=np.int64)
    start = np.array([0, 10, 0, 10, 50, 0, 60], dtype=np.int64)
    dur = np.array([100, 30, 15, 5, 9, 100, 20], dtype=np.int64)
    depth = np.array([0, 0, -2, -2, -2, 0, THREAD_BUSY_DEPTH], dtype=np.int32)
    assert SPAN_CPU_WAIT_DEPTH == -2
    name = np.array([0, 1, 0, 1, 0, 0, 2])
    sync = np.zeros(it.size, dtype=bool)
    assert host_self_ns(it, start, dur, depth, sync, name).tolist() == [100 - 30 - 20 - 15, 25, 0, 0, 0, 100, 0]
    # without names (a producer that measures no waits) the rows are unmatched, and still no span
    assert host_self_ns(it, start, dur, depth, sync).tolist() == [100 - 30 - 20, 30, 0, 0, 0, 100, 0]


def _synchronous_job(
    extra_ms: dict[int, float] | Callable[[int, int], float],
    at: range,
    seed: int,
    stages: int = 1,
    world: int = 4,
    grown_ms: float | dict[int, float] = 0.0,
) -> list[dict[str, Any]]:
    """Finding records of a synchronous CPU job (steps 80 ms, 25 of them run-queue wait, one all-reduce;
    ``stages`` pipeline stages, the first one's ranks waiting 30 ms more: their host work is larger): in the
    iterations ``at``, every rank's own work takes ``grown_ms`` more (rank r's ``grown_ms[r]``) and rank r
    waits ``extra_ms[r]`` more for a CPU (``extra_ms(r, it)``), and every rank's step takes the largest of
    those delays longer (the others wait for it in the all-reduce: blocked, no CPU wait)."""
    rng = np.random.default_rng(seed)
    diff = JobDifferential("j")
    out: list[dict[str, Any]] = []
    waits = extra_ms if callable(extra_ms) else lambda r, _: extra_ms.get(r, 0.0)  # type: ignore[union-attr]
    grown = grown_ms if isinstance(grown_ms, dict) else dict.fromkeys(range(world), grown_ms)
    for it in range(70):
        extra = {r: waits(r, it) if it in at else 0.0 for r in range(world)}
        delay = {r: extra[r] + (grown.get(r, 0.0) if it in at else 0.0) for r in range(world)}
        slowest = max(delay.values())
        for rank in range(world):
            stage = rank * stages // world
            wait = 25.0 + (30.0 if stages > 1 and stage == 0 else 0.0) + extra[rank] + rng.normal(0.0, 2.0)
            rec = _record(rank, it, 80.0 + slowest + rng.normal(0.0, 2.0), wait)
            rec |= {"world_size": world, "pp_rank": stage if stages > 1 else -1}
            allreduce = (10.0 + slowest - delay[rank] + rng.normal(0.0, 0.5)) * 1e6
            rec |= {key: [*rec[key], value] for key, value in (
                ("function", "allreduce|pg0|2^20"), ("kind", 2), ("calls", 1), ("total_ns", int(allreduce)),
                ("self_ns", int(allreduce)), ("mean_ns", allreduce), ("p50_ns", allreduce),
                ("p99_ns", allreduce), ("max_ns", int(allreduce)), ("cv", 0.0), ("share", 0.1),
                ("nbytes", 1 << 20), ("algbw_gbps", 1.0), ("busbw_gbps", 1.5), ("nvlink_mean_bps", np.nan),
                ("nvlink_cv", np.nan), ("nvlink_peak_bps", np.nan), ("pcie_mean_bps", np.nan),
                ("pcie_cv", np.nan), ("pcie_peak_bps", np.nan))}  # fmt: skip
            out += diff.add(rec)
    return out + diff.flush()


def test_a_rank_that_waits_for_a_cpu_longer_than_every_peer_is_host_slow_a_starved_pair_or_a_burst_is_not() -> None:
    """From iteration 30 rank 2 waits 30 ms more in each step (its host's cores taken by others): host_slow on
    ``cpu_wait``, named within 5 iterations (the median of 8), the job's slowdown explained by it. Healthy
    alike: ranks 0 and 1 starved together on one core for 20 iterations (each waits as long as its mate), or
    rank 3 for 3 iterations."""
    for seed in range(5):
        found = _synchronous_job({2: 30.0}, range(30, 70), seed)
        opened = [f for f in found if f["status"] == "open"]
        assert [(f["category"], f["rank"], f["function"]) for f in opened] == [("host_slow", 2, CPU_WAIT_FUNCTION)]
        assert 30 <= opened[0]["iteration_last"] <= 35, opened
        assert "waits longer than its peers for a CPU" in sentence(found, 110e6)
        assert _synchronous_job({0: 30.0, 1: 30.0}, range(30, 50), seed) == [], seed
        assert _synchronous_job({3: 60.0}, range(30, 33), seed) == [], seed


def test_ranks_wait_for_a_cpu_compared_within_their_pipeline_stage() -> None:
    """Two stages of 4 ranks, the first one's waiting 30 ms more in every step (more host work): nothing;
    a rank of the second stage waiting 30 ms more than its stage's peers from iteration 30: named."""
    for seed in range(3):
        assert _synchronous_job({}, range(0), seed, stages=2, world=8) == [], seed
        found = _synchronous_job({6: 30.0}, range(30, 70), seed, stages=2, world=8)
        opened = [(f["category"], f["rank"], f["function"]) for f in found if f["status"] == "open"]
        assert opened == [("host_slow", 6, CPU_WAIT_FUNCTION)], (seed, opened)


def test_a_job_whose_own_work_grew_and_starved_two_of_its_ranks_is_a_regression_named_in_time() -> None:
    """From iteration 30 every rank's own work takes 40 ms more, and on their shared cores ranks 1 and 3 wait
    60 ms more for a CPU, ranks 0 and 2 25 ms (a real 4-rank job on 2 cores whose forward grew 4 times: two
    ranks 60 ms late, 45 ms of it their longer wait): they arrive late at every all-reduce by more than half
    the slowdown, by their longer wait alone, and every rank's work outside the all-reduce grew. A
    job_regression, named within 5 iterations, that says so; no rank named."""
    for seed in range(3):
        found = _synchronous_job({0: 25.0, 1: 60.0, 2: 25.0, 3: 60.0}, range(30, 70), seed, grown_ms=40.0)
        opened = [(f["category"], f["rank"], f["iteration_last"]) for f in found if f["status"] == "open"]
        assert [o[:2] for o in opened] == [("job_regression", -1)] and opened[0][2] <= 35, (seed, opened)
        evidence = json.loads(next(f for f in found if f["status"] == "open")["evidence"])
        assert evidence["work_stepped"] and evidence["work_slowdown"] > 0.5, evidence


def test_a_rank_above_its_peers_in_the_median_of_a_window_but_not_in_its_iterations_is_not_host_slow() -> None:
    """From iteration 30 every rank's own work takes 40 ms more and every rank waits about 100 ms more for a
    CPU (the job's own ranks share the cores), each rank of 0, 1 and 3 once 40 ms less: in the window of 8
    with 4 of them after the change, rank 2's median wait is 20 ms above every other's, yet in no iteration
    above the latest other's. A job_regression and no host_slow."""
    dips = {0: 30, 1: 31, 3: 32}

    def waits(rank: int, it: int) -> float:
        return 100.0 if rank == 2 else 60.0 if dips[rank] == it else 140.0

    for seed in range(3):
        found = _synchronous_job(waits, range(30, 70), seed, grown_ms=40.0)
        opened = [(f["category"], f["rank"]) for f in found if f["status"] == "open"]
        assert opened == [("job_regression", -1)], (seed, opened)


def test_a_rank_whose_own_work_grew_explains_the_jobs_slowdown_though_it_also_waits_longer_for_a_cpu() -> None:
    """From iteration 30 rank 1's own work takes 60 ms more and, runnable that much longer on the shared
    cores, it waits 40 ms more for a CPU (a real job, one rank's forward 3 times over: 45 ms longer waits,
    80 ms late). The others wait for it in the all-reduce, their work outside it unchanged: no
    job_regression, and no rank but 1 named."""
    for seed in range(3):
        found = _synchronous_job({1: 40.0}, range(30, 70), seed, grown_ms={1: 60.0})
        opened = [(f["category"], f["rank"]) for f in found if f["status"] == "open"]
        assert opened and {rank for _, rank in opened} == {1}, (seed, opened)


def _waiting_job(kernels: bool, seed: int) -> list[dict[str, Any]]:
    """A 4-rank job whose steps take 30 ms more from iteration 20 to 45, all of it blocked in its all-reduce
    (its ranks waited for one another), its work outside collectives and its CPU wait unchanged; ``kernels``:
    each rank also ran a compute kernel (a GPU job)."""
    rng = np.random.default_rng(seed)
    diff = JobDifferential("j")
    out: list[dict[str, Any]] = []
    for it in range(60):
        extra = 30.0 if 20 <= it < 45 else 0.0
        for rank in range(4):
            rec = _record(rank, it, 80.0 + rng.normal(0.0, 2.0) + extra, 25.0 + rng.normal(0.0, 2.0))
            blocked = int((10.0 + extra) * 1e6)
            added = [("nccl:allreduce[pg=0,<=1MiB]", 2, blocked)] + ([("gemm", 0, 20_000_000)] if kernels else [])
            for name, kind, total in added:
                for key, value in (("function", name), ("kind", kind), ("calls", 1), ("total_ns", total),
                                   ("self_ns", total), ("mean_ns", float(total)), ("p50_ns", float(total)),
                                   ("p99_ns", float(total)), ("max_ns", total), ("cv", 0.0), ("share", 0.1),
                                   ("nbytes", 1 << 20), ("algbw_gbps", 1.0), ("busbw_gbps", 1.0)):  # fmt: skip
                    rec[key] = [*rec[key], value]
                for key in ("nvlink_mean_bps", "nvlink_cv", "nvlink_peak_bps", "pcie_mean_bps", "pcie_cv",
                            "pcie_peak_bps"):  # fmt: skip
                    rec[key] = [*rec[key], np.nan]
            out += diff.add(rec)
    return out + diff.flush()


def test_a_cpu_job_slower_only_in_its_waits_for_one_another_is_no_regression_a_gpu_job_still_is() -> None:
    """On CPUs, a collective is CPU work that contention slows, and ranks block in it while a descheduled peer
    catches up: a real healthy pp2 x dp2 gloo job slowed by 32 % for 12 iterations in CI, its work outside
    collectives not stepping. A GPU job's collectives run on its links: the same slowdown is its network's."""
    for seed in range(3):
        assert [f for f in _waiting_job(kernels=False, seed=seed) if f["status"] == "open"] == [], seed
        opened = [f for f in _waiting_job(kernels=True, seed=seed) if f["status"] == "open"]
        assert [(f["category"], f["rank"]) for f in opened] == [("job_regression", -1)], (seed, opened)
