"""The Kafka publisher every producer shares: event batches in, Avro messages on the raw topics out.

Why it looks like this: it runs inside training processes, so it must never block or raise into the caller.
``produce`` only enqueues into librdkafka's bounded local queue and ``poll(0)`` serves delivery callbacks
without waiting; when the queue is full the batch is dropped and counted. Keys are ``job/rank`` hashed with
the Java-compatible murmur2 partitioner, so a rank's four raw streams land in the same partition number
whichever client wrote them, and meet in one stream worker.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from fleetscope import telemetry
from fleetscope.schemas import EventBatch, Topics, encode_event_batch
from fleetscope.schemas.topics import rank_key

logger = logging.getLogger(__name__)
_client_logger = logging.getLogger(f"{__name__}.librdkafka")  # librdkafka's own log lines, not stderr

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
    "enable.idempotence": "(fixed: true)",
    "partitioner": "(fixed: murmur2_random)",
    "error_cb": "(fixed)",
    "logger": "(fixed: logging to fleetscope.producers.publisher.librdkafka)",
    "on_delivery": "(fixed)",
    "delivery.report.only.error": "(fixed: false)",
}


@dataclass(frozen=True, kw_only=True)
class PublisherConfig:
    """Where and how batches are published. ``extra`` goes to librdkafka as is (SASL/TLS...), never logged."""

    bootstrap_servers: str
    topic_prefix: str = "fleetscope"
    compression: str = "lz4"
    linger_ms: int = 20
    queue_max_messages: int = 100_000
    queue_max_kbytes: int = 262_144
    client_id: str = "fleetscope-producer"
    extra: Mapping[str, str] = field(default_factory=dict, repr=False, hash=False)

    def __post_init__(self) -> None:
        p: list[str] = []
        if not self.bootstrap_servers.strip():
            p.append("bootstrap_servers must not be empty")
        if not self.topic_prefix:
            p.append("topic_prefix must not be empty")
        if self.compression not in COMPRESSIONS:
            p.append(f"compression must be one of {'|'.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.linger_ms < 0:
            p.append(f"linger_ms must be >= 0, got {self.linger_ms}")
        if self.queue_max_messages < 1:
            p.append(f"queue_max_messages must be >= 1, got {self.queue_max_messages}")
        if self.queue_max_kbytes < 1:
            p.append(f"queue_max_kbytes must be >= 1, got {self.queue_max_kbytes}")
        if not self.client_id:
            p.append("client_id must not be empty")
        for key in sorted(set(self.extra) & set(_OWNED_KEYS)):
            owner = _OWNED_KEYS[key]
            hint = f"set {owner} instead" if not owner.startswith("(") else f"the publisher owns it {owner}"
            p.append(f"extra[{key!r}] is not allowed: {hint}")
        if p:
            raise ValueError("invalid publisher config: " + "; ".join(p))

    def librdkafka(self) -> dict[str, Any]:
        """The librdkafka settings, callbacks excluded."""
        return {
            **self.extra,
            "bootstrap.servers": self.bootstrap_servers,
            "client.id": self.client_id,
            "enable.idempotence": True,
            "compression.type": self.compression,
            "partitioner": "murmur2_random",
            "linger.ms": self.linger_ms,
            "queue.buffering.max.messages": self.queue_max_messages,
            "queue.buffering.max.kbytes": self.queue_max_kbytes,
        }


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """Counters since construction. Messages are batches; ``events_*`` count the events inside them."""

    published: int = 0
    """Messages accepted into the local queue."""
    delivered: int = 0
    failed: int = 0
    """Messages the broker never acknowledged (delivery error, purged on stop)."""
    dropped: int = 0
    """Messages never queued: queue full, not started, encoding or produce error."""
    events_published: int = 0
    events_delivered: int = 0
    errors: int = 0
    """Client-level errors reported by librdkafka (e.g. broker unreachable)."""


class Publisher:
    """Publishes ``EventBatch`` es to their raw topics; never blocks or raises in ``publish``."""

    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self._topics = Topics(prefix=config.topic_prefix)
        self._producer: Producer | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(PublisherStats.__dataclass_fields__, 0)
        self._logged: set[str] = set()
        self._fatal: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Create the Kafka producer (connects lazily, in the background). A second call does nothing.

        Raises ``KafkaException`` on settings librdkafka rejects: a start-up error should stop the process.
        """
        if self._producer is not None:
            return
        if self._stopped:
            raise RuntimeError("a stopped Publisher cannot be restarted; create a new one")
        settings = {**self.config.librdkafka(), "error_cb": self._on_error, "logger": _client_logger}
        self._producer = Producer(settings)
        telemetry.register_source("publisher", self, lambda p: dict(p._counts))  # read at scrape time
        logger.info(
            "publisher started: bootstrap=%s prefix=%s compression=%s",
            self.config.bootstrap_servers,
            self.config.topic_prefix,
            self.config.compression,
        )

    def flush(self, timeout_s: float = 10.0) -> int:
        """Wait up to ``timeout_s`` for queued messages; return how many are still undelivered."""
        if self._producer is None:
            return 0
        return int(self._producer.flush(timeout_s))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Flush within ``timeout_s``, purge what is left (counted as failed) and release the producer.

        Idempotent; stopping a publisher that never started is fine.
        """
        producer, self._producer = self._producer, None
        self._stopped = True
        if producer is None:
            return
        remaining = int(producer.flush(timeout_s))
        if remaining:
            logger.warning(
                "publisher stopping with %d messages undelivered after %.1f s", remaining, timeout_s
            )
            producer.purge(in_queue=True, in_flight=True)
            producer.flush(0)  # serve the purge callbacks so they are counted
        s = self.stats
        logger.info(
            "publisher stopped: published=%d delivered=%d failed=%d dropped=%d",
            s.published,
            s.delivered,
            s.failed,
            s.dropped,
        )

    def __enter__(self) -> Publisher:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- publishing --------------------------------------------------------------------------------------
    def publish(self, batch: EventBatch) -> bool:
        """Queue one batch for its raw topic, keyed ``job/rank``; False (and counted) when it was dropped."""
        n_events = len(batch)
        producer = self._producer
        if producer is None or self._fatal is not None:
            reason = "not_started" if producer is None else "fatal"
            return self._drop(n_events, reason, f"publisher is not running ({reason}); dropping batches")
        try:
            value = encode_event_batch(batch)
            topic = self._topics.raw(batch.kind)
            key = rank_key(batch.header.job, batch.header.rank)
        except Exception as exc:  # bad input must never reach the training loop
            return self._drop(n_events, f"encode:{type(exc).__name__}", f"cannot encode a batch: {exc}")

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            self._on_delivery(err, n_events)

        for attempt in (0, 1):
            try:
                producer.produce(topic, value=value, key=key, on_delivery=on_delivery)
                break
            except BufferError:
                if attempt == 1:
                    return self._drop(n_events, "queue_full", "local queue full; dropping batches")
                self._serve(producer)  # serve callbacks to free queue space, without waiting
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                name = err.name() if isinstance(err, KafkaError) else type(exc).__name__
                return self._drop(n_events, f"produce:{name}", f"produce failed: {exc}")
            except Exception as exc:  # e.g. a closed producer: still never the caller's problem
                return self._drop(n_events, f"produce:{type(exc).__name__}", f"produce failed: {exc!r}")
        with self._lock:
            self._counts["published"] += 1
            self._counts["events_published"] += n_events
        self._serve(producer)
        return True

    @property
    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(**self._counts)

    @property
    def fatal_error(self) -> str | None:
        """Set on a fatal librdkafka error: the publisher then drops everything; the process should stop."""
        return self._fatal

    # -- callbacks (run inside poll/flush, on the caller's thread) ---------------------------------------
    def _serve(self, producer: Producer) -> None:
        try:
            producer.poll(0)
        except Exception as exc:
            self._log_once(f"poll:{type(exc).__name__}", logging.WARNING, f"poll failed: {exc!r}")

    def _drop(self, n_events: int, reason: str, message: str) -> bool:
        with self._lock:
            self._counts["dropped"] += 1
        self._log_once(reason, logging.WARNING, message)
        return False

    def _on_delivery(self, err: KafkaError | None, n_events: int) -> None:
        with self._lock:
            if err is None:
                self._counts["delivered"] += 1
                self._counts["events_delivered"] += n_events
            else:
                self._counts["failed"] += 1
        if err is not None:
            self._log_once(f"delivery:{err.name()}", logging.WARNING, f"delivery failed: {err.str()}")

    def _on_error(self, err: KafkaError) -> None:
        with self._lock:
            self._counts["errors"] += 1
        if err.fatal():
            self._fatal = err.str()
            self._log_once(f"fatal:{err.name()}", logging.ERROR, f"fatal Kafka error: {err.str()}")
        else:
            self._log_once(f"error:{err.name()}", logging.WARNING, f"Kafka client error: {err.str()}")

    def _log_once(self, kind: str, level: int, message: str) -> None:
        """Log the first occurrence of each kind of problem; the counters carry the rest."""
        if kind in self._logged:
            return
        self._logged.add(kind)
        logger.log(level, "%s (further occurrences are only counted)", message)
