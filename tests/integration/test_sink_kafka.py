"""The sink end to end: real Tansu broker -> Sink -> real chDB, including the dead-letter path."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from clickhouse_connect.driver import Client
from clickhouse_connect.driver.exceptions import DataError, OperationalError
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from fleetscope.schemas import Topics, encode
from fleetscope.schemas.pattern_batch import batch_pattern_messages
from fleetscope.schemas.topics import job_key, rank_key
from fleetscope.sinks import (
    ClickHouseWriter,
    RetryPolicy,
    Sink,
    SinkConfig,
    StoreConfig,
    connect,
    current_findings,
    migrate,
    table_counts,
)

T0 = 1_700_000_000_000_000_000


@pytest.fixture(scope="module")
def kafka_bootstrap(broker: str) -> str:
    return broker


@pytest.fixture()
def store(chdb_path: Path) -> Iterator[tuple[Client, str]]:
    database = f"t_{uuid.uuid4().hex}"
    client = connect(StoreConfig(url=f"chdb://{chdb_path}", database=database))
    migrate(client, database)
    yield client, database
    client.command(f"DROP DATABASE IF EXISTS `{database}`", use_database=False)


def _create_topics(bootstrap: str, topics: Topics) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    names = [topics.iterations, topics.patterns, topics.findings, topics.deadletter]
    for future in admin.create_topics([NewTopic(n, num_partitions=2, replication_factor=1) for n in names]).values():
        future.result(10)


def _iteration(rank: int, it: int) -> dict[str, Any]:
    start = T0 + it * 10**9
    return {
        "job": "job-k", "rank": rank, "host": "node0", "world_size": 4, "tp_rank": -1, "pp_rank": -1,
        "dp_rank": rank, "iteration": it, "detected_by": "step_marker", "start_ns": start,
        "end_ns": start + 9 * 10**8, "duration_ns": 9 * 10**8, "gpu_busy_ns": 8 * 10**8,
        "compute_ns": 6 * 10**8, "collective_ns": 2 * 10**8, "exposed_collective_ns": 10**8,
        "idle_ns": 10**8, "max_idle_gap_ns": 10**7, "kernels": 100, "functions": 3,
    }  # fmt: skip


def _patterns(rank: int, it: int, functions: list[str]) -> dict[str, Any]:
    n = len(functions)
    record: dict[str, Any] = {
        "job": "job-k", "rank": rank, "host": "node0", "world_size": 4, "tp_rank": -1, "pp_rank": -1,
        "dp_rank": rank, "iteration": it, "iteration_start_ns": T0 + it * 10**9, "iteration_ns": 9 * 10**8,
        "function": functions, "kind": [0] * n, "calls": [1] * n, "total_ns": [1000] * n,
        "max_ns": [1000] * n, "nbytes": [0] * n,
    }  # fmt: skip
    for name in ("mean_ns", "p50_ns", "p99_ns", "cv", "share", "algbw_gbps", "busbw_gbps", "nvlink_mean_bps",
                 "nvlink_cv", "nvlink_peak_bps", "pcie_mean_bps", "pcie_cv", "pcie_peak_bps"):  # fmt: skip
        record[name] = [1.0] * n
    return record


def _finding(fid: str, version: int, status: str) -> dict[str, Any]:
    return {
        "finding_id": fid, "status": status, "version": version, "job": "job-k", "rank": 2, "ranks": [2],
        "host": "node0", "category": "gpu_slow", "function": "gemm", "metric": "mean_ns", "value": 2.0,
        "peer_median": 1.0, "score": 8.0, "iteration_first": 1, "iteration_last": 1 + version,
        "est_loss_ns": 5_000 * version, "evidence": json.dumps({"v": version}), "emitted_ns": T0 + version,
    }  # fmt: skip


def _wait_for(condition: Callable[[], bool], sink: Sink | None = None, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s; sink stats {sink.stats if sink else None}")
        if sink is None:
            time.sleep(0.05)
        else:
            sink.poll_once(0.1)


def _read_all(bootstrap: str, topic: str, expected: int, timeout_s: float = 15.0) -> list[Any]:
    """Read a topic from the start by assignment (no group join, no reliance on the high watermark)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})  # fmt: skip
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(2)])
        out: list[Any] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < expected and time.monotonic() < deadline:
            out.extend(m for m in consumer.consume(100, 0.2) if m.error() is None)
        return out
    finally:
        consumer.close()


