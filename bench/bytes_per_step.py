"""Bytes per rank-step, per topic, of real 4-rank PyTorch jobs (gloo on CPU) run through the embedded stack.

    python bench/bytes_per_step.py [--runs a,b,c] [--steps 200,150,120]

(a) the real-job test's DDP job in continuous mode, (b) a job of 50 collectives (40 all-reduces, 10
broadcasts) and 9 host spans a step, (c) the real-job test's job with a manual profiling window of 1.5 s.
Each runs through a real Tansu broker, the worker and chDB (``tests/integration/test_real_jobs.py``'s job and
harness, as ``bench/real_jobs.py`` runs them); then every topic is read back with confluent-kafka and the
job's message values are summed per topic. Tansu keeps its log in memory here, so the figure on the wire is
computed: the values of each partition, batched as their producer batches them (the messages of one
partition produced within its linger: the torch hook's publisher 20 ms, the worker's Faust producer 0, so
only those sent in the same millisecond), compressed with each one's codec (``kafka.compression``, lz4, and
the worker's zstd, ``wiring.worker_compression``). Keys,
headers and Kafka's record framing are not counted. For (c) the bytes of profiled steps are split off:
iteration and pattern records by their ``profiled`` flag, raw batches by the share of their events inside
the rank's profiled steps, each message compressed alone; the same for (a) or (b) where a finding opened
and asked for an automatic window.
Not a test: prints figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import cramjam
import fastavro
import lz4.frame
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "tests")]

import test_real_jobs as real  # noqa: E402  (the test's job and harness: one definition)

from fleetscope.broker import TansuBroker  # noqa: E402
from fleetscope.config import Config, load_config  # noqa: E402
from fleetscope.producers.control import request_profile  # noqa: E402
from fleetscope.producers.publisher.config import PublisherConfig  # noqa: E402
from fleetscope.schemas import CATALOG, EventKind, Topics, decode, decode_event_batch  # noqa: E402
from fleetscope.schemas.pattern_batch import pattern_messages  # noqa: E402
from fleetscope.stack import EmbeddedStack  # noqa: E402
from fleetscope.wiring import worker_compression  # noqa: E402

# argv as the real-job test's JOB: steps, fault (unused), faulty rank, fault step. 40 gradient all-reduces
# over 8 layers (5 buckets each, as DDP buckets them), 10 parameter broadcasts, a host span per layer and
# one for the data: 50 collectives and 9 host spans a step.
MANY_CALLS_JOB = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import fleetscope.producers.torch_hook as fs

steps = int(sys.argv[1])
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
torch.manual_seed(0)
LAYERS, BUCKETS, BROADCASTS = 8, 5, 10
layers = [torch.nn.Linear(256, 256) for _ in range(LAYERS)]
buckets = [torch.zeros(1024 * (1 + b)) for b in range(BUCKETS)]
fs.start()
for step in range(steps):
    with fs.span("data.next"):
        time.sleep(0.004)
        x = torch.randn(32, 256)
    for i, layer in enumerate(layers):
        with fs.span(f"layer{i}.forward_backward"):
            layer(x).pow(2).mean().backward()
        for bucket in buckets:
            dist.all_reduce(bucket)
    for b in range(BROADCASTS):
        dist.broadcast(buckets[b % BUCKETS], src=0)
    time.sleep(0.004)
    fs.step()
fs.stop()
dist.destroy_process_group()
"""

PUBLISHER_TOPICS = ("raw", "heartbeats", "control")
"""Topics the torch hook (and ``fleetscope profile``) write through the Publisher; the worker writes the rest."""
STATE_TOPICS = ("differential-state", "windower-state")
WORKER_LINGER_MS = 0
"""Faust's ``producer_linger_ms``, which the worker leaves at its default."""


def linger_ms(topic: str) -> int:
    if topic.split(":")[0] in PUBLISHER_TOPICS:
        return PublisherConfig(bootstrap_servers="-").linger_ms
    return WORKER_LINGER_MS


@dataclass
class Kept:
    """One message of the job, as read back."""

    topic: str
    partition: int
    timestamp_ms: int
    value: bytes


@dataclass
class Run:
    name: str
    job: str
    steps: int
    messages: dict[str, list[Kept]] = field(default_factory=dict)


