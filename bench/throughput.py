"""Events/s of each stage on the same messages: decode, decode + windowing, and end to end.

    python bench/throughput.py [--ranks 32] [--iterations 20] [--take 256] [--no-e2e] [--windower-workers 2]

The simulator produces a job once (rank 7's GPU 1.5x slow, so findings exist), its batches cut as the
real producers flush them (``--flush-interval-ms``, 500 ms: one message per rank and kind holds about
four iterations; 0 gives one message per rank-iteration and kind, 3.6x as many); they are encoded once
with ``encode_event_batch``. Then, on the same messages:

(a) decode only with fastavro (``decode_event_batch(fast=False)``: fastavro + numpy columns), one
    core: the reference the ratios are taken against; (a') the same with the numpy decoder
    (``decode_event_batch``, ``schemas/columnar_decode.py``), which every other stage uses;
(b) decode + windowing + pattern statistics (``RankWindower.add`` per rank, then ``flush``; the
    iterations each message closes summarized together), one core; (b take) the same ``--take``
    messages at a time, as the worker's agent does with its ``take_events`` batch: one vector pass
    decodes them (``decode_event_batches``) and one numpy pass summarizes every iteration they close,
    of every rank (``summarize_closed``); (b') (b) plus the differential (``JobDifferential.add``);
(c) end to end: (b)'s work through the broker and a Faust worker. The embedded stack (Tansu broker, a
    Faust worker process running the windower stage, ``streams.stages = ["windower"]``, the in-process
    ClickHouse sink) in a temporary data dir; the batches are published with ``Publisher`` from a child
    process (the training hosts' side: its CPU is printed, not counted) and the clock runs from the
    first publish to the last iteration row written by the sink (medians of ``--e2e-runs``). The CPU
    time of the broker and the worker until then says how many cores (c) used; the sink's is printed.
    (c full) the whole pipeline the same way, the worker running the differential too, and the sink's
    CPU counted. (c) and (c full) runs take turns. ``--take-max-events`` sets the worker's
    ``streams.take_max_events``. Also printed: the time from the end of publishing to the last finding
    row, which includes the idle timeouts that close the job's last iteration (``bench/latency.py``
    measures the findings latency of a running job). (c N) is (c) with ``--windower-workers`` workers in
    one consumer group: they share this machine's cores, so what it reports is events per worker CPU
    second against (c)'s, the scaling efficiency (1.0: a worker more adds a whole core's worth), not wall time.

Prints events/s per core, the ratios b/a, c/a and c full/a against the targets (``TARGETS``: b/a >= 0.9,
c/a >= 0.5, c full/a >= 0.6), each the median of its runs ((a) to (b'): CPU seconds, ``process_time``, so that
the shared machine's other work is not counted; the best run beside it), the commits that moved them
(``GAINS``, kept by hand) and the cProfile top entries of (b). The timeline
(``streams/analysis/timeline.py``): (b bare) is (b) with its builder left out, so (b) - (b bare) is what it
costs the windower (target <= 10 %); its bytes per rank-iteration on the wire (Avro, the pattern record with
it less without it), for this job and for a tp 2 x pp 2 job of about 100 calls per rank-iteration. (a) to
(b') run in turns, ``--repeat`` rounds, so a change in the machine's load hits all of them alike. Not a
test: figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import multiprocessing
import os
import pstats
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

from confluent_kafka import Consumer, TopicPartition

from fleetscope.config import load_config
from fleetscope.producers import Publisher, PublisherConfig, SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import EventBatch, Topics, decode_event_batch, decode_event_batches, encode, encode_event_batch
from fleetscope.sinks import current_findings
from fleetscope.sinks.sink import Sink
from fleetscope.stack import PROFILE_DIR_ENV, EmbeddedStack, StreamWorkerProcess
from fleetscope.streams import STAGES
from fleetscope.streams.analysis import patterns as patterns_module
from fleetscope.streams.analysis.differential import JobDifferential
from fleetscope.streams.analysis.timeline import TIMELINE_FIELDS
from fleetscope.streams.analysis.windowing import ClosedIteration, RankWindower, summarize_closed
from fleetscope.wiring import bulk_publisher_config

CLK_TCK = os.sysconf("SC_CLK_TCK")
TARGETS = {"b": 0.9, "c": 0.5, "c_full": 0.6}
"""The ratios to fastavro decode per core that issue 40 asks for (b/a, c/a, c full/a)."""
GAINS: tuple[tuple[str, str, str], ...] = (
    ("4dd2932", "b/a 0.604", "the start of issue 40 (main; one run)"),
    ("24037c6 11ca7f3 f119ea7 fce605d 604c5e9", "b/a 0.604 -> 0.836",
     "the summary: launch waits one group, one clip and copy per column, link shifts by ufunc.at, one sort"),
    ("02abb29 cf69b3e", "b/a -0.05", "the timeline (patterns.v4), built in the summary's pass: a cost, not a gain"),
    ("d25e723", "c/a -0.03", "the worker compresses with zstd: a cost"),
    ("755f42b 3fddafc 91d0d5a c53303f", "summary CPU -6 %, b/a 0.701 -> 0.714",
     "1-D reduceats, link samples filtered before their sort, one concatenation of the spans (the summary of "
     "the 408 per-message batches: 0.317 -> 0.298 s, median of 6 best-of-5 in turns with 704b992; b/a: "
     "median of 3 x 5 rounds each, load 11-14 on 2 cores)"),
    ("f68c62a", "after 100,000 steps, 18.5 -> 6.5 us a _distinct call", "no presence table a rank's names dwarf"),
    ("56406b0 a8bcd54", "score_records CPU -17 % (best), -19 % (median); b'/a 0.522 -> 0.562",
     "the scoring, bit for bit (pinned digests): each timeline read once for the replay, column medians picked by "
     "index from one sort, their counts reused (score_records over this job's 20 iterations, best/median of 7: "
     "153.6/164.1 -> 127.9/133.7 ms; b'/a: median of 5 rounds, one run each, load 5-7; c full/a after: 0.270, "
     "where the scoring is about 0.13 of the worker's 1.04 CPU s)"),
    ("9c4b7c4", "c full/a 0.236 -> 0.264 (+12 %), worker CPU -11 %, broker CPU -30 %",
     "the worker's producer batches up to 512 KiB, not 16 KiB: a take's pattern records share a batch (c full "
     "alone, 16 KiB and 512 KiB in turns, 3 runs each: c full/a 0.241/0.223/0.236 -> 0.279/0.264/0.256; CPU s "
     "worker 1.06/1.07/1.06 -> 0.92/0.95/0.95, broker 0.16/0.15/0.15 -> 0.10/0.11/0.11)"),
    ("a457a47 837d0c4 4125c7b c8b0584 202bb2d", "summary CPU 0.73x (A/B against 862d178)",
     "the summary's fixed cost per call, bit for bit: the function numbering kept per rank (268 of (b)'s 408 calls "
     "find theirs), no parent search at the shallowest host depth, one iteration's columns unjoined, one "
     "clip/shift/merge of the GPU intervals, launch waits from the span columns, bus factors cached, no list "
     "operands; C calls per summary call 370 -> 260 (summary of (b)'s 408 batches, 8 rounds in turns)"),
    ("bc421a3", "windower _close 96.7 -> 64.9 ms a (b) run",
     "a buffer's time order found once per buffer, a step's bounds one searchsorted, the rows it leaves a view "
     "until the next batch, the step's GPU end one slice (thread CPU, mean of 3 runs)"),
    ("a457a47..202bb2d", "b/a 0.681 -> 0.811 and 0.698 -> 0.776; b take/a 0.982 -> 1.060",
     "the two above, both trees in turns in one session, 5 rounds of a then b each, twice (load 17-21 on 2 "
     "cores): b CPU 0.87x and 0.89x of 862d178's; this bench alone at load ~20: b/a 0.675, at load 0.5 862d178 "
     "gave 0.745"),
    ("57145d3 be70058", "patterns topic 640 -> 5-7 messages a run; c full/a 0.236 -> 0.240, c/a 0.400 -> 0.404 (noise)",
     "pattern batches: a take's records of a job in one message (this job's records are 18 functions, ~2 KB: "
     "Faust's cost per message is a small part of the worker's; before and after in turns, 3 runs of 3 each, "
     "load 8-20 on 2 cores; medians of the 3 runs' medians; c full/a before 0.288/0.216/0.236, after "
     "0.201/0.240/0.267; c/a before 0.465/0.352/0.400, after 0.392/0.404/0.423). At 300 functions (47 KB a "
     "record) it pays: bench/differential_worker, 256 ranks, a pool of 1, lone and batched in turns, 2 runs each: "
     "the worker's own CPU 361/317 -> 244/228 us a rank-iteration, one job 2,774/3,151 -> 4,091/4,382 a second"),
    ("1e4f0df", "score_records CPU -31 % (median)",
     "the links' medians by one sort (stats.nan_median) for every host at once, not np.nanmedian per host (its "
     "masked-array path for short slices), bit for bit: score_records over this job's 20 iterations, base and "
     "change in turns, 4 x 5 runs, load 5-10 on 2 cores: medians 432.7 -> 297.4 ms; nanmedian was 22 % of it"),
    ("67fd32e", "encoding (c)'s 640 pattern records 213 -> 75 ms CPU (-65 %)",
     "the numpy encoder from 80 functions a record, not 16: with the timeline's arrays fastavro writes the "
     "simulator's 18-function records 2.3x as fast (same bytes; 4 rounds of 7 runs in turns, load ~10)"),
    ("6e4bcec", "the sink's pattern columns 69.8 -> 25.6 ms a run (Python side)",
     "lists read in one np.fromiter pass per column, row counts read in place (same rows; 3 rounds of 15 runs "
     "in turns, load ~9); the sink stays bound by chDB's ~15 ms per insert"),
    ("1e4f0df..6e4bcec", "c full/a 0.291 -> 0.314; worker CPU 2.71 -> 2.32 s (-14 %), all CPU 4.03 -> 3.55 s",
     "the three above: (c full) of e00d1ef and 6e4bcec in turns, 6 runs each, each run's (a) measured just "
     "before it, load 8-15 on 2 cores (medians; c full/a per run 0.20-0.37 and 0.25-0.39: (a) moves with the "
     "load); sink 0.82 -> 0.82, broker 0.51 -> 0.50 CPU s"),
    ("71199f9 24132ac", "(b) -1.4 % instructions; b/a not measurable at that load",
     "link_stats: one search per signal, its three sums one 2-D reduceat; _gpu_times: bounds gathered once, the "
     "running sum reused for the compute's CoveredTime (one callgrind pass of (b) after the same start-up: "
     "4,108.6 M -> 4,067.1 M instructions, the pass 2,889 M, fastavro's (a) 7,017 M; (b)'s numpy decode 846 M, "
     "windower adds 419 M, summaries 1,624 M, ~6 k instructions a numpy call; bench in turns at load 8-14 on 2 "
     "cores: b/a 0.756 and 1.055 before, 0.720 and 1.019 after, rounds 0.68-1.25)"),
)  # fmt: skip
"""The commits that moved the ratios (commit, figure, what), by hand: a change of speed adds its line."""


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


def decode_only(messages: list[bytes], fast: bool) -> int:
    return sum(len(decode_event_batch(m, fast=fast)) for m in messages)


def takes(messages: list[bytes], take: int) -> Iterator[list[EventBatch]]:
    """The messages' batches, decoded one message at a time or ``take`` at a time (one vector pass)."""
    if take <= 1:
        for m in messages:
            yield [decode_event_batch(m)]
        return
    for i in range(0, len(messages), take):
        yield [b for b in decode_event_batches(messages[i : i + take]) if isinstance(b, EventBatch)]


