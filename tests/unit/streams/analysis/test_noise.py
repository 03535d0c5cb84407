"""The straggler-by-arrival rule must not name a rank that chance alone makes last (few ranks), and must
name a slow one that contention overtakes now and then."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fleetscope.schemas import FunctionKind
from fleetscope.streams.analysis.differential import DifferentialConfig, JobDifferential
from fleetscope.streams.analysis.noise import JobNoise, NoiseConfig, _held_up_by, _noise
from fleetscope.streams.analysis.signals import RankSignal

_COMPUTE, _COLLECTIVE, _PYTHON = int(FunctionKind.COMPUTE), int(FunctionKind.COLLECTIVE), int(FunctionKind.PYTHON)


def test_chance_alone_makes_no_rank_clearly_late_a_slow_rank_overtaken_twice_is() -> None:
    """Random arrival order on 4 or 8 ranks (Gaussian waits) never gives a rank clearly late over the last 8
    iterations of its history; a slow rank is, even when contention overtook it twice. On 2 or 3 ranks, not
    even a rank always last by far: so few peers cannot say which one is the cause."""
    noise = JobNoise()
    rng = np.random.default_rng(1)
    for ranks in (4, 8):
        waits = rng.normal(size=(5_000, 24, ranks))
        histories = np.median(waits, axis=2, keepdims=True) - waits
        assert not any(noise._clearly_late(h, 0) for h in histories)
    late = rng.normal(size=(24, 4))
    late[-8:, 2] += 6.0
    assert noise._clearly_late(late, 2) and not noise._clearly_late(late, 0)
    late[[-7, -4], 2] = 0.0  # overtaken twice
    assert noise._clearly_late(late, 2)
    late[-2, 2] = 0.0  # three times: not clearly late in this window
    assert not noise._clearly_late(late, 2)
    for ranks in (2, 3):
        few = rng.normal(size=(24, ranks))
        few[:, 1] += 6.0
        assert not noise._clearly_late(few, 1)


def _behind_every_peer(leads: list[float], seed: int) -> tuple[np.ndarray, float]:
    """A 4-rank lateness history (24 iterations) whose rank 1 arrives ``leads`` (in units of its peers'
    jitter) after the latest peer in its last iterations; and that jitter."""
    late = np.random.default_rng(seed).normal(size=(24, 4))
    noise = _noise(late, 1, among=np.nanmedian)
    rows = range(24 - len(leads), 24)
    late[rows, 1] = np.delete(late[rows], 1, axis=1).max(axis=1) + np.asarray(leads) * noise
    return late, noise


def test_a_rank_behind_every_peer_each_iteration_is_named_by_its_summed_lead_a_burst_of_three_is_not() -> None:
    """The recorded 3x-forward job's pattern: behind every peer each iteration, but in half of them by less
    than the margin (twice the jitter), which the count by the margin misses; its lead adds up (``_leads``).
    Three iterations behind every peer by far, one descheduling burst, add up to less than the alarm; a
    fourth passes it. (The sum alone: the sign test, ``_late_throughout``, asks here for the whole history.)"""
    noise = JobNoise(NoiseConfig(sign_iterations=24, sign_misses=0))
    for seed in range(20):
        late, noise_ns = _behind_every_peer([1.6, 4.0] * 4, seed)  # a sum of 8.4 after 7 iterations
        assert noise._clearly_late(late, 1), seed
        late[-8:, 1] -= noise_ns  # by one unit less: 6.4 after 8
        assert not noise._clearly_late(late, 1), seed
        late, _ = _behind_every_peer([8.0] * 3, seed)
        assert not noise._clearly_late(late, 1), seed
        late, _ = _behind_every_peer([8.0] * 4, seed)
        assert noise._clearly_late(late, 1), seed


def _record(rank: int, it: int, wait_ms: float, loader_ms: float) -> dict[str, Any]:
    """One rank's patterns for one iteration of a 4-rank DDP job on CPU: its all-reduce time (how long it
    waited for the last rank, plus the transfer) and its data loader's time."""
    functions = [
        ("nccl:allreduce[pg=0,<=2MiB]", _COLLECTIVE, 1, wait_ms),
        ("dataloader.next", _PYTHON, 1, loader_ms),
        ("optimizer.step", _PYTHON, 1, 0.3),
    ]
    record = _record_of(rank, it, functions, iteration_ms=80.0)
    record.update(world_size=4, algbw_gbps=[0.3, 0.0, 0.0], busbw_gbps=[0.4, 0.0, 0.0])
    return record


def _record_of(rank: int, it: int, functions: list[tuple[str, int, int, float]], iteration_ms: float) -> dict[str, Any]:
    """One rank's patterns for one iteration: (function, kind, calls, total ms) each."""
    iteration_ns = int(iteration_ms * 1e6)
    total = [max(ms, 0.0) * 1e6 for _, _, _, ms in functions]
    calls = [c for _, _, c, _ in functions]
    mean = [t / c for t, c in zip(total, calls, strict=True)]
    nan = [float("nan")] * len(functions)
    return {
        "job": "j", "rank": rank, "host": "h", "world_size": 8, "tp_rank": -1, "pp_rank": -1, "dp_rank": -1,
        "iteration": it, "iteration_start_ns": it * iteration_ns, "iteration_ns": iteration_ns,
        "function": [f for f, _, _, _ in functions], "kind": [k for _, k, _, _ in functions], "calls": calls,
        "total_ns": [int(t) for t in total], "self_ns": [int(t) for t in total], "mean_ns": mean, "p50_ns": mean,
        "p99_ns": mean, "max_ns": [int(m) for m in mean], "cv": [0.0] * len(functions),
        "share": [t / iteration_ns for t in total],
        "nbytes": [1 << 20 if k == _COLLECTIVE else 0 for _, k, _, _ in functions],
        "algbw_gbps": [0.0] * len(functions), "busbw_gbps": [0.0] * len(functions), "nvlink_mean_bps": nan,
        "nvlink_cv": nan, "nvlink_peak_bps": nan, "pcie_mean_bps": nan, "pcie_cv": nan, "pcie_peak_bps": nan,
        "profiled": False,
    }  # fmt: skip


