"""Scale of the differential stage and of the windower's state: seconds and memory versus ranks.

    python bench/scale.py [--ranks 64,256,1024,4096,10240] [--functions 300] [--repeat 3] [--interleave]
    python bench/scale.py --replay-only [--replay-ranks 10240] [--profile-top 15]

1. Differential: synthetic pattern records for one iteration of a job with R ranks x F functions per
   rank (same names on every rank, as decoded from Avro: fresh strings and plain lists), a realistic
   mix of compute kernels, host functions and collectives with link features, and one injected slow
   rank (its GPU 1.3x slow: longer compute kernels, shorter collectives). Like the windower, a record
   lists kernels, then collectives, then host functions, each group in an order that differs by rank
   (odd ranks shuffle it); ``--interleave`` shuffles odd ranks' whole lists instead. Measured:
   ``cold``, ``score_iteration(records)`` of a job's first iteration (every name interned afresh);
   ``warm``, the same for its next iteration (fresh records, the job's ``FunctionIndex`` from the
   first): the steady state, median and least of ``--repeat`` runs; ``gather``, the warm matrix
   build inside it; the peak memory of cold scoring (tracemalloc); ``add``, ``JobDifferential.add``
   of every record of the next iteration after the first was scored (the last one triggers
   scoring); the warm cost per rank; and whether the slow rank is found (cold and warm) at every size.
2. Sharded differential (``--shards``, at the largest ``--ranks``): the functions split N ways
   (``shards.split_records``; each shard's records pickled and read back, as a shard would decode its
   own message), then each shard's column phase (``outliers.score_columns``) and the merge
   (``outliers.merge_columns``) timed apart in CPU seconds, steady state (each shard's index warm);
   the signals checked equal to unsharded scoring; the split's cost (the windower's side) printed
   apart; and what a 100k-GPU job needs: shard cores and merge cores at one iteration per second.
3. Windower: a simulated job fed rank by rank into ``RankWindower``; the cost per rank-iteration, and
   the state memory per rank after N open steps (one declared stream withheld so no step closes).
4. Replay (``--replay-ranks``): the call graph (cold, and warm: the job's previous graph given), the replay
   and the what-if of one iteration of a dp x pp8 GPipe job with 24 microbatches (~100 calls per rank), CPU
   and wall seconds, best of ``--repeat`` (issue 39: 10,240 ranks in <= 1 s); ``--profile-top N``: the cProfile
   top N by own time of the cold graph and of the what-if.

Not a test: figures depend on the machine and its load. Targets (issue 5): 10,240 ranks x 300
functions in < 1 s and < 2 GB, cost per rank flat (no worse than linear in ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import pickle
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict
from typing import TypeVar

import numpy as np

from fleetscope.producers import SimulatorConfig, simulate
from fleetscope.schemas import EventKind, FunctionKind, decode, encode
from fleetscope.streams.analysis.differential import DifferentialConfig, JobDifferential
from fleetscope.streams.analysis.outliers import (
    ScoringConfig,
    gather_matrices,
    merge_columns,
    score_columns,
    score_iteration,
)
from fleetscope.streams.analysis.peermatrix import FunctionIndex
from fleetscope.streams.analysis.shards import split_records
from fleetscope.streams.analysis.signals import robust_z
from fleetscope.streams.analysis.windowing import RankWindower, summarize_closed
from fleetscope.streams.differential import DifferentialStage
from fleetscope.streams.scoring import ScoringPool

SLOW_FACTOR = 1.3
ITERATION_NS = 400e6


def function_mix(f: int) -> tuple[list[str], np.ndarray]:
    """F function names and kinds: ~75 % compute kernels, ~15 % collectives, ~10 % host functions."""
    n_coll = max(1, f * 15 // 100)
    n_host = max(1, f // 10)
    n_comp = f - n_coll - n_host
    names = [f"ampere_bf16_s16816gemm_bf16_{i}x128_ldg8_f2f_tn" for i in range(n_comp)]
    names += [f"nccl:allreduce[pg={i % 4},<={1 << (i // 4)}MiB]" for i in range(n_coll)]  # one per (pg, size)
    names += [f"module.layer{i}.forward" for i in range(n_host)]
    kinds = np.array(
        [FunctionKind.COMPUTE] * n_comp + [FunctionKind.COLLECTIVE] * n_coll + [FunctionKind.PYTHON] * n_host,
        dtype=np.int64,
    )
    return names, kinds


def make_records(
    ranks: int, f: int, slow_rank: int, seed: int = 0, iteration: int = 0, interleave: bool = False
) -> list[dict[str, object]]:
    """One iteration's pattern records of ``ranks`` ranks (the windower's output shape, as lists).

    The same ``seed`` gives the same values and orders, in new objects, for any ``iteration``.
    """
    rng = np.random.default_rng(seed)
    names, kinds = function_mix(f)
    comp, coll, host = (kinds == k for k in (FunctionKind.COMPUTE, FunctionKind.COLLECTIVE, FunctionKind.PYTHON))
    calls = rng.integers(1, 8, f).astype(np.float64)
    base = np.where(comp, rng.uniform(0.05e6, 1e6, f), np.where(coll, rng.uniform(0.2e6, 3e6, f), 1e5))
    base = base * (ITERATION_NS * 0.8) / float((base * calls).sum())  # the functions fill ~80 % of it
    noise = rng.lognormal(0.0, 0.02, (ranks, f))
    mean = base * noise
    mean[slow_rank, comp] *= SLOW_FACTOR
    mean[slow_rank, coll] *= 0.7  # it arrives last: it waits least
    peak = np.where(coll, 25e9, np.nan) * rng.lognormal(0.0, 0.01, (ranks, f))
    act = peak * 0.8
    cv = np.where(coll, 0.3, np.nan) * rng.lognormal(0.0, 0.05, (ranks, f))
    pcie_peak = np.where(coll, 20e9, np.nan) * rng.lognormal(0.0, 0.01, (ranks, f))
    nbytes = np.where(coll, rng.integers(1, 64, f) << 20, 0)  # a collective's message size
    records = []
    blocks = [np.flatnonzero(kinds == k) for k in (FunctionKind.COMPUTE, FunctionKind.COLLECTIVE, FunctionKind.PYTHON)]
    for r in range(ranks):
        if r % 2 == 0:
            order = np.arange(f)
        elif interleave:
            order = rng.permutation(f)
        else:  # each kind's functions together, in an order of their own (the windower's first-seen order)
            order = np.concatenate([rng.permutation(b) for b in blocks])
        m = mean[r, order]
        records.append(
            {
                "job": "scale", "rank": r, "host": f"node{r // 8:05d}", "world_size": ranks,
                "tp_rank": -1, "pp_rank": -1, "dp_rank": r, "iteration": iteration,
                "iteration_start_ns": 0, "iteration_ns": int(ITERATION_NS * (1.0 + 0.001 * rng.standard_normal())),
                "function": [names[j].encode().decode() for j in order],  # fresh strings, as decoded
                "kind": kinds[order].tolist(),
                "calls": calls[order].astype(np.int64).tolist(),
                "total_ns": (m * calls[order]).astype(np.int64).tolist(),
                "self_ns": (m * calls[order]).astype(np.int64).tolist(),  # no nesting: self time is all of it
                "mean_ns": m.tolist(),
                "max_ns": m.astype(np.int64).tolist(),  # every call alike: the longest is the mean
                "nbytes": nbytes[order].tolist(),
                "nvlink_peak_bps": peak[r, order].tolist(),
                "nvlink_mean_bps": act[r, order].tolist(),
                "nvlink_cv": cv[r, order].tolist(),
                "pcie_peak_bps": pcie_peak[r, order].tolist(),
                "pcie_mean_bps": (pcie_peak[r, order] * 0.8).tolist(),
                "pcie_cv": cv[r, order].tolist(),
            }
        )  # fmt: skip
    return records


CPU_S: list[float] = []
"""The CPU seconds of each ``timed`` call's runs (median), in call order: what a core sustains does not
depend on how many other processes share the machine, where wall time does."""


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, float, object]:
    """Median and least seconds of ``repeat`` runs (the least is the one other load disturbed least),
    and the last result; the median CPU seconds go to ``CPU_S``."""
    times, cpu, out = [], [], None
    for _ in range(repeat):
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    CPU_S.append(statistics.median(cpu))
    return statistics.median(times), min(times), out


def peak_mib(fn: Callable[[], object]) -> float:
    """Peak memory allocated while ``fn`` runs (tracemalloc; numpy arrays included), MiB."""
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return (peak - base) / 2**20


def add_next(first: list[dict[str, object]], second: list[dict[str, object]]) -> Callable[[], JobDifferential]:
    """A job that has scored ``first``; the returned call adds every record of ``second`` (the last scores it)."""
    jd = JobDifferential("scale")
    for rec in first:
        jd.add(rec)

    def run() -> JobDifferential:
        for rec in second:
            jd.add(rec)
        return jd

    return run


def bench_differential(sizes: list[int], f: int, repeat: int, interleave: bool) -> bool:
    order = "each rank's list shuffled" if interleave else "kinds grouped, shuffled within"
    print(f"differential: one iteration, F = {f} functions per rank ({order}), slow rank's GPU {SLOW_FACTOR}x")
    print(
        f"{'ranks':>6} {'input MiB':>9} {'cold s':>7} {'warm s':>7} {'(least)':>7} {'warm CPU':>8} "
        f"{'gather s':>8} {'gather %':>8} "
        f"{'peak MiB':>8} {'us/rank':>8} {'add s':>7} {'found':>5}"
    )
    all_found = True
    sustained: list[tuple[int, float]] = []
    for ranks in sizes:
        slow = ranks * 7 // 10 + 3
        gc.collect()
        tracemalloc.start()
        first = make_records(ranks, f, slow, interleave=interleave)
        input_mib = tracemalloc.get_traced_memory()[0] / 2**20
        tracemalloc.stop()
        second = make_records(ranks, f, slow, iteration=1, interleave=interleave)
        t_cold, _, cold = timed(lambda first=first: score_iteration(first), repeat)
        index = FunctionIndex()
        score_iteration(first, index=index)
        t_warm, least, warm = timed(lambda second=second, index=index: score_iteration(second, index=index), repeat)
        cpu_warm = CPU_S[-1]
        t_gather, _, _ = timed(lambda second=second, index=index: gather_matrices(second, index), repeat)
        peak = peak_mib(lambda first=first: score_iteration(first))
        _, t_add, jd = timed(add_next(first, second), 1)
        # A finding opens after several iterations (lifecycle); one iteration yields the signal.
        found = jd.iterations_scored == 2 and all(
            any(s.category == "gpu_slow" and slow in s.member_ranks() for s in signals) for signals in (cold, warm)
        )
        others = {s.rank for s in warm} - {slow}
        all_found &= found
        sustained.append((ranks, cpu_warm))
        print(
            f"{ranks:>6} {input_mib:>9.0f} {t_cold:>7.3f} {t_warm:>7.3f} {least:>7.3f} {cpu_warm:>8.3f} "
            f"{t_gather:>8.3f} "
            f"{100 * t_gather / t_warm:>7.0f}% {peak:>8.0f} {1e6 * t_warm / ranks:>8.1f} {t_add:>7.3f} "
            f"{'yes' if found else 'NO':>5}" + (f"  (also flagged: {sorted(others)[:5]})" if others else "")
        )
        del first, second, cold, warm, jd
    # One core scores one job's iterations in sequence (the job's state is one partition's): its sustained rate,
    # from the CPU seconds of the warm runs (wall time above also counts other processes on this machine).
    print(f"\nsustained, one differential core (steady-state scoring, per CPU second; F = {f}):")
    for ranks, t_warm in sustained:
        print(
            f"  {ranks:>6} ranks: {ranks / t_warm:>9,.0f} rank-iterations/s, {ranks * f / t_warm / 1e6:6.2f} M "
            f"rank-functions/s, {1 / t_warm:6.2f} iterations/s of one job"
        )
    ranks, t_warm = sustained[-1]
    for gpus, per_s in ((100_000, 1.0), (100_000, 0.5)):
        need = gpus * t_warm / ranks * per_s
        print(
            f"  a {gpus:,}-GPU job at {per_s:g} iteration/s needs {need:.1f} differential cores at this rate"
            + (": more than one, so it must be sharded (by function)" if need > 1 else "")
        )
    return all_found


def cpu_s(fn: Callable[[], object]) -> tuple[float, object]:
    """CPU seconds of one call, and its result."""
    c0 = time.process_time()
    out = fn()
    return time.process_time() - c0, out


def bench_shards(ranks: int, f: int, counts: list[int], repeat: int, interleave: bool) -> bool:
    """Each shard's column phase and the merge, CPU seconds, steady state; signals equal to unsharded."""
    slow = ranks * 7 // 10 + 3
    first = make_records(ranks, f, slow, interleave=interleave)
    second = make_records(ranks, f, slow, iteration=1, interleave=interleave)
    cfg = ScoringConfig()
    scorer = robust_z(cfg)
    index = FunctionIndex()
    score_iteration(first, cfg, scorer, index)
    want = [asdict(s) for s in score_iteration(second, cfg, scorer, index)]
    print(f"\nsharded differential: {ranks:,} ranks x {f} functions, CPU s per iteration (steady, median of {repeat})")
    print(
        f"{'shards':>6} {'split':>6} {'shard max':>9} {'shard sum':>9} {'merge':>6} {'total':>6} "
        f"{'rank-it/CPU s':>13} {'it/s, one core each':>19} {'same':>5}"
    )
    same = True
    rows: list[tuple[int, float, float, float]] = []
    for n in counts:
        t_split, _ = cpu_s(lambda n=n: split_records(second, n))
        decoded = [pickle.loads(pickle.dumps(split_records(recs, n))) for recs in (first, second)]
        indexes = [FunctionIndex() for _ in range(n)]
        for k, sub in enumerate(decoded[0]):
            score_columns(sub, cfg, scorer, indexes[k])
        shard_runs: list[list[float]] = [[] for _ in range(n)]
        merges: list[float] = []
        got: list[object] = []
        for _ in range(repeat):
            gc.collect()
            parts = []
            for k, sub in enumerate(decoded[1]):
                t, part = cpu_s(lambda sub=sub, ix=indexes[k]: score_columns(sub, cfg, scorer, ix))
                shard_runs[k].append(t)
                parts.append(part)
            t, got = cpu_s(lambda parts=parts: merge_columns(parts, second, cfg, scorer))
            merges.append(t)
        shard = [statistics.median(ts) for ts in shard_runs]
        merge = statistics.median(merges)
        ok = [asdict(s) for s in got] == want
        same &= ok
        total = sum(shard) + merge
        rows.append((n, max(shard), sum(shard), merge))
        print(
            f"{n:>6} {t_split if n > 1 else 0.0:>6.2f} {max(shard):>9.3f} {sum(shard):>9.3f} {merge:>6.3f} "
            f"{total:>6.3f} {ranks / total:>13,.0f} {1 / max(max(shard), merge):>19.2f} {'yes' if ok else 'NO':>5}"
        )
    gpus = 100_000
    scale = gpus / ranks
    print(f"  a {gpus:,}-GPU job at 1 iteration/s (CPU s scaled by ranks, x{scale:.1f}), in cores:")
    for n, most, summed, merge in rows:
        largest = max(most, merge) * scale
        print(
            f"    {n} shard(s): {(summed + merge) * scale:5.1f} cores in all (shards {summed * scale:5.1f}, "
            f"merge {merge * scale:4.1f}); the busiest process {largest:4.1f} cores: "
            + ("fits" if largest <= 1 else f"one job at most {1 / largest:.2f} iterations/s")
        )
    print("  (split: the windower's cost of cutting records by shard here, in Python; not counted above)")
    return same