def windowing(messages: list[bytes], differential: bool = False, take_messages: int = 1) -> int:
    """Decode and window every message per rank, and summarize what each take closed (one batch), as
    the worker's agent does; return closed iterations."""
    windowers: dict[tuple[str, int], RankWindower] = {}
    jobs: dict[str, JobDifferential] = {}
    closed = 0

    def settle(items: list[ClosedIteration]) -> None:
        nonlocal closed
        summarize_closed(items)
        closed += len(items)
        if differential:
            for c in items:
                job = c.patterns["job"]
                jobs.setdefault(job, JobDifferential(job)).add(c.patterns)

    for batches in takes(messages, take_messages):
        items: list[ClosedIteration] = []
        for b in batches:
            key = (b.header.job, b.header.rank)
            w = windowers.get(key)
            if w is None:
                w = windowers[key] = RankWindower()
            items += w.add(b, 0)
        settle(items)
    settle([c for w in windowers.values() for c in w.flush()])
    for jd in jobs.values():
        jd.flush()
    return closed


class _NoTimeline:
    def record(self, i: int, function_map: object = None) -> dict[str, object]:
        return {}


@contextlib.contextmanager
def without_timeline() -> Iterator[None]:
    """The summary with its timeline builder left out: what the windower cost before it."""
    build = patterns_module.build_timelines
    patterns_module.build_timelines = lambda *args: _NoTimeline()  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        patterns_module.build_timelines = build