@pytest.mark.integration
def test_sink_writes_topics_to_clickhouse_and_dead_letters_garbage(
    kafka_bootstrap: str, store: tuple[Client, str]
) -> None:
    client, database = store
    prefix = f"it{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix=prefix)
    _create_topics(kafka_bootstrap, topics)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    for rank in range(4):
        for it in range(5):
            producer.produce(topics.iterations, encode("iterations", _iteration(rank, it)), key=rank_key("job-k", rank))
        producer.produce(topics.patterns, encode("patterns", _patterns(rank, 1, ["a", "b", "c"])),
                         key=rank_key("job-k", rank))  # fmt: skip
    for version, status in ((1, "open"), (2, "update"), (3, "closed")):
        producer.produce(topics.findings, encode("findings", _finding("f1", version, status)), key=job_key("job-k"))
    producer.produce(topics.findings, encode("findings", _finding("f2", 1, "open")), key=job_key("job-k"))
    producer.produce(topics.patterns, b"\x00\x00\x00\x01garbage", key=b"job-k/9")
    batched = [(2, encode("patterns", _patterns(rank, 2, ["a", "b", "c"]))) for rank in range(3)]
    (batch,) = batch_pattern_messages("job-k", [*batched[:1], (2, b"\x00\x00\x00\x02bad"), *batched[1:]], 1 << 20)
    producer.produce(topics.patterns, batch, key=job_key("job-k"))  # 3 records stored, the bad element dead-lettered
    producer.produce(topics.iterations, encode("findings", _finding("f3", 1, "open")), key=b"job-k")  # wrong topic
    assert producer.flush(10) == 0

    config = SinkConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, group_id=f"g-{prefix}",
                        session_timeout_ms=2000, flush_interval_ms=100)  # fmt: skip
    sink = Sink(config, ClickHouseWriter(client, database))
    try:
        expected = {"iterations": 20, "function_patterns": 12 + 9, "finding_updates": 5}

        def done() -> bool:
            return all(sink.stats[t] >= n for t, n in expected.items()) and sink.stats["dead_letters"] >= 2

        _wait_for(done, sink)
    finally:
        sink.stop()
        sink.stop()  # idempotent
    stats = sink.stats
    assert {t: stats[t] for t in expected} == expected
    assert stats["dead_letters"] == 2 and stats["messages"] == 20 + 4 + 4 + 3
    assert stats["last_flush_ns"] > 0
    assert table_counts(client, database) == {**expected, "findings": 3}
    found = {f["finding_id"]: f for f in current_findings(client, database)}
    assert found["f1"]["status"] == "closed" and found["f1"]["version"] == 3 and found["f2"]["status"] == "open"
    assert "f3" in found  # the subject, not the topic, picks the table

    letters = sorted(_read_all(kafka_bootstrap, topics.deadletter, expected=2), key=lambda m: m.value())
    assert [m.value() for m in letters] == [b"\x00\x00\x00\x01garbage", b"\x00\x00\x00\x02bad"]  # the element alone
    for letter in letters:
        headers = {k: v.decode() for k, v in letter.headers()}
        assert headers["topic"] == topics.patterns and headers["reason"].startswith("decode:")
        assert "unknown schema id" in headers["reason"]
        assert headers["offset"].isdigit() and headers["partition"].isdigit()

    # Every consumed offset was committed for the group, so a restart replays nothing.
    probe = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": config.group_id})
    try:
        committed = probe.committed([TopicPartition(t, p) for t in sink.topics for p in range(2)], timeout=10)
    finally:
        probe.close()
    per_topic: dict[str, int] = {}
    for tp in committed:
        per_topic[tp.topic] = per_topic.get(tp.topic, 0) + max(tp.offset, 0)
    assert per_topic == {topics.iterations: 21, topics.patterns: 6, topics.findings: 4}


@pytest.mark.integration
def test_sink_thread_lifecycle(kafka_bootstrap: str, store: tuple[Client, str]) -> None:
    client, database = store
    prefix = f"lc{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix=prefix)
    _create_topics(kafka_bootstrap, topics)
    config = SinkConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, group_id=f"g-{prefix}",
                        session_timeout_ms=2000, flush_interval_ms=50)  # fmt: skip
    sink = Sink(config, ClickHouseWriter(client, database))
    sink.start()
    sink.start()  # a second start is a no-op
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(topics.iterations, encode("iterations", _iteration(0, 7)), key=rank_key("job-k", 0))
    assert producer.flush(10) == 0
    try:
        _wait_for(lambda: sink.stats["iterations"] == 1)
    finally:
        sink.stop(timeout_s=10)
    sink.stop()
    assert table_counts(client, database)["iterations"] == 1
    with pytest.raises(RuntimeError):
        sink.start()