def bench_windower(ranks: int, iterations: int, open_steps: int) -> None:
    cfg = SimulatorConfig(job="wscale", ranks=ranks, iterations=iterations, seed=1)
    batches = list(simulate(cfg))
    events = sum(len(b) for b in batches)
    per_rank: dict[int, list[object]] = {}
    for b in batches:
        per_rank.setdefault(b.header.rank, []).append(b)
    gc.collect()
    t0 = time.perf_counter()
    closed = 0
    for rank_batches in per_rank.values():
        w = RankWindower()
        for items in [*(w.add(b, 0) for b in rank_batches), w.flush()]:
            summarize_closed(items)  # what each batch closed, summarized together (as the worker would)
            closed += len(items)
    secs = time.perf_counter() - t0
    rank_its = ranks * iterations
    print(
        f"\nwindower: {ranks} ranks x {iterations} iterations, {events / rank_its:.0f} events per rank-iteration, "
        f"{closed} rank-iterations closed"
    )
    print(
        f"  {1e3 * secs / rank_its:.2f} ms per rank-iteration ({events / secs:,.0f} events/s on one core, "
        f"{1e6 * secs / events:.2f} us/event)"
    )
    # State of one rank with N steps open: withhold its collectives (declared) so no step closes.
    rank0 = [b for b in per_rank[0] if b.kind is not EventKind.COLLECTIVES]
    gc.collect()
    tracemalloc.start()
    w = RankWindower()
    base = tracemalloc.get_traced_memory()[0]
    sizes: dict[int, float] = {}
    for b in rank0:
        w.add(b, 0)
        n = len(w._steps)
        sizes[n] = (tracemalloc.get_traced_memory()[0] - base) / 2**20
    tracemalloc.stop()
    n = min(open_steps, max(sizes))
    per_step = sizes[n] / max(n, 1)
    print(
        f"  state of one rank with {n} open steps: {sizes[n]:.2f} MiB ({1024 * per_step:.0f} KiB per open step); "
        f"x 10,240 ranks at 2 open steps: {2 * per_step * 10240 / 1024:.1f} GiB"
    )