def bare_windowing(messages: list[bytes]) -> int:
    with without_timeline():
        return windowing(messages)


def timeline_bytes(sim: SimulatorConfig) -> tuple[float, float, float]:
    """(calls, Avro bytes of the timeline, iteration ms) per rank-iteration of a simulated job: the encoded
    pattern record with its timeline less the same record without it."""
    windowers: dict[int, RankWindower] = {}
    closed = [c for b in simulate(sim) for c in windowers.setdefault(b.header.rank, RankWindower()).add(b, 0)]
    closed += [c for w in windowers.values() for c in w.flush()]
    summarize_closed(closed)
    calls = size = duration = 0
    for c in closed:
        p = c.patterns
        bare = {**p, **dict.fromkeys(TIMELINE_FIELDS[:-1], []), "sync_tail_compute_us": -1}
        calls += len(p["sync_function"])
        size += len(encode("patterns", p)) - len(encode("patterns", bare))
        duration += p["iteration_ns"]
    n = max(len(closed), 1)
    return calls / n, size / n, duration / n / 1e6


def timed(
    stages: dict[str, tuple[str, object]], events: int, repeat: int
) -> tuple[dict[str, Rate], dict[str, list[float]]]:
    """CPU seconds (``process_time``: a shared machine's other work is not counted) of each stage in each of
    ``repeat`` rounds, the stages taking turns within a round; rates at each stage's median."""
    runs: dict[str, list[float]] = {key: [] for key in stages}
    for _ in range(repeat):
        for key, (_, fn) in stages.items():
            t0 = time.process_time()
            fn()
            runs[key].append(time.process_time() - t0)
    rates = {key: Rate(label, events, statistics.median(runs[key]), 1.0) for key, (label, _) in stages.items()}
    return rates, runs