class _FlakyWriter(ClickHouseWriter):
    """Fails the first inserts of iterations (ClickHouse down) and any pattern batch naming ``poison``."""

    def __init__(self, client: Client, database: str, outages: int) -> None:
        super().__init__(client, database, retry=RetryPolicy(max_attempts=1))
        self.outages = outages

    def write_iterations(self, records: Sequence[Mapping[str, Any]]) -> int:
        if self.outages > 0:
            self.outages -= 1
            raise OperationalError("connection refused")
        return super().write_iterations(records)

    def write_patterns(self, records: Sequence[Mapping[str, Any]]) -> int:
        if any("poison" in r["function"] for r in records):
            raise DataError("value out of range")
        return super().write_patterns(records)


@pytest.mark.integration
def test_sink_pauses_through_outages_and_dead_letters_rejected_records(
    kafka_bootstrap: str, store: tuple[Client, str]
) -> None:
    client, database = store
    prefix = f"fl{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix=prefix)
    _create_topics(kafka_bootstrap, topics)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 5})
    for it in range(3):
        producer.produce(topics.iterations, encode("iterations", _iteration(0, it)), key=rank_key("job-k", 0))
    producer.produce(topics.patterns, encode("patterns", _patterns(0, 1, ["a", "b"])), key=rank_key("job-k", 0))
    producer.produce(topics.patterns, encode("patterns", _patterns(1, 1, ["poison"])), key=rank_key("job-k", 1))
    assert producer.flush(10) == 0
    config = SinkConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, group_id=f"g-{prefix}",
                        session_timeout_ms=2000, flush_interval_ms=50)  # fmt: skip
    sink = Sink(config, _FlakyWriter(client, database, outages=2))
    try:
        _wait_for(lambda: sink.stats["iterations"] == 3 and sink.stats["dead_letters"] == 1, sink)
    finally:
        sink.stop()
    assert sink.stats["flush_failures"] == 2 and sink.stats["function_patterns"] == 2
    assert table_counts(client, database)["iterations"] == 3
    letters = _read_all(kafka_bootstrap, topics.deadletter, expected=1)
    reason = dict(letters[0].headers())["reason"].decode()
    assert reason.startswith("insert:") and "out of range" in reason


def test_sink_stops_without_start_and_validates_config(store: tuple[Client, str]) -> None:
    client, database = store
    sink = Sink(SinkConfig(bootstrap_servers="127.0.0.1:1"), ClickHouseWriter(client, database))
    sink.stop()
    sink.stop()
    assert sink.poll_once(0.01) == 0
    assert "secret" not in repr(SinkConfig(bootstrap_servers="x", extra={"sasl.password": "secret"}))
    with pytest.raises(ValueError) as info:
        SinkConfig(bootstrap_servers="", flush_rows=0, session_timeout_ms=-1)
    assert all(key in str(info.value) for key in ("bootstrap_servers", "flush_rows", "session_timeout_ms"))


@pytest.mark.integration
def test_two_stores_each_get_every_record_and_see_each_other(kafka_bootstrap: str, chdb_path: Path) -> None:
    """One consumer group per store: a sink writing another store takes no partitions from the first."""
    from fleetscope.config import load_config
    from fleetscope.sinks import connect, migrate
    from fleetscope.stack import other_store_sinks, sink_config, sink_group

    prefix = f"st{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix=prefix)
    _create_topics(kafka_bootstrap, topics)
    configs = [
        load_config(env={}, overrides={"store.url": f"chdb://{chdb_path}", "store.database": f"st_{prefix}_{i}",
                                       "kafka.bootstrap_servers": kafka_bootstrap, "kafka.topic_prefix": prefix,
                                       "kafka.session_timeout_ms": 2000})
        for i in range(2)
    ]  # fmt: skip
    assert sink_group(configs[0]) != sink_group(configs[1])
    assert sink_group(configs[0]) == sink_group(configs[0].replace())
    sinks = []
    for cfg in configs:
        client = connect(cfg.store)
        migrate(client, cfg.store.database)
        sinks.append((Sink(sink_config(cfg), ClickHouseWriter(client, cfg.store.database)), client, cfg))
    try:
        for sink, _, _ in sinks:
            sink.start()
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        for rank in range(16):
            producer.produce(topics.iterations, encode("iterations", _iteration(rank, 1)), key=rank_key("job-s", rank))
        assert producer.flush(10) == 0
        _wait_for(lambda: all(s.stats["iterations"] == 16 for s, _, _ in sinks))
        assert sink_group(configs[0]) in other_store_sinks(configs[1])
    finally:
        for sink, _, _ in sinks:
            sink.stop(timeout_s=10)
    for _, client, cfg in sinks:
        assert table_counts(client, cfg.store.database)["iterations"] == 16
