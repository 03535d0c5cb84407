"""Alert follower: the findings topic -> one alert per finding state change, printed and/or POSTed.

In: Avro ``Finding`` records on ``<prefix>.findings`` (key ``job``), decoded with ``fleetscope.schemas``; with a
key (``fleetscope alerts`` always has one) only those the differential signed (``schemas.signing``).
Out: ``alert_payload`` dicts (the findings JSON plus status, version, time) handed to a callback, and
optionally POSTed as JSON to a webhook: a finding's opening, its close and its significant changes only
(``AlertFilter``), not every periodic update.

Why it is shaped like this: without a group the follower *assigns* every partition itself, so each
instance sees every finding (alerting is a broadcast, not a work queue) and starts in milliseconds instead
of waiting for a group join. With a group it subscribes and commits after each alert is handled, so a
restart resumes where it stopped (at-least-once). Webhook delivery runs in its own thread behind a
bounded queue: a slow or dead endpoint delays nothing and never stops the follower.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import urllib.error
import urllib.request
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from fleetscope.schemas import SchemaError, Topics, decode, units
from fleetscope.schemas.categories import next_checks, sql_command
from fleetscope.schemas.fields import as_float, as_float_or_none, as_int, as_list
from fleetscope.schemas.signing import signature_reason
from fleetscope.sinks.retry import RetryPolicy, with_retries

logger = logging.getLogger(__name__)

EVENTS = {"open": "new", "update": "updated", "closed": "closed"}
"""Finding status on the topic -> what the alert says happened."""
_METADATA_TIMEOUT_S = 5.0


def alert_payload(record: Mapping[str, object]) -> dict[str, object]:
    """The findings JSON of one state change (evidence parsed), plus event, status, version and time, and
    what its category means and what to check next (``meaning``, ``next_checks``: ``schemas.categories``), so
    that whoever is paged reads what to do without the README."""
    evidence: object = record.get("evidence") or "{}"
    if isinstance(evidence, str):
        try:
            evidence = json.loads(evidence)
        except ValueError:
            evidence = {"raw": evidence}
    emitted_ns = as_int(record.get("emitted_ns", 0))
    return {
        "event": EVENTS.get(str(record.get("status")), str(record.get("status"))),
        "finding_id": record.get("finding_id"),
        "status": record.get("status"),
        "version": record.get("version"),
        "job": record.get("job"),
        "rank": record.get("rank"),
        "ranks": as_list(record.get("ranks")),
        "subject": record.get("subject") or "",
        "host": record.get("host"),
        "local_rank": record.get("local_rank", -1),
        "gpu_uuid": record.get("gpu_uuid") or "",
        "pci_bus_id": record.get("pci_bus_id") or "",
        "category": record.get("category"),
        "function": record.get("function"),
        "metric": record.get("metric"),
        "value": record.get("value"),
        "peer_median": record.get("peer_median"),
        "score": record.get("score"),
        "iteration_first": record.get("iteration_first"),
        "iteration_last": record.get("iteration_last"),
        "est_loss_ns": record.get("est_loss_ns"),
        "evidence": evidence,
        "emitted_ns": emitted_ns,
        "emitted_at": datetime.fromtimestamp(emitted_ns / 1e9, UTC).isoformat(timespec="milliseconds"),
        **next_checks(record),
    }


class AlertFilter:
    """Which state changes a pager hears: a finding's opening, its close, and an update only when it changed
    significantly since the last one sent (category, rank or function, or its estimated loss by more than
    ``loss_change``); a record already sent (a replay) is not sent again. Updates every few iterations
    carry the same finding and would page every second."""

    SIGNIFICANT = ("category", "rank", "function")

    def __init__(self, loss_change: float = 0.5, max_findings: int = 100_000) -> None:
        self.loss_change = loss_change
        self.max_findings = max_findings
        self._sent: OrderedDict[str, Mapping[str, object]] = OrderedDict()
        self.suppressed = 0

    def __call__(self, record: Mapping[str, object]) -> bool:
        fid, status = str(record.get("finding_id")), record.get("status")
        last = self._sent.get(fid)
        if last is not None and as_int(record.get("version") or 0) <= as_int(last.get("version") or 0):
            self.suppressed += 1  # read again (a replay, another partition's copy)
            return False
        if status == "update" and last is not None and not self._significant(last, record):
            self.suppressed += 1
            return False
        self._sent[fid] = record  # a closed one stays, so that a copy read again is recognised
        self._sent.move_to_end(fid)
        while len(self._sent) > self.max_findings:
            self._sent.popitem(last=False)
        return True

    def _significant(self, last: Mapping[str, object], now: Mapping[str, object]) -> bool:
        if any(last.get(k) != now.get(k) for k in self.SIGNIFICANT):
            return True
        before, after = as_float(last.get("est_loss_ns") or 0), as_float(now.get("est_loss_ns") or 0)
        return abs(after - before) > self.loss_change * max(before, 1.0)


def format_alert(alert: Mapping[str, object]) -> str:
    """One human line: when, what happened, where, and the evidence in units (ms, µs, GB/s)."""
    metric = str(alert.get("metric") or "")
    value, median = as_float_or_none(alert.get("value")), as_float_or_none(alert.get("peer_median"))
    peers = f" vs peers {units.metric_value(metric, median)}" if median else ""
    gap = units.gap(value, median)
    device = units.gpu(alert)
    return (
        f"{alert['emitted_at']}  {str(alert['event']).upper():<7}  {alert['job']}  {units.subject(alert)} "
        f"({alert['host'] or '-'}{', ' + device if device else ''})  {alert['category']}  {alert['function']}  "
        f"{units.metric_name(metric)} {units.metric_value(metric, value)}{peers}{f' ({gap})' if gap else ''}  "
        f"score {alert.get('score') or 0.0:.1f}  iterations {alert['iteration_first']}-{alert['iteration_last']}  "
        f"loss {units.duration(as_float(alert.get('est_loss_ns') or 0))}/iter  "
        f"[{alert['finding_id']} v{alert['version']}]"
    )


def format_next_checks(alert: Mapping[str, object]) -> list[str]:
    """The lines under a new finding's: what it means, its likely causes, the NVML fields to look at and the
    command that shows it in the store; none for a category this version does not know."""
    checks = alert.get("next_checks")
    if not alert.get("meaning") or not isinstance(checks, Mapping):
        return []
    return [
        f"    means: {alert['meaning']}",
        f"    likely: {'; '.join(checks.get('likely_causes') or ())}",
        f"    NVML: {', '.join(checks.get('nvml') or ())}",
        f"    shows it: {sql_command(checks)}",
    ]


# -- webhook ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WebhookConfig:
    """Where alerts are POSTed. ``headers`` (e.g. an Authorization token) are never logged."""

    url: str
    timeout_s: float = 5.0
    retry: RetryPolicy = field(default_factory=lambda: RetryPolicy(max_attempts=4, initial_backoff_ms=250))
    queue_max: int = 1_000
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        errors: list[str] = []
        if not self.url.startswith(("http://", "https://")):
            errors.append(f"url: expected http(s)://..., got {self.url!r}")
        if self.timeout_s <= 0:
            errors.append(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.queue_max < 1:
            errors.append(f"queue_max: must be >= 1, got {self.queue_max}")
        if errors:
            raise ValueError("invalid WebhookConfig: " + "; ".join(errors))


class WebhookSender:
    """POSTs alerts as JSON from a background thread; never raises into the caller.

    Retries connection errors, timeouts, 429 and 5xx with jittered exponential backoff up to
    ``retry.max_attempts``; other 4xx are permanent (logged, not retried). A full queue drops and counts."""

    def __init__(self, config: WebhookConfig) -> None:
        self.config = config
        self._queue: queue.Queue[dict[str, object] | None] = queue.Queue(config.queue_max)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stats = {"sent": 0, "failed": 0, "dropped": 0, "retries": 0}

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fleetscope-webhook", daemon=True)
            self._thread.start()

    def submit(self, alert: dict[str, object]) -> bool:
        """Queue one alert; False (and counted) when the queue is full."""
        try:
            self._queue.put_nowait(alert)
        except queue.Full:
            self._count("dropped")
            logger.warning("webhook queue full (%d): an alert was dropped", self.config.queue_max)
            return False
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        """Deliver what is queued within ``timeout_s``, then stop; idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            logger.warning("webhook queue still full at stop; undelivered alerts are lost")
            return
        thread.join(timeout_s)
        if thread.is_alive():
            logger.warning("webhook deliveries still running after %.1f s at stop", timeout_s)

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    def _run(self) -> None:
        while (alert := self._queue.get()) is not None:
            self.post(alert)

    def post(self, alert: Mapping[str, object]) -> bool:
        """Deliver one alert now (with retries); True when the endpoint answered 2xx."""
        body = json.dumps(alert, default=str).encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "fleetscope-alerts",
            **self.config.headers,
        }
        attempts = 0

        def attempt() -> None:
            nonlocal attempts
            attempts += 1
            # the URL scheme is checked in WebhookConfig (http/https only)
            request = urllib.request.Request(self.config.url, data=body, headers=headers, method="POST")  # noqa: S310
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as resp:  # noqa: S310
                resp.read()

        try:
            with_retries(
                attempt,
                self.config.retry,
                retryable=_retryable,
                what=f"webhook {self.config.url}",
                on_retry=lambda *_: self._count("retries"),
                log_level=logging.DEBUG,
            )
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            reason = (
                f"HTTP {exc.code}" if isinstance(exc, urllib.error.HTTPError) else repr(getattr(exc, "reason", exc))
            )
            self._count("failed")
            logger.warning(
                "webhook %s: alert %s not delivered after %d attempt(s): %s",
                self.config.url,
                alert.get("finding_id"),
                attempts,
                reason,
            )
            return False
        self._count("sent")
        return True


