"""The sink process: iterations, patterns and findings topics -> the store, at least once.

Offsets are committed only after every buffered row is inserted and every dead letter delivered, so a
crash replays the uncommitted tail; the writer skips records whose natural key is stored already, so
that replay (or a whole-topic replay by a new group) adds no row. A pattern batch's elements are stored
one by one, as lone pattern messages are (``schemas.pattern_batch``). Undecodable messages (or a batch's
elements, each alone) go to the dead-letter topic with (reason, topic, partition, offset) headers and are
skipped; so do findings whose signature does not verify (``schemas.signing``): only the differential's
findings are stored.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from fleetscope import telemetry
from fleetscope.schemas import SchemaError, Topics, decode
from fleetscope.schemas.pattern_batch import PATTERN_BATCH, PATTERNS, element_reason
from fleetscope.schemas.signing import signature_reason
from fleetscope.sinks.records import pattern_rows
from fleetscope.sinks.retry import MAX_PAUSE_S as _MAX_PAUSE_S
from fleetscope.sinks.retry import backoff_s
from fleetscope.sinks.sink_clients import (
    ACCESS_ERRORS,
    SinkConfig,
    consumer_settings,
    deadletter_settings,
    produce_dead_letter,
)
from fleetscope.sinks.store import RecordWriter

logger = logging.getLogger(__name__)

_ROWS_STAT = {"iterations": "iterations", "patterns": "function_patterns", "findings": "finding_updates"}
"""Stored subject -> the stat counting its rows written."""
_UNDECODABLE = (SchemaError, ValueError, KeyError, TypeError)
"""What decoding a record, or counting its rows, raises on a bad one."""
_MAX_BATCH_MESSAGES = 1_000
_DEADLETTER_FLUSH_S = 10.0


@dataclass(slots=True)
class _Buffer:
    """Decoded records of one subject with the messages they came from (to isolate a bad one): each with the
    batch element it is, or None (the whole message)."""

    records: list[dict[str, object]] = field(default_factory=list)
    sources: list[tuple[Message, bytes | None]] = field(default_factory=list)
    rows: int = 0


class Sink:
    """Consumes the derived topics and writes them with a store's ``RecordWriter`` (``open_store``).

    Batches by rows and age; a flush that fails (after the writer's own retries) pauses the assigned
    partitions and is retried with backoff, so the buffer never grows without limit."""

    def __init__(self, config: SinkConfig, writer: RecordWriter) -> None:
        self._config = config
        self._writer = writer
        self._topics = Topics(prefix=config.topic_prefix)
        self._write: dict[str, Callable[[Sequence[dict[str, object]]], int]] = {
            "iterations": writer.write_iterations,
            "patterns": writer.write_patterns,
            "findings": writer.write_findings,
        }
        self._buffers = {subject: _Buffer() for subject in self._write}
        self._offsets: dict[tuple[str, int], int] = {}
        self._oldest_s: float | None = None
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        self._lock = threading.RLock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._paused = False
        self._retry_at_s = 0.0
        self._failures_in_row = 0
        self._access_failures = 0
        self._access_retry_at_s = 0.0
        self._access_logged_at_s = -_MAX_PAUSE_S
        self._seen_errors: set[int] = set()
        self._stats: dict[str, int] = {
            **dict.fromkeys(_ROWS_STAT.values(), 0),
            "messages": 0,
            "dead_letters": 0,
            "dead_letter_errors": 0,
            "flushes": 0,
            "flush_failures": 0,
            "last_flush_ns": 0,
            "consumer_lag": -1,
        }
        # Read without the lock: a scrape must not wait for a flush (a dict copy is atomic under the GIL).
        telemetry.register_source("sink", self, lambda sink: dict(sink._stats))

    @property
    def stats(self) -> dict[str, int]:
        """Rows written per kind, messages consumed, dead letters, flushes and ``last_flush_ns``."""
        with self._lock:
            return dict(self._stats)

    @property
    def topics(self) -> tuple[str, str, str]:
        return (self._topics.iterations, self._topics.patterns, self._topics.findings)

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Run the consume loop in a daemon thread."""
        with self._lock:
            if self._closed:
                raise RuntimeError("sink is stopped; build a new one")
            if self._thread is not None:
                return
            self._ensure_clients()
            self._thread = threading.Thread(
                target=self.run, args=(self._stop_event,), name="fleetscope-sink", daemon=True
            )
            self._thread.start()

    def run(self, stop: threading.Event) -> None:
        """Consume until ``stop`` is set, then flush, commit and close."""
        poll_s = min(0.1, self._config.flush_interval_ms / 1000.0)
        try:
            while not stop.is_set() and not self._stop_event.is_set():
                wait_s = self._access_retry_at_s - time.monotonic()
                if wait_s > 0:  # refused by the broker: wait, as a failing flush does
                    stop.wait(wait_s)
                    continue
                self.poll_once(poll_s)
        except KafkaException:
            logger.exception("fatal Kafka error; the sink stops")
            raise
        finally:
            self._shutdown()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Flush, commit and close; idempotent, and safe without a start."""
        self._stop_event.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                logger.warning("sink thread did not stop within %.1fs", timeout_s)
                return
        self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._consumer is not None:
                self._retry_at_s = 0.0
                if not self._flush():
                    logger.error("final flush failed; uncommitted messages will be replayed on restart")
                self._consumer.close()
            if self._producer is not None:
                left = self._producer.flush(_DEADLETTER_FLUSH_S)
                if left:
                    logger.warning("%d dead letters undelivered at stop", left)
            # Drop the clients: librdkafka handles live (and reconnect) until they are freed.
            self._consumer = None
            self._producer = None
            logger.info("sink stopped: %s", self._stats)

    # -- consuming ---------------------------------------------------------------------------------------

    def poll_once(self, timeout_s: float) -> int:
        """Consume what arrives within ``timeout_s``, buffer it, flush when due; messages handled."""
        with self._lock:
            if self._closed:
                return 0
            consumer = self._ensure_clients()
            messages = consumer.consume(_MAX_BATCH_MESSAGES, timeout_s)
            handled = 0
            for msg in messages:
                err = msg.error()
                if err is not None:
                    self._on_kafka_error(err)
                    continue
                self._access_failures = 0
                self._handle(msg)
                handled += 1
            self._stats["messages"] += handled
            if self._producer is not None:
                self._producer.poll(0)
            if self._flush_due():
                self._flush()
            return handled

    def _ensure_clients(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(
                consumer_settings(self._config, on_error=self._on_kafka_error, on_statistics=self._on_statistics)
            )
            self._consumer.subscribe(list(self.topics), on_assign=self._on_assign, on_revoke=self._on_revoke)
            self._producer = Producer(deadletter_settings(self._config, on_error=self._on_kafka_error))
            logger.info("sink subscribed to %s as group %s", ", ".join(self.topics), self._config.group_id)
        return self._consumer

    def _handle(self, msg: Message) -> None:
        value = msg.value() or b""
        try:
            subject, record = decode(value)
        except _UNDECODABLE as exc:
            self._dead_letter(msg, f"decode: {exc}")
        else:
            if subject != PATTERN_BATCH:
                self._keep(msg, None, subject, record)
            else:  # each element stored, or dead-lettered alone with its reason
                for element in record["records"]:
                    self._keep_element(msg, element, record)
        self._mark(msg)

    def _keep_element(self, msg: Message, element: bytes, batch: dict[str, object]) -> None:
        try:
            subject, record = decode(element)
        except _UNDECODABLE as exc:
            self._dead_letter(msg, f"decode: {exc}", element)
            return
        reason = (
            element_reason(batch, record.get("job"), record.get("iteration"))
            if subject == PATTERNS
            else f"subject: a pattern batch holds a {subject} record"
        )
        if reason is not None:
            self._dead_letter(msg, reason, element)
            return
        self._keep(msg, element, subject, record)

    def _keep(self, msg: Message, element: bytes | None, subject: str, record: dict[str, object]) -> None:
        """Buffer one decoded record: the message's (``element`` None) or one element of its batch."""
        try:
            if subject not in self._write:
                raise SchemaError(f"subject {subject!r} does not belong on the sink's topics")
            rows = pattern_rows(record) if subject == PATTERNS else 1
        except _UNDECODABLE as exc:
            self._dead_letter(msg, f"decode: {exc}", element)
            return
        untrusted = self._untrusted(msg, subject, msg.value() or b"") if element is None else None
        if untrusted is not None:
            self._dead_letter(msg, untrusted)
            return
        buffer = self._buffers[subject]
        buffer.records.append(record)
        buffer.sources.append((msg, element))
        buffer.rows += rows
        if self._oldest_s is None:
            self._oldest_s = time.monotonic()

    def _untrusted(self, msg: Message, subject: str, value: bytes) -> str | None:
        """Why a finding is not the differential's (``signature_reason``), or None: the store keeps only
        findings the differential signed, whatever topic they came by."""
        key = self._config.findings_key
        if subject != "findings" or key is None:
            return None
        return signature_reason(key, msg.topic() or "", msg.key(), value, msg.headers())

    def _mark(self, msg: Message) -> None:
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        if topic is not None and partition is not None and offset is not None:
            key = (topic, partition)
            self._offsets[key] = max(self._offsets.get(key, 0), offset + 1)

    def _dead_letter(self, msg: Message, reason: str, element: bytes | None = None) -> None:
        """Dead-letter the message, or only ``element`` of its batch (the batch's place in the headers)."""
        producer = self._producer
        if producer is None:
            raise RuntimeError("dead letter before the producer exists")
        delivery = self._on_dead_letter_delivery
        if not produce_dead_letter(producer, self._topics.deadletter, msg, reason, delivery, value=element):
            self._stats["dead_letter_errors"] += 1
            logger.error("dead-letter queue full; a bad message was dropped")
            return
        self._stats["dead_letters"] += 1

    def _on_dead_letter_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self._stats["dead_letter_errors"] += 1
            self._log_once(err, "dead letter not delivered: %s")

    def _on_statistics(self, stats_json: str) -> None:
        """Consumer lag summed over the assigned partitions (librdkafka statistics, every 5 s)."""
        topics = json.loads(stats_json).get("topics", {})
        lags = [p.get("consumer_lag", -1) for t in topics.values() for p in t.get("partitions", {}).values()]
        known = [lag for lag in lags if lag >= 0]
        self._stats["consumer_lag"] = sum(known) if known else -1

    def _on_kafka_error(self, err: KafkaError) -> None:
        if err.fatal():
            raise KafkaException(err)
        if err.code() in ACCESS_ERRORS:
            self._access_failures += 1
            delay = backoff_s(self._access_failures)
            self._access_retry_at_s = time.monotonic() + delay
            now = time.monotonic()
            if now >= self._access_logged_at_s + _MAX_PAUSE_S:  # errors queued while waiting arrive at once
                self._access_logged_at_s = now
                logger.warning("broker refused the sink (%d in a row), retrying in %.1fs: %s", self._access_failures,
                               delay, err)  # fmt: skip
            return
        if err.code() != KafkaError._PARTITION_EOF:
            self._log_once(err, "consumer error (not fatal): %s")

    def _log_once(self, err: KafkaError, message: str) -> None:
        """Warn on the first error of a kind, then log it at debug level only (no per-message spam)."""
        level = logging.DEBUG if err.code() in self._seen_errors else logging.WARNING
        self._seen_errors.add(err.code())
        logger.log(level, message, err)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if self._paused and partitions:
            consumer.pause(partitions)

    def _on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Try to flush before losing the partitions; otherwise forget their offsets (the new owner
        replays them, which the writer's key check absorbs)."""
        self._retry_at_s = 0.0
        if not self._flush():
            logger.warning("flush at partition revoke failed; the revoked partitions will be replayed")
        for tp in partitions:
            self._offsets.pop((tp.topic, tp.partition), None)

    # -- flushing ----------------------------------------------------------------------------------------

    def _flush_due(self) -> bool:
        if time.monotonic() < self._retry_at_s:
            return False
        rows = sum(b.rows for b in self._buffers.values())
        if rows >= self._config.flush_rows:
            return True
        if self._oldest_s is not None:
            return (time.monotonic() - self._oldest_s) * 1000.0 >= self._config.flush_interval_ms
        return bool(self._offsets)

    def _flush(self) -> bool:
        """Insert every buffer, deliver dead letters, then commit; on failure pause and back off.

        True when everything buffered is stored (the commit itself may still be retried later)."""
        if time.monotonic() < self._retry_at_s:
            return False
        try:
            for subject, buffer in self._buffers.items():
                if buffer.records:
                    self._stats[_ROWS_STAT[subject]] += self._insert(subject, buffer)
                    self._buffers[subject] = _Buffer()
            self._oldest_s = None
            if self._producer is not None and self._producer.flush(_DEADLETTER_FLUSH_S):
                raise TimeoutError("dead letters not delivered")
        except Exception as exc:
            self._on_flush_failure(exc)
            return False
        self._commit()
        self._stats["flushes"] += 1
        self._stats["last_flush_ns"] = time.time_ns()
        if self._paused:
            self._set_paused(False)
        self._failures_in_row = 0
        return True

    def _insert(self, subject: str, buffer: _Buffer) -> int:
        """Insert a buffer; when the store rejects the records themselves, insert message by message and
        dead-letter the ones it rejects."""
        write = self._write[subject]
        try:
            return write(buffer.records)
        except Exception as exc:
            if not self._rejected(exc):
                raise
            logger.warning("the store rejected a batch of %s (%s); isolating the bad messages", subject, exc)
        written = 0
        for record, (msg, element) in zip(buffer.records, buffer.sources, strict=True):
            try:
                written += write([record])
            except Exception as exc:
                if not self._rejected(exc):
                    raise
                self._dead_letter(msg, f"insert: {exc}", element)
        return written

    def _rejected(self, exc: BaseException) -> bool:
        """The records are at fault (not a store that is away, nor the SQL): dead-letter them."""
        return not self._writer.is_transient(exc) and self._writer.rejects_records(exc)

    def _on_flush_failure(self, exc: Exception) -> None:
        self._failures_in_row += 1
        self._stats["flush_failures"] += 1
        delay = backoff_s(self._failures_in_row)
        self._retry_at_s = time.monotonic() + delay
        logger.warning(
            "flush failed (%d in a row), consumption paused for %.1fs: %s",
            self._failures_in_row,
            delay,
            exc,
            exc_info=self._failures_in_row == 1,
        )
        if not self._paused:
            self._set_paused(True)

    def _set_paused(self, paused: bool) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        assignment = consumer.assignment()
        if assignment:
            (consumer.pause if paused else consumer.resume)(assignment)
        self._paused = paused

    def _commit(self) -> None:
        if not self._offsets or self._consumer is None:
            return
        offsets = [TopicPartition(t, p, o) for (t, p), o in self._offsets.items()]
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            self._retry_at_s = time.monotonic() + 1.0
            logger.warning("offset commit failed, retried at the next flush: %s", exc)
            return
        self._offsets.clear()
