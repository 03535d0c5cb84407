"""``fleetscope alerts`` on the real broker: a finding is printed within 5 s of its creation."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from harness import SLOW_GPU_RANK, SlowGpuRun

from fleetscope.broker import ensure_topics
from fleetscope.config import load_config
from fleetscope.schemas import Topics, encode
from fleetscope.schemas.signing import MAC_HEADER, findings_mac
from fleetscope.schemas.topics import job_key
from fleetscope.wiring import findings_key

pytestmark = pytest.mark.integration

MAX_DELAY_S = 5.0


def finding(job: str, version: int = 1, status: str = "open") -> dict[str, Any]:
    return {
        "finding_id": f"{job}/gpu_slow/3/0",
        "status": status,
        "version": version,
        "job": job,
        "rank": 3,
        "ranks": [3],
        "host": "node000",
        "category": "gpu_slow",
        "function": "flash_fwd_kernel",
        "metric": "mean_ns",
        "value": 6.8e5,
        "peer_median": 4.5e5,
        "score": 31.0,
        "iteration_first": 2,
        "iteration_last": 9,
        "est_loss_ns": 2_300_000,
        "evidence": "{}",
        "emitted_ns": time.time_ns(),
    }


def follower_setup(broker: str, tmp_path: Path) -> tuple[str, Path, bytes]:
    """A fresh topic prefix with its topics, a follower's configuration file in ``tmp_path`` (its data folder),
    and the findings key the differential of that folder signs with."""
    prefix = f"al{uuid.uuid4().hex[:6]}"
    ensure_topics({"bootstrap.servers": broker}, Topics(prefix=prefix), 2, 2)
    config = tmp_path / "alerts.json"
    settings = {"data_dir": str(tmp_path), "kafka": {"topic_prefix": prefix, "session_timeout_ms": 2000}}
    config.write_text(json.dumps(settings))
    return prefix, config, findings_key(load_config(env={}, overrides={"data_dir": str(tmp_path)}))


def produce_signed(producer: Producer, key: bytes, topic: str, rec: dict[str, Any]) -> None:
    """Publish a finding as the differential does: signed with its key (``schemas.signing``)."""
    value = encode("findings", rec)
    mac = findings_mac(key, topic, job_key(rec["job"]), value)
    producer.produce(topic, key=job_key(rec["job"]), value=value, headers=[(MAC_HEADER, mac)])
    producer.flush(5)


def test_the_cli_prints_each_state_change_of_its_job_within_5_s(broker: str, tmp_path: Path) -> None:
    prefix, config, key = follower_setup(broker, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE__")}
    cmd = [sys.executable, "-m", "fleetscope", "alerts", "--bootstrap", broker, "--config", str(config)]
    proc = subprocess.Popen(
        [*cmd, "--job", "watched", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[tuple[float, str]] = queue.Queue()
    threading.Thread(target=lambda: [lines.put((time.time(), x)) for x in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        assert proc.stderr is not None
        assert "following" in proc.stderr.readline(), "the follower reports when it is positioned"
        producer = Producer({"bootstrap.servers": broker})
        topic = Topics(prefix=prefix).findings
        for rec in (finding("other"), finding("watched"), finding("watched", 2, "closed")):
            produce_signed(producer, key, topic, rec)
            time.sleep(0.05)
        got = [lines.get(timeout=MAX_DELAY_S + 5) for _ in range(2)]
    finally:
        proc.terminate()
        proc.wait(10)
    alerts = [json.loads(line) for _, line in got]
    assert [(a["job"], a["event"], a["version"]) for a in alerts] == [
        ("watched", "new", 1),
        ("watched", "closed", 2),
    ]
    delays = [printed - a["emitted_ns"] / 1e9 for (printed, _), a in zip(got, alerts, strict=True)]
    print(f"CLI alert delays after publication: {[f'{d:.3f}' for d in delays]} s")
    assert max(delays) < MAX_DELAY_S, delays
    assert lines.empty(), "the other job's finding is filtered out"
    assert proc.returncode == 0


def test_a_finding_of_the_pipeline_reaches_the_follower_within_5_s(slow_gpu_demo: SlowGpuRun) -> None:
    result, received = slow_gpu_demo.result, slow_gpu_demo.alerts  # a follower of the job ran all along
    assert [(f["rank"], f["category"]) for f in result.findings] == [(SLOW_GPU_RANK, "gpu_slow")]
    assert received and received[0][1]["event"] == "new" and received[0][1]["rank"] == SLOW_GPU_RANK
    delays_s = [(at - alert["emitted_ns"]) / 1e9 for at, alert in received]
    print(f"alert delays after finding creation: {[f'{d:.3f}' for d in delays_s]} s")
    assert max(delays_s) < MAX_DELAY_S
    assert {a["finding_id"] for _, a in received} == {f["finding_id"] for f in result.findings}


def test_alerts_show_a_kernel_names_escapes_as_text_and_log_no_webhook_secret(broker: str, tmp_path: Path) -> None:
    """A finding's kernel name cannot retitle or clear the operator's terminal; the webhook's secret path and
    query (a Slack-style URL) never reach the log, only where it leads."""
    prefix, config, key = follower_setup(broker, tmp_path)
    with socket.socket() as s:  # a port nobody listens on: every POST fails, and is logged
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    webhook = f"http://127.0.0.1:{dead}/services/T0AAA/B0BBB/XyZsecretPath?password=hunter2"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE__")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleetscope", "alerts", "--bootstrap", broker, "--config", str(config),
         "--job", "esc", "--webhook", webhook, "--webhook-attempts", "1", "--log-level", "INFO"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None and proc.stdout is not None
        assert "following" in proc.stderr.readline()
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
        rec = finding("esc") | {"function": "flash\x1b]0;owned\x07\x1b[2J\x1b[Hfwd"}
        produce_signed(Producer({"bootstrap.servers": broker}), key, Topics(prefix=prefix).findings, rec)
        line = lines.get(timeout=MAX_DELAY_S + 10)
    finally:
        proc.terminate()
        _, log = proc.communicate(timeout=15)
    assert "flash\\x1b]0;owned\\x07\\x1b[2J\\x1b[Hfwd" in line, line
    assert [ch for ch in line if not ch.isprintable() and ch != "\n"] == []
    assert "not delivered" in log, log
    assert [s for s in ("T0AAA", "XyZsecretPath", "hunter2") if s in log] == [], log
    assert f"127.0.0.1:{dead}/…" in log
