"""dp x pp jobs of a real trace's kernels (``tests/realtrace_jobs.py``) through ``analyze``: each job's culprit,
the ranks named beside it, and ``est_loss_ns`` against the true cost (the same job with and without its fault).

``python bench/real_traces.py`` prints one row per job (about 5 s a job).
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from realtrace_jobs import RealJob, load_source, step_ms, write_job  # noqa: E402

from fleetscope.traces_cli import analyze_traces  # noqa: E402

JOBS = {
    "dp2xpp4 healthy": RealJob(dp=2, pp=4),
    "dp4xpp2 healthy": RealJob(dp=4, pp=2),
    "dp4xpp4 healthy": RealJob(dp=4, pp=4),
    "dp4xpp4 slow worker 5 x2.3": RealJob(dp=4, pp=4, fault="slow_worker", fault_rank=5),
    "dp2xpp4 slow worker 3 x2.3": RealJob(dp=2, pp=4, fault="slow_worker", fault_rank=3),
    "dp4xpp2 slow worker 1 x1.5": RealJob(dp=4, pp=2, fault="slow_worker", fault_rank=1, factor=1.5),
    "dp2xpp4 slow last stage x1.6": RealJob(dp=2, pp=4, fault="slow_stage", factor=1.6),
    "dp4xpp4 slow last stage x1.25": RealJob(dp=4, pp=4, fault="slow_stage", factor=1.25),
    "dp2xpp4 slow ring of stage 0 x3": RealJob(dp=2, pp=4, fault="slow_link", fault_rank=0, factor=3.0),
    "dp4xpp4 slow ring of stage 0 x3": RealJob(dp=4, pp=4, fault="slow_link", fault_rank=0, factor=3.0),
}


def main() -> int:
    source = load_source()
    print(f"{'job':34} {'step ms':>8} {'true ms':>8} {'est ms':>8} {'err':>6}  named (victims marked *)   s")
    for name, job in JOBS.items():
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            write_job(job, Path(tmp), source)
            findings = analyze_traces([Path(tmp)]).findings
        step = step_ms(job, source)
        true = step - step_ms(dataclasses.replace(job, fault="healthy"), source)
        est = sum(f["est_loss_ns"] for f in findings) / 1e6
        err = f"{est / true - 1:+.0%}" if true > 0 else "-"
        culprits = set(job.culprits())
        named = ", ".join(
            f"{f['category']} {sorted(f['ranks'])}{'*' if set(f['ranks']) - culprits else ''}" for f in findings
        )
        print(
            f"{name:34} {step:8.2f} {true:8.2f} {est:8.2f} {err:>6}  {named or '-':26} {time.perf_counter() - t0:.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
