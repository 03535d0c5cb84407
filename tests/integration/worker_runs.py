"""Runs of a simulated job through real stream workers while workers join, leave, are SIGKILLed or stall: a
configuration per run (built on tests/harness.py's ``isolated_config``), a paced publisher, the actions on
workers, and the stored outcome a run is compared by (row counts, finding updates, findings).

Used by test_multi_worker, test_worker_restart, test_split_stages and test_chaos; the one-worker reference
run they compare with is a session fixture (``one_worker_run`` in this folder's conftest).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from harness import isolated_config

from fleetscope.broker import ensure_topics
from fleetscope.config import Config
from fleetscope.demo import check_delivered
from fleetscope.producers import Publisher, SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import Topics
from fleetscope.sinks import table_counts
from fleetscope.stack import EmbeddedStack, StreamWorkerProcess
from fleetscope.wiring import bulk_publisher_config

BATCHES_PER_RANK_ITERATION = 4
"""The simulator sends kernels, collectives, host spans and link samples: four batches per rank and iteration."""


@dataclass(frozen=True)
class Job:
    """A simulated job and the pause between its iterations while it is published (0: as fast as it goes)."""

    sim: SimulatorConfig
    pace_s: float = 0.0

    @property
    def expected_rows(self) -> int:
        """Iteration rows a complete run stores."""
        return self.sim.ranks * self.sim.expected_iterations


MOVING_JOB = Job(
    SimulatorConfig(job="moving-job", ranks=8, iterations=30, faults=(parse_fault("slow_gpu:5:1.5"),)), pace_s=0.25
)
"""The job of every run compared with the one-worker reference: long enough (about 8 s published at its pace)
for partitions to move while it runs, and a slow GPU the findings must name with the same first iteration."""

QUICK_HANDOVER: dict[str, object] = {"kafka.session_timeout_ms": 3000}
"""A dead or stalled worker's partitions move after 3 s instead of 6: shorter runs (the one-worker reference
keeps the default; nothing it stores depends on the session timeout). Runs whose partitions move while a job
runs add a job idle time three times as long (test_multi_worker.HANDOVER_TIMING): with 3 s and the default
2 s idle, a stalled worker's job was flushed twice in one run of two (one finding update more than one
worker's)."""

UPDATES_SQL = "SELECT finding_id, version, status, category, rank FROM {db}finding_updates ORDER BY finding_id, version"
FINDINGS_SQL = (
    "SELECT finding_id, status, version, category, rank, iteration_first, iteration_last FROM {db}findings "
    "ORDER BY finding_id"
)


def run_config(data_dir: Path, broker: str, store_url: str, database: str | None = None, **overrides: object) -> Config:
    """A configuration of its own for one run (``isolated_config``) in a folder of its own under ``data_dir``,
    with a database of its own; ``{data_dir}`` in ``store_url`` is that folder."""
    folder = data_dir / uuid.uuid4().hex[:8]
    settings = {"store.url": store_url.format(data_dir=folder), **overrides}
    return isolated_config("t", folder, database=database or f"t_{folder.name}", broker=broker, overrides=settings)


def stage_config(config: Config, *stages: str) -> Config:
    """The configuration of one app of the split deployment: its stages, and a consumer group of its own."""
    streams = dataclasses.replace(config.streams, app_id=f"{config.streams.app_id}-{'-'.join(stages)}", stages=stages)
    return config.replace(streams=streams)


def quiet_s(config: Config) -> float:
    """How long nothing new must be stored before a run counts as settled: the windower closes an idle rank's
    last step, then the differential flushes the idle job, with a margin."""
    return (config.streams.job_idle_ms + config.streams.windower.idle_close_ms) / 1000 + 1.5


def wait_settled(
    progress: Callable[[], int],
    ready: Callable[[], bool],
    quiet: float,
    timeout_s: float,
    on_poll: Callable[[], None] = lambda: None,
    poll_s: float = 0.2,
) -> None:
    """Poll until ``ready()`` holds and ``progress()`` (a count of what was stored; negative while unknown) has
    not moved for ``quiet`` seconds; ``on_poll`` runs at every poll (actions on workers, liveness checks)."""
    deadline = time.monotonic() + timeout_s
    last, since = -2, time.monotonic()
    while True:
        on_poll()
        now = time.monotonic()
        current = progress()
        if current != last or current < 0:
            last, since = current, now
        if ready() and now - since >= quiet:
            return
        if now > deadline:
            raise TimeoutError(f"not settled within {timeout_s} s (progress {current})")
        time.sleep(poll_s)