def encodable(record: dict[str, object]) -> dict[str, object]:
    """``record`` with every field the pattern schema has (those ``make_records`` leaves out: as the windower
    fills them for a function whose calls all took the same time, with no link samples)."""
    n, mean = len(record["function"]), record["mean_ns"]
    filled = {
        "p50_ns": mean, "p99_ns": mean, "cv": [0.0] * n, "algbw_gbps": [0.0] * n, "busbw_gbps": [0.0] * n,
        "share": [t / record["iteration_ns"] for t in record["total_ns"]],
        "profiled": False, "local_rank": record["rank"] % 8, "gpu_uuid": f"GPU-{record['rank']:08d}", "cpu_wait_ns": -1,
    }  # fmt: skip
    return {**filled, **record}


def bench_messages(ranks: int, f: int, repeat: int, interleave: bool) -> bool:
    """The differential from its input, the pattern messages: decoding each (fastavro, the reference, and the
    numpy decoder that ``decode`` uses) and the whole stage (decode, add, score), CPU s per iteration."""
    slow = ranks * 7 // 10 + 3
    first, second = (
        [encode("patterns", encodable(r)) for r in make_records(ranks, f, slow, iteration=i, interleave=interleave)]
        for i in (0, 1)
    )
    mib = sum(map(len, second)) / 2**20
    print(
        f"\ndifferential from its messages: {ranks:,} ranks x {f} functions, one iteration = {mib:.0f} MiB of records"
    )
    print(f"{'step':<44} {'CPU s':>7} {'us/rank':>8} {'rank-it/CPU s':>13}")
    rows: dict[str, float] = {}
    steps: dict[str, Callable[[], object]] = {
        "decode, fastavro (before 2026-11-29)": lambda: [decode(m, fast=False) for m in second],
        "decode, numpy (decode())": lambda: [decode(m) for m in second],
    }
    for name, fn in steps.items():
        fn()  # warm: each process decodes a rank's names once
        runs = [cpu_s(fn)[0] for _ in range(repeat)]
        rows[name] = statistics.median(runs)
    found = True
    for fast in (False, True):
        runs = []
        for _ in range(repeat):
            stage = DifferentialStage()
            for m in first:
                stage.apply(*decode(m, fast=fast), None)
            t, taken = cpu_s(lambda stage=stage, fast=fast: [stage.apply(*decode(m, fast=fast), None) for m in second])
            runs.append(t)
            found &= stage.jobs["scale"].iterations_scored == 2 and not any(x.reason for x in taken)
        rows[f"whole stage (decode + add + score), {'numpy' if fast else 'fastavro'}"] = statistics.median(runs)
    for name, t in rows.items():
        print(f"{name:<44} {t:>7.3f} {1e6 * t / ranks:>8.0f} {ranks / t:>13,.0f}")
    whole = rows["whole stage (decode + add + score), numpy"]
    print(
        f"  a 100,000-GPU job at 1 iteration/s needs {100_000 * whole / ranks:.1f} differential cores at the whole"
        f" stage's rate ({100_000 * rows['whole stage (decode + add + score), fastavro'] / ranks:.1f} with fastavro)"
    )
    return found


