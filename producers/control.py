"""On-demand control of running jobs: profiling requests on the control topic, and their listener.

Why: fine-grained profiling is too costly to run all the time, so an operator (or the job-regression
trigger) asks for a window: ``fleetscope profile --job J --seconds 20`` publishes a ``ControlRequest`` with
a common UTC start a few seconds ahead, and every rank of the job, each following the topic with its own
``ControlListener`` (no consumer group: every rank must see every request), opens its window at that
instant, so all ranks profile the same iterations (XPUTimer's synchronous dump). The NVML sampler raises
its rate for the same span.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from confluent_kafka import OFFSET_END, Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from fleetscope.schemas import SchemaError, Topics, decode, encode
from fleetscope.schemas.topics import job_key

if TYPE_CHECKING:
    from fleetscope.config import Config

logger = logging.getLogger(__name__)

SUBJECT = "control"
ACTIONS = ("profile",)


@dataclass(frozen=True, kw_only=True)
class ControlRequest:
    """A request to every rank of ``job`` (see control.v1.avsc)."""

    job: str
    duration_s: float
    start_at_ns: int
    action: str = "profile"
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    requested_by: str = ""
    reason: str = ""
    issued_ns: int = field(default_factory=time.time_ns)

    def __post_init__(self) -> None:
        p: list[str] = []
        if not self.job:
            p.append("job must not be empty")
        if self.action not in ACTIONS:
            p.append(f"action must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        if not 0 < self.duration_s <= 3600:
            p.append(f"duration_s must be in (0, 3600], got {self.duration_s!r}")
        if self.start_at_ns < 0:
            p.append(f"start_at_ns must be >= 0, got {self.start_at_ns}")
        if p:
            raise ValueError("invalid control request: " + "; ".join(p))

    @property
    def end_at_ns(self) -> int:
        return self.start_at_ns + int(self.duration_s * 1e9)

    def to_record(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> ControlRequest:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in record.items() if k in names})


def _kafka_settings(config: Config) -> tuple[str, str, dict[str, str]]:
    """(bootstrap servers, topic prefix, security settings) from a ``fleetscope.config.Config``."""
    k = config.kafka
    if not k.bootstrap_servers:
        raise ValueError("no Kafka broker configured (kafka.bootstrap_servers / --bootstrap)")
    return k.bootstrap_servers, k.topic_prefix, k.client_settings()


def publish_request(config: Config, request: ControlRequest, timeout_s: float = 10.0) -> None:
    """Publish a request and wait for the broker's acknowledgement; raises ``RuntimeError`` otherwise."""
    servers, prefix, security = _kafka_settings(config)
    producer = Producer({**security, "bootstrap.servers": servers, "client.id": "fleetscope-control"})
    errors: list[str] = []

    def on_delivery(err: KafkaError | None, _msg: object) -> None:
        if err is not None:
            errors.append(err.str())

    producer.produce(
        Topics(prefix=prefix).control,
        value=encode(SUBJECT, request.to_record()),
        key=job_key(request.job),
        on_delivery=on_delivery,
    )
    if producer.flush(timeout_s) or errors:
        raise RuntimeError(f"control request not delivered to {servers}: {errors or 'timed out'}")


def request_profile(
    config: Config,
    job: str,
    seconds: float,
    reason: str = "",
    *,
    start_in_s: float = 5.0,
    requested_by: str = "",
) -> ControlRequest:
    """Ask every rank of ``job`` to profile for ``seconds``, all starting ``start_in_s`` from now (UTC)."""
    request = ControlRequest(
        job=job,
        duration_s=float(seconds),
        start_at_ns=time.time_ns() + int(start_in_s * 1e9),
        requested_by=requested_by,
        reason=reason,
    )
    publish_request(config, request)
    logger.info("requested a %.1f s profile of job %s (request %s)", seconds, job, request.request_id)
    return request


@dataclass(frozen=True, kw_only=True)
class ControlListenerConfig:
    bootstrap_servers: str
    topic_prefix: str = "fleetscope"
    lookback_s: float = 60.0
    """Requests published this long before the listener started still count (if not yet over)."""
    poll_timeout_s: float = 0.5
    extra: Mapping[str, str] = field(default_factory=dict, repr=False)


class ControlListener:
    """Follows the control topic in a daemon thread; calls ``on_request`` for live requests of ``job``.

    Every partition is assigned (no group), from ``lookback_s`` ago; requests already over, for other jobs,
    or seen before are skipped. ``on_request`` runs on the listener's thread and must be quick.
    """

    def __init__(self, config: ControlListenerConfig, job: str, on_request: Callable[[ControlRequest], None]) -> None:
        self.config = config
        self.job = job
        self._on_request = on_request
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: set[str] = set()
        self._logged: set[str] = set()
        self.received = 0
        self.errors = 0

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="fleetscope-control", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Idempotent; fine before start."""
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        topic = Topics(prefix=self.config.topic_prefix).control
        consumer = Consumer(
            {
                **self.config.extra,
                "bootstrap.servers": self.config.bootstrap_servers,
                "group.id": f"fleetscope-control-{uuid.uuid4().hex}",  # offsets are never committed
                "enable.auto.commit": False,
                "client.id": "fleetscope-control-listener",
                "logger": logging.getLogger(f"{__name__}.librdkafka"),
            }
        )
        try:
            if self._assign(consumer, topic):
                while not self._stop.is_set():
                    msg = consumer.poll(self.config.poll_timeout_s)
                    if msg is not None:
                        self._handle(msg)
        except Exception as exc:
            self._problem("listener", exc)
        finally:
            try:
                consumer.close()
            except Exception as exc:
                self._problem("close", exc)

    def _assign(self, consumer: Consumer, topic: str) -> bool:
        """Assign every partition from ``lookback_s`` ago, retrying until the topic exists or we stop."""
        since_ms = int((time.time() - self.config.lookback_s) * 1000)
        while not self._stop.is_set():
            try:
                meta = consumer.list_topics(topic, timeout=5.0).topics.get(topic)
                if meta is not None and meta.error is None and meta.partitions:
                    wanted = [TopicPartition(topic, p, since_ms) for p in sorted(meta.partitions)]
                    offsets = consumer.offsets_for_times(wanted, timeout=5.0)
                    consumer.assign(
                        [TopicPartition(topic, o.partition, o.offset if o.offset >= 0 else OFFSET_END) for o in offsets]
                    )
                    return True
            except KafkaException as exc:
                self._problem("assign", exc)
            self._stop.wait(2.0)
        return False

    def _handle(self, msg: Message) -> None:
        error = msg.error()
        if error is not None:
            self._problem(f"message:{error.name()}", KafkaException(error))
            return
        try:
            subject, record = decode(msg.value() or b"")
            if subject != SUBJECT:
                raise SchemaError(f"subject {subject!r} on the control topic")
            request = ControlRequest.from_record(record)
        except (SchemaError, ValueError, TypeError) as exc:
            self._problem("decode", exc)
            return
        if request.job != self.job or request.request_id in self._seen:
            return
        self._seen.add(request.request_id)
        if request.end_at_ns <= time.time_ns():
            return
        self.received += 1
        logger.info("control request %s: %s for %.1f s", request.request_id, request.action, request.duration_s)
        try:
            self._on_request(request)
        except Exception as exc:
            self._problem("on_request", exc)

    def _problem(self, site: str, exc: BaseException) -> None:
        self.errors += 1
        if site not in self._logged:
            self._logged.add(site)
            logger.warning("control listener: %s failed (further failures only counted): %r", site, exc)
