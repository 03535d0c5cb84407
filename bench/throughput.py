"""Events/s of each stage on the same messages: decode, decode + windowing, and end to end.

    python bench/throughput.py [--ranks 32] [--iterations 20] [--no-e2e]

The simulator produces a job once (rank 7's GPU 1.5x slow, so findings exist); its batches are
encoded once with ``encode_event_batch``. Then, on the same messages:

(a) decode only (``decode_event_batch``: fastavro + numpy columns), one core;
(b) decode + windowing + pattern statistics (``RankWindower.add`` per rank, as the worker does, then
    ``flush``), one core; (b') the same plus the differential (``JobDifferential.add``);
(c) end to end: the embedded stack (Tansu broker, a Faust worker process, the in-process ClickHouse
    sink) in a temporary data dir; the batches are published with ``Publisher`` and the clock runs
    from the first publish to the last iteration row written by the sink (medians of ``--e2e-runs``).
    The CPU time of this process (publisher, sink), the worker and the broker says how many cores it used.
    Findings latency: from the end of publishing (flush) to the last finding row written.

Prints events/s per core, the ratios b/a and c/a against the targets (b/a >= 0.7, c/a >= 0.5,
findings latency < 5 s), and the cProfile top entries of (b). Not a test: figures depend on the
machine and its load.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from fleetscope.config import load_config
from fleetscope.demo import publisher_config
from fleetscope.producers import Publisher, SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import EventBatch, decode_event_batch, encode_event_batch
from fleetscope.sinks import current_findings
from fleetscope.stack import EmbeddedStack
from fleetscope.streams.analysis.differential import JobDifferential
from fleetscope.streams.analysis.windowing import RankWindower

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Rate:
    label: str
    events: int
    seconds: float
    cores: float

    @property
    def per_s(self) -> float:
        return self.events / self.seconds

    @property
    def per_core(self) -> float:
        return self.per_s / max(self.cores, 1e-9)


def decode_only(messages: list[bytes]) -> int:
    return sum(len(decode_event_batch(m)) for m in messages)


def windowing(messages: list[bytes], differential: bool = False) -> int:
    """Decode and window every message per rank, as the worker's agent does; return closed iterations."""
    windowers: dict[tuple[str, int], RankWindower] = {}
    jobs: dict[str, JobDifferential] = {}
    closed = 0

    def take(items: list[Any]) -> None:
        nonlocal closed
        closed += len(items)
        if differential:
            for c in items:
                job = c.patterns["job"]
                jobs.setdefault(job, JobDifferential(job)).add(c.patterns)

    for m in messages:
        b = decode_event_batch(m)
        key = (b.header.job, b.header.rank)
        w = windowers.get(key)
        if w is None:
            w = windowers[key] = RankWindower()
        take(w.add(b, 0))
    for w in windowers.values():
        take(w.flush())
    for jd in jobs.values():
        jd.flush()
    return closed


