"""The windower's stall records travel on ``<prefix>.stalls`` to the differential (real broker, worker,
store): a simulated job hangs, its ranks' hardware samples go on after their events stopped, the hang is
found from the reports, and the patterns topic carries pattern records only."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from fleetscope.config import load_config
from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import EventBatch, EventKind, Topics, decode, encode_event_batch
from fleetscope.schemas.pattern_batch import PATTERN_TOPIC_SUBJECTS
from fleetscope.schemas.topics import rank_key
from fleetscope.sinks import current_findings
from fleetscope.stack import EmbeddedStack

pytestmark = pytest.mark.integration


def _tail(batches: list[EventBatch]) -> set[int]:
    """Indices of the sample batches that lie wholly after their rank's last event: the hang's aftermath."""
    last: dict[int, int] = {}
    for b in batches:
        if b.kind is not EventKind.SAMPLES and len(b):
            last[b.header.rank] = max(last.get(b.header.rank, 0), int((b["start_ns"] + b["dur_ns"]).max()))
    return {
        i
        for i, b in enumerate(batches)
        if b.kind is EventKind.SAMPLES and len(b) and int(b["t_ns"].min()) > last[b.header.rank]
    }


def _subjects(broker: str, topic: str, wait_s: float = 5.0) -> list[tuple[str, dict[str, Any]]]:
    consumer = Consumer({"bootstrap.servers": broker, "group.id": f"t-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})  # fmt: skip
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    out: list[tuple[str, dict[str, Any]]] = []
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            out += [decode(m.value()) for m in consumer.consume(200, 0.5) if m.error() is None]
    finally:
        consumer.close()
    return out


def test_stall_records_reach_the_differential_on_their_own_topic(
    tmp_path: Path, chdb_path: Path, database: str, broker: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path), "store.url": f"chdb://{chdb_path}", "store.database": database,
            "kafka.bootstrap_servers": broker, "kafka.topic_prefix": f"st{tag}", "streams.app_id": f"st-{tag}",
        },
    )  # fmt: skip
    topics = Topics(prefix=config.kafka.topic_prefix)
    sim = SimulatorConfig(job=f"hung-{tag}", ranks=4, iterations=12, faults=(parse_fault("hang:2@6"),))
    batches = list(simulate(sim))
    tail = _tail(batches)
    assert len(tail) == sim.ranks
    with EmbeddedStack(config) as stack:
        assert stack.client is not None
        producer = Producer({"bootstrap.servers": broker})

        def publish(selected: list[EventBatch]) -> None:
            for b in selected:
                producer.produce(topics.raw(b.kind), key=rank_key(b.header.job, b.header.rank),
                                 value=encode_event_batch(b))  # fmt: skip
            producer.flush(10)

        publish([b for i, b in enumerate(batches) if i not in tail])
        time.sleep(3.0)  # the ranks' events stopped arriving (stall_silence_ms) while their samples go on
        publish([batches[i] for i in sorted(tail)])
        deadline, hangs = time.monotonic() + 40, []
        while time.monotonic() < deadline and not hangs:
            hangs = [f for f in current_findings(stack.client, database, job=sim.job) if f["category"] == "hang"]
            time.sleep(0.5)
        assert [f["rank"] for f in hangs] == [2]
        stalls = _subjects(broker, topics.stalls)
        patterns = _subjects(broker, topics.patterns)
    assert {s for s, _ in stalls} == {"stall"}
    assert {int(r["rank"]) for _, r in stalls if r["stalled"]} == set(range(sim.ranks))
    assert patterns and {s for s, _ in patterns} <= set(PATTERN_TOPIC_SUBJECTS)  # lone or batched
