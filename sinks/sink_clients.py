"""The sink's Kafka side: its configuration, the settings of its consumer and dead-letter producer, the
errors that mean the broker refuses it, and how a message that cannot be stored reaches the dead-letter topic
(with its reason and origin as headers)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, Message, Producer

from fleetscope import telemetry
from fleetscope.schemas.signing import MIN_KEY_BYTES

ACCESS_ERRORS = frozenset(
    {
        KafkaError._AUTHENTICATION,
        KafkaError._SSL,
        KafkaError.SASL_AUTHENTICATION_FAILED,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    }
)
"""Errors a retry in 50 ms cannot cure (wrong credentials, missing ACLs): the consume loop backs off."""
CLIENT_LOGGER = logging.getLogger("fleetscope.sinks.sink.librdkafka")
"""librdkafka's own log lines (not stderr), one of each kind per 30 s."""
CLIENT_LOGGER.addFilter(telemetry.RepeatFilter(30.0))


@dataclass(frozen=True, kw_only=True)
class SinkConfig:
    """Kafka side of the sink. ``extra`` passes librdkafka settings to the consumer and the dead-letter
    producer (e.g. security); it is never logged."""

    bootstrap_servers: str
    topic_prefix: str = "fleetscope"
    group_id: str = "fleetscope-sink"
    session_timeout_ms: int = 6000
    """Tansu holds a JoinGroup for half of it: keep it low in development."""
    flush_rows: int = 50_000
    flush_interval_ms: int = 500
    extra: Mapping[str, str] = field(default_factory=dict, repr=False)
    findings_key: bytes | None = field(default=None, repr=False)
    """Key of the findings' signatures (``schemas.signing``): a finding that does not verify is dead-lettered.
    Every configured sink has one (``stack.sink_config``); None, a sink built by hand trusts the topic."""

    def __post_init__(self) -> None:
        errors: list[str] = []
        if not self.bootstrap_servers:
            errors.append("bootstrap_servers: must not be empty")
        if not self.topic_prefix:
            errors.append("topic_prefix: must not be empty")
        if not self.group_id:
            errors.append("group_id: must not be empty")
        for name in ("session_timeout_ms", "flush_rows", "flush_interval_ms"):
            if getattr(self, name) <= 0:
                errors.append(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.findings_key is not None and len(self.findings_key) < MIN_KEY_BYTES:
            errors.append(f"findings_key: at least {MIN_KEY_BYTES} bytes")
        if errors:
            raise ValueError("invalid SinkConfig: " + "; ".join(errors))


def _common(config: SinkConfig, on_error: Callable[[KafkaError], None]) -> dict[str, object]:
    return {
        "reconnect.backoff.ms": 500,  # librdkafka's own reconnects: a refused login is not retried at 50 ms
        "reconnect.backoff.max.ms": 30_000,
        **config.extra,
        "bootstrap.servers": config.bootstrap_servers,
        "logger": CLIENT_LOGGER,
        "error_cb": on_error,
    }


def consumer_settings(
    config: SinkConfig, *, on_error: Callable[[KafkaError], None], on_statistics: Callable[[str], None]
) -> dict[str, object]:
    """The consumer's: manual commits (after a flush), from the earliest offset, statistics every 5 s."""
    return {
        **_common(config, on_error),
        "group.id": config.group_id,
        "client.id": "fleetscope-sink",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": config.session_timeout_ms,
        "heartbeat.interval.ms": max(100, config.session_timeout_ms // 3),
        "statistics.interval.ms": 5_000,
        "stats_cb": on_statistics,
    }


def deadletter_settings(config: SinkConfig, *, on_error: Callable[[KafkaError], None]) -> dict[str, object]:
    return {**_common(config, on_error), "client.id": "fleetscope-sink-deadletter", "linger.ms": 5,
            "message.timeout.ms": 30_000}  # fmt: skip


def produce_dead_letter(
    producer: Producer,
    topic: str,
    msg: Message,
    reason: str,
    on_delivery: Callable[[KafkaError | None, Message], None],
    *,
    value: bytes | None = None,
) -> bool:
    """Queue ``msg`` (value and key as they came; ``value``: one element of its batch instead) on ``topic`` with
    (reason, topic, partition, offset) headers; False when the producer's queue stayed full for 5 s (the message
    is dropped)."""
    headers: list[tuple[str, str | bytes | None]] = [
        ("reason", reason[:2000].encode()),
        ("topic", (msg.topic() or "").encode()),
        ("partition", str(msg.partition()).encode()),
        ("offset", str(msg.offset()).encode()),
    ]
    for _ in range(50):
        try:
            sent = msg.value() if value is None else value
            producer.produce(topic, value=sent, key=msg.key(), headers=headers, on_delivery=on_delivery)
            return True
        except BufferError:
            producer.poll(0.1)
    return False