class Publishing(threading.Thread):
    """Publishes a job from a thread, as the training hosts would while workers change under it. A paced job
    is flushed and paused after each iteration; ``published`` counts the iterations sent."""

    def __init__(self, config: Config, job: Job) -> None:
        super().__init__(daemon=True, name="publishing")
        self.config, self.job = config, job
        self.published = 0
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        per_iteration = self.job.sim.ranks * BATCHES_PER_RANK_ITERATION
        try:
            with Publisher(bulk_publisher_config(self.config)) as publisher:
                for i, batch in enumerate(simulate(self.job.sim), start=1):
                    publisher.publish(batch)
                    if i % per_iteration == 0:
                        self.published += 1
                        if self.job.pace_s > 0:
                            publisher.flush(5.0)
                            time.sleep(self.job.pace_s)
                publisher.flush(60.0)
            check_delivered(publisher.stats, self.config.kafka.bootstrap_servers)
        except BaseException as e:  # the waiting test raises it
            self.error = e
        self.done.set()

    def past(self, fraction: float) -> bool:
        """Whether this share of the job's iterations has been published."""
        return self.published >= fraction * self.job.sim.iterations

    def finished(self) -> bool:
        """Everything published and delivered (raises what publishing raised)."""
        if self.error is not None:
            raise self.error
        return self.done.is_set()


Workers = Sequence[StreamWorkerProcess]
Action = Callable[[Workers], None]


def _each_later(workers: Workers, do: Callable[[StreamWorkerProcess], None]) -> Callable[[], None]:
    """Start ``do`` to every worker at once (a worker's start or drain takes seconds); the returned call
    waits for all of them and raises the first failure."""
    errors: list[BaseException] = []

    def one(worker: StreamWorkerProcess) -> None:
        try:
            do(worker)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()

    def wait() -> None:
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    return wait


def _each(workers: Workers, do: Callable[[StreamWorkerProcess], None]) -> None:
    """``do`` to every worker at once, raising the first failure."""
    _each_later(workers, do)()


def join(workers: Workers) -> None:
    """Workers join their groups (started together, each ready before this returns)."""
    _each(workers, lambda w: w.start())


def leave(workers: Workers) -> None:
    """Workers leave their groups cleanly (drained and stopped)."""
    _each(workers, lambda w: w.stop())


def kill(workers: Workers) -> None:
    """SIGKILL, as a crash: no drain, no commit; their partitions move after the session timeout."""
    for w in workers:
        w.kill()


def stall(workers: Workers) -> None:
    """SIGSTOP past the session timeout (their partitions go to the other workers), then SIGCONT: they come
    back and rejoin."""
    pids = [pid for w in workers if (pid := w.pid) is not None]
    assert len(pids) == len(workers), "a stalled worker must be running"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(max(w.config.kafka.session_timeout_ms for w in workers) / 1000 * 1.5)
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def stop_all(workers: Workers) -> None:
    """Stop every worker that runs, all at once."""
    _each([w for w in workers if w.alive()], lambda w: w.stop())


@dataclass
class Step:
    """What happens to which workers once the run is due (``Run.due``)."""

    action: Action
    workers: Workers


