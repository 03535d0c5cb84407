"""Scale of the differential stage and of the windower's state: seconds and memory versus ranks.

    python bench/scale.py [--ranks 64,256,1024,4096,10240] [--functions 300] [--repeat 3]

1. Differential: synthetic pattern records for one iteration of a job with R ranks x F functions per
   rank (same names on every rank, in a per-rank order, as decoded from Avro: fresh strings and plain
   lists), a realistic mix of compute kernels, host functions and collectives with link features, and
   one injected slow rank (its GPU 1.3x slow: longer compute kernels, shorter collectives). Times
   ``score_iteration(records)`` and ``JobDifferential.add`` of every record of one iteration (the last
   one triggers scoring), the peak memory of scoring (tracemalloc), the share of ``PeerMatrix.build``,
   and the cost per rank; checks that the slow rank is found at every size.
2. Windower: a simulated job fed rank by rank into ``RankWindower``; the cost per rank-iteration, and
   the state memory per rank after N open steps (one declared stream withheld so no step closes).

Not a test: figures depend on the machine and its load. Targets (issue 5): 10,240 ranks x 300
functions in < 1 s and < 2 GB, cost per rank flat (no worse than linear in ranks).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from fleetscope.producers import SimulatorConfig, simulate
from fleetscope.schemas import EventKind, FunctionKind
from fleetscope.streams.analysis import outliers
from fleetscope.streams.analysis.differential import JobDifferential
from fleetscope.streams.analysis.outliers import score_iteration
from fleetscope.streams.analysis.windowing import RankWindower

SLOW_FACTOR = 1.3
ITERATION_NS = 400e6


def function_mix(f: int) -> tuple[list[str], np.ndarray]:
    """F function names and kinds: ~75 % compute kernels, ~15 % collectives, ~10 % host functions."""
    n_coll = max(1, f * 15 // 100)
    n_host = max(1, f // 10)
    n_comp = f - n_coll - n_host
    names = [f"ampere_bf16_s16816gemm_bf16_{i}x128_ldg8_f2f_tn" for i in range(n_comp)]
    names += [f"nccl:allreduce[pg={i % 4},<={1 << (i % 8)}MiB]" for i in range(n_coll)]
    names += [f"module.layer{i}.forward" for i in range(n_host)]
    kinds = np.array(
        [FunctionKind.COMPUTE] * n_comp + [FunctionKind.COLLECTIVE] * n_coll + [FunctionKind.PYTHON] * n_host,
        dtype=np.int64,
    )
    return names, kinds


def make_records(ranks: int, f: int, slow_rank: int, seed: int = 0) -> list[dict[str, Any]]:
    """One iteration's pattern records of ``ranks`` ranks (the windower's output shape, as lists)."""
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
    records = []
    for r in range(ranks):
        order = rng.permutation(f) if r % 2 else np.arange(f)  # the windower's order differs by rank
        m = mean[r, order]
        records.append(
            {
                "job": "scale", "rank": r, "host": f"node{r // 8:05d}", "world_size": ranks,
                "tp_rank": -1, "pp_rank": -1, "dp_rank": r, "iteration": 0,
                "iteration_start_ns": 0, "iteration_ns": int(ITERATION_NS * (1.0 + 0.001 * rng.standard_normal())),
                "function": [names[j].encode().decode() for j in order],  # fresh strings, as decoded
                "kind": kinds[order].tolist(),
                "calls": calls[order].astype(np.int64).tolist(),
                "total_ns": (m * calls[order]).astype(np.int64).tolist(),
                "mean_ns": m.tolist(),
                "nvlink_peak_bps": peak[r, order].tolist(),
                "nvlink_mean_bps": act[r, order].tolist(),
                "nvlink_cv": cv[r, order].tolist(),
                "pcie_peak_bps": pcie_peak[r, order].tolist(),
                "pcie_mean_bps": (pcie_peak[r, order] * 0.8).tolist(),
                "pcie_cv": cv[r, order].tolist(),
            }
        )  # fmt: skip
    return records


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median seconds of ``repeat`` runs and the last result."""
    times, out = [], None
    for _ in range(repeat):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def peak_mib(fn: Callable[[], Any]) -> float:
    """Peak memory allocated while ``fn`` runs (tracemalloc; numpy arrays included), MiB."""
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return (peak - base) / 2**20


