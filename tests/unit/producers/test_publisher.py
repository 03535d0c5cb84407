"""The publisher's lifecycle, and its promise to training code: publish never blocks and never raises."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, cast

import pytest

from fleetscope.producers import Publisher, PublisherConfig, PublisherStats, SimulatorConfig, simulate
from fleetscope.schemas import EventBatch

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


def test_publish_never_blocks_and_counts_overflow_as_dropped() -> None:
    batches = some_batches(40)
    publisher = Publisher(PublisherConfig(bootstrap_servers=UNREACHABLE, queue_max_messages=5))
    publisher.start()
    began = time.monotonic()
    accepted = [publisher.publish(b) for b in batches]
    elapsed = time.monotonic() - began
    stats = publisher.stats
    publisher.stop(timeout_s=0.1)
    assert elapsed < 0.5
    assert accepted == [True] * 5 + [False] * 35
    assert stats.published == 5 and stats.dropped == 35
    assert stats.events_published == sum(len(b) for b in batches[:5])


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
            extra={"linger.ms": "5", "enable.idempotence": "false"},
        )
    text = str(info.value)
    for part in (
        "bootstrap_servers must not be empty",
        "compression must be one of none|gzip|snappy|lz4|zstd",
        "linger_ms must be >= 0",
        "queue_max_messages must be >= 1",
        "extra['linger.ms']",
        "extra['enable.idempotence']",
    ):
        assert part in text


def test_librdkafka_settings_pin_idempotence_and_the_java_compatible_partitioner() -> None:
    cfg = PublisherConfig(bootstrap_servers="b:9092", extra={"security.protocol": "SASL_SSL"})
    settings = cfg.librdkafka()
    assert settings["enable.idempotence"] is True and settings["partitioner"] == "murmur2_random"
    assert settings["security.protocol"] == "SASL_SSL" and settings["compression.type"] == "lz4"
    assert "SASL_SSL" not in repr(cfg)  # extra may hold secrets: never in a repr or a log line
