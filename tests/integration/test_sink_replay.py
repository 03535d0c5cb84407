"""Replaying the whole derived topics through the sink adds no row (``count()`` without FINAL)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clickhouse_connect.driver import Client
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from fleetscope.schemas import Topics, encode
from fleetscope.schemas.topics import job_key, rank_key
from fleetscope.sinks import ClickHouseWriter, Sink, SinkConfig, StoreConfig, connect, migrate
from fleetscope.sinks.clickhouse import NATURAL_KEYS

pytestmark = pytest.mark.integration

RANKS, ITERATIONS, FUNCTIONS = 4, 6, ["gemm", "ncclAllReduce", "flash_fwd"]
EXPECTED = {"iterations": RANKS * ITERATIONS, "function_patterns": RANKS * ITERATIONS * 3, "finding_updates": 4}


T0 = 1_700_000_000_000_000_000


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


@pytest.fixture()
def store(chdb_path: Path) -> Iterator[tuple[Client, str]]:
    database = f"t_{uuid.uuid4().hex}"
    client = connect(StoreConfig(url=f"chdb://{chdb_path}", database=database))
    migrate(client, database)
    yield client, database
    client.command(f"DROP DATABASE IF EXISTS `{database}`", use_database=False)


def _counts(client: Client, database: str) -> dict[str, int]:
    return {t: int(client.command(f"SELECT count() FROM `{database}`.{t}")) for t in NATURAL_KEYS}


def _drain(config: SinkConfig, writer: ClickHouseWriter, messages: int, timeout_s: float = 30.0) -> Sink:
    """Run a sink until it has consumed ``messages`` messages and flushed them, then stop it."""
    sink = Sink(config, writer)
    deadline = time.monotonic() + timeout_s
    try:
        while sink.stats["messages"] < messages or sink.stats["flushes"] == 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"sink did not drain {messages} messages: {sink.stats}")
            sink.poll_once(0.1)
    finally:
        sink.stop()
    return sink


def test_replaying_every_derived_topic_twice_leaves_row_counts_unchanged(
    broker: str, store: tuple[Client, str]
) -> None:
    client, database = store
    prefix = f"rp{uuid.uuid4().hex[:8]}"
    topics = Topics(prefix=prefix)
    admin = AdminClient({"bootstrap.servers": broker})
    names = [topics.iterations, topics.patterns, topics.findings, topics.deadletter]
    for future in admin.create_topics([NewTopic(n, num_partitions=2, replication_factor=1) for n in names]).values():
        future.result(10)
    producer = Producer({"bootstrap.servers": broker, "linger.ms": 5})
    for rank in range(RANKS):
        for it in range(ITERATIONS):
            key = rank_key("job-k", rank)
            producer.produce(topics.iterations, encode("iterations", _iteration(rank, it)), key=key)
            producer.produce(topics.patterns, encode("patterns", _patterns(rank, it, FUNCTIONS)), key=key)
    for fid, version, status in (("f1", 1, "open"), ("f1", 2, "update"), ("f1", 3, "closed"), ("f2", 1, "open")):
        producer.produce(topics.findings, encode("findings", _finding(fid, version, status)), key=job_key("job-k"))
    assert producer.flush(10) == 0
    messages = 2 * RANKS * ITERATIONS + 4

    writer = ClickHouseWriter(client, database)

    def config(group: str) -> SinkConfig:
        # Small flush sizes so each run cuts the topics into different insert batches.
        return SinkConfig(bootstrap_servers=broker, topic_prefix=prefix, group_id=group,
                          session_timeout_ms=2000, flush_interval_ms=50, flush_rows=7)  # fmt: skip

    first = _drain(config(f"g-{prefix}"), writer, messages)
    assert {t: first.stats[t] for t in EXPECTED} == EXPECTED
    assert _counts(client, database) == EXPECTED

    for replay in range(2):  # a new group reads every topic from the beginning: a full replay
        again = _drain(config(f"g-{prefix}-replay{replay}"), writer, messages)
        assert again.stats["messages"] == messages and again.stats["dead_letters"] == 0
        assert {t: again.stats[t] for t in EXPECTED} == dict.fromkeys(EXPECTED, 0)
        assert _counts(client, database) == EXPECTED


def test_writer_skips_records_already_stored_or_repeated_in_one_batch(store: tuple[Client, str]) -> None:
    client, database = store
    writer = ClickHouseWriter(client, database)
    odd_job = "job'with\\quotes"
    first = [_iteration(0, 0), _iteration(0, 0), {**_iteration(1, 0), "job": odd_job}]
    assert writer.write_iterations(first) == 2
    assert writer.write_iterations([_iteration(0, 0), _iteration(0, 1), {**_iteration(1, 0), "job": odd_job}]) == 1
    assert writer.write_patterns([_patterns(0, 0, FUNCTIONS)] * 2) == 3
    assert writer.write_patterns([_patterns(0, 0, FUNCTIONS), _patterns(0, 1, ["gemm"])]) == 1
    assert writer.write_findings([_finding("f1", 1, "open"), _finding("f1", 2, "update")]) == 2
    assert writer.write_findings([_finding("f1", 2, "update"), _finding("f1", 3, "closed")]) == 1
    assert _counts(client, database) == {"iterations": 3, "function_patterns": 4, "finding_updates": 3}