def _job(
    late_ms: float, fault_at: int, overtaken: set[int], seed: int, iterations: int = 60, hiccups: float = 0.0
) -> list[dict[str, Any]]:
    """Finding records of a job where rank 1 is late by ``late_ms`` from ``fault_at``, except in the
    ``overtaken`` iterations, where contention makes another rank later still; every rank's wait jitters
    by a few milliseconds (a shared CPU host), and with probability ``hiccups`` an iteration has one
    random rank descheduled for 5 to 30 ms more."""
    rng = np.random.default_rng(seed)
    diff = JobDifferential("j")
    out: list[dict[str, Any]] = []
    for it in range(iterations):
        arrival = rng.normal(0.0, 2.0, size=4)  # ms after the first possible arrival
        if rng.random() < hiccups:
            arrival[rng.integers(4)] += rng.uniform(5.0, 30.0)
        if it >= fault_at:
            arrival[1] += late_ms
            if it in overtaken:
                arrival[(it % 3) + (it % 3 >= 1)] = arrival[1] + 3.0
        last = arrival.max()
        for rank in range(4):
            out += diff.add(_record(rank, it, 4.0 + last - arrival[rank], 9.0 + rng.normal(0.0, 0.5)))
    return out + diff.flush()


def test_a_slow_rank_overtaken_twice_by_contention_is_still_named_within_ten_iterations_and_stays_open() -> None:
    """Last in 6 of the first 8 iterations of its fault (contention made another rank later twice) but by
    far more than the noise: named within 10 iterations, as its one finding, which stays open (judged
    again each iteration, not left to expire and open anew)."""
    for seed in range(5):
        out = _job(late_ms=12.0, fault_at=30, overtaken={31, 34, 45, 52}, seed=seed)
        assert [(f["status"], f["rank"]) for f in out if f["status"] != "update"] == [("open", 1)], out
        assert 30 <= out[0]["iteration_first"] <= 40


def test_a_healthy_job_with_a_jittery_host_has_no_straggler() -> None:
    for seed in range(4):
        assert _job(late_ms=0.0, fault_at=0, overtaken=set(), seed=seed, iterations=300) == []


def _varying_work_job(
    late_ms: float, seed: int, iterations: int = 60, fault_at: int = 30, waiting: bool = False
) -> list[dict[str, Any]]:
    """Finding records of a 4-rank job whose work varies from step to step (sequences of varying length): each
    rank's step is 12 ms longer or shorter at random (standard deviation), so a different rank is last each
    time; from ``fault_at``, rank 2 sleeps ``late_ms`` more each step (a real 4-rank job with gradient
    accumulation over batches of 32-160 rows), or, ``waiting``, waits that long for a CPU (other processes
    on its cores). Every rank's run-queue wait is measured, 30 ms give or take 2, and delays its arrival."""
    rng = np.random.default_rng(seed)
    diff = JobDifferential("j")
    out: list[dict[str, Any]] = []
    for it in range(iterations):
        waits = 30.0 + rng.normal(0.0, 2.0, size=4)
        arrival = rng.normal(0.0, 12.0, size=4) + waits
        if it >= fault_at:
            arrival[2] += late_ms
            waits[2] += late_ms if waiting else 0.0
        last = arrival.max()
        for rank in range(4):
            record = _record(rank, it, 4.0 + last - arrival[rank], 9.0 + rng.normal(0.0, 0.5))
            out += diff.add(record | {"cpu_wait_ns": int(max(waits[rank], 0.0) * 1e6)})
    return out + diff.flush()


def test_a_rank_behind_each_peer_nearly_every_step_is_named_where_work_varies_more_than_its_lateness() -> None:
    """Where every rank's step varies by as much as the fault, no margin in units of the peers' jitter is
    passed: a rank 25 ms late each step of 80 (a third of the job's time) was named by nothing in 2 of these 4
    jobs. It is behind each peer, on its own, in 11 of 12 steps nearly always, and healthy ranks, taking
    turns, are not: named within 16 iterations, and nothing in 300 healthy ones. Not where the rank waited
    for a CPU as long: that is other processes on its cores, its host's contention, which the run-queue rule
    names. (A real varying-work job beside CPU burners had a rank behind each peer for want of a CPU, but
    below that rule's bar; the recorded jobs' test replays it: none-varying8bd1aa.)"""
    for seed in range(4):
        assert _varying_work_job(late_ms=0.0, seed=seed, iterations=300) == []
        opened = [f for f in _varying_work_job(late_ms=25.0, seed=seed) if f["status"] == "open"]
        assert [(f["category"], f["rank"]) for f in opened][:1] == [("straggler", 2)], opened
        assert {f["rank"] for f in opened} == {2} and 30 <= opened[0]["iteration_first"] <= 46, opened
        # as late for want of a CPU, its run-queue wait above its peers' by as much: host_slow on that wait
        waited = [f for f in _varying_work_job(late_ms=25.0, seed=seed, waiting=True) if f["status"] == "open"]
        assert [(f["category"], f["rank"], f["function"]) for f in waited][:1] == [("host_slow", 2, "cpu_wait")]
        assert not [f for f in waited if f["category"] == "straggler" or f["rank"] != 2], waited


def _loader_job(extra_ms: dict[int, float], rank: int, seed: int, iterations: int = 56) -> list[dict[str, Any]]:
    """Finding records of a 4-rank job where ``rank``'s data loader takes ``extra_ms[it]`` more in iteration
    ``it`` (so it arrives that much later at the all-reduce, and its peers wait for it); every rank's
    loader and arrival jitter by a few milliseconds (a shared CPU host)."""
    rng = np.random.default_rng(seed)
    diff = JobDifferential("j")
    out: list[dict[str, Any]] = []
    for it in range(iterations):
        loader = 9.0 + rng.normal(0.0, 0.5, size=4)
        loader[rank] += extra_ms.get(it, 0.0)
        arrival = rng.normal(0.0, 2.0, size=4) + loader
        for r in range(4):
            out += diff.add(_record(r, it, 4.0 + arrival.max() - arrival[r], float(loader[r])))
    return out + diff.flush()