def timed(label: str, fn: Any, events: int, repeat: int) -> Rate:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return Rate(label, events, best, 1.0)


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a child process, seconds (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def end_to_end(
    sim: SimulatorConfig, batches: list[EventBatch], events: int, timeout_s: float, store: str, run: int
) -> dict[str, float]:
    """Publish the batches through a fresh embedded stack; wall time and CPU until the sink wrote every row.

    One process can open one chDB path only: every run uses the same ``store`` path, its own database.
    """
    with tempfile.TemporaryDirectory(prefix="fleetscope-bench-") as tmp:
        config = load_config(
            overrides={"data_dir": tmp, "store.url": f"chdb://{store}", "store.database": f"bench{run}"}
        )
        with EmbeddedStack(config) as stack:
            assert stack.sink is not None and stack.worker is not None and stack.broker is not None
            pids = {"worker": stack.worker._proc.pid, "broker": stack.broker._proc.pid}  # type: ignore[union-attr]
            cpu0 = {name: proc_cpu_s(pid) for name, pid in pids.items()} | {"this": self_cpu_s()}
            expected = sim.ranks * sim.expected_iterations
            t0 = time.perf_counter()
            with Publisher(publisher_config(stack.config)) as publisher:
                for b in batches:
                    publisher.publish(b)
                publisher.flush(60.0)
            t_pub = time.perf_counter()
            t_all_but_last = t_rows = t_find = 0.0
            last_findings = -1
            deadline = t_pub + timeout_s
            while time.perf_counter() < deadline:
                stats = stack.sink.stats
                now = time.perf_counter()
                if not t_all_but_last and stats["iterations"] >= expected - sim.ranks:
                    t_all_but_last = now
                if not t_rows and stats["iterations"] >= expected:
                    t_rows = now
                if stats["finding_updates"] != last_findings:
                    last_findings, t_find = stats["finding_updates"], now
                if t_rows and now - t_find > 5.0 and now - t_rows > 5.0:
                    break
                if not stack.worker.alive():
                    raise RuntimeError(f"stream worker died; see {stack.worker.log_path}")
                time.sleep(0.02)
            cpu = {name: proc_cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
            cpu["this (publisher + sink)"] = self_cpu_s() - cpu0["this"]
            ch = stack.config.store
            findings = current_findings(stack.client, ch.database, job=sim.job)
    if not t_rows:
        raise TimeoutError(f"the sink did not write {expected} iteration rows within {timeout_s} s")
    wall = t_rows - t0
    return {
        "publish_s": t_pub - t0,
        "all_but_last_s": t_all_but_last - t0,
        "wall_s": wall,
        "findings_latency_s": max(t_find - t_pub, 0.0),
        "findings": float(len(findings)),
        "found_rank7": float(any(7 in f["ranks"] or f["rank"] == 7 for f in findings)),
        "cores": sum(cpu.values()) / wall,
        **{f"cpu_{k}": v for k, v in cpu.items()},
        "events": float(events),
    }


def profile_b(messages: list[bytes], top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    windowing(messages)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "ncalls" in line)
    return "\n".join(lines[start : start + top + 1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-e2e", action="store_true", help="skip (c), the embedded stack")
    ap.add_argument("--e2e-runs", type=int, default=3, help="(c) runs, each on a fresh stack; medians reported")
    ap.add_argument("--profile-top", type=int, default=15)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    args = ap.parse_args(argv)

    sim = SimulatorConfig(
        job="throughput", ranks=args.ranks, iterations=args.iterations, seed=5, faults=(parse_fault("slow_gpu:7:1.5"),)
    )
    batches = list(simulate(sim))
    messages = [encode_event_batch(b) for b in batches]
    events = sum(len(b) for b in batches)
    rank_its = sim.ranks * sim.expected_iterations
    mib = sum(map(len, messages)) / 2**20
    print(
        f"job: {sim.ranks} ranks x {sim.expected_iterations} iterations, {len(messages)} messages, "
        f"{events:,} events ({events / rank_its:.0f} per rank-iteration), {mib:.1f} MiB Avro "
        f"({sum(map(len, messages)) / events:.1f} B/event)"
    )
    rates = [
        timed("(a) decode only", lambda: decode_only(messages), events, args.repeat),
        timed("(b) decode + windowing + patterns", lambda: windowing(messages), events, args.repeat),
        timed("(b') (b) + differential", lambda: windowing(messages, differential=True), events, args.repeat),
    ]
    e2e: dict[str, float] = {}
    if not args.no_e2e:
        with tempfile.TemporaryDirectory(prefix="fleetscope-bench-store-") as store:
            runs = [end_to_end(sim, batches, events, args.timeout_s, store, i) for i in range(args.e2e_runs)]
        e2e = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        e2e["found_rank7"] = float(all(r["found_rank7"] for r in runs))
        latencies = ", ".join(f"{r['findings_latency_s']:.2f}" for r in runs)
        rates.append(Rate("(c) end to end (broker + worker + sink)", events, e2e["wall_s"], e2e["cores"]))
    print(f"\n{'stage':<42} {'seconds':>8} {'events/s':>11} {'cores':>5} {'events/s/core':>13} {'us/event':>8}")
    for r in rates:
        print(
            f"{r.label:<42} {r.seconds:>8.2f} {r.per_s:>11,.0f} {r.cores:>5.2f} {r.per_core:>13,.0f} "
            f"{1e6 * r.seconds * r.cores / r.events:>8.2f}"
        )
    a = rates[0].per_core
    print(f"\nb/a = {rates[1].per_core / a:.3f} (target >= 0.7)   b'/a = {rates[2].per_core / a:.3f}")
    print(f"windowing cost: {1e3 * rates[1].seconds / rank_its:.2f} ms per rank-iteration (decode included)")
    if e2e:
        print(
            f"c/a = {rates[3].per_core / a:.3f} per core (target >= 0.5); "
            f"wall-clock c/a = {rates[3].per_s / rates[0].per_s:.3f}"
        )
        print(
            f"(c): publish {e2e['publish_s']:.2f} s, all iterations but the last stored at "
            f"{e2e['all_but_last_s']:.2f} s, "
            f"all at {e2e['wall_s']:.2f} s (the last closes on the idle timeout); CPU s: "
            + ", ".join(f"{k[4:]} {v:.1f}" for k, v in e2e.items() if k.startswith("cpu_"))
        )
        print(
            f"findings latency (end of publishing -> last finding row stored), median of {len(runs)} runs: "
            f"{e2e['findings_latency_s']:.2f} s ({latencies}; target < 5 s); "
            f"{e2e['findings']:.0f} findings, slow rank 7 found: {bool(e2e['found_rank7'])}"
        )
    print(f"\ncProfile of (b), top {args.profile_top} by own time:")
    print(profile_b(messages, args.profile_top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