def _topic_label(topic: str, topics: Topics) -> str:
    if topic in topics.raw_all:
        return "raw:" + topic.rsplit(".", 1)[-1]
    for label in ("iterations", "patterns", "stalls", "findings", "control", "heartbeats", "deadletter"):
        if topic == getattr(topics, label):
            return label
    return topic.rsplit(".", 1)[-1]  # <prefix>.<app_id>.windower-state, differential-state


def _job_of(key: bytes) -> str:
    """The job a key names: ``job``, ``job/rank``, or a state record's chunk key (``\\x00chunk`` + slot and
    index + the record's key)."""
    if key.startswith(b"\x00chunk"):
        key = key[len(b"\x00chunk") + 5 :]
    return key.split(b"/", 1)[0].decode(errors="replace")


def read_back(config: Config) -> dict[str, dict[str, list[Kept]]]:
    """Every message of every topic of the prefix, by job, then by topic label (fences left out)."""
    topics = Topics(prefix=config.kafka.topic_prefix)
    consumer = Consumer({"bootstrap.servers": config.kafka.bootstrap_servers, "group.id": uuid.uuid4().hex,
                         "enable.auto.commit": False})  # fmt: skip
    names = [t for t in consumer.list_topics(timeout=10).topics if t.startswith(config.kafka.topic_prefix + ".")]
    assigned = []
    for name in names:
        partitions = consumer.list_topics(name, timeout=10).topics[name].partitions
        assigned += [TopicPartition(name, p, OFFSET_BEGINNING) for p in partitions]
    consumer.assign(assigned)
    out: dict[str, dict[str, list[Kept]]] = defaultdict(lambda: defaultdict(list))
    idle = 0
    while idle < 6:
        batch = consumer.consume(1000, 0.5)
        idle = idle + 1 if not batch else 0
        for m in batch:
            key = m.key() or b""
            if m.error() is not None or key.startswith(b"\x00fence"):
                continue
            kept = Kept(_topic_label(m.topic(), topics), m.partition(), m.timestamp()[1], m.value() or b"")
            out[_job_of(key)][kept.topic].append(kept)
    consumer.close()
    return out


def producer_batches(messages: Iterable[Kept], linger_ms: int) -> list[list[bytes]]:
    """The values as a producer batches them: per partition, those produced within ``linger_ms`` of the
    batch's first."""
    by_partition: dict[int, list[Kept]] = defaultdict(list)
    for m in messages:
        by_partition[m.partition].append(m)
    out: list[list[bytes]] = []
    for kept in by_partition.values():
        kept.sort(key=lambda m: m.timestamp_ms)
        first = None
        for m in kept:
            if first is None or m.timestamp_ms - first > linger_ms:
                out.append([])
                first = m.timestamp_ms
            out[-1].append(m.value)
    return out


def compressed(batches: list[list[bytes]], codec: str) -> int:
    if codec == "none":
        return sum(len(v) for b in batches for v in b)
    if codec == "zstd":  # aiokafka's level, the worker's
        return sum(len(cramjam.zstd.compress(b"".join(b), 3)) for b in batches)
    if codec != "lz4":
        raise SystemExit(f"this bench compresses lz4 and zstd only (kafka.compression is {codec!r})")
    return sum(len(lz4.frame.compress(b"".join(b))) for b in batches)


def codec_of(topic: str, config: Config) -> str:
    """The torch hook's publisher compresses with ``kafka.compression``, the worker with its own codec."""
    if topic.split(":")[0] in PUBLISHER_TOPICS:
        return config.kafka.compression
    return worker_compression(config)


def rank_steps(run: Run) -> int:
    """Iteration records of the job, each (rank, iteration) once (a replay may repeat one)."""
    seen = set()
    for m in run.messages.get("iterations", []):
        _, rec = decode(m.value)
        seen.add((rec["rank"], rec["iteration"]))
    return len(seen)


