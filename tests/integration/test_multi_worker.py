"""Several stream workers in one consumer group store exactly what one worker stores, while partitions move.

A worker joins mid-run, leaves cleanly mid-run, is SIGKILLed while its peer goes on, or stalls past the
session timeout and comes back: the windower's per-rank and the differential's per-job state must move with
their partitions (restored from the state topics by the new owner before it touches a message), and a
rebalance must never look like a hang. Each run is compared with a one-worker run of the same job.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fleetscope.config import Config, load_config
from fleetscope.demo import publisher_config
from fleetscope.producers import Publisher, SimulatorConfig, parse_fault, simulate
from fleetscope.sinks import table_counts
from fleetscope.stack import EmbeddedStack, StreamWorkerProcess

pytestmark = pytest.mark.integration

SIM = SimulatorConfig(job="multi-job", ranks=8, iterations=30, faults=(parse_fault("slow_gpu:5:1.5"),))
EXPECTED_ROWS = SIM.ranks * SIM.expected_iterations
PACE_S = 0.25
"""Pause between iterations while publishing: the job runs while partitions move."""


@dataclass
class Run:
    counts: dict[str, int]
    updates: list[tuple[Any, ...]] = field(default_factory=list)
    findings: list[tuple[Any, ...]] = field(default_factory=list)
    acted_at_rows: int = -1
    acted_before_end: bool = False


Action = Callable[[StreamWorkerProcess, StreamWorkerProcess], None]


def _publish(config: Config, third: threading.Event, done: threading.Event) -> None:
    per_iteration = SIM.ranks * 4
    with Publisher(publisher_config(config)) as publisher:
        for i, batch in enumerate(simulate(SIM), start=1):
            publisher.publish(batch)
            if i % per_iteration == 0:
                publisher.flush(5.0)
                if i // per_iteration == SIM.iterations // 3:
                    third.set()
                time.sleep(PACE_S)
        publisher.flush(30.0)
    done.set()


def _run(tmp_path: Path, chdb_path: Path, broker: str, *, two_at_start: bool, action: Action | None) -> Run:
    tag = uuid.uuid4().hex[:8]
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path / tag),
            "store.url": f"chdb://{chdb_path}",
            "store.database": f"t_multi_{tag}",
            "kafka.bootstrap_servers": broker,
            "kafka.topic_prefix": f"mw{tag}",
            "streams.app_id": f"mw-{tag}",
        },
    )
    settle_s = (config.streams.job_idle_ms + config.streams.windower.idle_close_ms) / 1000 + 1.5
    run = Run(counts={})
    with EmbeddedStack(config) as stack:
        assert stack.sink is not None and stack.worker is not None and stack.client is not None
        second = StreamWorkerProcess(stack.config, name="worker-2")
        try:
            if two_at_start:
                second.start()
            third, published = threading.Event(), threading.Event()
            publisher = threading.Thread(target=_publish, args=(stack.config, third, published), daemon=True)
            publisher.start()
            deadline = time.monotonic() + 180
            last_total, last_change = -1, time.monotonic()
            while time.monotonic() < deadline:
                stats = stack.sink.stats
                rows = stats["iterations"]
                if action is not None and run.acted_at_rows < 0 and third.is_set():
                    run.acted_at_rows = rows  # a third of the job published: the rest flows while partitions move
                    run.acted_before_end = not published.is_set()
                    action(stack.worker, second)
                total = rows + stats["function_patterns"] + stats["finding_updates"]
                if total != last_total:
                    last_total, last_change = total, time.monotonic()
                if published.is_set() and rows >= EXPECTED_ROWS and time.monotonic() - last_change >= settle_s:
                    break
                time.sleep(0.2)
            else:
                raise TimeoutError(f"not settled: {stack.sink.stats}")
            publisher.join(5)
            db = config.store.database
            run.counts = table_counts(stack.client, db)
            run.updates = stack.client.query(
                f"SELECT finding_id, version, status, category, rank FROM {db}.finding_updates "
                "ORDER BY finding_id, version"
            ).result_rows
            run.findings = stack.client.query(
                f"SELECT finding_id, status, category, rank, iteration_first FROM {db}.findings ORDER BY finding_id"
            ).result_rows
        finally:
            second.stop()
    return run


def _join(_first: StreamWorkerProcess, second: StreamWorkerProcess) -> None:
    second.start()


def _leave(_first: StreamWorkerProcess, second: StreamWorkerProcess) -> None:
    second.stop()


def _kill(_first: StreamWorkerProcess, second: StreamWorkerProcess) -> None:
    second.kill()


def _stall(_first: StreamWorkerProcess, second: StreamWorkerProcess) -> None:
    """SIGSTOP past the session timeout (its partitions go to the other worker), then SIGCONT."""
    pid = second.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    time.sleep(second.config.kafka.session_timeout_ms / 1000 * 1.5)
    os.kill(pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory, chdb_path: Path, broker: str) -> Run:
    return _run(tmp_path_factory.mktemp("clean"), chdb_path, broker, two_at_start=False, action=None)


@pytest.mark.parametrize(
    ("two_at_start", "action"),
    [(False, _join), (True, _leave), (True, _kill), (True, _stall)],
    ids=["a worker joins", "a worker leaves cleanly", "a worker is killed", "a worker stalls and comes back"],
)
def test_partitions_moving_between_workers_store_what_one_worker_stores(
    tmp_path: Path, chdb_path: Path, broker: str, clean_run: Run, two_at_start: bool, action: Action
) -> None:
    moved = _run(tmp_path, chdb_path, broker, two_at_start=two_at_start, action=action)

    assert clean_run.counts["iterations"] == EXPECTED_ROWS
    assert ("gpu_slow", 5) in {(f[2], f[3]) for f in clean_run.findings}
    assert moved.acted_before_end and moved.acted_at_rows < EXPECTED_ROWS, "partitions must move mid-run"
    assert moved.counts == clean_run.counts, (moved.findings, clean_run.findings)
    assert moved.findings == clean_run.findings, "a rebalance is no fault: same findings, same first iteration"
    assert moved.updates == clean_run.updates