def test_one_burst_of_contention_on_a_rank_is_no_host_fault_a_fault_that_stays_or_comes_back_is() -> None:
    """A rank descheduled for three iterations in a row (its loader 40 ms slower: one burst of contention
    on a shared host, seen on a real 4-rank job under load) is no finding; the same excess from iteration
    30 on for good, or every third iteration, is a host_slow finding on the data loader within 10
    iterations, and names no other rank."""
    for seed in range(4):
        burst = _loader_job({it: 40.0 for it in (15, 16, 17)}, rank=2, seed=seed)
        assert [f for f in burst if f["category"] == "host_slow"] == [], burst
        for every in (1, 3):
            fault = _loader_job({it: 40.0 for it in range(30, 56, every)}, rank=2, seed=seed)
            opened = [f for f in fault if f["status"] == "open"]
            assert opened and {f["rank"] for f in opened} == {2}, fault
            assert (opened[0]["category"], opened[0]["function"]) == ("host_slow", "dataloader.next"), opened
            assert 30 <= opened[0]["iteration_last"] <= 40, opened


def test_a_slow_rank_among_descheduled_ones_is_named_within_ten_iterations_healthy_ranks_never() -> None:
    """In 4 iterations of 10 some rank, a different one each time, is descheduled for 5 to 30 ms more
    (heavy contention, as the real 4-rank job's arrivals in the full suite), so the slow rank is often not
    the latest; it is late beyond its peers' median by the margin, and later than each peer on its own,
    nearly every time, which names it within 10 iterations, and no other rank (when it also had to be
    the latest: named at 35-57 on these seeds). Healthy jobs with such hiccups get no finding."""
    for seed in range(10):
        out = _job(late_ms=12.0, fault_at=30, overtaken=set(), seed=seed, hiccups=0.4)
        assert {f["rank"] for f in out} == {1}, out
        assert 30 <= out[0]["iteration_last"] <= 40 and out[0]["status"] == "open", out[0]
    for seed in range(4):
        assert _job(late_ms=0.0, fault_at=0, overtaken=set(), seed=100 + seed, iterations=300, hiccups=0.25) == []


def test_two_ranks_late_together_are_not_one_straggler() -> None:
    """Two of 4 ranks late together (starved on a shared host), one of them a little later: each passes the
    margin over its peers' median (an early rank's), but neither beats the other 6 times in 8."""
    noise = JobNoise()
    rng = np.random.default_rng(3)
    late = rng.normal(size=(24, 4))
    late[-8:, :2] += 10.0
    late[-8:, 0] += 0.3  # rank 0 later than rank 1 about 4 times in 8
    assert not noise._clearly_late(late, 0) and not noise._clearly_late(late, 1)
    late[-8:, 1] -= 10.0  # rank 1 back with the others: rank 0 alone is late
    assert noise._clearly_late(late, 0)


def _windowed_job(late: range, window: range, seed: int, iterations: int = 190) -> list[dict[str, Any]]:
    """Finding records of a 4-rank job profiled on every rank in ``window``, where rank 3 arrives 12 ms late
    at every all-reduce in the ``late`` iterations (each rank's wait jitters by 2 ms)."""
    rng = np.random.default_rng(seed)
    diff = JobDifferential("j")
    out: list[dict[str, Any]] = []
    for it in range(iterations):
        arrival = rng.normal(0.0, 2.0, size=4) + np.where(np.arange(4) == 3, 12.0 * (it in late), 0.0)
        for rank in range(4):
            record = _record(rank, it, 4.0 + arrival.max() - arrival[rank], 9.0 + rng.normal(0.0, 0.5))
            out += diff.add(record | {"profiled": it in window})
    return out + diff.flush()


def test_a_rank_late_in_a_profiler_windows_aftermath_is_no_straggler_one_late_after_it_is() -> None:
    """After a 16-iteration window the ranks export its trace and publish the events it held back, each in
    its own time: one rank late at every all-reduce for 12 iterations of the window's aftermath (twice its
    length) is the tool's doing (a real healthy job in the suite: a false straggler a dozen steps after its
    window). The same lateness without a window is a straggler; one that starts after the aftermath is
    named within 10 iterations, as in a job that had no window."""
    window = range(100, 116)
    for seed in range(4):
        assert _windowed_job(late=range(122, 134), window=window, seed=seed) == []
        unannounced = _windowed_job(late=range(122, 134), window=range(0), seed=seed)
        assert {(f["category"], f["rank"]) for f in unannounced} == {("straggler", 3)}, unannounced
        after = _windowed_job(late=range(150, 190), window=window, seed=seed)
        assert {(f["category"], f["rank"]) for f in after} == {("straggler", 3)}, after
        assert 150 <= after[0]["iteration_last"] <= 160 and after[0]["status"] == "open", after[0]


def test_two_ranks_starved_together_are_no_straggler_even_when_one_is_a_hair_later_a_slow_rank_beside_them_is() -> None:
    """4 ranks on 2 cores pair up per core; the pair on the busier core arrives late together for a dozen
    iterations (two healthy real jobs, recorded: ranks 0 and 2 late by 10-50 ms at iterations 205-222, rank 2
    the later of the two 7 times in 8 by a few ms, and a false straggler). Later than each peer is not
    enough: by the margin, against each peer on its own. A rank slow of its own (3x forward) is late by the
    margin beyond its core mate too, which its extra work slows a little as well."""
    noise = JobNoise()
    rng = np.random.default_rng(5)
    late = rng.normal(size=(24, 4))
    late[-8:, [0, 2]] += rng.uniform(10.0, 50.0, size=(8, 1))  # starved together, by as much
    late[-8:, 2] = late[-8:, 0] + np.array([0.6, 0.4, -0.5, 0.3, 0.7, 0.2, 0.5, 0.4])
    assert not noise._clearly_late(late, 2) and not noise._clearly_late(late, 0)
    slow = rng.normal(size=(24, 4))
    slow[-8:, 1] += 30.0
    slow[-8:, 3] += 10.0  # its core mate
    assert noise._clearly_late(slow, 1) and not noise._clearly_late(slow, 3)