def build_seconds(records: list[dict[str, Any]], repeat: int) -> float:
    """Time of the PeerMatrix builds that score_iteration does (peer group + hosts)."""
    feats = outliers._FEATURES
    host_feats = ("mean_ns", "calls", "pcie_cv", "pcie_mean_bps")
    t, _ = timed(
        lambda: (outliers.PeerMatrix.build(records, feats), outliers.PeerMatrix.build(records, host_feats)), repeat
    )
    return t


def add_all(records: list[dict[str, Any]]) -> JobDifferential:
    """Every record of one iteration into a fresh job; the last one completes it and scores it."""
    jd = JobDifferential("scale")
    for rec in records:
        jd.add(rec)
    return jd


def bench_differential(sizes: list[int], f: int, repeat: int) -> bool:
    print(f"differential: one iteration, F = {f} functions per rank, slow rank's GPU {SLOW_FACTOR}x")
    print(
        f"{'ranks':>6} {'input MiB':>9} {'score s':>8} {'build s':>8} {'build %':>7} {'peak MiB':>8} "
        f"{'us/rank':>8} {'add s':>7} {'found':>5}"
    )
    all_found = True
    for ranks in sizes:
        slow = ranks * 7 // 10 + 3
        gc.collect()
        tracemalloc.start()
        records = make_records(ranks, f, slow)
        input_mib = tracemalloc.get_traced_memory()[0] / 2**20
        tracemalloc.stop()
        reps = repeat if ranks <= 4096 else max(1, min(repeat, 2))
        t_score, signals = timed(lambda records=records: score_iteration(records), reps)
        t_build = build_seconds(records, reps)
        peak = peak_mib(lambda records=records: score_iteration(records))
        t_add, jd = timed(lambda records=records: add_all(records), 1)
        # A finding opens after several iterations (lifecycle); one iteration yields the signal.
        found = jd.iterations_scored == 1 and any(
            s.category == "gpu_slow" and slow in s.member_ranks() for s in signals
        )
        others = {s.rank for s in signals} - {slow}
        all_found &= found
        print(
            f"{ranks:>6} {input_mib:>9.0f} {t_score:>8.3f} {t_build:>8.3f} {100 * t_build / t_score:>6.0f}% "
            f"{peak:>8.0f} {1e6 * t_score / ranks:>8.1f} {t_add:>7.3f} {'yes' if found else 'NO':>5}"
            + (f"  (also flagged: {sorted(others)[:5]})" if others else "")
        )
        del records, signals, jd
    return all_found


def bench_windower(ranks: int, iterations: int, open_steps: int) -> None:
    cfg = SimulatorConfig(job="wscale", ranks=ranks, iterations=iterations, seed=1)
    batches = list(simulate(cfg))
    events = sum(len(b) for b in batches)
    per_rank: dict[int, list[Any]] = {}
    for b in batches:
        per_rank.setdefault(b.header.rank, []).append(b)
    gc.collect()
    t0 = time.perf_counter()
    closed = 0
    for rank_batches in per_rank.values():
        w = RankWindower()
        for b in rank_batches:
            closed += len(w.add(b, 0))
        closed += len(w.flush())
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="64,256,1024,4096,10240", help="comma-separated rank counts")
    ap.add_argument("--functions", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--windower-ranks", type=int, default=16)
    ap.add_argument("--windower-iterations", type=int, default=12)
    ap.add_argument("--open-steps", type=int, default=8)
    args = ap.parse_args(argv)
    ok = bench_differential([int(x) for x in args.ranks.split(",")], args.functions, args.repeat)
    bench_windower(args.windower_ranks, args.windower_iterations, args.open_steps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
