"""Worker and sink, separate processes as deployed, each SIGKILLed three times at random moments (the first
within 5 s, before any state record exists) and restarted: the store ends up identical to a clean run's.

The sink runs as ``fleetscope sink`` with a chDB store of its own (one process per chDB directory), so the
test reads that store with ``fleetscope sql`` once the sink has stopped. Progress is the sink's /metrics."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fleetscope.broker import ensure_topics, free_port
from fleetscope.config import Config, load_config, split_secrets
from fleetscope.demo import publisher_config
from fleetscope.producers import Publisher, SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import Topics
from fleetscope.stack import StreamWorkerProcess

pytestmark = pytest.mark.integration

SIM = SimulatorConfig(job="chaos-job", ranks=16, iterations=60, faults=(parse_fault("slow_gpu:5:1.5"),))
MAX_OPEN_STEPS = 8
"""Small, so that this run's restart backlogs (light streams far ahead of the kernels) exceed it."""
KILLS = 3
QUIET_S = 10.0
"""The sink consumed nothing for this long after the last publish and kill: the pipeline is done."""


@dataclass
class SinkProcess:
    """``fleetscope sink`` in a child process (SIGKILL to crash it, SIGINT to stop it cleanly)."""

    config_path: Path
    log_path: Path
    metrics_port: int
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "fleetscope", "sink", "--config", str(self.config_path), "--log-level", "INFO"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=self.env)  # noqa: S603

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)

    def consumed(self) -> int:
        """Messages the current sink process consumed (-1 while it is not serving metrics yet)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return -1
        match = re.search(r"^fleetscope_sink_messages_total (\S+)$", text, re.MULTILINE)
        return int(float(match.group(1))) if match else -1


@dataclass
class Outcome:
    counts: dict[str, int]
    updates: list[dict[str, Any]]
    findings: list[dict[str, Any]]
    kills: list[tuple[float, str]] = field(default_factory=list)
    incomplete: int = 0


def _sql(config_path: Path, query: str) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "fleetscope", "sql", "--config", str(config_path), "--json", query]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)  # noqa: S603
    return list(json.loads(out.stdout))


def _publish(config: Config, done: threading.Event) -> None:
    with Publisher(publisher_config(config)) as publisher:
        for batch in simulate(SIM):
            publisher.publish(batch)
        publisher.flush(60.0)
    done.set()


def _schedule(rng: random.Random) -> list[float]:
    """Kill times (s from the start of publishing): the first within 5 s, then 3 to 12 s apart."""
    times = [rng.uniform(1.0, 5.0)]
    while len(times) < KILLS:
        times.append(times[-1] + rng.uniform(3.0, 12.0))
    return times


def _killer(at: list[float], t0: float, kill: Any, start: Any, name: str, log: list[tuple[float, str]]) -> None:
    for when in at:
        time.sleep(max(0.0, t0 + when - time.monotonic()))
        kill()
        log.append((round(time.monotonic() - t0, 1), name))
        start()


def _run(tmp_path: Path, broker: str, rng: random.Random | None) -> Outcome:
    tag = uuid.uuid4().hex[:8]
    data = tmp_path / tag
    config = load_config(
        env={},
        overrides={
            "data_dir": str(data),
            "store.url": f"chdb://{data}/store",
            "kafka.bootstrap_servers": broker,
            "kafka.topic_prefix": f"ch{tag}",
            "streams.app_id": f"ch-{tag}",
            "streams.windower.max_open_steps": MAX_OPEN_STEPS,
        },
    )
    ensure_topics(config.kafka.admin_settings(), Topics(prefix=config.kafka.topic_prefix), 4, 4)
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    settings, secrets = split_secrets(config.replace(metrics_port=port))
    sink_config = data / "sink-config.json"
    sink_config.write_text(json.dumps(settings))
    sink = SinkProcess(sink_config, data / "sink.log", port, {**os.environ, **secrets})
    worker = StreamWorkerProcess(config)
    sink.start()
    worker.start()
    kills: list[tuple[float, str]] = []
    published = threading.Event()
    t0 = time.monotonic()
    threads = [threading.Thread(target=_publish, args=(config, published), daemon=True)]
    if rng is not None:
        threads.append(threading.Thread(target=_killer, args=(_schedule(rng), t0, worker.kill, worker.start,
                                                              "worker", kills)))  # fmt: skip
        threads.append(threading.Thread(target=_killer, args=(_schedule(rng), t0, sink.kill, sink.start,
                                                              "sink", kills)))  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads[1:]:
        thread.join(240)
    assert published.wait(240), "publishing did not finish"
    deadline = time.monotonic() + 300
    last, since = -2, time.monotonic()
    while time.monotonic() - since < QUIET_S:
        assert time.monotonic() < deadline, f"the pipeline did not settle; see {data}"
        assert worker.alive(), f"stream worker died; see {worker.log_path}"
        consumed = sink.consumed()
        if consumed != last or consumed < 0:
            last, since = consumed, time.monotonic()
        time.sleep(0.5)
    worker.stop()
    sink.stop()
    log = worker.log_path.read_text(errors="replace")
    incomplete = [int(n) for n in re.findall(r"incomplete_iterations=(\d+)", log)]
    return Outcome(
        counts=_sql(
            sink_config,
            "SELECT (SELECT count() FROM iterations) AS iterations, "
            "(SELECT count() FROM function_patterns) AS patterns, "
            "(SELECT count() FROM finding_updates) AS updates",
        )[0],  # fmt: skip
        updates=_sql(
            sink_config,
            "SELECT finding_id, version, status, category, rank FROM finding_updates ORDER BY finding_id, version",
        ),  # fmt: skip
        findings=_sql(
            sink_config,
            "SELECT finding_id, status, version, category, rank, iteration_first, "
            "iteration_last FROM findings ORDER BY finding_id",
        ),  # fmt: skip
        kills=sorted(kills),
        incomplete=max(incomplete, default=0),
    )


def test_worker_and_sink_killed_three_times_each_store_exactly_what_a_clean_run_stores(
    tmp_path: Path, broker: str
) -> None:
    seed = int(os.environ.get("FLEETSCOPE_CHAOS_SEED", random.SystemRandom().randrange(2**32)))
    clean = _run(tmp_path, broker, rng=None)
    chaos = _run(tmp_path, broker, rng=random.Random(seed))
    print(f"\nchaos seed {seed}: kills {chaos.kills}; counts {chaos.counts}; clean {clean.counts}")

    assert clean.counts["iterations"] == SIM.ranks * SIM.expected_iterations
    assert ("gpu_slow", 5) in {(f["category"], f["rank"]) for f in clean.findings}
    assert [name for _, name in chaos.kills].count("worker") == KILLS
    assert [name for _, name in chaos.kills].count("sink") == KILLS
    assert min(t for t, name in chaos.kills if name == "worker") <= 5.5
    assert chaos.counts == clean.counts, f"seed {seed}"
    assert chaos.updates == clean.updates, f"seed {seed}"
    assert chaos.findings == clean.findings, f"seed {seed}"
    assert chaos.incomplete == 0, f"seed {seed}: steps closed without all their streams"
