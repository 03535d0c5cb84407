"""Real 4-rank PyTorch jobs (tests/integration/test_real_jobs.py's job, gloo on CPU) recorded under load, then
replayed through today's differential: how a rule change does on the same real arrivals, before and after.

    python bench/real_jobs.py record DIR [--jobs compute,dataloader,gc,none] [--load steady|bursty|none]
                                         [--layout tp2dp2|fsdp|hsdp|dtensor|varying|pipe]
    python bench/real_jobs.py replay DIR
    python bench/real_jobs.py export DIR NAME...   (into tests/data/real_jobs, which a unit test replays)

``record`` runs each job (faults from step 30, healthy ones as the test runs them: 300 steps, a manual
profiling window past step 120) through the embedded stack (real Tansu broker, worker and chDB) beside a
background load, and writes every pattern message the windower published for it and its heartbeats, byte for
byte, with the findings the live worker stored. ``replay`` feeds those messages to ``DifferentialStage`` in
publication order and prints each job's opened findings and whether they meet the real-job test's bar: the
faulty rank named within 10 iterations of the fault and no culprit rank other than it (a healthy job: nothing
at all), and how far the iterations replayed from the ranks' timelines are from their measured times. Not a
test: what a run records depends on the machine's load.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "integration"), str(ROOT / "tests")]

import recorded_jobs  # noqa: E402  (the unit tests' recorded jobs: their format)
import test_real_jobs as real  # noqa: E402  (the test's job, faults and harness: one definition)

from fleetscope.broker import TansuBroker  # noqa: E402
from fleetscope.config import load_config  # noqa: E402
from fleetscope.schemas import Topics, decode  # noqa: E402
from fleetscope.schemas.pattern_batch import pattern_messages  # noqa: E402
from fleetscope.stack import EmbeddedStack  # noqa: E402
from fleetscope.streams.differential import DifferentialStage  # noqa: E402

Message = tuple[int, int, int, bytes]
"""partition, offset, broker timestamp (ms), value"""


def _load(kind: str, seconds: float, seed: int) -> None:
    """A background CPU load: always busy (steady) or busy 0.2-2 s, idle 0.2-3 s at random (bursty)."""
    rng, end = random.Random(seed), time.monotonic() + seconds
    while time.monotonic() < end:
        busy = time.monotonic() + (rng.uniform(0.2, 2.0) if kind == "bursty" else 1.0)
        while time.monotonic() < busy:
            sum(range(5000))
        if kind == "bursty":
            time.sleep(rng.uniform(0.2, 3.0))


def _patterns(config: object, job: str) -> list[Message]:
    """The job's pattern records and heartbeats (a rank in a profiling window says so in its heartbeats: its
    records are late, not missing), as the differential reads them."""
    topics = Topics(prefix=config.kafka.topic_prefix)
    consumer = Consumer({"bootstrap.servers": config.kafka.bootstrap_servers, "group.id": uuid.uuid4().hex})
    assigned = []
    for topic in (topics.patterns, topics.heartbeats):
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        assigned += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions]
    consumer.assign(assigned)
    out: list[Message] = []
    idle = 0
    while idle < 5:
        batch = consumer.consume(500, 0.5)
        idle = idle + 1 if not batch else 0
        out += [(m.partition(), m.offset(), m.timestamp()[1], m.value() or b"") for m in batch
                if m.error() is None and m.key() == job.encode()]  # fmt: skip
    consumer.close()
    return out


def record(folder: Path, jobs: list[str], load: str, layout: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    loads = [multiprocessing.Process(target=_load, args=(load, 3600.0, i), daemon=True) for i in range(2)]
    with tempfile.TemporaryDirectory(prefix="fleetscope-real-") as tmp:
        broker = TansuBroker(log_path=Path(tmp) / "tansu.log")
        servers = broker.start()
        config = load_config(env={}, overrides={
            "data_dir": tmp, "kafka.bootstrap_servers": servers, "kafka.topic_prefix": f"real{uuid.uuid4().hex[:6]}",
            "store.url": f"chdb://{tmp}/store", "store.database": "real",
        })  # fmt: skip
        script = Path(tmp) / ("pipeline_job.py" if layout == "pipe" else "job.py")
        script.write_text(real.PIPELINE_JOB if layout == "pipe" else real.JOB)  # pipe: the test's dp2 x pp2, healthy
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE")} | {
            "FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS": servers, "FLEETSCOPE__DATA_DIR": tmp,
            "FLEETSCOPE__KAFKA__TOPIC_PREFIX": config.kafka.topic_prefix,
            "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
        }  # fmt: skip
        try:
            with EmbeddedStack(config) as stack:
                for process in loads if load != "none" else []:
                    process.start()
                live = real.Live(stack, config, "real", script, env)
                for fault in jobs:
                    faulty = real.FAULTS[fault][0] if fault in real.FAULTS else -1
                    steps = real.FAULT_STEPS if fault in real.FAULTS else real.HEALTHY_STEPS
                    if fault in real.FAULTS:
                        job = live.launch(fault, faulty, steps=steps, layout=layout)
                    else:
                        job = real.launch_healthy(live, layout)
                    try:
                        job.wait(timeout_s=600)
                        real._wait_for_steps(live, job.name, steps - 2, timeout_s=60)
                        found = live.wait_for(job.name, lambda _: False, timeout_s=real.SETTLE_S)
                    finally:
                        job.kill()
                    saved = {"fault": fault, "faulty": faulty, "load": load, "found": found,
                             "messages": _patterns(config, job.name)}  # fmt: skip
                    (folder / f"{job.name}.pkl").write_bytes(pickle.dumps(saved))
                    print(f"{job.name}: {len(saved['messages'])} messages; live: {verdict(fault, found)}", flush=True)
        finally:
            for process in loads:
                if process.is_alive():
                    process.terminate()
            broker.stop()


def verdict(fault: str, updates: list[dict[str, object]]) -> str:
    """Opened findings as category:rank@iteration, then OK or BAD by the real-job test's bar."""
    opened = [u for u in updates if u["status"] == "open"]
    missed = recorded_jobs.missed_bar(fault, opened)
    text = " ".join(f"{u['category']}:{u['rank']}@{u['iteration_last']}" for u in opened) or "nothing"
    return f"OK  {text}" if missed is None else f"BAD {text} ({missed})"


