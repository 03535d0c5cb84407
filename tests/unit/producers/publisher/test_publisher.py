"""The publisher's lifecycle, and its promise to training code: publish never blocks and never raises."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest

from fleetscope.config import load_config
from fleetscope.producers import Publisher, PublisherConfig, PublisherStats, SimulatorConfig, simulate
from fleetscope.producers.publisher import DiskSpool
from fleetscope.schemas import EventBatch, decode_event_batch, encode_event_batch
from fleetscope.wiring import publisher_config

UNREACHABLE = "127.0.0.1:1"


def some_batches(n: int) -> list[EventBatch]:
    batches = list(simulate(SimulatorConfig(ranks=2, iterations=(n + 7) // 8)))
    return batches[:n]


def test_builds_from_defaults_and_stops_without_start_twice() -> None:
    publisher = Publisher(PublisherConfig(bootstrap_servers=UNREACHABLE))
    publisher.stop()
    publisher.stop()
    assert publisher.stats == PublisherStats()
    assert publisher.flush(0.1) == 0


def test_start_then_stop_twice_with_an_unreachable_broker_returns_within_the_deadline() -> None:
    publisher = Publisher(PublisherConfig(bootstrap_servers=UNREACHABLE))
    publisher.start()
    publisher.start()  # a second start is a no-op
    assert publisher.publish(some_batches(1)[0])
    began = time.monotonic()
    publisher.stop(timeout_s=0.2)
    publisher.stop(timeout_s=0.2)
    assert time.monotonic() - began < 2.0
    stats = publisher.stats
    assert stats.published == 1 and stats.failed == 1 and stats.delivered == 0  # purged on stop
    with pytest.raises(RuntimeError, match="cannot be restarted"):
        publisher.start()


def settle(publisher: Publisher, predicate: Callable[[PublisherStats], bool], timeout_s: float = 5.0) -> PublisherStats:
    deadline = time.monotonic() + timeout_s
    while not predicate(stats := publisher.stats) and time.monotonic() < deadline:
        time.sleep(0.02)
    return stats


def test_publish_never_blocks_and_a_full_spool_drops_the_oldest_with_a_count() -> None:
    batches = some_batches(40)
    size = sum(len(encode_event_batch(b)) for b in batches)
    cfg = PublisherConfig(bootstrap_servers=UNREACHABLE, queue_max_messages=5, spool_max_bytes=65_536)
    assert size > 2 * cfg.spool_max_bytes
    publisher = Publisher(cfg)
    publisher.start()
    began = time.monotonic()
    accepted = [publisher.publish(b) for b in batches]
    elapsed = time.monotonic() - began
    stats = settle(publisher, lambda s: s.spool_records + s.spool_dropped == 40)
    publisher.stop(timeout_s=0.1)
    assert elapsed < 0.5
    assert accepted == [True] * 40
    assert stats.published == 40 and stats.dropped == 0 and stats.outages == 1
    assert stats.spool_dropped > 0 and stats.spool_dropped_events > 0
    assert 0 < stats.spool_bytes <= cfg.spool_max_bytes
    assert stats.spool_records == 40 - stats.spool_dropped  # the newest are kept
    final = publisher.stats
    assert final.published == final.delivered + final.failed + final.spool_dropped  # nothing unaccounted


def test_an_unreachable_broker_leaves_the_messages_in_the_disk_spool_for_the_next_start(tmp_path: Path) -> None:
    batches = some_batches(6)
    cfg = PublisherConfig(bootstrap_servers=UNREACHABLE, spool_dir=str(tmp_path / "spool"))
    publisher = Publisher(cfg)
    publisher.start()
    assert all(publisher.publish(b) for b in batches)
    assert publisher.flush(0.2) == 6
    publisher.stop(timeout_s=0.2)
    stats = publisher.stats
    assert stats.failed == 0 and stats.spooled == 6 and stats.spool_records == 6

    again = Publisher(cfg)
    again.start()
    try:
        assert again.stats.spool_records == 6  # read back at start, sent first once the broker answers
        assert again.publish(batches[0])
    finally:
        again.stop(timeout_s=0.2)
    assert again.stats.spool_records == 7
    records = DiskSpool(cfg.spool_dir, cfg.spool_max_bytes).read(100)
    assert [decode_event_batch(r.value).header.seq for _, r in records] == [b.header.seq for b in batches] + [
        batches[0].header.seq
    ]


def test_publish_before_start_or_after_stop_drops_instead_of_raising() -> None:
    publisher = Publisher(PublisherConfig(bootstrap_servers=UNREACHABLE))
    batch = some_batches(1)[0]
    assert publisher.publish(batch) is False
    publisher.start()
    publisher.stop(timeout_s=0.1)
    assert publisher.publish(batch) is False
    assert publisher.stats.dropped == 2


def test_a_batch_that_cannot_be_encoded_is_dropped_not_raised() -> None:
    batch = some_batches(1)[0]
    batch.header = dataclasses.replace(batch.header, job=cast(Any, None))
    with Publisher(PublisherConfig(bootstrap_servers=UNREACHABLE)) as publisher:  # nothing queued: quick exit
        assert publisher.publish(batch) is False
        assert publisher.stats.dropped == 1 and publisher.stats.published == 0


def test_config_validation_reports_every_problem_and_protects_owned_settings() -> None:
    with pytest.raises(ValueError) as info:
        PublisherConfig(
            bootstrap_servers="",
            compression="brotli",
            linger_ms=-1,
            queue_max_messages=0,
            delivery_timeout_ms=10,
            spool_max_bytes=100,
            extra={"linger.ms": "5", "enable.idempotence": "false", "allow.auto.create.topics": "true"},
        )
    text = str(info.value)
    for part in (
        "bootstrap_servers must not be empty",
        "compression must be one of none|gzip|snappy|lz4|zstd",
        "linger_ms must be >= 0",
        "queue_max_messages must be >= 1",
        "delivery_timeout_ms must be >= 1000",
        "spool_max_bytes must be >= 65536",
        "extra['linger.ms']",
        "extra['enable.idempotence']",
        "extra['allow.auto.create.topics']",
    ):
        assert part in text


def test_librdkafka_settings_pin_idempotence_and_the_java_compatible_partitioner() -> None:
    cfg = PublisherConfig(bootstrap_servers="b:9092", extra={"security.protocol": "SASL_SSL"})
    settings = cfg.librdkafka()
    assert settings["enable.idempotence"] is True and settings["partitioner"] == "murmur2_random"
    assert settings["allow.auto.create.topics"] is False  # co-partitioning needs the topics ensure_topics made
    assert settings["security.protocol"] == "SASL_SSL" and settings["compression.type"] == "lz4"
    assert "SASL_SSL" not in repr(cfg)  # extra may hold secrets: never in a repr or a log line


def test_the_program_config_sets_the_spool_one_directory_per_process(tmp_path: Path) -> None:
    config = load_config(
        env={"FLEETSCOPE__PRODUCER__SPOOL_MAX_BYTES": "1_000_000"},
        overrides={"kafka.bootstrap_servers": "b:9092", "data_dir": str(tmp_path)},
    )
    cfg = publisher_config(config, client_id="fleetscope-agent")
    assert cfg.spool_dir == f"{tmp_path}/spool/fleetscope-agent" and cfg.spool_max_bytes == 1_000_000
    assert cfg.bootstrap_servers == "b:9092" and cfg.client_id == "fleetscope-agent"
    memory = load_config(env={}, overrides={"kafka.bootstrap_servers": "b:9092", "producer.spool_on_disk": "no"})
    assert publisher_config(memory).spool_dir == ""
    with pytest.raises(ValueError, match=r"producer: .*spool_max_bytes must be >= 65536"):
        load_config(env={}, overrides={"producer.spool_max_bytes": 10})


def test_a_batch_over_max_message_bytes_is_dropped_and_counted_not_sent() -> None:
    batch = some_batches(1)[0]
    batch.names[0] = "k" * 4096
    with Publisher(PublisherConfig(bootstrap_servers=UNREACHABLE, max_message_bytes=2048)) as publisher:
        assert publisher.publish(batch) is False
        assert publisher.stats.dropped == 1 and publisher.stats.published == 0
    assert PublisherConfig(bootstrap_servers="x", max_message_bytes=2_000_000).librdkafka()["message.max.bytes"] > (
        2_000_000
    )
    with pytest.raises(ValueError, match="max_message_bytes"):
        PublisherConfig(bootstrap_servers="x", max_message_bytes=10)