def report(run: Run, config: Config) -> dict[str, float]:
    """Print the run's per-topic table; return wire bytes per rank-step by topic."""
    n = rank_steps(run)
    print(f"\n({run.name}) job {run.job}: {n} rank-steps ({n / max(1, real.WORLD):.0f} steps x {real.WORLD} ranks)")
    print(f"  {'topic':22} {'msgs':>7} {'values B':>11} {'wire B':>11} {'B/rank-step':>12} {'values/step':>12}")
    per_step: dict[str, float] = {}
    total = 0.0
    for topic in sorted(run.messages):
        msgs = run.messages[topic]
        values = sum(len(m.value) for m in msgs)
        wire = compressed(producer_batches(msgs, linger_ms(topic)), codec_of(topic, config))
        per_step[topic] = wire / max(1, n)
        total += per_step[topic]
        print(f"  {topic:22} {len(msgs):7d} {values:11d} {wire:11d} {per_step[topic]:12.0f} {values / max(1, n):12.0f}")
    values = {t: sum(len(m.value) for m in run.messages.get(t, [])) for t in ("patterns", *STATE_TOPICS)}
    on_wire = sum(per_step.get(t, 0.0) for t in STATE_TOPICS) / max(per_step.get("patterns", 0.0), 1e-9)
    by_value = sum(values[t] for t in STATE_TOPICS) / max(values["patterns"], 1)
    print(f"  total {total:.0f} B = {total / 1000:.2f} KB per rank-step on the wire")
    print(
        f"  state records / pattern records: {100 * by_value:.1f} % of their values, {100 * on_wire:.1f} % on the wire"
    )
    return per_step


def pattern_fields(run: Run, profiled: bool) -> None:
    """Where a pattern record's bytes go: each field of the newest schema encoded alone, averaged."""
    schema = json.loads(CATALOG.latest("patterns").json)
    carried = [element for m in run.messages.get("patterns", []) for element in pattern_messages(m.value)]
    records = [rec for value in carried for _, rec in [decode(value, fast=False)]]
    records = [r for r in records if bool(r.get("profiled")) == profiled]
    if not records:
        return
    sizes: dict[str, int] = defaultdict(int)
    for f in schema["fields"]:  # self-contained: each field's named types are spelled out in it
        alone = fastavro.parse_schema({"type": "record", "name": "alone", "fields": [f]})
        for rec in records:
            out = _Sink()
            fastavro.schemaless_writer(out, alone, {f["name"]: rec.get(f["name"])})
            sizes[f["name"]] += out.n
    functions = sum(len(r["function"]) for r in records) / len(records)
    whole = sum(sizes.values()) / len(records)
    groups: dict[str, list[str]] = defaultdict(list)  # per-function columns by item type, the rest apart
    for f in schema["fields"]:
        array = isinstance(f["type"], dict) and f["type"].get("type") == "array"
        items = f["type"]["items"] if array else None
        groups["per record" if not array else f"{items} columns" if isinstance(items, str) else "other"].append(
            f["name"]
        )
    parts = []
    for group, names in sorted(groups.items()):
        per = len(records) * (1 if group == "per record" else functions)
        parts.append(f"{group} ({len(names)}) {sum(sizes[n] for n in names) / per:.0f}")
    shown = ", ".join(parts)
    kind = "profiled" if profiled else "continuous"
    print(f"  {kind} pattern record: {whole:.0f} B, {functions:.1f} functions; B per function by column type "
          f"(B per record for the fields of the record): {shown}")  # fmt: skip


class _Sink:
    def __init__(self) -> None:
        self.n = 0

    def write(self, data: bytes) -> int:
        self.n += len(data)
        return len(data)


def profiled_cost(run: Run, config: Config) -> None:
    """Bytes of the job's profiled rank-steps, per profiled rank-step, by topic."""
    windows: dict[int, list[tuple[int, int]]] = defaultdict(list)
    profiled_steps = set()
    for m in run.messages.get("iterations", []):
        _, rec = decode(m.value)
        if rec["profiled"]:
            windows[rec["rank"]].append((rec["start_ns"], rec["end_ns"]))
            profiled_steps.add((rec["rank"], rec["iteration"]))
    n = len(profiled_steps)
    if not n:
        print("  no profiled step (the window did not open)")
        return
    print(f"  profiled: {n} rank-steps; their bytes per profiled rank-step on the wire:")
    total = 0.0
    for topic in sorted(run.messages):
        shares: list[tuple[Kept, float]] = []
        for m in run.messages[topic]:
            share = _profiled_share(topic, m.value, windows)
            if share > 0:
                shares.append((m, share))
        if not shares:
            continue
        codec = codec_of(topic, config)
        wire = sum(share * compressed([[m.value]], codec) for m, share in shares)  # each compressed alone
        total += wire / n
        print(f"    {topic:22} {wire / n:10.0f}")
    print(f"    total {total:.0f} B = {total / 1000:.2f} KB per profiled rank-step")


