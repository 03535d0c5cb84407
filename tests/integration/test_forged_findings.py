"""Findings on the real broker, worker and store: the sink stores, and the alert follower alerts on, only the
findings the differential signed; a finding any other process writes to the findings topic is dead-lettered
with its reason (issue 38 item 8)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from harness import isolated_config, read_topic, wait_until

from fleetscope.broker import ensure_topics
from fleetscope.demo import publish_simulation
from fleetscope.producers import SimulatorConfig, parse_fault
from fleetscope.progress import Progress
from fleetscope.schemas import Topics, encode
from fleetscope.schemas.signing import MAC_HEADER, findings_mac
from fleetscope.schemas.topics import job_key
from fleetscope.sinks.alerts import AlertFollower, AlertsConfig
from fleetscope.stack import EmbeddedStack
from fleetscope.wiring import findings_key

pytestmark = pytest.mark.integration

JOB = "ff-job"


def forged(finding_id: str) -> dict[str, Any]:
    """A finding as the differential would write it, claiming the real job."""
    return {
        "finding_id": finding_id, "status": "open", "version": 1, "job": JOB, "rank": 0, "ranks": [0],
        "host": "node000", "category": "hang", "function": "", "metric": "progress", "value": 1.0,
        "peer_median": 0.0, "score": 99.0, "iteration_first": 1, "iteration_last": 2, "est_loss_ns": 10**12,
        "evidence": "{}", "emitted_ns": time.time_ns(),
    }  # fmt: skip


def test_only_findings_the_differential_signed_are_stored_and_alerted(
    broker: str, tmp_path: Path, chdb_path: Path, database: str
) -> None:
    config = isolated_config("ff", tmp_path, chdb_path, database, broker)
    k, topics = config.kafka, Topics(prefix=config.kafka.topic_prefix)
    ensure_topics(k.admin_settings(), topics, k.raw_partitions, k.derived_partitions)
    alerts: list[dict[str, Any]] = []
    follower = AlertFollower(
        AlertsConfig(bootstrap_servers=broker, topic_prefix=k.topic_prefix, from_beginning=True, every_update=True,
                     findings_key=findings_key(config)),
        alerts.append,
    )  # fmt: skip
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, args=(stop,), daemon=True)
    thread.start()
    sim = SimulatorConfig(job=JOB, ranks=8, iterations=16, start_ns=time.time_ns() - 3_600 * 10**9,
                          faults=(parse_fault("slow_gpu:3:1.5"),))  # fmt: skip
    try:
        with EmbeddedStack(config, with_worker=True) as stack:
            assert stack.store is not None and stack.sink is not None
            producer = Producer({"bootstrap.servers": broker})
            unsigned, wrong = encode("findings", forged("forged/unsigned")), encode("findings", forged("forged/key"))
            producer.produce(topics.findings, key=job_key(JOB), value=unsigned)
            mac = findings_mac(b"not-the-key-" * 3, topics.findings, job_key(JOB), wrong)
            producer.produce(topics.findings, key=job_key(JOB), value=wrong, headers=[(MAC_HEADER, mac)])
            assert producer.flush(10) == 0
            publish_simulation(stack.config, sim, Progress(enabled=False))
            real = wait_until(lambda: stack.store.findings(job=JOB) if stack.sink.stats["dead_letters"] >= 2 else [],
                              timeout_s=90)  # fmt: skip
            letters = read_topic(broker, [topics.deadletter], until=lambda got: len(got) >= 2, timeout_s=30)
        wait_until(lambda: any(a["job"] == JOB for a in alerts), timeout_s=10)
    finally:
        stop.set()
        thread.join(10)
    assert [(f["rank"], f["category"]) for f in real] == [(3, "gpu_slow")]  # the signed finding is stored
    reasons = sorted({k: v.decode() for k, v in m.headers() or []}["reason"] for m in letters)
    assert reasons == [
        "signature: does not verify (another key, or the message was altered)",
        f"signature: no {MAC_HEADER} header (not written by the differential stage)",
    ]
    assert {a["finding_id"] for a in alerts} == {f["finding_id"] for f in real}
    assert follower.stats["unsigned"] == 2
