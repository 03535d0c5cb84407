"""The publisher's settings and counters, and which delivery errors no retry can cure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from confluent_kafka import KafkaError

from fleetscope.schemas.limits import IntakeLimits

COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")

# librdkafka keys the publisher owns: set through a typed field, or fixed because correctness depends on them.
_OWNED_KEYS = {
    "bootstrap.servers": "bootstrap_servers",
    "client.id": "client_id",
    "compression.type": "compression",
    "compression.codec": "compression",
    "linger.ms": "linger_ms",
    "queue.buffering.max.ms": "linger_ms",
    "queue.buffering.max.messages": "queue_max_messages",
    "queue.buffering.max.kbytes": "queue_max_kbytes",
    "message.timeout.ms": "delivery_timeout_ms",
    "delivery.timeout.ms": "delivery_timeout_ms",
    "message.max.bytes": "max_message_bytes",
    "enable.idempotence": "(fixed: true)",
    "partitioner": "(fixed: murmur2_random)",
    "allow.auto.create.topics": "(fixed: false)",
    "error_cb": "(fixed)",
    "logger": "(fixed: logging to fleetscope.producers.publisher.librdkafka)",
    "on_delivery": "(fixed)",
    "delivery.report.only.error": "(fixed: false)",
}

# Delivery errors that a retry cannot cure: the message is counted as failed instead of spooled.
PERMANENT_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_MSG,
        KafkaError.INVALID_RECORD,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.INVALID_REQUIRED_ACKS,
        KafkaError.UNSUPPORTED_FOR_MESSAGE_FORMAT,
        KafkaError._INVALID_ARG,
        KafkaError._INVALID_TYPE,
    }
)


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    """Where and how batches are published. ``extra`` goes to librdkafka as is (SASL/TLS...), never logged.

    ``spool_dir`` empty keeps the outage spool in memory (lost if the process ends); ``spool_max_bytes``
    bounds it, and separately bounds the in-memory backlog that feeds it."""

    bootstrap_servers: str
    topic_prefix: str = "fleetscope"
    compression: str = "lz4"
    linger_ms: int = 20
    queue_max_messages: int = 100_000
    queue_max_kbytes: int = 262_144
    client_id: str = "fleetscope-producer"
    delivery_timeout_ms: int = 30_000
    """librdkafka's message.timeout.ms: a message still undelivered after this starts an outage."""
    spool_dir: str = ""
    spool_max_bytes: int = 268_435_456
    retry_backoff_max_ms: int = 5_000
    """Longest wait between two probes of an unreachable broker."""
    max_message_bytes: int = IntakeLimits().max_message_bytes
    """A batch encoding to more is dropped (and counted) here: the intake would dead-letter it."""
    extra: Mapping[str, str] = field(default_factory=dict, repr=False, hash=False)

    def __post_init__(self) -> None:
        p: list[str] = []
        if not self.bootstrap_servers.strip():
            p.append("bootstrap_servers must not be empty")
        if not self.topic_prefix:
            p.append("topic_prefix must not be empty")
        if self.compression not in COMPRESSIONS:
            p.append(f"compression must be one of {'|'.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.max_message_bytes < 1024:
            p.append(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.linger_ms < 0:
            p.append(f"linger_ms must be >= 0, got {self.linger_ms}")
        if self.queue_max_messages < 1:
            p.append(f"queue_max_messages must be >= 1, got {self.queue_max_messages}")
        if self.queue_max_kbytes < 1:
            p.append(f"queue_max_kbytes must be >= 1, got {self.queue_max_kbytes}")
        if not self.client_id:
            p.append("client_id must not be empty")
        if self.delivery_timeout_ms < 1000 or self.delivery_timeout_ms <= self.linger_ms:
            p.append(f"delivery_timeout_ms must be >= 1000 and > linger_ms, got {self.delivery_timeout_ms}")
        if self.spool_max_bytes < 1 << 16:
            p.append(f"spool_max_bytes must be >= 65536, got {self.spool_max_bytes}")
        if not 100 <= self.retry_backoff_max_ms <= 600_000:
            p.append(f"retry_backoff_max_ms must be in [100, 600000], got {self.retry_backoff_max_ms}")
        for key in sorted(set(self.extra) & set(_OWNED_KEYS)):
            owner = _OWNED_KEYS[key]
            hint = f"set {owner} instead" if not owner.startswith("(") else f"the publisher owns it {owner}"
            p.append(f"extra[{key!r}] is not allowed: {hint}")
        if p:
            raise ValueError("invalid publisher config: " + "; ".join(p))

    def librdkafka(self) -> dict[str, object]:
        """The librdkafka settings, callbacks excluded."""
        return {
            "reconnect.backoff.max.ms": 1000,  # a default: reconnect soon after a broker restart
            **self.extra,
            "bootstrap.servers": self.bootstrap_servers,
            "client.id": self.client_id,
            "enable.idempotence": True,
            "compression.type": self.compression,
            "partitioner": "murmur2_random",
            "allow.auto.create.topics": False,
            "linger.ms": self.linger_ms,
            "message.timeout.ms": self.delivery_timeout_ms,
            "queue.buffering.max.messages": self.queue_max_messages,
            "queue.buffering.max.kbytes": self.queue_max_kbytes,
            # librdkafka's own cap (a request, with overhead) must not be the smaller one.
            "message.max.bytes": max(1_000_000, self.max_message_bytes + 65_536),
        }


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """Counters since construction, and two gauges (``spool_*``). Messages are batches; ``events_*`` count
    the events inside them. Every published message ends up delivered, failed, spool_dropped or pending (and
    ``delivered`` also counts what an earlier run left in the spool)."""

    published: int = 0
    """Messages accepted (into librdkafka's queue or the backlog)."""
    delivered: int = 0
    failed: int = 0
    """Messages given up: a permanent delivery error, or still undelivered at stop with the spool in memory."""
    dropped: int = 0
    """Messages never accepted: not started or stopped, or not encodable."""
    events_published: int = 0
    events_delivered: int = 0
    errors: int = 0
    """Client-level errors reported by librdkafka (e.g. broker unreachable)."""
    outages: int = 0
    """Times the broker became unreachable (or the producer unusable) and messages went to the spool."""
    producer_restarts: int = 0
    """Fresh librdkafka producers installed after an outage."""
    spooled: int = 0
    """Messages written to the spool."""
    events_spooled: int = 0
    spool_delivered: int = 0
    """Spooled messages delivered after an outage (also counted in ``delivered``)."""
    spool_dropped: int = 0
    """Accepted messages dropped, oldest first, because the spool or the backlog was full."""
    spool_dropped_events: int = 0
    spool_records: int = 0
    """Gauge: messages in the spool not delivered yet."""
    spool_bytes: int = 0
    """Gauge: bytes the spool holds."""
