"""One large job's differential through the real stream worker (Faust, the embedded broker), CPU per
rank-iteration, with and without scoring processes, and scored across 1, 2 and 3 workers.

    python bench/differential_worker.py [--ranks 512] [--iterations 8] [--functions 300] [--processes 0,1,2]
        [--scorers 1,2,3] [--batch-bytes 1000000]

``bench/scale.py`` times the differential stage in-process; the worker also pays Faust and its Kafka
client for every message (fetching, unpacking, events). Here a worker running only the differential
(``streams.stages = ["differential"]``) reads a job's pattern messages (``bench/scale.py``'s records, one
slow rank) published to its topic at once. Measured: the CPU seconds of the worker process, and of it with
its scoring processes, from the first message until its counters report every record taken and none held
(less its idle rate), per rank-iteration. The worker's own figure bounds one job: its partition is one
worker's. Not a test: figures depend on the machine and its load.

``--scorers N`` runs N workers with ``streams.score_across_workers``: the job's head (the worker owning its
patterns partition) hands each iteration to the requests topic and every worker scores its stripes. It
prints one job's rank-iterations per second (wall, first message to none held), each worker's CPU, and,
in this process without Kafka, the serial share: the head's tracking (``JobDifferential.apply``) and its
whole in-process part (placing by head, framing the request, tracking) per rank-iteration, against the
scoring's cost (``score_payloads``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition

from fleetscope.config import load_config
from fleetscope.schemas import Topics, encode
from fleetscope.schemas.pattern_batch import batch_pattern_messages
from fleetscope.schemas.topics import job_key
from fleetscope.stack import EmbeddedStack, StreamWorkerProcess

sys.path.insert(0, str(Path(__file__).parent))
from scale import encodable, make_records, process_cpu_s  # noqa: E402 - the bench's records and CPU clock

_COUNTERS = re.compile(r"pattern_records=(\d+),.*held_messages=(\d+)")
COMPRESSION = "lz4"
"""``kafka.compression`` (the default; the worker then sends zstd), or none: ``--compression``."""
_SCORED = re.compile(r"scoring across workers: scored=(\d+) requested=(\d+) resent=(\d+)")


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
                "kafka.compression": COMPRESSION,
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


def _settled(workers: list[StreamWorkerProcess], expected: int) -> bool:
    """Every record taken (by the job's head) and none held, by the workers' last counters."""
    last = [_COUNTERS.findall(w.log_path.read_text(errors="replace"))[-1:] for w in workers]
    taken = sum(int(c[0][0]) for c in last if c)
    return taken >= expected and all(not c or int(c[0][1]) == 0 for c in last)


@dataclass(frozen=True)
class StripedRun:
    """What one run scoring across workers measured: wall seconds, and per worker CPU s (less its idle
    rate), iterations scored and iterations requested (the head's), and requests sent again in all."""

    took: float
    cpu: list[float]
    scored: list[int]
    requested: list[int]
    resent: int


def run_striped(
    ranks: int, functions: int, iterations: int, scorers: int, store: str, frames_per_score: int
) -> StripedRun:
    """One fresh stack, ``scorers`` workers scoring across workers: wall seconds until every iteration's score
    is sent, and each worker's CPU s (less its idle rate) until none is held, iterations scored and requests
    sent."""
    messages = [
        encode("patterns", encodable(r))
        for i in range(iterations)
        for r in make_records(ranks, functions, ranks // 3, iteration=i)
    ]
    with tempfile.TemporaryDirectory(prefix="fleetscope-dw-") as tmp:
        config = load_config(
            env={},
            overrides={
                "data_dir": tmp,
                "store.url": f"chdb://{store}",
                "store.database": f"dws{scorers}",
                "streams.stages": ["differential"],
                "streams.score_across_workers": True,
                "kafka.derived_partitions": 6,  # 1, 2 and 3 workers each get an even share of the stripes
                "kafka.compression": COMPRESSION,
            },
        )
        with EmbeddedStack(config, with_worker=False) as stack:
            workers = [StreamWorkerProcess(stack.config, name=f"scorer-{i}") for i in range(scorers)]
            for w in workers:
                w.start()
            pids = [w.pid for w in workers if w.pid is not None]
            time.sleep(8)  # the group settles
            idle0, t_idle = [cpu_s(p)[1] for p in pids], time.perf_counter()
            time.sleep(6)
            idle = [(cpu_s(p)[1] - i0) / (time.perf_counter() - t_idle) for p, i0 in zip(pids, idle0, strict=True)]
            topic = Topics(prefix=stack.config.kafka.topic_prefix).patterns
            producer = Producer({"bootstrap.servers": stack.config.kafka.bootstrap_servers, "linger.ms": 20})
            cpu0, t0 = [cpu_s(p)[1] for p in pids], time.perf_counter()
            for m in messages:
                while True:
                    try:
                        producer.produce(topic, value=m, key=job_key("scale"))
                        break
                    except BufferError:
                        producer.poll(0.1)
            producer.flush(60)
            probe = Consumer({"bootstrap.servers": stack.config.kafka.bootstrap_servers, "group.id": "bench-probe"})
            scores = [TopicPartition(Topics(prefix=stack.config.kafka.topic_prefix).scores, p) for p in range(6)]
            while time.perf_counter() - t0 < 900:  # every iteration's score sent: tracking them is the head's
                if sum(probe.get_watermark_offsets(tp, 5)[1] for tp in scores) >= iterations * frames_per_score:
                    break
                time.sleep(0.1)
            took = time.perf_counter() - t0
            while time.perf_counter() - t0 < 900 and not _settled(workers, len(messages)):
                time.sleep(0.5)
            probe.close()
            settled = time.perf_counter() - t0
            cpu = [cpu_s(p)[1] - c0 - i * settled for p, c0, i in zip(pids, cpu0, idle, strict=True)]
            time.sleep(10.5)  # the scorers' counts, reported every 10 s
            scored = [_SCORED.findall(w.log_path.read_text(errors="replace"))[-1:] for w in workers]
            for w in workers:
                w.stop()
    return StripedRun(
        took,
        cpu,
        [int(c[0][0]) if c else 0 for c in scored],
        [int(c[0][1]) if c else 0 for c in scored],
        sum(int(c[0][2]) for c in scored if c),
    )


def serial_share(ranks: int, functions: int, iterations: int) -> tuple[float, float, float, int]:
    """In this process: (scoring, tracking, the head's in-process part) CPU us per rank-iteration, and how
    many frames one score takes."""
    from fleetscope.streams.analysis.differential import DifferentialConfig, JobDifferential
    from fleetscope.streams.differential import DifferentialStage
    from fleetscope.streams.scoring import score_payloads
    from fleetscope.streams.striped_scoring import KafkaScoring, StripeScorer, encode_score, writers_of

    per_iteration = [
        [encode("patterns", encodable(r)) for r in make_records(ranks, functions, ranks // 3, iteration=i)]
        for i in range(iterations)
    ]
    scoring = tracking = 0.0
    jd = JobDifferential("scale", DifferentialConfig())
    for i, msgs in enumerate(per_iteration):
        t = time.process_time()
        score = score_payloads("scale", msgs, writers_of(msgs))
        scoring += time.process_time() - t
        if score.score is None:
            raise SystemExit("the bench's iteration did not score")
        t = time.process_time()
        jd.apply(i, score.score)
        tracking += time.process_time() - t
    sent: list[bytes] = []
    scorer = StripeScorer(DifferentialConfig(), 512 * 1024)
    head = KafkaScoring(lambda _p, _k, v: sent.append(v), 6, 512 * 1024, lambda _job: 0, 60.0)
    stage = DifferentialStage(pool=head)
    head_s = 0.0
    for msgs in per_iteration:
        t = time.process_time()
        for m in msgs:
            stage.take(m, None)
        head_s += time.process_time() - t
        scores = [v for request in sent for _, _, v in scorer.take(request)]  # not the head's: not timed
        sent.clear()
        t = time.process_time()
        for v in scores:
            head.receive(v)
        stage.collect()
        head_s += time.process_time() - t
    t = time.process_time()
    stage.flush("scale")
    head_s += time.process_time() - t
    n = ranks * iterations
    return (
        1e6 * scoring / n,
        1e6 * tracking / n,
        1e6 * head_s / n,
        len(encode_score("scale", b"0" * 16, score, 512 * 1024)),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--functions", type=int, default=300)
    ap.add_argument("--processes", default="0,1,2", help="comma-separated scoring process counts ('' for none)")
    ap.add_argument("--scorers", default="", help="comma-separated counts of workers scoring across workers")
    ap.add_argument("--compression", default="lz4", help="kafka.compression: lz4 (the worker sends zstd) or none")
    ap.add_argument(
        "--batch-bytes", type=int, default=0, help="publish pattern batches of at most this size (0: lone records)"
    )
    args = ap.parse_args(argv)
    global COMPRESSION
    COMPRESSION = args.compression
    n = args.ranks * args.iterations
    store = tempfile.TemporaryDirectory(prefix="fleetscope-dw-chdb-")  # one chDB path per process
    if args.scorers:
        striped(args, n, store.name)
    if not args.processes:
        return 0
    print(f"one job through the worker: {args.ranks} ranks x {args.functions} functions, {args.iterations} iterations")
    print(f"{'processes':>9} {'worker CPU s':>12} {'worker us/rank-it':>17} {'job rank-it/s (worker)':>22} "
          f"{'with pool CPU s':>15} {'all us/rank-it':>14} {'done s':>7}")  # fmt: skip
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


def striped(args: argparse.Namespace, n: int, store: str) -> None:
    """The ``--scorers`` table and the serial share."""
    scoring, tracking, head_part, frames = serial_share(args.ranks, args.functions, args.iterations)
    print(
        f"one job scored across workers: {args.ranks} ranks x {args.functions} functions, {args.iterations} iterations"
    )
    print(f"in process, CPU us per rank-iteration: scoring {scoring:.0f}, tracking {tracking:.1f} "
          f"({100 * tracking / scoring:.1f} % of scoring), the head's whole in-process part {head_part:.1f} "
          f"({100 * head_part / scoring:.1f} %)")  # fmt: skip
    print(f"{'workers':>7} {'done s':>7} {'rank-it/s':>10} {'CPU s per worker':>24} {'scored per worker':>18} "
          f"{'head CPU us/rank-it':>19} {'resent':>6}")  # fmt: skip
    for scorers in (int(x) for x in args.scorers.split(",")):
        r = run_striped(args.ranks, args.functions, args.iterations, scorers, store, frames)
        cpu, scored, requested = r.cpu, r.scored, r.requested
        head = max(range(scorers), key=lambda i: requested[i])
        head_serial = cpu[head] - scored[head] * scoring * args.ranks / 1e6  # less its own stripes' scoring
        print(
            f"{scorers:>7} {r.took:>7.1f} {n / r.took:>10,.0f} "
            f"{' '.join(f'{c:.1f}' for c in cpu):>24} {' '.join(map(str, scored)):>18} "
            f"{1e6 * head_serial / n:>19.0f} {r.resent:>6}"
        )
    print("(head CPU: the worker that sent the requests, less its own stripes' scoring at the in-process rate)")


if __name__ == "__main__":
    sys.exit(main())
