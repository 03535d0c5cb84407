"""One large job's differential through the real stream worker (Faust, the embedded broker), CPU per
rank-iteration, with and without scoring processes.

    python bench/differential_worker.py [--ranks 512] [--iterations 8] [--functions 300] [--processes 0,1,2]
                                        [--batch-bytes 1000000]

``bench/scale.py`` times the differential stage in-process; the worker also pays Faust and its Kafka
client for every message (fetching, unpacking, events). Here a worker running only the differential
(``streams.stages = ["differential"]``) reads a job's pattern messages (``bench/scale.py``'s records, one
slow rank) published to its topic at once. Measured: the CPU seconds of the worker process, and of it with
its scoring processes, from the first message until its counters report every record taken and none held
(less its idle rate), per rank-iteration. The worker's own figure bounds one job: its partition is one
worker's. Not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from confluent_kafka import Producer

from fleetscope.config import load_config
from fleetscope.schemas import Topics, encode
from fleetscope.schemas.pattern_batch import batch_pattern_messages
from fleetscope.schemas.topics import job_key
from fleetscope.stack import EmbeddedStack, StreamWorkerProcess

sys.path.insert(0, str(Path(__file__).parent))
from scale import encodable, make_records, process_cpu_s  # noqa: E402 - the bench's records and CPU clock

_COUNTERS = re.compile(r"pattern_records=(\d+),.*held_messages=(\d+)")


def cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of ``pid`` with all its descendants (its scoring processes), and of ``pid`` alone."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    family, grew = {pid}, True
    while grew:
        kids = {p for p, parent in parents.items() if parent in family} - family
        family |= kids
        grew = bool(kids)
    return process_cpu_s(sorted(family)), process_cpu_s([pid])


def run(
    ranks: int, functions: int, iterations: int, processes: int, store: str, batch_bytes: int = 0
) -> tuple[float, float, float, int]:
    """One fresh stack: (worker CPU s, with its scoring processes, seconds until done, messages) for the job;
    ``batch_bytes``: each iteration's records published as pattern batches of at most that size (as the
    windower sends a take's records), 0: a message per record."""
    messages: list[bytes] = []
    for i in range(iterations):
        lone = [encode("patterns", encodable(r)) for r in make_records(ranks, functions, ranks // 3, iteration=i)]
        messages += batch_pattern_messages("scale", [(i, m) for m in lone], batch_bytes) if batch_bytes else lone
    with tempfile.TemporaryDirectory(prefix="fleetscope-dw-") as tmp:
        config = load_config(
            env={},
            overrides={
                "data_dir": tmp,
                "store.url": f"chdb://{store}",  # one chDB path per process: a database per run
                "store.database": f"dw{processes}",
                "streams.stages": ["differential"],
                "streams.scoring_processes": processes,
            },
        )
        with EmbeddedStack(config, with_worker=False) as stack:
            worker = StreamWorkerProcess(stack.config)
            worker.start()
            pid = worker.pid
            if pid is None:
                raise SystemExit("the stream worker did not start")
            time.sleep(5)
            idle0, t_idle = cpu_s(pid)[0], time.perf_counter()
            time.sleep(10)
            idle = (cpu_s(pid)[0] - idle0) / (time.perf_counter() - t_idle)
            topic = Topics(prefix=stack.config.kafka.topic_prefix).patterns
            producer = Producer({"bootstrap.servers": stack.config.kafka.bootstrap_servers, "linger.ms": 20})
            (all0, own0), t0 = cpu_s(pid), time.perf_counter()
            for m in messages:
                while True:
                    try:
                        producer.produce(topic, value=m, key=job_key("scale"))
                        break
                    except BufferError:
                        producer.poll(0.1)
            producer.flush(60)
            while time.perf_counter() - t0 < 900:
                counts = _COUNTERS.findall(worker.log_path.read_text(errors="replace"))
                if counts and int(counts[-1][0]) >= ranks * iterations and int(counts[-1][1]) == 0:
                    break
                time.sleep(1)
            (all1, own1), took = cpu_s(pid), time.perf_counter() - t0
            worker.stop()
    return own1 - own0 - idle * took, all1 - all0 - idle * took, took, len(messages)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--functions", type=int, default=300)
    ap.add_argument("--processes", default="0,1,2", help="comma-separated scoring process counts")
    ap.add_argument(
        "--batch-bytes", type=int, default=0, help="publish pattern batches of at most this size (0: lone records)"
    )
    args = ap.parse_args(argv)
    n = args.ranks * args.iterations
    print(f"one job through the worker: {args.ranks} ranks x {args.functions} functions, {args.iterations} iterations")
    print(f"{'processes':>9} {'worker CPU s':>12} {'worker us/rank-it':>17} {'job rank-it/s (worker)':>22} "
          f"{'with pool CPU s':>15} {'all us/rank-it':>14} {'done s':>7}")  # fmt: skip
    store = tempfile.TemporaryDirectory(prefix="fleetscope-dw-chdb-")
    for processes in (int(x) for x in args.processes.split(",")):
        own, everything, took, sent = run(
            args.ranks, args.functions, args.iterations, processes, store.name, args.batch_bytes
        )
        print(
            f"{processes:>9} {own:>12.2f} {1e6 * own / n:>17.0f} {n / own:>22,.0f} {everything:>15.2f} "
            f"{1e6 * everything / n:>14.0f} {took:>7.1f}  ({sent} messages)"
        )
    print("(done s: until the worker's counters, reported every 10 s, show every record taken and none held)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
