"""``fleetscope analyze`` against HolisticTraceAnalysis on the same folder of Kineto traces: time and memory.

    python bench/analyze_speed.py DIR... [--hta-python PYTHON] [--baseline-python PYTHON] [--repeat N]
    python bench/analyze_speed.py --generate DIR   # a 32-rank dp=8 x pp=4 job, 32 steps (tracegen)
    python bench/analyze_speed.py --tile 4 DIR     # DIR's ranks four times over (8 -> 32 ranks), renumbered

Each tool runs in a fresh process (imports included, as a user runs it). Both tools parse files in
worker processes, so one process's peak RSS says little: the bench samples the whole process tree
every 10 ms and reports the peak of its summed PSS (shared pages split between the processes that
share them), with the wall time and the CPU time of the tree (user + system, from the child's rusage).
HTA is not a dependency of fleetscope: give an interpreter that has it (``pip install
HolisticTraceAnalysis``); it loads the traces and computes what ``analyze`` reports: the per-rank
temporal breakdown (busy/idle), the communication/computation overlap and the idle-time breakdown.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HTA_SCRIPT = """
import sys
from hta.trace_analysis import TraceAnalysis
a = TraceAnalysis(trace_dir=sys.argv[1])
a.get_temporal_breakdown(visualize=False)
a.get_comm_comp_overlap(visualize=False)
for rank in a.t.get_ranks():
    a.get_idle_time_breakdown(ranks=[rank], visualize=False)
"""


def _tree(pid: int) -> list[int]:
    """The process and all its descendants (from /proc's children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            m = re.search(r"^Pss:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


def _run(argv: list[str]) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds and peak summed PSS (MiB) of one child process and its descendants."""
    t0 = time.perf_counter()
    # run outside any checkout: `-m fleetscope` must find the interpreter's own install
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], sum(_pss_kib(p) for p in _tree(child.pid)))
            done.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... exited with {os.waitstatus_to_exitcode(status)}")
    return wall, usage.ru_utime + usage.ru_stime, peak[0] / 1024


def tile(folder: Path, times: int, dest: Path) -> Path:
    """``folder``'s rank files ``times`` over in ``dest``, copy k renumbered to ranks k*n..k*n+n-1."""
    files = sorted(f for f in folder.iterdir() if f.name.endswith(".json"))
    n = len(files)
    dest.mkdir(parents=True, exist_ok=True)
    for k in range(times):
        for r, f in enumerate(files):
            doc = json.loads(f.read_bytes())
            info = doc.setdefault("distributedInfo", {})
            info.update(rank=k * n + int(info.get("rank", r)), world_size=n * times)
            (dest / f"rank-{k * n + r}.json").write_text(json.dumps(doc))
    return dest


def measure(folder: str, tools: dict[str, list[str]], repeat: int) -> None:
    files = len([f for f in os.listdir(folder) if f.endswith((".json", ".json.gz"))])
    mb = sum(f.stat().st_size for f in Path(folder).iterdir()) / 2**20
    print(f"{folder}: {files} trace files, {mb:.0f} MiB, {repeat} run(s) each, {os.cpu_count()} cores")
    print(f"{'tool':<24} {'wall s':>8} {'cpu s':>8} {'peak MiB':>9}")
    runs: dict[str, list[tuple[float, float, float]]] = {}
    for _ in range(repeat):  # interleaved, so machine load hits both alike
        for name, cmd in tools.items():
            runs.setdefault(name, []).append(_run([*cmd, folder]))
    med = {}
    for name, rs in runs.items():
        med[name] = (
            statistics.median(w for w, _, _ in rs),
            statistics.median(c for _, c, _ in rs),
            max(m for *_, m in rs),
        )
        print(f"{name:<24} {med[name][0]:>8.2f} {med[name][1]:>8.2f} {med[name][2]:>9.0f}")
    if "HolisticTraceAnalysis" in med:
        (fw, fc, fm), (hw, hc, hm) = med["fleetscope analyze"], med["HolisticTraceAnalysis"]
        print(f"fleetscope: {hw / fw:.1f}x faster (wall), {hc / fc:.1f}x less CPU, {hm / fm:.1f}x less peak memory")
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", help="folders of one job's Kineto traces, one file per rank")
    ap.add_argument("--hta-python", help="an interpreter with HolisticTraceAnalysis installed")
    ap.add_argument("--baseline-python", help="an interpreter with another fleetscope (e.g. main's), for before/after")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--generate", metavar="DIR", help="write a 32-rank generated job into DIR and measure it")
    ap.add_argument("--tile", type=int, default=1, help="measure each folder's ranks this many times over")
    args = ap.parse_args(argv)
    folders = list(args.folders)
    if args.generate:
        from fleetscope.producers.tracegen import TraceJob, write_traces

        write_traces(TraceJob(dp=8, pp=4, steps=32, seed=3), args.generate)
        folders.append(args.generate)
    scratch = Path(tempfile.mkdtemp(prefix="analyze-speed-"))
    try:
        if args.tile > 1:
            folders = [str(tile(Path(f), args.tile, scratch / f"{Path(f).name}x{args.tile}")) for f in folders]
        tools = {"fleetscope analyze": [sys.executable, "-m", "fleetscope", "analyze", "--quiet"]}
        if args.baseline_python:
            tools["fleetscope (baseline)"] = [args.baseline_python, "-m", "fleetscope", "analyze", "--quiet"]
        if args.hta_python:
            tools["HolisticTraceAnalysis"] = [args.hta_python, "-c", HTA_SCRIPT]
        for folder in folders:
            measure(folder, tools, args.repeat)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