def _compute_job(jitter: float, slow: float, seed: int, iterations: int = 40) -> list[dict[str, Any]]:
    """Finding records of a 16-rank job of 4 pipeline stages (4 ranks each, one host each): stage 1's
    compute varies by +-``jitter`` per rank and step at random (sequences of varying length: a different
    rank's batch the longest each time), the others' by 2 %; from iteration 20, rank 6's GPU (stage 1) is
    ``slow`` times slower every step. Each stage's ranks wait in their all-reduce for its slowest."""
    rng = np.random.default_rng(seed)
    diff = JobDifferential("j")
    out: list[dict[str, Any]] = []
    for it in range(iterations):
        factor = rng.uniform(0.98, 1.02, size=16)
        factor[4:8] = rng.uniform(1 - jitter, 1 + jitter, size=4)
        factor[6] *= slow if it >= 20 else 1.0
        compute = 40.0 * factor
        last = compute.reshape(4, 4).max(axis=1)
        for rank in range(16):
            stage = rank // 4
            functions = [
                (f"nccl:allreduce[pg={stage + 1},<=2MiB]", _COLLECTIVE, 1, 0.3 + last[stage] - compute[rank]),
                ("dataloader.next", _PYTHON, 1, 1.0 + rng.normal(0.0, 0.05)),
                ("optimizer.step", _PYTHON, 1, 0.3),
                ("gemm", _COMPUTE, 8, compute[rank]),
            ]
            record = _record_of(rank, it, functions, iteration_ms=80.0)
            record.update(world_size=16, pp_rank=stage, dp_rank=rank % 4, tp_rank=0, host=f"h{rank}")
            record["iteration_ns"] = int((last.max() + 2.0) * 1e6)
            out += diff.add(record)
    return out + diff.flush()


def test_compute_that_varies_on_every_rank_of_a_stage_is_no_slow_gpu_one_slow_every_step_is() -> None:
    """A different rank is the slowest of its stage each step, by up to 30 %: no gpu_slow (a blind trace
    generator's 4-rank stage had two; this job had 1 to 4 in 5 of 6 seeds before the stage's noise was
    judged). A GPU slower every step is named: at once in a calm stage (25 %), within 13 iterations in the
    noisy one (50 %)."""
    for seed in range(3):
        assert _compute_job(jitter=0.15, slow=1.0, seed=seed) == []
        calm = _compute_job(jitter=0.02, slow=1.25, seed=seed)
        assert [(f["category"], f["rank"], f["iteration_first"]) for f in calm if f["status"] == "open"] == [
            ("gpu_slow", 6, 20)
        ]
        noisy = [f for f in _compute_job(jitter=0.15, slow=1.5, seed=seed) if f["status"] == "open"]
        assert [(f["category"], f["rank"]) for f in noisy] == [("gpu_slow", 6)] and noisy[0]["iteration_first"] <= 32