def process_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used so far (Linux /proc; those that ended count none)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended: its time is no longer to be read
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def bench_pool(ranks: int, f: int, processes: list[int], iterations: int, interleave: bool) -> bool:
    """One job's differential with its scoring in a pool of processes (``streams.scoring_processes``): the
    worker places each message by its head, the pool decodes and scores each iteration, the worker tracks
    them in order. Timed over ``iterations`` iterations after a first one: the worker's CPU s (what bounds one
    job: its rate is the worker's, the pool's grows with processes), the pool's, and the wall time."""
    slow = ranks * 7 // 10 + 3
    its = [
        [encode("patterns", encodable(r)) for r in make_records(ranks, f, slow, iteration=i, interleave=interleave)]
        for i in range(iterations + 1)
    ]
    print(f"\none job's differential, scored in processes: {ranks:,} ranks x {f} functions, {iterations} iterations")
    print(f"{'processes':>9} {'worker CPU s':>12} {'pool CPU s':>10} {'wall s':>7} {'worker us/rank-it':>17} "
          f"{'job rank-it/s (worker)':>22} {'all us/rank-it':>14} {'found':>5}")  # fmt: skip
    found = True
    inline: list[dict[str, object]] | None = None
    for n in processes:
        pool = ScoringPool(n, DifferentialConfig()) if n else None
        stage = DifferentialStage(pool=pool)
        out: list[dict[str, object]] = []
        for m in its[0]:
            out += stage.take(m, None).findings
        out += stage.collect(wait={"scale"})
        pids = list(pool._executor._processes) if pool is not None else []  # noqa: SLF001 - the bench reads them
        c0, p0, w0 = time.process_time(), process_cpu_s(pids), time.perf_counter()
        for batch in its[1:]:
            for m in batch:
                out += stage.take(m, None).findings
            while len(stage.in_flight()) > 2 * n:  # as the worker does: the input waits for the oldest
                stage.in_flight()[0].result()
                out += stage.collect()
            out += stage.collect()
        out += stage.collect(wait={"scale"})
        worker, wall = time.process_time() - c0, time.perf_counter() - w0
        pids = list(pool._executor._processes) if pool is not None else []  # noqa: SLF001 - started since too
        in_pool = process_cpu_s(pids) - p0
        jd = stage.jobs["scale"]
        ok = jd.scored_upto == iterations and not stage.rejected
        ok &= any(u["rank"] == slow for u in out) if iterations > 3 else True
        inline = inline if inline is not None else out
        ok &= [u["finding_id"] for u in out] == [u["finding_id"] for u in inline]
        found &= ok
        n_rank_its = ranks * iterations
        print(
            f"{n:>9} {worker:>12.2f} {in_pool:>10.2f} {wall:>7.2f} {1e6 * worker / n_rank_its:>17.0f} "
            f"{n_rank_its / worker:>22,.0f} {1e6 * (worker + in_pool) / n_rank_its:>14.0f} {str(ok):>5}"
        )
        if pool is not None:
            pool.close()
    return found