def round_ratios(runs: dict[str, list[float]], key: str) -> list[float]:
    """(key)/a of each round: a and the stage ran back to back on the same core."""
    return [a / x for a, x in zip(runs["a"], runs[key], strict=True)]


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


PRODUCER = multiprocessing.get_context("spawn")


def publish_batches(config: PublisherConfig, batches: list[EventBatch], link: Connection) -> None:
    """The training hosts' side of (c), in its own process: on the go signal publish and flush; send back
    the CPU seconds that took."""
    with Publisher(config) as publisher:
        link.send("ready")
        link.recv()
        cpu0 = self_cpu_s()
        for b in batches:
            publisher.publish(b)
        publisher.flush(60.0)
        link.send(self_cpu_s() - cpu0)


def topic_messages(bootstrap_servers: str, topic: str) -> int:
    """Messages on a topic (every partition's high less low watermark)."""
    consumer = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": "bench-throughput-count"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        marks = [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in partitions]
    finally:
        consumer.close()
    return sum(high - low for low, high in marks)


def end_to_end(
    sim: SimulatorConfig,
    batches: list[EventBatch],
    events: int,
    timeout_s: float,
    store: str,
    run: int,
    stages: tuple[str, ...],
    take_max_events: int | None = None,
    workers: int = 1,
) -> dict[str, float]:
    """Publish the batches through a fresh embedded stack whose ``workers`` (one consumer group) run
    ``stages``; wall time and CPU until the sink wrote every iteration row (and, with the differential, until
    findings settle). ``cpu_worker`` is every worker's CPU together.

    One process can open one chDB path only: every run uses the same ``store`` path, its own database.
    """
    with tempfile.TemporaryDirectory(prefix="fleetscope-bench-") as tmp:
        overrides: dict[str, object] = {
            "data_dir": tmp,
            "store.url": f"chdb://{store}",
            "store.database": f"bench{run}",
            "streams.stages": stages,
        }
        if take_max_events is not None:
            overrides["streams.take_max_events"] = take_max_events
        config = load_config(overrides=overrides)
        with EmbeddedStack(config) as stack, contextlib.ExitStack() as more:
            if stack.sink is None or stack.worker is None or stack.broker is None:
                raise SystemExit("the embedded stack started without its sink, worker or broker")
            pids = {"worker": stack.worker._proc.pid, "broker": stack.broker._proc.pid}  # type: ignore[union-attr]
            for i in range(2, workers + 1):
                worker = StreamWorkerProcess(stack.config, name=f"worker-{i}")
                worker.start()
                more.callback(worker.stop)
                pids[f"worker-{i}"] = worker.pid  # type: ignore[assignment]
            if workers > 1:
                time.sleep(stack.config.kafka.session_timeout_ms / 1000)  # the group settles before the clock runs
            expected = sim.ranks * sim.expected_iterations
            link, child_link = PRODUCER.Pipe()
            producer = PRODUCER.Process(
                target=publish_batches, args=(bulk_publisher_config(stack.config), batches, child_link)
            )
            producer.start()
            link.recv()
            cpu0 = {name: proc_cpu_s(pid) for name, pid in pids.items()} | {"this": self_cpu_s()}
            t0 = time.perf_counter()
            link.send("go")
            producer_cpu_s = link.recv()
            t_pub = time.perf_counter()
            producer.join()
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
                    cpu = {name: proc_cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
                    cpu["this (sink)"] = self_cpu_s() - cpu0["this"]
                if stats["finding_updates"] != last_findings:
                    last_findings, t_find = stats["finding_updates"], now
                if t_rows and ("differential" not in stages or (now - t_find > 5.0 and now - t_rows > 5.0)):
                    break
                if not stack.worker.alive():
                    raise RuntimeError(f"stream worker died; see {stack.worker.log_path}")
                time.sleep(0.02)
            ch = stack.config.store
            findings = current_findings(stack.client, ch.database, job=sim.job)
            patterns_topic = Topics(prefix=stack.config.kafka.topic_prefix).patterns
            pattern_messages = topic_messages(stack.config.kafka.bootstrap_servers, patterns_topic)
    if not t_rows:
        raise TimeoutError(f"the sink did not write {expected} iteration rows within {timeout_s} s")
    wall = t_rows - t0
    cpu["worker"] = sum(v for k, v in cpu.items() if k.startswith("worker"))
    cpu = {k: v for k, v in cpu.items() if not k.startswith("worker-")}
    counted = cpu.values() if "differential" in stages else (cpu["worker"], cpu["broker"])
    return {
        "publish_s": t_pub - t0,
        "all_but_last_s": t_all_but_last - t0,
        "wall_s": wall,
        "findings_latency_s": max(t_find - t_pub, 0.0),
        "findings": float(len(findings)),
        "found_rank7": float(any(7 in f["ranks"] or f["rank"] == 7 for f in findings)),
        "cores": sum(counted) / wall,
        **{f"cpu_{k}": v for k, v in cpu.items()},
        "producer_cpu_s": producer_cpu_s,
        "events": float(events),
        "pattern_messages": float(pattern_messages),
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


def top_costs(path: str, top: int) -> str:
    """The ``top`` functions of a cProfile dump (CPU clocks) by own time, each with its share of the total:
    the worker's startup, imports included, is in it."""
    stats = pstats.Stats(path)
    total = max(stats.total_tt, 1e-9)  # type: ignore[attr-defined]
    ranked = sorted(((tt, ct, nc, f) for f, (_, nc, tt, ct, _) in stats.stats.items()), reverse=True)  # type: ignore[attr-defined]
    lines = [f"CPU {total:.2f} s", f"{'own s':>7} {'share':>6} {'cum s':>7} {'calls':>7}  function"]
    for tt, ct, nc, (file, line, name) in ranked[:top]:
        where = f"{file.split('site-packages/')[-1].replace(os.getcwd() + '/', '')}:{line}" if line else ""
        lines.append(f"{tt:>7.3f} {tt / total:>6.1%} {ct:>7.3f} {nc:>7}  {name} {where}")
    return "\n".join(lines)


@contextlib.contextmanager
def profiled_pipeline(folder: str) -> Iterator[None]:
    """Run the stack's workers under cProfile (``PROFILE_DIR_ENV``) and the sink's consume thread too, on
    that thread's CPU clock (chDB's own threads are not in it): ``worker.prof`` and ``sink.prof`` in ``folder``."""
    run = Sink.run

    def sink_run(self: Sink, stop: object) -> None:
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        try:
            run(self, stop)  # type: ignore[arg-type]
        finally:
            prof.disable()
            prof.dump_stats(os.path.join(folder, "sink.prof"))

    os.environ[PROFILE_DIR_ENV] = folder
    Sink.run = sink_run  # type: ignore[method-assign]
    try:
        yield
    finally:
        Sink.run = run  # type: ignore[method-assign]
        del os.environ[PROFILE_DIR_ENV]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=32)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument(
        "--flush-interval-ms",
        type=float,
        default=500.0,
        help="batches cut as the producers flush (Recorder, NVML sampler: 500 ms); 0: one per rank-iteration",
    )
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--take", type=int, default=256, help="messages decoded at once in (b take)")
    ap.add_argument("--take-max-events", type=int, default=None, help="(c): the worker's take size")
    ap.add_argument("--no-e2e", action="store_true", help="skip (c), the embedded stack")
    ap.add_argument("--e2e-runs", type=int, default=3, help="(c) runs, each on a fresh stack; medians reported")
    ap.add_argument(
        "--windower-workers", type=int, default=2, help="(c N) also runs (c) with this many windower workers (1: no)"
    )
    ap.add_argument("--profile-top", type=int, default=15)
    ap.add_argument(
        "--profile-e2e", action="store_true", help="one more (c full) run, its worker and sink under cProfile"
    )
    ap.add_argument("--timeout-s", type=float, default=300.0)
    args = ap.parse_args(argv)

    sim = SimulatorConfig(
        job="throughput",
        ranks=args.ranks,
        iterations=args.iterations,
        seed=5,
        faults=(parse_fault("slow_gpu:7:1.5"),),
        flush_interval_ms=args.flush_interval_ms,
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
    stages = {
        "a": ("(a) decode only, fastavro (reference)", lambda: decode_only(messages, False)),
        "a_fast": ("(a') decode only, numpy decoder", lambda: decode_only(messages, True)),
        "b": ("(b) decode + windowing + patterns", lambda: windowing(messages)),
        "b_bare": ("(b bare) (b) without the timeline", lambda: bare_windowing(messages)),
        "b_take": (
            f"(b take) (b), decoding {args.take} at a time",
            lambda: windowing(messages, take_messages=args.take),
        ),
        "b_diff": ("(b') (b) + differential", lambda: windowing(messages, differential=True)),
    }
    rates, cpu_runs = timed(stages, events, args.repeat)
    # One process opens one chDB path: every stack of this run stores there, each in its own database.
    store_dir = tempfile.TemporaryDirectory(prefix="fleetscope-bench-store-")
    store = store_dir.name
    e2e: dict[str, dict[str, float]] = {}
    if not args.no_e2e:
        n = args.windower_workers
        kinds = {"c": (("windower",), 1), "c_full": (STAGES, 1)} | ({"c_n": (("windower",), n)} if n > 1 else {})
        runs: dict[str, list[dict[str, float]]] = {key: [] for key in kinds}
        for i in range(args.e2e_runs):  # in turns, so a change in the machine's load hits all alike
            for j, (key, (stages, workers)) in enumerate(kinds.items()):
                take = args.take_max_events
                runs[key].append(
                    end_to_end(sim, batches, events, args.timeout_s, store, 3 * i + j, stages, take, workers)
                )
        for key, done in runs.items():
            e2e[key] = {k: statistics.median(r[k] for r in done) for k in done[0]}
        e2e["c_full"]["found_rank7"] = float(all(r["found_rank7"] for r in runs["c_full"]))
        latencies = ", ".join(f"{r['findings_latency_s']:.2f}" for r in runs["c_full"])
        a_rate = rates["a"].per_core
        run_ratios = {key: [events / r["wall_s"] / r["cores"] / a_rate for r in done] for key, done in runs.items()}
        per_run = {key: ", ".join(f"{x:.3f}" for x in xs) for key, xs in run_ratios.items()}
        rates["c"] = Rate("(c) end to end (broker + worker)", events, e2e["c"]["wall_s"], e2e["c"]["cores"])
        rates["c_full"] = Rate(
            "(c full) + differential + ClickHouse sink", events, e2e["c_full"]["wall_s"], e2e["c_full"]["cores"]
        )
    print(
        f"\n(a) to (b'): CPU seconds, median of {args.repeat} rounds, and the best; (c): wall (median), cores"
        f"\n{'stage':<42} {'seconds':>8} {'best':>6} {'events/s':>11} {'cores':>5} {'events/s/core':>13} "
        f"{'us/event':>8}"
    )
    for key, r in rates.items():
        best = f"{min(cpu_runs[key]):.2f}" if key in cpu_runs else ""
        print(
            f"{r.label:<42} {r.seconds:>8.2f} {best:>6} {r.per_s:>11,.0f} {r.cores:>5.2f} {r.per_core:>13,.0f} "
            f"{1e6 * r.seconds * r.cores / r.events:>8.2f}"
        )
    a = rates["a"].per_core
    ratio = {key: statistics.median(round_ratios(cpu_runs, key)) for key in cpu_runs}
    if e2e:
        ratio |= {key: statistics.median(xs) for key, xs in run_ratios.items()}
    b_rounds = round_ratios(cpu_runs, "b")
    print(
        f"\nb/a = {ratio['b']:.3f} (target >= {TARGETS['b']}; median of {len(b_rounds)} rounds, each a and b back "
        f"to back: {', '.join(f'{x:.3f}' for x in b_rounds)}; best {max(b_rounds):.3f})\n"
        f"a'/a = {ratio['a_fast']:.3f}   b take/a = {ratio['b_take']:.3f}   b'/a = {ratio['b_diff']:.3f}"
    )
    b_ms = 1e3 * rates["b"].seconds / rank_its
    print(f"windowing cost: {b_ms:.2f} ms per rank-iteration (decode included)")
    bare_ms = 1e3 * rates["b_bare"].seconds / rank_its
    print(
        f"timeline cost: {b_ms - bare_ms:.3f} ms per rank-iteration = {(b_ms - bare_ms) / bare_ms:.1%} of the "
        f"windowing without it ({bare_ms:.2f} ms; target <= 10 %); b bare/a = {ratio['b_bare']:.3f}"
    )
    hundred = SimulatorConfig(job="timeline", ranks=8, iterations=3, tp=2, pp=2, microbatches=7)
    for label, job in (("this job", replace(sim, iterations=3)), ("tp 2 x pp 2, 7 microbatches", hundred)):
        calls, size, it_ms = timeline_bytes(job)
        at_100 = f"; {100 * size / calls:.0f} B at 100 calls, target <= 1 KB" if job is hundred and calls else ""
        print(
            f"timeline bytes ({label}): {calls:.0f} calls per rank-iteration of {it_ms:.0f} ms, {size:.0f} B Avro "
            f"({size / max(calls, 1):.1f} B a call{at_100})"
        )
    if e2e:
        c, full = e2e["c"], e2e["c_full"]
        print(
            f"c/a = {ratio['c']:.3f} per core (median of runs; target >= {TARGETS['c']}): decode + windowing + "
            f"patterns, as (b), through the "
            f"broker and a Faust worker running the windower, the CPU of both counted (the sink, which times "
            f"the end by storing the rows, used {c['cpu_this (sink)']:.2f} CPU s, not counted); the worker alone: "
            f"{events / c['cpu_worker']:,.0f} events per CPU second = {events / c['cpu_worker'] / a:.3f} a"
        )
        print(
            f"c full/a = {ratio['c_full']:.3f} per core (median of runs; target >= {TARGETS['c_full']}): the whole "
            f"pipeline on one machine, the worker running "
            f"the differential too and the ClickHouse sink counted; the worker alone: "
            f"{events / full['cpu_worker']:,.0f} events per CPU second = {events / full['cpu_worker'] / a:.3f} a"
        )
        print(f"each run: c/a {per_run['c']}; c full/a {per_run['c_full']}")
        if "c_n" in e2e:
            one, several = events / c["cpu_worker"], events / e2e["c_n"]["cpu_worker"]
            each = ", ".join(f"{events / r['cpu_worker']:,.0f}" for r in runs["c_n"])
            print(
                f"(c {n} workers) {n} windower workers in one group, sharing this machine's cores: "
                f"{several:,.0f} events per worker CPU second (each run: {each}) against {one:,.0f} with one: "
                f"scaling efficiency {several / one:.2f} (1.0: a second worker adds its whole core); "
                f"wall {e2e['c_n']['wall_s']:.2f} s against {c['wall_s']:.2f} s; broker CPU s "
                f"{e2e['c_n']['cpu_broker']:.2f} against {c['cpu_broker']:.2f}"
            )
        shown = [("c", c), ("c full", full)] + ([(f"c {n} workers", e2e["c_n"])] if "c_n" in e2e else [])
        for key, r in shown:
            print(
                f"({key}): publish {r['publish_s']:.2f} s, all iterations but the last stored at "
                f"{r['all_but_last_s']:.2f} s, all at {r['wall_s']:.2f} s (the last closes on the idle timeout); "
                "CPU s: "
                + ", ".join(f"{k[4:]} {v:.2f}" for k, v in r.items() if k.startswith("cpu_"))
                + f"; the producer (on the training hosts, not counted): {r['producer_cpu_s']:.2f}; "
                f"{r['pattern_messages']:.0f} messages on the patterns topic for {rank_its} pattern records"
            )
        print(
            f"(c full) end of publishing -> last finding row stored (idle timeouts included; findings latency: "
            f"bench/latency.py), median of {len(runs['c_full'])} runs: {full['findings_latency_s']:.2f} s "
            f"({latencies}); {full['findings']:.0f} findings, slow rank 7 found: {bool(full['found_rank7'])}"
        )
    print("\ncommits that moved the ratios (commit: figure, what):")
    for commit, figure, what in GAINS:
        print(f"  {commit}: {figure}; {what}")
    if args.profile_e2e:
        with tempfile.TemporaryDirectory(prefix="fleetscope-bench-profile-") as folder:
            with profiled_pipeline(folder):
                end_to_end(sim, batches, events, args.timeout_s, store, 3 * args.e2e_runs + 3, STAGES)
            for part in ("worker", "sink"):
                print(f"\ncProfile of (c full)'s {part}, top {args.profile_top} by own time:")
                print(top_costs(os.path.join(folder, f"{part}.prof"), args.profile_top))
    print(f"\ncProfile of (b), top {args.profile_top} by own time:")
    print(profile_b(messages, args.profile_top))
    store_dir.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
