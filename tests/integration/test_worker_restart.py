"""A stream worker killed (SIGKILL) mid-run and restarted stores exactly what an uninterrupted run stores:
state comes back from the state topics, and what was in memory is re-read from uncommitted offsets."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fleetscope.config import load_config
from fleetscope.demo import publisher_config
from fleetscope.producers import Publisher, SimulatorConfig, parse_fault, simulate
from fleetscope.sinks import table_counts
from fleetscope.stack import EmbeddedStack

pytestmark = pytest.mark.integration

SIM = SimulatorConfig(job="restart-job", ranks=8, iterations=24, faults=(parse_fault("slow_gpu:5:1.5"),))
EXPECTED_ROWS = SIM.ranks * SIM.expected_iterations
PACE_S = 0.15
"""Pause between iterations while publishing, the same in both runs: the job runs while the worker dies."""


@dataclass
class Run:
    counts: dict[str, int]
    updates: list[tuple[Any, ...]]
    findings: list[tuple[Any, ...]]
    sink_messages: int
    rows_at_kill: int = -1
    restart_s: float = 0.0


def _publish(config: Any, done: threading.Event) -> None:
    per_iteration = SIM.ranks * 4
    with Publisher(publisher_config(config)) as publisher:
        for i, batch in enumerate(simulate(SIM), start=1):
            publisher.publish(batch)
            if i % per_iteration == 0:
                publisher.flush(5.0)
                time.sleep(PACE_S)
        publisher.flush(30.0)
    done.set()


def _run(tmp_path: Path, chdb_path: Path, broker: str, kill_at_rows: int | None) -> Run:
    tag = uuid.uuid4().hex[:8]
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path / tag),
            "store.url": f"chdb://{chdb_path}",
            "store.database": f"t_restart_{tag}",
            "kafka.bootstrap_servers": broker,
            "kafka.topic_prefix": f"rs{tag}",
            "streams.app_id": f"rs-{tag}",
        },
    )
    settle_s = (config.streams.job_idle_ms + config.streams.windower.idle_close_ms) / 1000 + 1.5
    run = Run(counts={}, updates=[], findings=[], sink_messages=0)
    with EmbeddedStack(config) as stack:
        assert stack.sink is not None and stack.worker is not None and stack.client is not None
        published = threading.Event()
        publisher = threading.Thread(target=_publish, args=(stack.config, published), daemon=True)
        publisher.start()
        deadline = time.monotonic() + 120
        last_total, last_change = -1, time.monotonic()
        while time.monotonic() < deadline:
            stats = stack.sink.stats
            rows = stats["iterations"]
            if kill_at_rows is not None and run.rows_at_kill < 0 and rows >= kill_at_rows:
                run.rows_at_kill = rows
                t0 = time.monotonic()
                stack.worker.kill()
                stack.worker.start()
                run.restart_s = time.monotonic() - t0
            total = rows + stats["function_patterns"] + stats["finding_updates"]
            if total != last_total:
                last_total, last_change = total, time.monotonic()
            if published.is_set() and rows >= EXPECTED_ROWS and time.monotonic() - last_change >= settle_s:
                break
            assert stack.worker.alive(), f"stream worker died; see {stack.worker.log_path}"
            time.sleep(0.2)
        else:
            raise TimeoutError(f"not settled: {stack.sink.stats}")
        publisher.join(5)
        db = config.store.database
        run.counts = table_counts(stack.client, db)
        run.updates = stack.client.query(
            f"SELECT finding_id, version, status, category, rank FROM {db}.finding_updates ORDER BY finding_id, version"
        ).result_rows
        run.findings = stack.client.query(
            f"SELECT finding_id, status, version, category, rank, iteration_first, iteration_last FROM {db}.findings "
            "ORDER BY finding_id"
        ).result_rows
        run.sink_messages = stack.sink.stats["messages"]
    return run


def test_a_worker_killed_mid_run_and_restarted_stores_exactly_what_a_clean_run_stores(
    tmp_path: Path, chdb_path: Path, broker: str
) -> None:
    clean = _run(tmp_path, chdb_path, broker, kill_at_rows=None)
    killed = _run(tmp_path, chdb_path, broker, kill_at_rows=EXPECTED_ROWS // 3)

    assert clean.counts["iterations"] == EXPECTED_ROWS
    assert ("gpu_slow", 5) in {(f[3], f[4]) for f in clean.findings}
    assert 0 < killed.rows_at_kill < EXPECTED_ROWS, "the worker must die mid-run"
    assert killed.counts == clean.counts
    assert killed.updates == clean.updates
    assert killed.findings == clean.findings
    print(
        f"\nrestart (kill to ready) {killed.restart_s:.1f} s at {killed.rows_at_kill}/{EXPECTED_ROWS} rows; "
        f"sink consumed {killed.sink_messages} messages vs {clean.sink_messages} "
        f"({killed.sink_messages - clean.sink_messages} re-emitted, dropped by natural key); counts {killed.counts}"
    )