@dataclass
class Outcome:
    """What a run stored, and when it acted."""

    counts: dict[str, int]
    updates: list[tuple[Any, ...]] = field(default_factory=list)
    findings: list[tuple[Any, ...]] = field(default_factory=list)
    acted_at_rows: int = -1
    acted_before_end: bool = False
    act_s: float = 0.0
    sink_messages: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds spent starting the stack and the workers, publishing and settling, querying, stopping."""

    def categories(self) -> set[tuple[str, int]]:
        """(category, rank) of every finding."""
        return {(str(f[3]), int(f[4])) for f in self.findings}


def third_published(publishing: Publishing, _rows: int) -> bool:
    """Due once a third of the job is published: the rest flows while partitions move."""
    return publishing.past(1 / 3)


class GroupOffsets:
    """The offsets the stream workers' consumer groups committed, summed: a stage that takes records moves it
    (the differential commits a job's pattern records once their iteration is scored). Part of a run's
    progress: after a rebalance a differential can score a job's last iteration long after the store last
    changed, and the job's idle flush (its findings' last update) is due ``job_idle_ms`` after that."""

    def __init__(self, config: Config, workers: Workers) -> None:
        k = config.kafka
        topics = Topics(prefix=k.topic_prefix)
        derived = (topics.patterns, topics.stalls, topics.heartbeats)
        self.partitions = [TopicPartition(t, p) for t in topics.raw_all for p in range(k.raw_partitions)]
        self.partitions += [TopicPartition(t, p) for t in derived for p in range(k.derived_partitions)]
        self.probes = [
            Consumer({**k.admin_settings(), "group.id": group, "enable.auto.commit": False})
            for group in sorted({w.config.streams.app_id for w in workers})
        ]  # never subscribed: they only read what the groups committed, and join no group

    def total(self) -> int:
        """Sum of the committed offsets (-1 when a probe cannot tell now)."""
        try:
            return sum(max(tp.offset, 0) for probe in self.probes for tp in probe.committed(self.partitions, 5))
        except KafkaException:
            return -1

    def close(self) -> None:
        for probe in self.probes:
            probe.close()


def run_pipeline(
    config: Config,
    job: Job,
    workers: Workers,
    steps: Sequence[Step] = (),
    due: Callable[[Publishing, int], bool] = third_published,
    timeout_s: float = 240.0,
) -> Outcome:
    """Publish ``job`` to an embedded stack (broker given, in-process sink into chDB) whose stream ``workers``
    start first; once ``due``, take the ``steps`` in order; wait until everything is stored and quiet; return
    what the store holds. Every worker named, started or not, is stopped at the end."""
    everyone = list(dict.fromkeys([*workers, *(w for s in steps for w in s.workers)]))
    running = set(workers)
    outcome = Outcome(counts={})
    t0 = time.monotonic()

    def lap(phase: str) -> None:
        outcome.phases[phase] = round(time.monotonic() - t0 - sum(outcome.phases.values()), 1)

    k = config.kafka
    ensure_topics(k.admin_settings(), Topics(prefix=k.topic_prefix), k.raw_partitions, k.derived_partitions)
    started = _each_later(workers, lambda w: w.start())  # the workers boot while the store and sink start
    stack = EmbeddedStack(config, with_worker=False)
    try:
        stack.start()
        sink, client = stack.sink, stack.client
        assert sink is not None and client is not None
        started()
        lap("start")
        publishing = Publishing(stack.config, job)
        publishing.start()

        def act() -> None:
            rows = sink.stats["iterations"]
            if steps and outcome.acted_at_rows < 0 and due(publishing, rows):
                outcome.acted_at_rows, outcome.acted_before_end = rows, not publishing.done.is_set()
                began = time.monotonic()
                for step in steps:
                    step.action(step.workers)
                    if step.action in (leave, kill):
                        running.difference_update(step.workers)
                    elif step.action is join:
                        running.update(step.workers)
                outcome.act_s = time.monotonic() - began
            dead = [w.log_path for w in running if not w.alive()]
            assert not dead, f"a stream worker died; see {dead}"

        def stored() -> int:
            stats = sink.stats
            committed = offsets.total()
            rows = stats["iterations"] + stats["function_patterns"] + stats["finding_updates"]
            return -1 if committed < 0 else rows + committed

        def ready() -> bool:
            return publishing.finished() and sink.stats["iterations"] >= job.expected_rows

        offsets = GroupOffsets(config, everyone)
        try:
            wait_settled(stored, ready, quiet_s(config), timeout_s, on_poll=act)
        finally:
            offsets.close()
        lap("run")
        db = f"{config.store.database}."
        outcome.counts = table_counts(client, config.store.database)
        outcome.updates = client.query(UPDATES_SQL.format(db=db)).result_rows
        outcome.findings = client.query(FINDINGS_SQL.format(db=db)).result_rows
        outcome.sink_messages = sink.stats["messages"]
        lap("query")
    finally:
        with contextlib.suppress(BaseException):
            started()  # a worker still booting when the stack failed is stopped too
        stop_all(everyone)
        stack.stop()
    lap("stop")
    return outcome