def _retryable(exc: BaseException) -> bool:
    """A 429 or 5xx answer, a refused or dropped connection, a timeout; any other 4xx is permanent."""
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code == 429 or exc.code >= 500
    return isinstance(exc, urllib.error.URLError | TimeoutError | ConnectionError | OSError)


# -- follower -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AlertsConfig:
    """What to follow. Empty ``group_id``: no group, every partition assigned, nothing committed."""

    bootstrap_servers: str
    topic_prefix: str = "fleetscope"
    job: str | None = None
    from_beginning: bool = False
    group_id: str = ""
    session_timeout_ms: int = 6000
    every_update: bool = False
    """Off: only openings, closes and significant updates (``AlertFilter``)."""
    loss_change: float = 0.5
    extra: Mapping[str, str] = field(default_factory=dict, repr=False)
    findings_key: bytes | None = field(default=None, repr=False)
    """Key of the findings' signatures (``schemas.signing``): a finding that does not verify raises no alert.
    ``fleetscope alerts`` always has one; None, a follower built by hand trusts the topic."""

    def __post_init__(self) -> None:
        if self.loss_change < 0:
            raise ValueError("invalid AlertsConfig: loss_change must be >= 0")
        if not self.bootstrap_servers:
            raise ValueError("invalid AlertsConfig: bootstrap_servers must not be empty")
        if not self.topic_prefix:
            raise ValueError("invalid AlertsConfig: topic_prefix must not be empty")


