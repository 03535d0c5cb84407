"""The ``Publisher``: event batches in, Avro messages on the raw topics out, whatever the broker does.

It runs inside training processes, so ``publish`` never blocks or raises: it encodes, then hands the message to
librdkafka's bounded queue, or, while older messages still wait, to an in-memory backlog behind them. A
background thread serves the delivery callbacks and recovers from broker outages:

1. Trouble (every broker down, a delivery error that is not permanent, a fatal idempotence error) starts an
   outage: the producer is taken out of service and purged, and every undelivered message moves, oldest first,
   into the bounded spool (``spool.py``), where newer ones follow. A full spool drops its oldest messages.
2. The thread probes the broker with a *fresh* producer (jittered exponential backoff): a broker that lost its
   state (Tansu is memory-only) answers the old producer id with UNKNOWN_PRODUCER_ID forever, and librdkafka
   only bumps that id's epoch. Once the broker answers and every topic written to exists (never auto-created:
   that would break co-partitioning), the spool is replayed in order, then the backlog, then ``publish`` goes
   straight to librdkafka again.

Order per key (``job/rank``) is kept: nothing overtakes an older message. Delivery is at least once (a message
in flight when the broker went away is sent again); the per-producer sequence number in every batch header
shows duplicates and gaps downstream. Keys are hashed with the Java-compatible murmur2 partitioner, so a rank's
four raw streams land in the same partition number whichever client wrote them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from types import TracebackType

from confluent_kafka import KafkaError, KafkaException

from fleetscope import telemetry
from fleetscope.producers.publisher.config import PERMANENT_ERRORS, PublisherConfig, PublisherStats
from fleetscope.producers.publisher.delivery import PURGE_WAIT_S, DeliveryThread, logger
from fleetscope.producers.publisher.spool import SpoolRecord
from fleetscope.schemas import EventBatch, Topics, encode_event_batch
from fleetscope.schemas.topics import rank_key


class Publisher(DeliveryThread):
    """Publishes ``EventBatch`` es to their raw topics; never blocks or raises in ``publish``.

    The callers' side (start, publish, flush, stop); the background thread's work is ``DeliveryThread``."""

    def __init__(self, config: PublisherConfig) -> None:
        super().__init__(config)
        self._topics = Topics(prefix=config.topic_prefix)
        self._stopped = False
        self._seq = 0
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Create the Kafka producer (connects lazily) and the background thread. A second call does nothing.

        Raises ``KafkaException`` on settings librdkafka rejects: a start-up error should stop the process.
        An unusable spool directory is not one: the spool then stays in memory (logged).
        """
        if self._running:
            return
        if self._stopped:
            raise RuntimeError("a stopped Publisher cannot be restarted; create a new one")
        generation, producer = self._new_producer()
        if self.config.spool_dir and os.path.isdir(self.config.spool_dir):
            self._open_disk_spool()  # an earlier run may have left messages; otherwise opened when first needed
        with self._route:
            self._producer, self._generation = producer, generation
            self._backlog_on = self._spool.records > 0  # an earlier run left messages: they go first
            self._running = True
        if self._backlog_on:
            self._draining_since = time.monotonic()
        self._update_gauges()
        self._thread = threading.Thread(target=self._run, name="fleetscope-publisher", daemon=True)
        self._thread.start()
        telemetry.register_source("publisher", self, lambda p: dataclasses.asdict(p.stats))
        cfg = self.config
        logger.info(
            "publisher started: %s -> %s, spool %s",
            cfg.topic_prefix,
            cfg.bootstrap_servers,
            cfg.spool_dir or "in memory",
        )

    def flush(self, timeout_s: float = 10.0) -> int:
        """Wait up to ``timeout_s`` until everything accepted is delivered; return how many are still pending."""
        deadline = time.monotonic() + timeout_s
        while (pending := self._pending()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return pending

    def stop(self, timeout_s: float = 10.0) -> None:
        """Deliver what is pending within ``timeout_s``; keep the rest in the spool (on disk) or count it as
        failed (in memory); release the producer. Idempotent; stopping a publisher that never started is fine."""
        with self._route:
            running, self._running, self._stopped = self._running, False, True
        if not running or self._thread is None:
            return
        self._deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._thread.join(timeout_s + 2 * PURGE_WAIT_S + 1.0)
        logger.info("publisher stopped: %s", self.stats)

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
        try:
            value = encode_event_batch(batch)
            topic = self._topics.raw(batch.kind)
            key = rank_key(batch.header.job, batch.header.rank)
        except Exception as exc:  # bad input must never reach the training loop
            return self._drop(f"encode:{type(exc).__name__}", f"cannot encode a batch: {exc}")
        if len(value) > self.config.max_message_bytes:
            return self._drop(
                "too_large",
                f"a {batch.kind.value} batch of {len(value)} bytes exceeds max_message_bytes "
                f"{self.config.max_message_bytes}: dropped (the intake would dead-letter it)",
            )
        return self.publish_record(topic, key, value, n_events)

    def publish_record(self, topic: str, key: bytes, value: bytes, n_events: int = 0) -> bool:
        """Queue one encoded message (a heartbeat, say) on ``topic``: the same never-blocking route as batches,
        behind older messages, through the bounded backlog and spool while the broker is away."""
        with self._route:
            if not self._running:
                reason = "stopped" if self._stopped else "not_started"
                return self._drop(reason, f"publisher is not running ({reason}); dropping batches")
            self._seq += 1
            self._topics_used.add(topic)
            producer = None if self._backlog_on else self._producer
            if producer is not None:
                try:
                    producer.produce(
                        topic, value=value, key=key, on_delivery=self._direct_callback(self._seq, n_events)
                    )
                except BufferError:
                    self._log_once("queue_full", logging.WARNING, "local queue full; messages wait in the backlog")
                    self._backlog_on = True
                except KafkaException as exc:
                    err = exc.args[0] if exc.args else None
                    if isinstance(err, KafkaError) and err.code() in PERMANENT_ERRORS:
                        return self._drop(f"produce:{err.name()}", f"produce failed: {exc}")
                    self._raise_trouble(f"produce: {exc}")
                    self._backlog_on = True
                except Exception as exc:  # e.g. a closed producer: still never the caller's problem
                    return self._drop(f"produce:{type(exc).__name__}", f"produce failed: {exc!r}")
                else:
                    self._count(published=1, events_published=n_events)
                    return True
            lost, lost_events = self._backlog.append(self._seq, SpoolRecord(topic, key, value, n_events))
            if lost:
                self._count(spool_dropped=lost, spool_dropped_events=lost_events)
        self._count(published=1, events_published=n_events)
        return True

    @property
    def topics(self) -> Topics:
        """The topic names of this publisher's prefix."""
        return self._topics

    @property
    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(**self._counts)

    @property
    def fatal_error(self) -> str | None:
        """The last fatal librdkafka error; the publisher recovers from it with a fresh producer."""
        return self._fatal