def replay_error(messages: list[Message]) -> str:
    """How far the replayed iteration time is from the measured one, per iteration (``recorded_jobs.replay_errors``):
    the median and 90th percentile of its size, the largest, and the mean with its sign (a rank late at one
    iteration's end is early at the next's: the signs alternate, the mean is near zero)."""
    ordered = sorted(messages, key=lambda m: (m[2], m[0], m[1]))
    errors = recorded_jobs.replay_errors([value for _, _, _, value in ordered])
    known = np.array([e for e in errors if e is not None])
    if not known.size:
        return f"no iteration with every rank's timeline (of {len(errors)})"
    size = np.abs(known)
    text = f"|replayed - measured| / measured, {known.size} iterations: median {100 * np.median(size):.1f} %"
    text += f", p90 {100 * np.percentile(size, 90):.1f} %, max {100 * size.max():.1f} %"
    text += f"; mean {100 * known.mean():+.2f} %"
    return text + (f"; {len(errors) - known.size} without a timeline" if known.size < len(errors) else "")


def replay(folder: Path) -> int:
    bad = 0
    for path in sorted(folder.glob("*.pkl")):
        saved = pickle.loads(path.read_bytes())
        stage = DifferentialStage()
        updates: list[dict[str, object]] = []
        for _, _, ts_ms, value in sorted(saved["messages"], key=lambda m: (m[2], m[0], m[1])):
            taken = stage.take(value, ts_ms * 1_000_000)
            if taken.reason:
                print(f"  {path.name}: refused: {taken.reason}")
            updates += taken.findings
        for job in list(stage.jobs):
            updates += stage.flush(job)
        line = verdict(saved["fault"], updates)
        bad += line.startswith("BAD")
        print(f"{path.stem:24} {saved['fault']:10} {saved['load']:7} now: {line}")
        print(f"{'':43} live: {verdict(saved['fault'], saved['found'])}")
        print(f"{'':43} replay: {replay_error(saved['messages'])}")
    print(f"{bad} job(s) below the bar")
    return 0


def export(folder: Path, names: list[str]) -> None:
    """Save the named recordings' pattern records, in publication order, as the unit tests' recorded jobs."""
    for name in names:
        saved = pickle.loads((folder / f"{name}.pkl").read_bytes())
        messages = sorted(saved["messages"], key=lambda m: (m[2], m[0], m[1]))
        carried = [element for _, _, _, value in messages for element in pattern_messages(value)]  # batches unpacked
        values = [value for value in carried if decode(value)[0] == "patterns"]
        path = recorded_jobs.RECORDED / recorded_jobs.file_name(saved["fault"], saved["faulty"], name.split("-")[-1])
        recorded_jobs.save(path, values)
        print(f"{path}: {len(values)} pattern records, {path.stat().st_size} bytes")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run real jobs under load and save their pattern messages")
    rec.add_argument("folder", type=Path)
    rec.add_argument("--jobs", default="compute,dataloader,gc,none", help="faults (none: healthy), in order")
    rec.add_argument("--load", choices=("steady", "bursty", "none"), default="bursty")
    layouts = ("", "tp2dp2", "fsdp", "hsdp", "dtensor", "varying", "pipe")
    rec.add_argument("--layout", choices=layouts, default="", help="the job's layout (default: DDP)")
    rep = sub.add_parser("replay", help="replay saved jobs through today's differential")
    rep.add_argument("folder", type=Path)
    exp = sub.add_parser("export", help="save recordings as the unit tests' recorded jobs (tests/data/real_jobs)")
    exp.add_argument("folder", type=Path)
    exp.add_argument("names", nargs="+", help="recordings (file names without .pkl)")
    args = ap.parse_args(argv)
    if args.command == "record":
        record(args.folder, args.jobs.split(","), args.load, args.layout)
        return 0
    if args.command == "export":
        export(args.folder, args.names)
        return 0
    return replay(args.folder)


if __name__ == "__main__":
    raise SystemExit(main())