class AlertFollower:
    """Follows the findings topic and calls ``on_alert(alert_payload(record))`` for each state change."""

    def __init__(
        self,
        config: AlertsConfig,
        on_alert: Callable[[dict[str, object]], None],
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.topic = Topics(prefix=config.topic_prefix).findings
        self._on_alert = on_alert
        self._on_ready = on_ready
        self.ready = threading.Event()
        """Set once the follower reads from fixed positions: anything published later is seen."""
        self.stats = {"alerts": 0, "other_jobs": 0, "bad_messages": 0, "insignificant": 0, "unsigned": 0}
        self._filter = AlertFilter(config.loss_change)
        self._logged: set[str] = set()

    def run(self, stop: threading.Event) -> None:
        """Follow until ``stop`` is set (blocking)."""
        consumer = Consumer(self._settings())
        try:
            if self.config.group_id:
                consumer.subscribe([self.topic], on_assign=lambda *_: self._set_ready())
            elif not self._assign_all(consumer, stop):
                return
            while not stop.is_set():
                for msg in consumer.consume(100, 0.2):
                    self._handle(consumer, msg)
        finally:
            consumer.close()

    def _settings(self) -> dict[str, object]:
        c = self.config
        return {
            **c.extra,
            "bootstrap.servers": c.bootstrap_servers,
            "group.id": c.group_id or f"fleetscope-alerts-{uuid.uuid4().hex[:12]}",
            "client.id": "fleetscope-alerts",
            "enable.auto.commit": bool(c.group_id),
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest" if c.from_beginning else "latest",
            "session.timeout.ms": c.session_timeout_ms,
            "heartbeat.interval.ms": max(100, c.session_timeout_ms // 3),
        }

    def _assign_all(self, consumer: Consumer, stop: threading.Event) -> bool:
        """Assign every partition at its first (``from_beginning``) or next offset; wait for the topic."""
        while not stop.is_set():
            try:
                md = consumer.list_topics(self.topic, timeout=_METADATA_TIMEOUT_S).topics.get(self.topic)
                if md is not None and md.error is None and md.partitions:
                    tps = []
                    for p in sorted(md.partitions):
                        low, high = consumer.get_watermark_offsets(
                            TopicPartition(self.topic, p), timeout=_METADATA_TIMEOUT_S
                        )
                        tps.append(TopicPartition(self.topic, p, low if self.config.from_beginning else high))
                    consumer.assign(tps)
                    logger.info("following %s (%d partitions)", self.topic, len(tps))
                    self._set_ready()
                    return True
            except KafkaException as exc:
                self._log_once("metadata", f"waiting for topic {self.topic}: {exc}")
            else:
                self._log_once("missing", f"waiting for topic {self.topic} to exist")
            stop.wait(1.0)
        return False

    def _set_ready(self) -> None:
        if not self.ready.is_set():
            self.ready.set()
            if self._on_ready is not None:
                self._on_ready()

    def _handle(self, consumer: Consumer, msg: Message) -> None:
        err = msg.error()
        if err is not None:
            if err.fatal():
                raise KafkaException(err)
            if err.code() != KafkaError._PARTITION_EOF:
                self._log_once(str(err.code()), f"consumer error (not fatal): {err}")
            return
        job = self.config.job
        if job is not None and msg.key() is not None and msg.key() != job.encode():
            self.stats["other_jobs"] += 1
        else:
            key = self.config.findings_key
            value = msg.value() or b""
            untrusted = signature_reason(key, self.topic, msg.key(), value, msg.headers()) if key else None
            try:
                if untrusted is not None:
                    self.stats["unsigned"] += 1
                    raise SchemaError(untrusted)
                subject, record = decode(value)
                if subject != "findings":
                    raise SchemaError(f"subject {subject!r} on the findings topic")
            except SchemaError as exc:
                self.stats["bad_messages"] += untrusted is None
                self._log_once("bad", f"skipping a message at offset {msg.offset()}: {exc}")
            else:
                if job is not None and record["job"] != job:
                    self.stats["other_jobs"] += 1
                elif self.config.every_update or self._filter(record):
                    self._on_alert(alert_payload(record))
                    self.stats["alerts"] += 1
                else:
                    self.stats["insignificant"] += 1
        if self.config.group_id:
            consumer.store_offsets(message=msg)

    def _log_once(self, kind: str, message: str) -> None:
        level = logging.DEBUG if kind in self._logged else logging.WARNING
        self._logged.add(kind)
        logger.log(level, "%s", message)
