"""``fleetscope analyze`` against HolisticTraceAnalysis on the same folder of Kineto traces: time and memory.

    python bench/analyze_speed.py DIR [--hta-python PYTHON] [--baseline-python PYTHON] [--repeat N]

Each tool runs in a fresh process (imports included, as a user runs it); wall time and peak resident
memory come from the child's resource usage. HTA is not a dependency of fleetscope: give an interpreter
that has it (``pip install HolisticTraceAnalysis`` in a separate virtual environment); it loads the
traces and computes what ``analyze`` reports: the per-rank temporal breakdown (busy/idle), the
communication/computation overlap and the idle-time breakdown.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HTA_SCRIPT = """
import sys
import tempfile
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
a.get_temporal_breakdown(visualize=False)
a.get_comm_comp_overlap(visualize=False)
for rank in a.t.get_ranks():
    a.get_idle_time_breakdown(ranks=[rank], visualize=False)
"""


def _run(argv: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one child process (its own rusage, by ``wait4``)."""
    t0 = time.perf_counter()
    # run outside any checkout: `-m fleetscope` must find the interpreter's own install
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited with {child.returncode}")
    return wall, usage.ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", help="a folder of one job's Kineto traces, one file per rank")
    ap.add_argument("--hta-python", help="an interpreter with HolisticTraceAnalysis installed")
    ap.add_argument("--baseline-python", help="an interpreter with another fleetscope (e.g. main's), for before/after")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    tools = {"fleetscope analyze": [sys.executable, "-m", "fleetscope", "analyze", args.folder, "--quiet"]}
    if args.baseline_python:
        tools["fleetscope (baseline)"] = [args.baseline_python, "-m", "fleetscope", "analyze", args.folder, "--quiet"]
    if args.hta_python:
        tools["HolisticTraceAnalysis"] = [args.hta_python, "-c", HTA_SCRIPT, args.folder]
    files = len([f for f in os.listdir(args.folder) if f.endswith((".json", ".json.gz"))])
    print(f"{args.folder}: {files} trace files, {args.repeat} runs each (median wall, peak RSS of the runs)\n")
    print(f"{'tool':<24} {'wall s':>8} {'peak MiB':>9}")
    results = {}
    for _ in range(args.repeat):  # interleaved, so machine load hits both alike
        for name, cmd in tools.items():
            results.setdefault(name, []).append(_run(cmd))
    for name, runs in results.items():
        results[name] = [(statistics.median(w for w, _ in runs), max(m for _, m in runs))]
        wall, peak = results[name][0]
        print(f"{name:<24} {wall:>8.2f} {peak:>9.0f}")
    if len(results) == 2:
        (fw, fm), (hw, hm) = results["fleetscope analyze"][0], results["HolisticTraceAnalysis"][0]
        print(f"\nfleetscope is {hw / fw:.1f}x faster with {hm / fm:.1f}x less peak memory")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
