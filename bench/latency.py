"""Findings latency in the embedded stack, with the job published at its own pace (as a live job would).

    python bench/latency.py [--ranks 16] [--iterations 40] [--fault slow_gpu:7:1.5] [--speed 0.25] [--runs 2]

The simulator's batches are published in event time: a batch leaves when the wall clock reaches its
``sent_ns`` (scaled by ``--speed``), so the broker, worker and sink see the load of a running job.
For every finding that opens, latency = the moment its ``open`` row is queryable in ClickHouse minus
the moment the evidence was complete: the publication of the last batch (over all ranks) that carries
the end of the iteration the finding opened on (``iteration_last``; its end from the ``iterations``
table). Target (issue 5): median < 5 s. Not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict

from fleetscope.config import load_config
from fleetscope.producers import Publisher, SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import EventBatch
from fleetscope.stack import EmbeddedStack
from fleetscope.wiring import bulk_publisher_config


def paced_run(sim: SimulatorConfig, speed: float, store: str, run: int, settle_s: float) -> list[float]:
    """One fresh stack; returns the latency of every finding that opened, seconds."""
    batches: list[EventBatch] = list(simulate(sim))
    first_ns = min(b.header.sent_ns for b in batches)
    sent: dict[int, list[tuple[int, float]]] = defaultdict(list)  # rank -> (sent_ns, wall published)
    with tempfile.TemporaryDirectory(prefix="fleetscope-latency-") as tmp:
        config = load_config(
            overrides={"data_dir": tmp, "store.url": f"chdb://{store}", "store.database": f"latency{run}"}
        )
        with EmbeddedStack(config) as stack:
            if stack.sink is None or stack.client is None:
                raise SystemExit("the embedded stack started without its sink or store client")
            db = stack.config.store.database
            seen_at: dict[str, tuple[float, int]] = {}  # finding_id -> (wall queryable, iteration_last)
            last_count = -1

            def poll() -> None:
                nonlocal last_count
                count = stack.sink.stats["finding_updates"]  # type: ignore[union-attr]
                if count == last_count:
                    return
                last_count = count
                now = time.perf_counter()
                rows = stack.client.query(  # type: ignore[union-attr]
                    f"SELECT finding_id, iteration_last FROM `{db}`.finding_updates WHERE status = 'open'"
                ).result_rows
                for fid, it in rows:
                    seen_at.setdefault(fid, (now, int(it)))

            with Publisher(bulk_publisher_config(stack.config)) as publisher:
                t0 = time.perf_counter()
                for b in batches:
                    due = t0 + (b.header.sent_ns - first_ns) / 1e9 / speed
                    while (wait := due - time.perf_counter()) > 0:
                        poll()
                        time.sleep(min(wait, 0.02))
                    publisher.publish(b)
                    sent[b.header.rank].append((b.header.sent_ns, time.perf_counter()))
                publisher.flush(30.0)
            deadline = time.perf_counter() + settle_s
            while time.perf_counter() < deadline:
                poll()
                time.sleep(0.02)
            ends = dict(
                stack.client.query(
                    f"SELECT iteration, groupArray((rank, end_ns)) FROM `{db}`.iterations "
                    f"WHERE job = '{sim.job}' GROUP BY iteration"
                ).result_rows
            )
    latencies = []
    for fid, (t_row, it) in sorted(seen_at.items()):
        rank_ends = ends.get(it)
        if not rank_ends:
            print(f"  {fid}: iteration {it} has no rows; skipped", file=sys.stderr)
            continue
        # per rank, the first batch reaching the iteration's end carries its last events
        complete = max(
            next((wall for ns, wall in sent[rank] if ns >= end), sent[rank][-1][1]) for rank, end in rank_ends
        )
        latencies.append(t_row - complete)
        print(f"  run {run}: {fid} opened on iteration {it}: {t_row - complete:.2f} s")
    return latencies


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--fault", action="append", default=None, help="as in `fleetscope demo` (repeatable)")
    ap.add_argument("--speed", type=float, default=0.25, help="event time / wall time (1 = real time)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--settle-s", type=float, default=15.0, help="wait after the last batch for late findings")
    args = ap.parse_args(argv)
    faults = tuple(parse_fault(f) for f in (args.fault or ["slow_gpu:7:1.5", "host_slow:12"]))
    sim = SimulatorConfig(job="latency", ranks=args.ranks, iterations=args.iterations, faults=faults)
    with tempfile.TemporaryDirectory(prefix="fleetscope-latency-store-") as store:
        all_latencies = []
        for run in range(args.runs):
            all_latencies += paced_run(sim, args.speed, store, run, args.settle_s)
    if not all_latencies:
        print("no finding opened", file=sys.stderr)
        return 1
    q = statistics.quantiles(all_latencies, n=10) if len(all_latencies) > 1 else all_latencies * 9
    print(
        f"findings latency (evidence complete -> open row queryable), {len(all_latencies)} findings, "
        f"{args.runs} runs, {args.ranks} ranks at speed {args.speed}: median {statistics.median(all_latencies):.2f} s, "
        f"p90 {q[-1]:.2f} s, max {max(all_latencies):.2f} s (target: median < 5 s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