def _any_profiled(run: Run) -> bool:
    return any(decode(m.value)[1]["profiled"] for m in run.messages.get("iterations", []))


def _profiled_share(topic: str, value: bytes, windows: dict[int, list[tuple[int, int]]]) -> float:
    if topic in ("iterations", "patterns"):
        _, rec = decode(value)
        return 1.0 if rec.get("profiled") else 0.0
    if not topic.startswith("raw:"):
        return 0.0
    batch = decode_event_batch(value)
    times = batch["t_ns"] if batch.kind is EventKind.SAMPLES else batch["start_ns"]  # near enough to split
    spans = windows.get(batch.header.rank, [])
    if not len(times) or not spans:
        return 0.0
    inside = sum(int(((times >= a) & (times < b)).sum()) for a, b in spans)
    return inside / len(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="a,b,c", help="which runs: a (continuous), b (50 calls), c (profiled)")
    ap.add_argument("--steps", default="200,150,120", help="steps of a, b, c")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a setting (streams.state_share=0.03)"
    )
    args = ap.parse_args(argv)
    steps = dict(zip("abc", (int(s) for s in args.steps.split(",")), strict=True))
    runs = args.runs.split(",")
    with tempfile.TemporaryDirectory(prefix="fleetscope-bytes-") as tmp:
        broker = TansuBroker(log_path=Path(tmp) / "tansu.log")
        servers = broker.start()
        config = load_config(env={}, overrides={
            "data_dir": tmp, "kafka.bootstrap_servers": servers, "kafka.topic_prefix": f"b{uuid.uuid4().hex[:6]}",
            "store.url": f"chdb://{tmp}/store", "store.database": "bytes",
        } | dict(kv.split("=", 1) for kv in args.set))  # fmt: skip
        script, many = Path(tmp) / "job.py", Path(tmp) / "many_calls.py"
        script.write_text(real.JOB)
        many.write_text(MANY_CALLS_JOB)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE")} | {
            "FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS": servers, "FLEETSCOPE__DATA_DIR": tmp,
            "FLEETSCOPE__KAFKA__TOPIC_PREFIX": config.kafka.topic_prefix,
            "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
        }  # fmt: skip
        done: list[Run] = []
        try:
            with EmbeddedStack(config) as stack:
                live = real.Live(stack, config, "bytes", script, env)
                for name in runs:
                    started = time.monotonic()
                    n = steps[name]
                    job = live.launch(steps=n, script=many if name == "b" else None)
                    try:
                        if name == "c":
                            real._wait_for_steps(live, job.name, n // 2 - 10, timeout_s=120)
                            request_profile(config, job.name, 1.5, "bytes bench", start_in_s=0.5)
                        job.wait(timeout_s=600)
                        real._wait_for_steps(live, job.name, n - 2, timeout_s=90)
                        time.sleep(config.streams.job_idle_ms / 1000 + 3.0)  # the idle flush's state record
                    finally:
                        job.kill()
                    done.append(Run(name, job.name, n))
                    print(f"({name}) {job.name}: {n} steps in {time.monotonic() - started:.0f} s", flush=True)
        finally:
            broker_messages = read_back(config) if done else {}
            broker.stop()
    print(f"\ncodecs: the publisher's {codec_of('raw', config)}, the worker's {codec_of('patterns', config)}; "
          f"linger: the publisher's {linger_ms('raw')} ms, the worker's {WORKER_LINGER_MS} ms")  # fmt: skip
    for run in done:
        run.messages = dict(broker_messages.get(run.job, {}))
        report(run, config)
        pattern_fields(run, profiled=False)
        if run.name == "c" or _any_profiled(run):  # (a) and (b) too where a finding asked for a window
            pattern_fields(run, profiled=True)
            profiled_cost(run, config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