T = TypeVar("T")


def best_of(fn: Callable[[], T], repeat: int) -> tuple[float, float, T]:
    """Least CPU seconds and least wall seconds of ``repeat`` runs (the machine is shared), and the last result."""
    cpu, wall, outs = [], [], []
    for _ in range(max(1, repeat)):
        gc.collect()
        t0, c0 = time.perf_counter(), time.process_time()
        outs[:] = [fn()]  # the last result only: a graph is tens of MB
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(cpu), min(wall), outs[-1]


def profile_top(fn: Callable[[], object], top: int) -> str:
    """cProfile's ``top`` entries by own time of one run of ``fn``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def bench_replay(ranks: int, microbatches: int, repeat: int, top: int = 0) -> bool:
    """Replay and what-if of one iteration of a dp x pp8 GPipe job of ``ranks`` ranks (``whatif_truth``'s
    synthetic job: ``4 * microbatches + 1`` calls per middle rank), best of ``repeat`` in CPU and wall seconds:
    the call graph cold (the job's first iteration) and warm (its next, other times, the same calls: the first
    one's graph passed as ``like``), the replay, the what-if; the totals cold and warm; the replay's error
    against the job's own times; and whether the warm graph's what-if equals the cold one's."""
    from whatif_truth import synthetic_job

    from fleetscope.streams.analysis.replay import call_graph, replay
    from fleetscope.streams.analysis.whatif import what_if

    records, timelines = synthetic_job(max(1, ranks // 8), 8, microbatches)
    nxt, nxt_timelines = synthetic_job(max(1, ranks // 8), 8, microbatches, seed=1)
    first = call_graph(records, timelines)
    phases = {
        "graph, cold": best_of(lambda: call_graph(nxt, nxt_timelines), repeat),
        "graph, warm": best_of(lambda: call_graph(nxt, nxt_timelines, like=first), repeat),
    }
    g = phases["graph, warm"][2]
    phases["replay"] = best_of(lambda: replay(nxt, g), repeat)
    phases["what-if"] = best_of(lambda: what_if(nxt, graph=g), repeat)
    same = phases["what-if"][2] == what_if(nxt, graph=phases["graph, cold"][2])
    r, causes = phases["replay"][2], phases["what-if"][2]
    print(f"\nreplay: {len(nxt)} ranks, {g.calls} calls ({g.calls / len(nxt):.0f}/rank), {len(g.levels)} levels, "
          f"{g.matched_p2p} transfers matched, {len(causes)} causes; replay error "
          f"{float(abs(r.error).max()) * 100:.2f} % per rank; best of {repeat}")  # fmt: skip
    print(f"{'phase':<22} {'CPU s':>6} {'wall s':>6}")
    for name, (cpu, wall, _) in phases.items():
        print(f"{name:<22} {cpu:>6.3f} {wall:>6.3f}")
    rest = [phases[k] for k in ("replay", "what-if")]
    for kind in ("cold", "warm"):
        cpu = phases[f"graph, {kind}"][0] + sum(p[0] for p in rest)
        wall = phases[f"graph, {kind}"][1] + sum(p[1] for p in rest)
        print(f"{'total, ' + kind:<22} {cpu:>6.3f} {wall:>6.3f}  (target 1 s)")
    print(f"  the warm graph's what-if equals the cold one's: {'yes' if same else 'NO'}")
    held = sum(v.nbytes for f in dataclasses.fields(g) if isinstance(v := getattr(g, f.name), np.ndarray))
    print(f"  the graph a job keeps for its next iteration (``ScoringCache``): {held / 2**20:.0f} MiB")
    if top:
        print(f"\ncProfile of the cold graph, top {top} by own time:")
        print(profile_top(lambda: call_graph(nxt, nxt_timelines), top))
        print(f"cProfile of the what-if, top {top} by own time:")
        print(profile_top(lambda: what_if(nxt, graph=g), top))
    return same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="64,256,1024,4096,10240", help="comma-separated rank counts")
    ap.add_argument("--functions", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--interleave", action="store_true", help="shuffle odd ranks' whole function lists")
    ap.add_argument("--shards", default="1,2,4,8", help="comma-separated shard counts ('' to skip)")
    ap.add_argument("--message-ranks", type=int, default=2048, help="ranks of the from-messages run (0 to skip)")
    ap.add_argument("--pool", default="", help="comma-separated scoring process counts (0: none) for the pool run")
    ap.add_argument("--pool-iterations", type=int, default=4)
    ap.add_argument("--windower-ranks", type=int, default=16)
    ap.add_argument("--windower-iterations", type=int, default=12)
    ap.add_argument("--open-steps", type=int, default=8)
    ap.add_argument("--replay-ranks", type=int, default=10240, help="ranks of the replay/what-if run (0 to skip)")
    ap.add_argument("--replay-only", action="store_true", help="only the replay/what-if run")
    ap.add_argument("--profile-top", type=int, default=0, help="cProfile top N of the replay run's phases (0: none)")
    args = ap.parse_args(argv)
    if args.replay_only:
        return 0 if bench_replay(args.replay_ranks, 24, args.repeat, args.profile_top) else 1
    sizes = [int(x) for x in args.ranks.split(",")]
    ok = bench_differential(sizes, args.functions, args.repeat, args.interleave)
    if args.shards:
        counts = [int(x) for x in args.shards.split(",")]
        ok &= bench_shards(max(sizes), args.functions, counts, args.repeat, args.interleave)
    if args.message_ranks:
        ok &= bench_messages(args.message_ranks, args.functions, args.repeat, args.interleave)
    if args.pool:
        pool_ranks = args.message_ranks or max(sizes)
        counts = [int(x) for x in args.pool.split(",")]
        ok &= bench_pool(pool_ranks, args.functions, counts, args.pool_iterations, args.interleave)
    bench_windower(args.windower_ranks, args.windower_iterations, args.open_steps)
    if args.replay_ranks:
        ok &= bench_replay(args.replay_ranks, 24, args.repeat, args.profile_top)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
