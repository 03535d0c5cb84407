"""``fleetscope replay`` into a real broker: what lands on the raw topics is exactly what the parser made."""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from fleetscope.broker import ensure_topics
from fleetscope.config import load_config
from fleetscope.producers import parse_trace
from fleetscope.schemas import EventKind, Topics, decode_event_batch
from fleetscope.traces_cli import cmd_replay

pytestmark = pytest.mark.integration

TRACES = Path(os.environ.get("FLEETSCOPE_TRACES_DIR", "/work/shared/traces"))
TRACE_FILTER = TRACES / "hta_kineto_samples" / "trace_filter"


@pytest.mark.skipif(not TRACE_FILTER.is_dir(), reason="no shared traces")
def test_replay_publishes_every_batch_of_the_hta_pair(
    broker: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = f"rp{uuid.uuid4().hex[:8]}"
    config = load_config(
        env={},
        overrides={
            "kafka.bootstrap_servers": broker,
            "kafka.topic_prefix": prefix,
            "kafka.raw_partitions": 2,
        },
    )
    topics = Topics(prefix=prefix)
    ensure_topics({"bootstrap.servers": broker}, topics, raw_partitions=2, derived_partitions=1)
    expected: Counter[tuple[int, str, str]] = Counter()
    for path in sorted(TRACE_FILTER.glob("*.json.gz")):
        for b in parse_trace(path).batches:
            expected[(b.header.rank, b.kind.value, "batches")] += 1
            expected[(b.header.rank, b.kind.value, "events")] += len(b)

    args = argparse.Namespace(paths=[str(TRACE_FILTER)], job=None, quiet=True, tp=0, pp=0, json=False)
    assert cmd_replay(args, config) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["job", "rank", "host"] and "trace_filter" in out

    got: Counter[tuple[int, str, str]] = Counter()
    want_batches = sum(v for k, v in expected.items() if k[2] == "batches")
    consumer = Consumer({"bootstrap.servers": broker, "group.id": prefix, "enable.auto.commit": False})
    try:  # assigned partitions, no group join: Tansu holds a join for half the session timeout
        raw = [topics.raw(k) for k in (EventKind.KERNELS, EventKind.COLLECTIVES, EventKind.HOST)]
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t in raw for p in range(2)])
        deadline = time.monotonic() + 30
        received = 0
        while received < want_batches and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            batch = decode_event_batch(msg.value())
            assert msg.key() == f"trace_filter/{batch.header.rank}".encode()
            assert msg.topic() == topics.raw(batch.kind)
            got[(batch.header.rank, batch.kind.value, "batches")] += 1
            got[(batch.header.rank, batch.kind.value, "events")] += len(batch)
            received += 1
        assert consumer.poll(1.0) is None  # nothing beyond what the parser produced
    finally:
        consumer.close()
    assert got == expected
    assert {k[1] for k in got} == {"kernels", "collectives", "python"}
    assert expected[(0, "collectives", "events")] == 10 and expected[(1, "collectives", "events")] == 10
