"""What runs on the publisher's background thread, and the state the callers' side shares with it.

Delivery callbacks (served inside ``poll``/``flush``), outages (the producer taken out of service, what it
held moved into the spool, the broker probed with a fresh producer), and the replay of the spool, then of the
backlog, once the broker answers. ``Publisher`` (``core.py``) is the callers' side on top of it. Two locks:
``_lock`` guards the counters and what callbacks hand to the thread, ``_route`` where ``publish`` sends a
message (producer or backlog).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from fleetscope.producers.publisher.backlog import Backlog
from fleetscope.producers.publisher.client_log import CLIENT_LOGGER
from fleetscope.producers.publisher.config import PERMANENT_ERRORS, PublisherConfig, PublisherStats
from fleetscope.producers.publisher.disk_spool import DiskSpool
from fleetscope.producers.publisher.spool import MemorySpool, Spool, SpoolError, SpoolRecord

logger = logging.getLogger("fleetscope.producers.publisher")

_OURS = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})  # our own purges: not worth a log line
_FEED_CHUNK = 256
_IDLE_POLL_S = 0.05
_BUSY_POLL_S = 0.005
PURGE_WAIT_S = 2.0
_PROBE_TIMEOUT_S = 0.25
_FIRST_BACKOFF_S = 0.2


class DeliveryThread:
    """The publisher's state and its background thread's work; see the module docstring."""

    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self._lock = threading.Lock()  # counters and what callbacks hand to the thread
        self._counts = dict.fromkeys(PublisherStats.__dataclass_fields__, 0)
        self._logged: set[str] = set()
        self._fatal: str | None = None
        self._trouble: str | None = None
        self._rescued: list[tuple[int, SpoolRecord]] = []
        self._acks: list[int] = []
        # routing, under _route: where publish() sends a message
        self._route = threading.Lock()
        self._running = False
        self._producer: Producer | None = None
        self._generation = 0  # number of the producer in service (0: none); callbacks of others change nothing
        self._made = 0
        self._backlog_on = False
        self._backlog = Backlog(config.spool_max_bytes)
        self._in_transit = 0
        self._topics_used: set[str] = set()
        # owned by the background thread
        self._stop = threading.Event()
        self._deadline = 0.0
        self._spool: Spool = MemorySpool(config.spool_max_bytes)
        self._disk_tried = False
        self._outage_since: float | None = None
        self._candidate: tuple[int, Producer] | None = None  # (generation, producer) probing the broker
        self._draining_since: float | None = None
        self._next_probe = 0.0
        self._backoff_s = _FIRST_BACKOFF_S
        self._feed: deque[tuple[int, SpoolRecord]] = deque()
        self._acked: set[int] = set()

    # -- callbacks (run inside poll/flush on the background thread) --------------------------------------
    def _direct_callback(self, seq: int, n_events: int) -> Callable[[KafkaError | None, Message], None]:
        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is None:
                self._count(delivered=1, events_delivered=n_events)
            elif err.code() in PERMANENT_ERRORS:
                self._count(failed=1)
                self._log_once(f"delivery:{err.name()}", logging.WARNING, f"delivery failed: {err.str()}")
            else:
                record = SpoolRecord(msg.topic() or "", msg.key(), msg.value() or b"", n_events)
                with self._lock:
                    self._rescued.append((seq, record))
                self._raise_trouble(f"delivery: {err.str()}", log=err.code() not in _OURS)

        return on_delivery

    def _spooled_callback(self, record_id: int, n_events: int) -> Callable[[KafkaError | None, Message], None]:
        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            if err is None:
                self._count(delivered=1, events_delivered=n_events, spool_delivered=1)
            elif err.code() in PERMANENT_ERRORS:
                self._count(failed=1)
                self._log_once(f"delivery:{err.name()}", logging.WARNING, f"delivery failed: {err.str()}")
            else:
                self._raise_trouble(f"delivery: {err.str()}", log=err.code() not in _OURS)
                return
            with self._lock:
                self._acks.append(record_id)

        return on_delivery

    def _on_error(self, err: KafkaError, generation: int) -> None:
        self._count(errors=1)
        current = generation == self._generation
        if err.fatal():
            self._fatal = err.str()
            self._log_once(f"fatal:{err.name()}", logging.ERROR, f"fatal Kafka error: {err.str()}")
            if current:
                self._raise_trouble(f"fatal: {err.str()}", log=False)
        else:
            self._log_once(f"error:{err.name()}", logging.WARNING, f"Kafka client error: {err.str()}")
            if current and err.code() == KafkaError._ALL_BROKERS_DOWN:
                self._raise_trouble("all brokers down", log=False)

    def _raise_trouble(self, reason: str, log: bool = True) -> None:
        with self._lock:
            self._trouble = self._trouble or reason
        if log:
            self._log_once(f"trouble:{reason.split(':')[0]}", logging.WARNING, reason)

    # -- background thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not (self._stop.is_set() and (self._pending() == 0 or time.monotonic() >= self._deadline)):
                self._tick()
            self._shutdown()
        except Exception:  # never into the training process; the counters and this line tell
            logger.exception("publisher thread failed; messages are no longer sent")
            with self._route:
                self._running = False

    def _tick(self) -> None:
        producer = self._producer
        wait = _BUSY_POLL_S if self._backlog_on or self._stop.is_set() else _IDLE_POLL_S
        if producer is not None:
            producer.poll(wait)
        else:
            time.sleep(wait)
        self._commit_acks()
        if self._trouble is not None:
            self._begin_outage()
        if self._outage_since is not None:
            self._backlog_to_spool()
            if time.monotonic() >= self._next_probe:
                self._probe()
        elif self._backlog_on and self._producer is not None:
            self._drain(self._producer)
        self._update_gauges()

    def _begin_outage(self) -> None:
        rescued, reason = self._out_of_service()
        if self._outage_since is None:
            self._outage_since, self._draining_since = time.monotonic(), None
            self._count(outages=1)
            where = self.config.spool_dir or "in memory"
            logger.warning("broker unreachable (%s): %d queued messages moved to spool %s", reason, rescued, where)
        self._schedule_probe(_FIRST_BACKOFF_S)

    def _out_of_service(self) -> tuple[int, str | None]:
        """Take the producer out of service and move what it still holds into the spool, oldest first."""
        with self._route:
            old, self._producer = self._producer, None
            self._backlog_on = True
            self._generation = 0
            self._in_transit += 1  # flush() must not see "nothing pending" while messages move
        if old is not None:
            old.purge(in_queue=True, in_flight=True)
            old.flush(PURGE_WAIT_S)  # serves the purge callbacks: they fill _rescued
        with self._lock:
            rescued, self._rescued = sorted(self._rescued, key=lambda r: r[0]), []
            reason, self._trouble = self._trouble, None
        self._spool.rewind()  # spooled messages that were in flight go again (acked ones are skipped)
        self._feed.clear()
        self._spool_in_transit(rescued)
        return len(rescued), reason

    def _probe(self) -> None:
        """Install the candidate producer once the broker answers and every topic written to exists.

        The candidate lives across probes, so its connection (TLS, SASL) can take longer than one probe."""
        timeout_s = _PROBE_TIMEOUT_S
        if self._stop.is_set():
            timeout_s = min(timeout_s, self._deadline - time.monotonic())
            if timeout_s < 0.01:
                return
        if self._candidate is None:
            self._candidate = self._new_producer()
        generation, candidate = self._candidate
        with self._route:
            wanted = sorted(self._topics_used)
        try:
            meta = candidate.list_topics(timeout=timeout_s)
        except KafkaException as exc:
            problem = str(exc)
        else:
            missing = [t for t in wanted if t not in meta.topics or meta.topics[t].error is not None]
            problem = f"waiting for topics {', '.join(missing)}" if missing else ""
        if problem:
            self._log_once(f"probe:{problem[:40]}", logging.INFO, f"broker not ready: {problem}")
            self._schedule_probe(min(self._backoff_s * 2, self.config.retry_backoff_max_ms / 1000))
            return
        candidate.poll(0)  # its connection errors from before the broker came back: stale, ignored
        with self._route:
            self._producer, self._generation = candidate, generation
        self._candidate = None
        self._count(producer_restarts=1)
        now = time.monotonic()
        down_s = now - (self._outage_since or now)
        self._outage_since, self._draining_since = None, now
        logger.warning("broker reachable again after %.1f s: sending %d spooled messages", down_s, self._spool.records)

    def _drain(self, producer: Producer) -> None:
        """Replay the spool, then the backlog, into the producer; leave backlog mode once both are empty.

        Bounded work per call, so delivery callbacks are served in between."""
        if self._spool.records:  # newer messages queue behind the spooled ones, on disk
            self._backlog_to_spool()
        for _ in range(4 * _FEED_CHUNK):
            if not self._feed:
                self._feed.extend(r for r in self._spool.read(_FEED_CHUNK) if r[0] not in self._acked)
                if not self._feed:
                    break
            record_id, rec = self._feed[0]
            callback = self._spooled_callback(record_id, rec.events)
            try:
                producer.produce(rec.topic, value=rec.value, key=rec.key, on_delivery=callback)
            except BufferError:
                return
            except KafkaException as exc:
                self._raise_trouble(f"produce: {exc}")
                return
            self._feed.popleft()
        if self._feed or self._spool.records:  # more to send, or sent and not yet acknowledged
            return
        with self._route:
            for _ in range(min(len(self._backlog), 4 * _FEED_CHUNK)):  # bounded time under the lock
                seq, rec = self._backlog.first()
                callback = self._direct_callback(seq, rec.events)
                try:
                    producer.produce(rec.topic, value=rec.value, key=rec.key, on_delivery=callback)
                except (BufferError, KafkaException):
                    return
                self._backlog.popleft()
            if self._backlog:
                return
            self._backlog_on = False
        if self._draining_since is not None:
            logger.warning(
                "spool drained in %.1f s; publishing directly again", time.monotonic() - self._draining_since
            )
            self._draining_since = None

    def _backlog_to_spool(self) -> None:
        with self._route:
            moved = self._backlog.take_all()
            self._in_transit += 1
        self._spool_in_transit(moved)

    def _spool_in_transit(self, records: list[tuple[int, SpoolRecord]]) -> None:
        """Spool records taken out of the producer or the backlog, then stop counting them as in transit."""
        for _, record in records:
            self._append(record)
        self._spool.flush()
        self._update_gauges()
        with self._route:
            self._in_transit -= 1

    def _open_disk_spool(self) -> None:
        self._disk_tried = True
        try:
            self._spool = DiskSpool(self.config.spool_dir, self.config.spool_max_bytes)
        except (SpoolError, OSError) as exc:
            logger.error("%s; the spool stays in memory (lost if this process ends)", exc)

    def _append(self, record: SpoolRecord) -> None:
        if self.config.spool_dir and not self._disk_tried:
            self._open_disk_spool()
        dropped, dropped_events = self._spool.dropped, self._spool.dropped_events
        self._spool.append(record)
        self._count(
            spooled=1,
            events_spooled=record.events,
            spool_dropped=self._spool.dropped - dropped,
            spool_dropped_events=self._spool.dropped_events - dropped_events,
        )

    def _commit_acks(self) -> None:
        with self._lock:
            acks, self._acks = self._acks, []
        if not acks:
            return
        self._acked.update(acks)
        head = self._spool.head
        while head in self._acked:
            self._acked.discard(head)
            head += 1
        self._spool.commit(head)
        head = self._spool.head
        self._acked = {i for i in self._acked if i >= head}

    def _update_gauges(self) -> None:
        records, size = self._spool.records, self._spool.bytes
        with self._lock:
            self._counts["spool_records"], self._counts["spool_bytes"] = records, size

    def _shutdown(self) -> None:
        """All delivered, or the deadline passed: keep the rest in the spool (or count it as lost)."""
        producer = self._producer
        if producer is not None and (len(producer) or self._backlog_on):
            self._raise_trouble("stopping", log=False)
        if self._trouble is not None:
            self._out_of_service()
        self._backlog_to_spool()
        with self._route:
            self._producer = None
        self._candidate = None
        kept = self._spool.records
        if kept and isinstance(self._spool, MemorySpool):
            self._count(failed=kept)
            self._spool.commit(self._spool.head + kept)
            logger.warning("publisher stopped with %d messages undelivered (spool in memory: lost)", kept)
        elif kept:
            logger.warning("%d undelivered messages stay in %s for the next start", kept, self.config.spool_dir)
        self._spool.close()
        self._update_gauges()

    # -- helpers -----------------------------------------------------------------------------------------
    def _new_producer(self) -> tuple[int, Producer]:
        self._made += 1
        generation = self._made

        def on_error(err: KafkaError) -> None:
            self._on_error(err, generation)

        return generation, Producer({**self.config.librdkafka(), "error_cb": on_error, "logger": CLIENT_LOGGER})

    def _pending(self) -> int:
        with self._route:
            waiting = len(self._backlog) + self._in_transit
            producer = self._producer
        with self._lock:
            spooled = self._counts["spool_records"]
        return waiting + spooled + (len(producer) if producer is not None else 0)

    def _schedule_probe(self, backoff_s: float) -> None:
        self._backoff_s = backoff_s
        self._next_probe = time.monotonic() + backoff_s * random.uniform(0.8, 1.2)  # jitter: fleets retry apart

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _drop(self, reason: str, message: str) -> bool:
        self._count(dropped=1)
        self._log_once(reason, logging.WARNING, message)
        return False

    def _log_once(self, kind: str, level: int, message: str) -> None:
        """Log the first occurrence of each kind of problem; the counters carry the rest."""
        if kind in self._logged:
            return
        self._logged.add(kind)
        logger.log(level, "%s (further occurrences are only counted)", message)