def _pair_job(
    late_ms: float, seed: int, iterations: int = 60, fault_at: int = 30, buckets: bool = False
) -> list[dict[str, Any]]:
    """Finding records of a dp2 x tp2 x pp2 job (the blind probe's layout: stage = rank // 4, tensor pairs
    {0, 1}, {2, 3}, data-parallel pairs {0, 2}, {1, 3}, the same one stage later) where every collective
    group is a pair. From ``fault_at``, rank 2 arrives ``late_ms`` late at each step's collectives: its
    tensor partner 3 waits for it in their 16 all-reduces, then both reach the data-parallel all-reduce
    late, where 0 and 1 wait; stage 1 waits in its recv. Every arrival jitters by 1 ms (a shared host).
    ``buckets``: each group's calls are two functions of different sizes, and the wait falls in the first
    call, which is of the smaller one (FSDP2's first all-gather of a step; a real HSDP job's pairs)."""
    rng = np.random.default_rng(seed)
    diff = JobDifferential("j")
    out: list[dict[str, Any]] = []
    for it in range(iterations):
        ready = np.zeros(8)  # when each rank can start its step's tensor-parallel all-reduces (ms)
        for stage in (0, 1):
            ranks = np.arange(4) + 4 * stage
            arrive = ready[ranks] + rng.normal(0.0, 1.0, size=4)
            if stage == 0 and it >= fault_at:
                arrive[2] += late_ms
            tp_done = np.repeat(arrive.reshape(2, 2).max(axis=1), 2)
            tp_wait = tp_done - arrive
            dp_arrive = tp_done + rng.normal(0.0, 1.0, size=4)
            dp_done = dp_arrive.reshape(2, 2).max(axis=0)[[0, 1, 0, 1]]
            dp_wait = dp_done - dp_arrive
            if stage == 0:
                ready[4:] = tp_done  # activations go on after the tensor-parallel work
            for k, rank in enumerate(ranks.tolist()):
                dp, tp = (k // 2, k % 2)
                functions = [
                    (f"nccl:allreduce[pg=tp{stage}{dp},<=2MiB]", _COLLECTIVE, 16, 16 * 0.2 + tp_wait[k]),
                    (f"nccl:allreduce[pg=dp{stage}{tp},<=64MiB]", _COLLECTIVE, 1, 5.0 + dp_wait[k]),
                    ("gemm", _COMPUTE, 32, 60.0 + rng.normal(0.0, 0.3)),
                ]
                if buckets:
                    steady = np.abs(rng.normal(0.0, 0.3, size=2))
                    functions[:2] = [
                        (f"nccl:allgather[pg=tp{stage}{dp},<=16KiB]", _COLLECTIVE, 1, 0.1 + tp_wait[k]),
                        (f"nccl:allgather[pg=tp{stage}{dp},<=2MiB]", _COLLECTIVE, 15, 15 * 0.2 + steady[0]),
                        (f"nccl:allreduce[pg=dp{stage}{tp},<=1MiB]", _COLLECTIVE, 1, 0.3 + dp_wait[k]),
                        (f"nccl:allreduce[pg=dp{stage}{tp},<=64MiB]", _COLLECTIVE, 4, 20.0 + steady[1]),
                    ]
                if stage == 0:
                    functions.append((f"nccl:send[pg=pp{dp}{tp},<=16MiB]", _COLLECTIVE, 4, 2.0))
                    functions.append(("dataloader.next", _PYTHON, 1, 3.0 + rng.normal(0.0, 0.2)))
                else:
                    functions.append((f"nccl:recv[pg=pp{dp}{tp},<=16MiB]", _COLLECTIVE, 1, 2.0 + ready[rank]))
                record = _record_of(rank, it, functions, iteration_ms=100.0 + max(late_ms, 0.0) * (it >= fault_at))
                record.update(world_size=8, pp_rank=stage, dp_rank=dp, tp_rank=tp, host=f"h{stage}")
                out += diff.add(record)
    return out + diff.flush()


def test_a_rank_late_in_every_one_of_its_collective_pairs_is_the_straggler_its_partners_are_not() -> None:
    """Where every group is a pair, one member's lateness is the other's wait, so no group alone says who
    is late; across groups it shows: rank 2 is last in its tensor pair and in its data-parallel pair, while
    each partner waits in the pair it shares with it. Named within 10 iterations of its fault, alone; a
    healthy job of the same layout has no finding in 300 iterations."""
    for seed in range(3):
        assert _pair_job(late_ms=0.0, seed=seed, iterations=300) == []
        opened = [f for f in _pair_job(late_ms=12.0, seed=seed) if f["status"] == "open"]
        assert [(f["category"], f["rank"]) for f in opened] == [("straggler", 2)], opened
        assert 30 <= opened[0]["iteration_first"] <= 40


def test_a_pairs_lateness_is_read_over_all_its_collectives_not_each_alone() -> None:
    """A group's collectives of several sizes: the partner waits at whichever call comes next after the late
    arrival (FSDP2's first all-gather of a step), and the group's other calls show nothing. A real 4-rank
    HSDP job (shard pairs, replicated over pairs) had a rank sleeping 30 ms a step named by no finding: its
    least lateness over its collectives was that of a call nobody waited at. Its lateness is that of each
    group, all of its calls summed; a healthy job of the same layout still has nothing in 300 iterations."""
    for seed in range(3):
        assert _pair_job(late_ms=0.0, seed=seed, iterations=300, buckets=True) == []
        opened = [f for f in _pair_job(late_ms=12.0, seed=seed, buckets=True) if f["status"] == "open"]
        assert [(f["category"], f["rank"]) for f in opened] == [("straggler", 2)], opened
        assert 30 <= opened[0]["iteration_first"] <= 40
        assert opened[0]["function"].endswith("<=16KiB]") or opened[0]["function"].endswith("<=1MiB]")


def test_a_slowdown_is_a_late_ranks_only_where_the_same_rank_is_late_again_and_again() -> None:
    """``late_explains``: a job slowed by 40 ms whose ranks are descheduled 25-35 ms in turn, a different one
    each iteration (a real 4-rank job sharing its cores: 25-39 ms late, once each, during a 60 ms
    regression), has no late rank to blame: its slowdown is its own. One
    rank late by 25 ms in 3 of the latest 4 iterations explains it, and so does a rank late in a pair,
    where the median of both would halve its lateness."""

    def noise_of(late: list[dict[int, float]], pair: bool = False) -> JobNoise:
        noise = JobNoise()
        for it, lateness in enumerate(late):
            ranks = (0, 1) if pair else (0, 1, 2, 3)
            wait = {r: 30.0 - lateness.get(r, 0.0) for r in ranks}  # a late rank waits less in the all-reduce
            noise.record([_record_of(r, it, [("nccl:allreduce", _COLLECTIVE, 1, wait[r])], 100.0) for r in ranks])
        return noise

    in_turn = [{0: 30.0}, {1: 25.0}, {2: 35.0}, {3: 28.0}]
    assert not noise_of(in_turn).late_explains(40e6)
    assert noise_of([{1: 25.0}, {1: 26.0}, {2: 35.0}, {1: 27.0}]).late_explains(40e6)
    assert not noise_of([{1: 25.0}, {0: 30.0}, {2: 35.0}, {1: 27.0}]).late_explains(40e6)
    assert noise_of([{1: 25.0}] * 4, pair=True).late_explains(40e6)
    assert not noise_of([{1: 15.0}] * 4, pair=True).late_explains(40e6)


def _stack_job(
    spikes: dict[tuple[int, int], tuple[str, float]], seed: int, iterations: int = 40
) -> list[dict[str, Any]]:
    """Finding records of a 4-rank CPU job whose host time is a dozen fine-grained Python functions (a trace
    with the Python stack), each 0.5 ms; ``spikes[(iteration, rank)]`` adds (function, ms) to one of them,
    which delays the rank's arrival at the all-reduce by as much."""
    rng = np.random.default_rng(seed)
    diff = JobDifferential("j")
    out: list[dict[str, Any]] = []
    names = [f"train.py({10 + i}): f{i}" for i in range(12)]
    for it in range(iterations):
        host = 0.5 + rng.normal(0.0, 0.02, size=(4, len(names)))
        for (at, rank), (name, ms) in spikes.items():
            if at == it:
                host[rank, names.index(name)] += ms
        arrival = host.sum(axis=1) + rng.normal(0.0, 0.5, size=4)
        for r in range(4):
            functions = [("nccl:allreduce[pg=0,<=2MiB]", _COLLECTIVE, 1, 4.0 + arrival.max() - arrival[r])]
            functions += [(name, _PYTHON, 1, float(ms)) for name, ms in zip(names, host[r], strict=True)]
            out += diff.add(_record_of(r, it, functions, iteration_ms=40.0))
    return out + diff.flush()


def test_chance_spikes_in_one_of_many_host_functions_are_held_to_the_others_spikes_in_any_of_them() -> None:
    """Descheduling delays whatever function runs: rank 3's four 4 ms spikes land in one function (f7) by
    chance, the other ranks' (6 to 13 ms) in other ones. Held to the others' spikes in that function alone
    (none), they came back (an intermittent fault): a host_slow finding on a healthy job, as on a real
    4-rank trace with the Python stack. Held to the others' largest in any function, they are contention.
    A rank whose f7 takes 20 ms more every third iteration, beyond any spike of the others, still is."""
    f7 = "train.py(17): f7"
    chance = {(it, 3): (f7, 4.0 + 0.3 * k) for k, it in enumerate((9, 14, 17, 20))}
    chance |= {(6, 0): ("train.py(12): f2", 13.0), (11, 1): ("train.py(14): f4", 9.0)}
    chance |= {(15, 2): ("train.py(19): f9", 11.0), (23, 0): ("train.py(11): f1", 6.0)}
    for seed in range(3):
        assert [f for f in _stack_job(chance, seed) if f["category"] == "host_slow"] == [], seed
        fault = chance | {(it, 2): (f7, 20.0) for it in range(24, 40, 3)}
        opened = [f for f in _stack_job(fault, seed) if f["status"] == "open"]
        assert [(f["category"], f["rank"], f["function"]) for f in opened] == [("host_slow", 2, f7)], seed


def _trace_job(
    spikes: dict[int, tuple[str, float]], kernels: bool, seed: int, iterations: int = 24
) -> list[dict[str, Any]]:
    """Finding records of a 4-rank trace judged from its first iteration (``analyze``: no warm-up), whose
    ranks arrive at the all-reduce with 3 ms of jitter (CPUs shared) or 0.2 ms (GPUs); rank 0's host
    functions take ``spikes[iteration]`` more. ``kernels``: every rank runs a 10 ms compute kernel."""
    rng = np.random.default_rng(seed)
    config = DifferentialConfig(noise=NoiseConfig(warmup_iterations=0))
    diff = JobDifferential("j", config)
    out: list[dict[str, Any]] = []
    names = ("DistributedDataParallel.forward", "Optimizer.zero_grad#SGD.zero_grad", "Optimizer.step#SGD.step")
    for it in range(iterations):
        host = np.array([[1.5, 0.05, 0.3]] * 4) + rng.normal(0.0, 0.01, size=(4, 3))
        if it in spikes:
            host[0, names.index(spikes[it][0])] += spikes[it][1]
        arrival = host.sum(axis=1) + rng.normal(0.0, 0.2 if kernels else 3.0, size=4)
        for r in range(4):
            functions = [("nccl:allreduce[pg=0,<=2MiB]", _COLLECTIVE, 1, 4.0 + arrival.max() - arrival[r])]
            functions += [(name, _PYTHON, 1, float(ms)) for name, ms in zip(names, host[r], strict=True)]
            functions += [("gemm", _COMPUTE, 1, 10.0)] if kernels else []
            out += diff.add(_record_of(r, it, functions, iteration_ms=25.0))
    return out + diff.flush()


def test_a_cpu_traces_first_chance_spikes_before_its_noise_is_known_are_no_finding_a_gpu_traces_slow_host_is() -> None:
    """A real 4-rank gloo trace: rank 0 descheduled in three of its first four iterations, each time in
    another function, and late by more than the budget then, as any rank of a CPU job often is. Before
    the noise is known, a CPU job's lateness is no cost to go by: no finding. A GPU job's rank whose host
    adds 4 ms from the trace's first iteration costs its peers that wait, and is named within its first
    iterations as before. Seen on real 4-rank gloo traces judged from their first iteration: a rank's
    first three chance spikes, in three functions, were a host_slow finding in 3 of 13 healthy traces."""
    chance = {0: ("DistributedDataParallel.forward", 2.8), 1: ("DistributedDataParallel.forward", 0.6)}
    chance |= {2: ("Optimizer.zero_grad#SGD.zero_grad", 3.7), 3: ("DistributedDataParallel.forward", 1.8)}
    for seed in range(4):
        assert [f for f in _trace_job(chance, kernels=False, seed=seed) if f["category"] == "host_slow"] == [], seed
        slow = {it: ("DistributedDataParallel.forward", 4.0) for it in range(24)}
        opened = [f for f in _trace_job(slow, kernels=True, seed=seed) if f["status"] == "open"]
        assert [(f["category"], f["rank"]) for f in opened] == [("host_slow", 0)], seed
        assert opened[0]["iteration_last"] <= 4, opened


def _f7_spikes_stand_out(
    spikes: dict[tuple[int, int], float], iterations: int = 24, steady: float = 0.0, jitter: float = 0.01
) -> bool:
    """Whether rank 3's latest f7 time stands out of a 4-rank job's noise, f7 taking 0.5 ms (rank 3: plus
    ``steady``), jittering by ``jitter`` ms, plus ``spikes[(iteration, rank)]`` (a rank descheduled while in
    it)."""
    rng = np.random.default_rng(0)
    noise = JobNoise(NoiseConfig(warmup_iterations=0))
    f7 = "train.py(17): f7"
    for it in range(iterations):
        times = {r: 0.5 + (r == 3) * steady + rng.normal(0.0, jitter) + spikes.get((it, r), 0.0) for r in range(4)}
        noise.record([_record_of(r, it, [(f7, _PYTHON, 1, ms)], iteration_ms=40.0) for r, ms in times.items()])
    value = (0.5 + steady + spikes.get((iterations - 1, 3), 0.0)) * 1e6
    sig = RankSignal(rank=3, host="h", category="host_slow", function=f7, metric="self_ns", value=value,
                     peer_median=0.5e6, score=10.0, loss_ns=value - 0.5e6)  # fmt: skip
    return bool(noise.stands_out(sig))


def test_under_contention_a_ranks_largest_spikes_twice_are_chance_three_times_and_more_a_fault() -> None:
    """Every rank is descheduled now and then while in f7, by up to 4 ms; rank 3's spikes happen to reach 5.5
    and 6.6 ms (as one rank's of a real 4-rank trace whose fourth rank slept, leaving three to share two
    cores). Of four ranks' alike spikes, one rank's two largest are its own one time in 16: twice above the
    others' largest is chance. Three times is one in 64, and an intermittent fault comes back more often
    still. With no spike on the others, twice is enough, as before."""
    others = {(3, 0): 4.0, (9, 1): 3.6, (15, 2): 3.8, (20, 0): 2.9}
    assert not _f7_spikes_stand_out(others | {(18, 3): 5.5, (23, 3): 6.6})
    assert _f7_spikes_stand_out(others | {(13, 3): 5.1, (18, 3): 5.5, (23, 3): 6.6})
    assert _f7_spikes_stand_out(others | {(it, 3): 12.0 for it in range(14, 24, 3)})
    assert _f7_spikes_stand_out({(18, 3): 5.5, (23, 3): 6.6})


def test_a_ranks_steady_microseconds_more_do_not_vouch_for_a_spike_a_steady_fault_carrying_half_of_it_does() -> None:
    """Rank 3 spends a steady 14 µs more in f7 than its peers, 7 times their 2 µs jitter (a real healthy
    4-rank trace under another process's load: rank 2 in ``ones_like``), and is then descheduled there for
    6.8 ms once: its usual excess is no fault of the spike's size, and a single spike is chance. A steady
    4 ms excess, topped up by 2 ms of chance in this iteration, and work only rank 3 does, stand out."""
    last = {(23, 3): 6.8}
    assert not _f7_spikes_stand_out(last, steady=0.014, jitter=0.002)
    assert _f7_spikes_stand_out({(23, 3): 2.0}, steady=4.0, jitter=0.002)
    own = {(it, r): -0.5 for it in range(24) for r in range(3)}  # the peers never run f7
    assert _f7_spikes_stand_out(own | last, steady=0.014, jitter=0.0)


def _checkpoint_job(slow_from: int, seed: int, iterations: int = 200) -> list[dict[str, Any]]:
    """Finding records of a 4-rank job that all-reduces its gradients every iteration and a logged loss every
    10th; rank 0 saves a checkpoint (150 ms) before the logging all-reduce every 20th, so the others wait
    for it there, and comes to it 5 ms after its peers otherwise (it logs the loss). From ``slow_from``
    rank 1 arrives 12 ms late at both all-reduces, every iteration."""
    rng = np.random.default_rng(seed)
    diff = JobDifferential("j")
    out: list[dict[str, Any]] = []
    for it in range(iterations):
        grads = rng.normal(0.0, 2.0, size=4)
        logged = rng.normal(0.0, 2.0, size=4)
        logged[0] += 150.0 if it % 20 == 19 else 5.0
        if it >= slow_from:
            grads[1] += 12.0
            logged[1] += 12.0
        for r in range(4):
            functions = [("nccl:allreduce[pg=0,<=2MiB]", _COLLECTIVE, 1, 4.0 + grads.max() - grads[r])]
            if it % 10 == 9:
                functions += [("nccl:allreduce[pg=0,<=4B]", _COLLECTIVE, 1, 0.5 + logged.max() - logged[r])]
            functions += [("dataloader.next", _PYTHON, 1, 9.0)]
            out += diff.add(_record_of(r, it, functions, iteration_ms=80.0))
    return out + diff.flush()


def test_a_rank_that_checkpoints_every_20_steps_before_a_sparse_all_reduce_is_no_straggler_a_slow_rank_is() -> None:
    """Rank 0 pauses 150 ms every 20th iteration just before an all-reduce that runs every 10th (a real
    healthy 4-rank job logging its loss): in that all-reduce's own history it is behind every peer in every
    other entry, as if late each time, and was named a straggler. A collective run in fewer than half the
    iterations says nothing of a rank's history. A rank late at every all-reduce, every iteration, is
    named as before, at the one every iteration runs."""
    for seed in range(3):
        assert [f for f in _checkpoint_job(slow_from=10**6, seed=seed) if f["category"] == "straggler"] == [], seed
        opened = [f for f in _checkpoint_job(slow_from=100, seed=seed) if f["status"] == "open"]
        assert [(f["category"], f["rank"]) for f in opened] == [("straggler", 1)], seed
        assert 100 <= opened[0]["iteration_last"] <= 110, opened


def test_a_sign_test_that_chance_would_pass_is_refused_at_configuration() -> None:
    """A quarter of misses or more lets healthy ranks taking turns pass; a window longer than the history
    could never be read."""
    for bad in ({"sign_iterations": 12, "sign_misses": 3}, {"sign_iterations": 30}):
        with pytest.raises(ValueError, match="sign_misses < sign_iterations / 4"):
            NoiseConfig(**bad)
    assert NoiseConfig(sign_iterations=24, sign_misses=5).sign_misses == 5


def _pipeline_job(
    seed: int,
    *,
    starved_ms: float = 0.0,
    slow_forward_ms: float = 0.0,
    iterations: int = 60,
    fault_at: int = 30,
    measured: bool = True,
) -> list[dict[str, Any]]:
    """Finding records of a dp2 x pp2 job by hand, as a real one on 2 shared cores runs (the real-job test's
    pipeline): data pairs {0, 1}, {2, 3}; rank k of stage 0 sends its activations to rank k + 2, which sends
    its gradients back; each stage's pair all-reduces. Run-queue waits are measured; rank 2's sends take
    12 ms longer than rank 3's (which core each pair shares: the real job's sends differed so). From
    ``fault_at``: ``starved_ms``, rank 1 waits that much longer for a CPU before its backward (its host's
    contention, its core mate busy); ``slow_forward_ms``, rank 1's forward computes that much longer, and
    rank 3 waits for its activations."""
    rng = np.random.default_rng(seed)
    diff = JobDifferential("j")
    out: list[dict[str, Any]] = []
    for it in range(iterations):
        on = it >= fault_at
        jit = rng.normal(0.0, 1.0, size=(8, 4))
        sent = 20.0 + jit[:2, 0] + np.array([0.0, slow_forward_ms if on else 0.0])  # stage 0's activations out
        grads = sent + 30.0 + jit[2:4, 0]  # stage 1: received, computed, sent back
        starved = np.array([0.0, starved_ms if on else 0.0])
        waits = np.concatenate([5.0 + np.abs(jit[:2, 1]) + starved, 5.0 + np.abs(jit[2:4, 1])])
        arrive = np.concatenate([grads + 20.0 + jit[:2, 2] + starved, grads + 5.0 + jit[2:4, 2]])
        done = np.repeat(arrive.reshape(2, 2).max(axis=1), 2)
        sends = np.array([1.0, 1.0, 13.0, 1.0]) + np.abs(jit[:4, 3])
        recvs = np.concatenate([grads - sent, sent])
        for rank in range(4):
            stage = rank // 2
            functions = [
                (f"nccl:allreduce[pg=d{stage},<=4MiB]", _COLLECTIVE, 1, done[rank] - arrive[rank] + 2.0),
                ("nccl:send[pg=0,<=128KiB]", _COLLECTIVE, 4, sends[rank]),
                ("nccl:recv[pg=0,<=128KiB]", _COLLECTIVE, 4, recvs[rank]),
                ("dataloader.next", _PYTHON, 1, 4.0 + abs(jit[rank, 3])),
            ]
            record = _record_of(rank, it, functions, iteration_ms=float(done.max()) + 5.0)
            record.update(world_size=4, pp_rank=stage, dp_rank=rank % 2, tp_rank=0, host="h")
            out += diff.add(record | ({"cpu_wait_ns": int(waits[rank] * 1e6)} if measured else {}))
    return out + diff.flush()


def test_in_a_pipeline_a_rank_on_shared_cores_is_no_one_pair_straggler_a_traces_slow_forward_is() -> None:
    """A rank with one pair partner (dp2 x pp) is the straggler where it is late in its pair and did not wait
    in its pipeline send/recv. Live, on shared cores (run-queue waits measured), the scheduler decides who is
    late in a pair: a healthy real pipeline by hand had rank 1, its core mate running, named at step 209,
    and with its wait for a CPU taken off, another healthy run had rank 0 named at 67. So where waits are
    measured, no one-pair straggler: neither a rank starved of a CPU nor one whose forward is slower. Where
    they are not (traces, GPU-side times), the slow forward is rank 1's, within 10 steps, and its next
    stage's rank, which waited for it, is not named."""
    for seed in range(3):
        assert _pipeline_job(seed, iterations=200) == []
        for job in (_pipeline_job(seed, starved_ms=15.0), _pipeline_job(seed, slow_forward_ms=15.0)):
            assert [f for f in job if f["status"] == "open" and f["category"] == "straggler"] == [], job
        assert _pipeline_job(seed, iterations=200, measured=False) == []
        opened = [f for f in _pipeline_job(seed, slow_forward_ms=15.0, measured=False) if f["status"] == "open"]
        assert [(f["category"], f["rank"]) for f in opened] == [("straggler", 1)], opened
        assert 30 <= opened[0]["iteration_first"] <= 40


def test_a_late_rank_that_waited_in_its_pipeline_more_than_another_late_one_is_held_up_by_it() -> None:
    """The real pipeline job's figures, (lateness in its pair, wait in send/recv above its partner's), ms:
    rank 1 computing 4x, late by 15 and waiting 15 less than its partner; rank 3, waiting for its activations,
    late by 19 and waiting 10 more in its receives (its sends took less). Rank 3 alone passed the tests at
    step 66 and was named; it is rank 1's symptom, whether or not rank 1 passed them then."""
    piped = {1: (15.3, -15.0), 3: (18.7, 10.0)}
    assert _held_up_by(3, piped) and not _held_up_by(1, piped)
    assert not _held_up_by(3, {1: (5.0, -15.0), 3: (18.7, 10.0)})  # late by less than half: no culprit of it
    assert not _held_up_by(3, {1: (15.3, 12.0), 3: (18.7, 10.0)})  # it waited more: no culprit of it either


def test_the_noise_history_keeps_arrays_and_a_state_from_before_with_dicts_continues_alike() -> None:
    """Each recorded iteration keeps every function's values as two arrays (a dict per entry cost ~100 bytes a
    rank); a job restored from a state record written with dicts finds, from there on, what it would have."""
    from fleetscope.producers import SimulatorConfig, parse_fault, simulate
    from fleetscope.streams.analysis.noise import RankValues, _as_matrix
    from fleetscope.streams.offline import OfflinePipeline

    cfg = SimulatorConfig(job="hist", ranks=8, iterations=24, seed=2, faults=(parse_fault("host_slow:3:1.5@8"),))
    pipeline = OfflinePipeline(keep_patterns=True).add_all(simulate(cfg))
    pipeline.finish()
    records = pipeline.patterns
    current, older = JobDifferential("hist"), JobDifferential("hist")
    cut = len(records) // 3
    for rec in records[:cut]:
        current.add(rec)
        older.add(rec)
    series = older._noise._series
    assert series and all(isinstance(e, RankValues) for s in series.values() for e in s)
    for entries in series.values():  # as older code wrote it: a dict of each rank's value
        arrays = list(entries)
        entries.clear()
        entries.extend({r: v for r, v in zip(e.ranks.tolist(), e.values.tolist(), strict=True)} for e in arrays)
    a = [u for rec in records[cut:] for u in current.add(rec)] + current.flush()
    b = [u for rec in records[cut:] for u in older.add(rec)] + older.flush()
    assert any(u["category"] == "host_slow" and u["rank"] == 3 for u in a)
    strip = [{k: v for k, v in u.items() if k != "emitted_ns"} for u in a]
    assert strip == [{k: v for k, v in u.items() if k != "emitted_ns"} for u in b]
    mixed = [{5: 1.0, 2: 2.0}, RankValues(np.array([2, 7]), np.array([3.0, 4.0]))]
    x, ranks = _as_matrix(mixed)
    assert ranks == [2, 5, 7] and np.array_equal(x, [[2.0, 1.0, np.nan], [3.0, np.nan, 4.0]], equal_nan=True)
