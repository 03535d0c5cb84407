"""What the integration tests share: a configuration isolated per test, polling instead of fixed sleeps,
reading a topic by assignment, publishing simulated jobs at once, one demo run of a job with a slow GPU.

Importable from every test as ``harness`` (pyproject's ``pythonpath``); the fixtures that build on it are in
tests/conftest.py."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition

from fleetscope.broker import ensure_topics
from fleetscope.config import Config, load_config
from fleetscope.demo import DemoResult, publish_simulation, run_demo
from fleetscope.producers import SimulatorConfig, parse_fault
from fleetscope.producers.publisher import PublisherStats
from fleetscope.progress import Progress
from fleetscope.schemas import EventBatch, Topics
from fleetscope.sinks.alerts import AlertFollower, AlertsConfig

T = TypeVar("T")


def isolated_config(
    name: str,
    data_dir: Path,
    chdb_path: Path | None = None,
    database: str | None = None,
    broker: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """A configuration of its own: topics prefix and stream app id ``<name><random tag>``, its data directory,
    its chDB database (the session's chDB directory holds one per test), the session broker when given
    (otherwise the embedded stack starts one)."""
    tag = uuid.uuid4().hex[:8]
    settings: dict[str, Any] = {
        "data_dir": str(data_dir),
        "kafka.topic_prefix": f"{name}{tag}",
        "streams.app_id": f"{name}-{tag}",
    }
    if chdb_path is not None:
        settings["store.url"] = f"chdb://{chdb_path}"
    if database is not None:
        settings["store.database"] = database
    if broker is not None:
        settings["kafka.bootstrap_servers"] = broker
    return load_config(env={}, overrides={**settings, **(overrides or {})})


def wait_until(probe: Callable[[], T], timeout_s: float, interval_s: float = 0.2) -> T:
    """Poll ``probe`` until it returns something truthy or ``timeout_s`` passes; return its last answer (the
    caller asserts on it, so a timeout fails with the value that was seen)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval_s)


def read_topic(
    bootstrap: str,
    topics: Iterable[str],
    until: Callable[[list[Message]], bool],
    timeout_s: float,
    idle_s: float = 0.0,
) -> list[Message]:
    """Every message of ``topics`` from the start of each partition, in offset order per partition, until
    ``until(messages)`` holds and nothing more came for ``idle_s`` (or ``timeout_s`` passes). Assigned
    partitions, no group join: Tansu holds a join for half the session timeout."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})  # fmt: skip
    out: list[Message] = []
    try:
        assigned = []
        for topic in topics:
            partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            assigned += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions]
        consumer.assign(assigned)
        deadline = last = time.monotonic()
        deadline += timeout_s
        while time.monotonic() < deadline and not (until(out) and time.monotonic() - last >= idle_s):
            for msg in consumer.consume(100, 0.2):
                if msg.error() is None:
                    out.append(msg)
                    last = time.monotonic()
    finally:
        consumer.close()
    return out


def publish_at_once(config: Config, jobs: Iterable[SimulatorConfig]) -> float:
    """Publish every job from its own thread, all at once, as concurrent jobs do; return the seconds taken."""
    t0 = time.monotonic()
    threads = [threading.Thread(target=publish_simulation, args=(config, sim, Progress(enabled=False))) for sim in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - t0


SLOW_GPU_RANK = 11
"""The rank whose GPU runs 1.5x slow in ``slow_gpu_run`` (on node001: 8 GPUs a host)."""


@dataclass(frozen=True)
class SlowGpuRun:
    """A finished demo run (its store stays readable) and what an alert follower of its job received."""

    config: Config
    sim: SimulatorConfig
    result: DemoResult
    alerts: list[tuple[int, dict[str, Any]]]
    """(receipt time in ns, alert), in order of receipt."""


def slow_gpu_run(config: Config, alert_wait_s: float) -> SlowGpuRun:
    """The demo on 16 ranks for 20 iterations an hour ago, rank ``SLOW_GPU_RANK``'s GPU 1.5x slow, followed
    by an alert follower started before it; waits up to ``alert_wait_s`` after the run for the follower to
    catch up. One run serves every test that reads a finished store or follows its findings (a stack start-up
    costs seconds each)."""
    sim = SimulatorConfig(
        job="it-job", ranks=16, iterations=20, start_ns=time.time_ns() - 3_600 * 10**9,  # this week's, for SQL
        faults=(parse_fault(f"slow_gpu:{SLOW_GPU_RANK}:1.5"),),
    )  # fmt: skip
    k = config.kafka
    ensure_topics(k.admin_settings(), Topics(prefix=k.topic_prefix), k.raw_partitions, k.derived_partitions)
    alerts: list[tuple[int, dict[str, Any]]] = []
    follower = AlertFollower(
        AlertsConfig(bootstrap_servers=k.bootstrap_servers, topic_prefix=k.topic_prefix, job=sim.job),
        lambda alert: alerts.append((time.time_ns(), alert)),
    )
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert follower.ready.wait(10), "the alert follower is positioned before the run"
        result = run_demo(config, sim, Progress(enabled=False), timeout_s=180)
        wait_until(lambda: len(alerts) >= sum(f["version"] for f in result.findings), alert_wait_s, 0.05)
    finally:
        stop.set()
        thread.join(10)
    return SlowGpuRun(config=config, sim=sim, result=result, alerts=list(alerts))


class CollectingPublisher:
    """A publisher that keeps the batches a real rank's recorder sends (no broker: the caller reads them)."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []

    def start(self) -> None:
        pass

    def publish(self, batch: EventBatch) -> bool:
        self.batches.append(batch)
        return True

    def publish_record(self, topic: str, key: bytes, value: bytes, n_events: int = 0) -> bool:
        return True

    @property
    def topics(self) -> Topics:
        return Topics(prefix="t")

    def stop(self, timeout_s: float = 10.0) -> None:
        pass

    @property
    def stats(self) -> PublisherStats:
        return PublisherStats(published=len(self.batches))
