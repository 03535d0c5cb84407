"""The store seam holds: the sink runs against any ``RecordWriter``, not only ClickHouse.

A second store kind (a dict keyed by each record's natural key, as the add-a-store checklist asks) behind the
real Tansu broker and the real ``Sink``: every record is stored once, a whole-topic replay by a new group adds
nothing, garbage is dead-lettered, and a record the store itself rejects is dead-lettered alone while its
batch-mates are stored."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import pytest
from confluent_kafka import Producer

from fleetscope.schemas import Topics, encode
from fleetscope.schemas.topics import job_key, rank_key
from fleetscope.sinks import RecordWriter, Sink, SinkConfig
from fleetscope.sinks.records import pattern_rows
from fleetscope.sinks.store import Records
from tests.integration.test_sink_kafka import _create_topics, _finding, _iteration, _patterns, _read_all, _wait_for

pytestmark = pytest.mark.integration

POISON_RANK = 666
"""An iteration of this rank is refused by the store itself (as a column type a store cannot hold would be)."""


class DictStore:
    """A store of another kind: rows by natural key, idempotent as the seam requires."""

    def __init__(self) -> None:
        self.iterations: dict[tuple[Any, ...], Mapping[str, Any]] = {}
        self.patterns: dict[tuple[Any, ...], int] = {}
        self.findings: dict[tuple[Any, ...], Mapping[str, Any]] = {}

    def write_iterations(self, records: Records) -> int:
        if any(r["rank"] == POISON_RANK for r in records):
            raise ValueError(f"rank {POISON_RANK} does not fit this store")
        return self._put(self.iterations, records, ("job", "rank", "iteration"))

    def write_patterns(self, records: Records) -> int:
        added = 0
        for r in records:
            key = (r["job"], r["rank"], r["iteration"])
            if key not in self.patterns:
                self.patterns[key] = pattern_rows(r)
                added += self.patterns[key]
        return added

    def write_findings(self, records: Records) -> int:
        return self._put(self.findings, records, ("job", "finding_id", "version"))

    def is_transient(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectionError)

    def rejects_records(self, exc: BaseException) -> bool:
        return isinstance(exc, ValueError)

    @staticmethod
    def _put(table: dict[tuple[Any, ...], Mapping[str, Any]], records: Records, key: tuple[str, ...]) -> int:
        added = 0
        for r in records:
            k = tuple(r[name] for name in key)
            if k not in table:
                table[k] = r
                added += 1
        return added


def _sink(broker: str, topics: Topics, store: RecordWriter) -> Sink:
    group = f"seam-{uuid.uuid4().hex[:8]}"
    return Sink(SinkConfig(bootstrap_servers=broker, topic_prefix=topics.prefix, group_id=group), store)


def _rows(sink: Sink) -> tuple[int, int, int]:
    stats = sink.stats
    return stats["iterations"], stats["function_patterns"], stats["finding_updates"]


def test_the_sink_stores_through_the_seam_once_and_dead_letters_what_the_store_refuses(broker: str) -> None:
    topics = Topics(prefix=f"seam{uuid.uuid4().hex[:8]}")
    _create_topics(broker, topics)
    producer = Producer({"bootstrap.servers": broker})
    job = job_key("job-k")
    for rank in range(4):
        for it in range(3):
            record = encode("iterations", _iteration(rank, it))
            producer.produce(topics.iterations, key=rank_key("job-k", rank), value=record)
            producer.produce(topics.patterns, key=job, value=encode("patterns", _patterns(rank, it, ["gemm", "ar"])))
    poison = encode("iterations", _iteration(POISON_RANK, 0))
    producer.produce(topics.iterations, key=rank_key("job-k", POISON_RANK), value=poison)
    for version, status in ((1, "open"), (2, "update"), (3, "closed")):
        producer.produce(topics.findings, key=job, value=encode("findings", _finding("f1", version, status)))
    producer.produce(topics.findings, key=job, value=b"\x00not avro")
    assert producer.flush(10) == 0

    store = DictStore()
    sink = _sink(broker, topics, store)
    try:
        _wait_for(lambda: _rows(sink) == (12, 24, 3) and sink.stats["dead_letters"] >= 2, sink, timeout_s=30.0)
    finally:
        sink.stop()
    assert len(store.iterations) == 12 and POISON_RANK not in {k[1] for k in store.iterations}
    assert sum(store.patterns.values()) == 12 * 2 and len(store.findings) == 3
    assert _rows(sink) == (12, 24, 3)
    letters = _read_all(broker, topics.deadletter, 2)
    reasons = sorted(dict(m.headers() or [])["reason"].decode().split(":")[0] for m in letters)
    assert reasons == ["decode", "insert"], reasons

    replay = _sink(broker, topics, store)  # a new group reads every topic from the start again
    try:
        _wait_for(lambda: replay.stats["messages"] >= 29 and replay.stats["flushes"] >= 1, replay, timeout_s=30.0)
    finally:
        replay.stop()
    assert _rows(replay) == (0, 0, 0)
    assert len(store.iterations) == 12 and len(store.findings) == 3
