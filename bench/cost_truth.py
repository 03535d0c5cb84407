"""Each finding's ``est_loss_ns`` against the true cost of its fault, through the whole differential.

    python bench/cost_truth.py [--workers N] [--kinds slow_gpu,host_slow,...]

For every single-fault scenario of the quality suite (``bench/quality.py --quick``: simulated jobs and the
trace generator's), the same job (same seed, same noise) is run with and without its fault; the true cost is
the difference of the job's step time from the fault's onset on (the slowest rank's mean: over a run the
others wait for it). The finding that names the fault's ranks gives ``est_loss_ns``. Printed per scenario:
true and estimated ms, the error, whether a finding names exactly the fault's ranks (simulated: in its
category; the culprit), how many name none of them (victims), and per fault kind how many land within +-20 %.
A fault that costs the job
nothing has no row (nothing to name; ``quality.FREE_FAULT_SHARE``), nor one that acts on every few
iterations only (a finding's loss is the mean over the iterations it was flagged in).

Not a test: the figures depend on the suite's sizes and seeds.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality  # noqa: E402  (the suite, its scenarios and how a finding matches a fault: one definition)

from fleetscope.producers import simulate  # noqa: E402
from fleetscope.streams.offline import OfflinePipeline  # noqa: E402

WITHIN = 0.2


def _sim_step_ms(cfg: object, onset: int) -> tuple[float, list[dict[str, object]]]:
    result = OfflinePipeline().add_all(simulate(cfg)).finish()
    per_rank: dict[int, list[float]] = {}
    for rec in result.iterations:
        if int(rec["iteration"]) >= onset + 2:
            per_rank.setdefault(int(rec["rank"]), []).append(float(rec["duration_ns"]) / 1e6)
    return max(statistics.mean(v) for v in per_rank.values()), result.findings


def priced(scenario: object) -> tuple[str, str, float, float, bool, int] | None:
    """(kind, name, true ms, estimated ms, culprit right, victims) of one single-fault scenario; None: healthy,
    double or free."""
    if scenario.kind in ("healthy", "double", "hang", "job_slowdown") or "every" in scenario.name:
        return None  # no single peer fault, or one acting on some iterations only (a finding's loss is per flagged one)
    if isinstance(scenario, quality.TraceScenario):
        job = scenario.job
        faulty, twin = quality._analyzed(job), quality._analyzed(replace(job, fault="healthy"))
        twin_ms = quality._step_ms(twin)
        true_ms = quality._step_ms(faulty) - twin_ms
        ranks, findings, categories = set(job.culprits()), faulty.findings, None
    else:
        cfg = scenario.config()
        onset = min(f.onset for f in cfg.expected_findings())
        faulty_ms, findings = _sim_step_ms(cfg, onset)
        twin_ms, _ = _sim_step_ms(replace(cfg, faults=()), onset)
        true_ms = faulty_ms - twin_ms
        ranks = {r for f in cfg.expected_findings() for r in f.ranks}
        categories = {f.category for f in cfg.expected_findings()}
    if true_ms < quality.FREE_FAULT_SHARE * twin_ms:
        return None
    named = [f for f in findings if set(f["ranks"]) & ranks]
    est_ms = max((float(f["est_loss_ns"]) / 1e6 for f in named), default=0.0)
    right = any(set(f["ranks"]) == ranks and (categories is None or f["category"] in categories) for f in named)
    return scenario.kind, scenario.name, true_ms, est_ms, right, len(findings) - len(named)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kinds", default="", help="only these fault kinds (comma-separated)")
    args = ap.parse_args()
    wanted = set(filter(None, args.kinds.split(",")))
    scenarios = [s for s in [*quality.suite(True), *quality.trace_suite(True)] if not wanted or s.kind in wanted]
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("fork")) as pool:
        rows = [r for r in pool.map(priced, scenarios) if r is not None]
    print(f"{'scenario':62s} {'true ms':>9s} {'est ms':>9s} {'err %':>7s} {'culprit':>7s} {'victims':>7s}")
    by_kind: dict[str, list[float]] = {}
    for kind, name, true_ms, est_ms, right, victims in rows:
        err = est_ms / true_ms - 1
        by_kind.setdefault(kind, []).append(err)
        right_text = "yes" if right else "NO"
        print(f"{name:62s} {true_ms:9.2f} {est_ms:9.2f} {100 * err:+7.1f} {right_text:>7s} {victims:7d}")
    print(f"\n{'fault kind':20s} {'n':>3s} {'within 20 %':>12s} {'median err %':>13s}")
    for kind, errs in sorted(by_kind.items()):
        ok = sum(abs(e) <= WITHIN for e in errs)
        print(f"{kind:20s} {len(errs):3d} {ok:8d}/{len(errs):<3d} {100 * statistics.median(errs):+13.1f}")
    errs = [e for v in by_kind.values() for e in v]
    print(f"{'OVERALL':20s} {len(errs):3d} {sum(abs(e) <= WITHIN for e in errs):8d}/{len(errs):<3d} "
          f"{100 * statistics.median(errs):+13.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
