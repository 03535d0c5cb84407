"""Forged messages on the real broker, worker and store (issue 38 items 5 and 8): the sink stores, and the
alert follower alerts on, only the findings the differential signed, and a step marker stamped 23 h ahead
is refused as a clock jump; each forgery is dead-lettered with its reason, and the job is stored whole."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from harness import isolated_config, read_topic, wait_until

from fleetscope.broker import ensure_topics
from fleetscope.demo import publish_simulation
from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.progress import Progress
from fleetscope.schemas import EventBatch, EventKind, Topics, encode, encode_event_batch
from fleetscope.schemas.signing import MAC_HEADER, findings_mac
from fleetscope.schemas.topics import job_key, rank_key
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


def marker_23_hours_ahead(sim: SimulatorConfig, rank: int) -> bytes:
    """A host batch of ``rank`` holding one step marker 23 h past the rank's last event (the intake's day
    allows it): on 4dd2932 it became a step of its own and made the rank's later events late."""
    like = [b for b in simulate(sim) if b.kind is EventKind.HOST and b.header.rank == rank][-1]
    start = int(like["start_ns"].max()) + 23 * 3_600 * 10**9
    return encode_event_batch(EventBatch(
        kind=EventKind.HOST, header=replace(like.header, seq=like.header.seq + 1), names=["ProfilerStep#900"],
        columns={"start_ns": [start], "dur_ns": [10**6], "name_id": [0], "depth": [0]},
    ))  # fmt: skip


def test_forged_findings_and_a_forged_clock_jump_are_dead_lettered_and_cost_the_job_nothing(
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
            producer.produce(topics.raw(EventKind.HOST), key=rank_key(JOB, 2), value=marker_23_hours_ahead(sim, 2))
            assert producer.flush(10) == 0
            real = wait_until(lambda: stack.store.findings(job=JOB) if stack.sink.stats["dead_letters"] >= 2 else [],
                              timeout_s=90)  # fmt: skip
            letters = read_topic(broker, [topics.deadletter], until=lambda got: len(got) >= 3, timeout_s=30)
            sql = f"SELECT rank, iteration FROM `{database}`.iterations WHERE job = '{JOB}'"
            expected = sim.ranks * sim.expected_iterations
            wait_until(lambda: len(stack.store.query(sql)[1]) >= expected, timeout_s=30)
            time.sleep(1.0)  # a step 900 would close with the rank's last ones
            steps = sorted(tuple(row) for row in stack.store.query(sql)[1])
        wait_until(lambda: any(a["job"] == JOB for a in alerts), timeout_s=10)
    finally:
        stop.set()
        thread.join(10)
    assert [(f["rank"], f["category"]) for f in real] == [(3, "gpu_slow")]  # the signed finding is stored
    reasons = sorted({k: v.decode() for k, v in m.headers() or []}["reason"] for m in letters)
    assert reasons[:2] == [
        "signature: does not verify (another key, or the message was altered)",
        f"signature: no {MAC_HEADER} header (not written by the differential stage)",
    ]
    jump_s = float(reasons[2].removeprefix("value: events reach ").split(" s ", 1)[0])
    assert 82_790 < jump_s < 82_810 and "a clock jump" in reasons[2], reasons[2]  # 23 h past the rank's clock
    assert len(steps) == sim.ranks * sim.expected_iterations and max(i for _, i in steps) < 900
    assert {a["finding_id"] for a in alerts} == {f["finding_id"] for f in real}
    assert follower.stats["unsigned"] == 2
