"""Prometheus metrics of every fleetscope process: each metric defined once, here.

Why pull-based: the components already count what matters in plain integers (the stream stages'
``StageCounters``, the sink's ``stats``, the publisher's ``stats``). Touching Prometheus objects per event
would cost on the hot path and spread metric names over the code; instead each component registers a
snapshot function, and a scrape maps the snapshots onto the definitions in ``METRICS``. A component that
does not run in the process exports nothing. Rates (events/s, rows/s) are ``rate()`` of the counters.

This module imports nothing from fleetscope, so any package may register with it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, SupportsFloat, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class MetricDef:
    """One exported metric: where its value comes from in a component's snapshot.

    ``keys`` + ``label``: one sample per key, labelled with the key (rows per table). ``label`` alone: the
    snapshot value is a mapping, one sample per entry (dead letters per reason). ``scale`` converts units
    (ns -> s)."""

    name: str
    kind: Literal["counter", "gauge"]
    help: str
    source: str
    key: str = ""
    label: str = ""
    keys: tuple[str, ...] = ()
    scale: float = 1.0


METRICS: tuple[MetricDef, ...] = (
    # stream worker: streams.app.StageCounters
    MetricDef("fleetscope_stream_raw_batches", "counter", "Raw event batches decoded by the windower.",
              "stream", "raw_batches"),
    MetricDef("fleetscope_stream_raw_events", "counter", "Events inside the decoded raw batches.",
              "stream", "raw_events"),
    MetricDef("fleetscope_stream_iterations", "counter", "Rank-iterations closed by the windower.",
              "stream", "iterations"),
    MetricDef("fleetscope_stream_pattern_records", "counter", "Pattern records read by the differential.",
              "stream", "pattern_records"),
    MetricDef("fleetscope_stream_findings", "counter", "Finding state changes emitted (open/update/closed).",
              "stream", "findings"),
    MetricDef("fleetscope_stream_dead_letters", "counter", "Input sent to the dead-letter topic, by reason.",
              "stream", "per_reason", label="reason"),
    MetricDef("fleetscope_stream_held_messages", "gauge", "Input messages held un-acked for in-memory state.",
              "stream", "held_messages"),
    MetricDef("fleetscope_stream_state_writes", "counter", "Recovery state records written (windower + differential).",
              "stream", "state_writes"),
    MetricDef("fleetscope_stream_states_restored", "counter", "Recovery state records read back after a (re)start.",
              "stream", "states_restored"),
    MetricDef("fleetscope_stream_replayed_skipped", "counter", "Replayed outputs the worker had already emitted.",
              "stream", "replayed_skipped"),
    MetricDef("fleetscope_stream_incomplete_iterations", "gauge",
              "Steps closed before all their streams arrived (a quiet stream, too many open), current ranks.",
              "stream", "incomplete_iterations"),
    # sink: sinks.sink.Sink.stats
    MetricDef("fleetscope_sink_messages", "counter", "Messages consumed by the ClickHouse sink.",
              "sink", "messages"),
    MetricDef("fleetscope_sink_rows_written", "counter", "Rows inserted into ClickHouse, by table.",
              "sink", label="table", keys=("iterations", "function_patterns", "finding_updates")),
    MetricDef("fleetscope_sink_dead_letters", "counter", "Messages the sink routed to the dead-letter topic.",
              "sink", "dead_letters"),
    MetricDef("fleetscope_sink_dead_letter_errors", "counter", "Dead letters that could not be delivered.",
              "sink", "dead_letter_errors"),
    MetricDef("fleetscope_sink_flushes", "counter", "Successful flushes (insert, then offset commit).",
              "sink", "flushes"),
    MetricDef("fleetscope_sink_flush_failures", "counter", "Failed flushes (consumption paused, retried).",
              "sink", "flush_failures"),
    MetricDef("fleetscope_sink_last_flush_timestamp_seconds", "gauge", "Unix time of the last good flush.",
              "sink", "last_flush_ns", scale=1e-9),
    MetricDef("fleetscope_stream_consumer_lag", "gauge",
              "Messages the stream worker is behind the partition ends (-1 until known).",
              "stream", "consumer_lag"),
    MetricDef("fleetscope_sink_consumer_lag", "gauge",
              "Messages behind the partition ends, from librdkafka statistics (-1 until known).",
              "sink", "consumer_lag"),
    # agent / producers: producers.publisher.PublisherStats
    MetricDef("fleetscope_publisher_messages_published", "counter", "Batches accepted into the local queue.",
              "publisher", "published"),
    MetricDef("fleetscope_publisher_messages_delivered", "counter", "Batches acknowledged by the broker.",
              "publisher", "delivered"),
    MetricDef("fleetscope_publisher_messages_failed", "counter",
              "Batches given up: a permanent delivery error, or undelivered at stop with the spool in memory.",
              "publisher", "failed"),
    MetricDef("fleetscope_publisher_messages_dropped", "counter",
              "Batches never accepted (publisher not running, batch not encodable).",
              "publisher", "dropped"),
    MetricDef("fleetscope_publisher_events_published", "counter", "Events inside the published batches.",
              "publisher", "events_published"),
    MetricDef("fleetscope_publisher_events_delivered", "counter", "Events inside the delivered batches.",
              "publisher", "events_delivered"),
    MetricDef("fleetscope_publisher_client_errors", "counter", "Client-level errors reported by librdkafka.",
              "publisher", "errors"),
    MetricDef("fleetscope_publisher_outages", "counter",
              "Times the broker became unreachable and undelivered batches went to the spool.",
              "publisher", "outages"),
    MetricDef("fleetscope_publisher_producer_restarts", "counter",
              "Fresh Kafka producers installed when the broker came back.", "publisher", "producer_restarts"),
    MetricDef("fleetscope_publisher_messages_spooled", "counter", "Batches written to the outage spool.",
              "publisher", "spooled"),
    MetricDef("fleetscope_publisher_events_spooled", "counter", "Events inside the spooled batches.",
              "publisher", "events_spooled"),
    MetricDef("fleetscope_publisher_messages_spool_delivered", "counter",
              "Spooled batches delivered after an outage.", "publisher", "spool_delivered"),
    MetricDef("fleetscope_publisher_messages_spool_dropped", "counter",
              "Batches dropped, oldest first, because the spool (or the backlog before it) was full.",
              "publisher", "spool_dropped"),
    MetricDef("fleetscope_publisher_events_spool_dropped", "counter", "Events inside the batches the spool dropped.",
              "publisher", "spool_dropped_events"),
    MetricDef("fleetscope_publisher_spool_messages", "gauge", "Batches waiting in the spool.",
              "publisher", "spool_records"),
    MetricDef("fleetscope_publisher_spool_bytes", "gauge", "Bytes the spool holds.", "publisher", "spool_bytes"),
)  # fmt: skip

SOURCES = frozenset(m.source for m in METRICS)

_T = TypeVar("_T")
Snapshot = Callable[[Any], Mapping[str, object]]


class _Sources(Collector):
    """Reads every registered component at scrape time. Owners are held weakly where they can be (a sink
    or publisher that is gone stops exporting); slotted values are held as they are."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sources: dict[str, tuple[Callable[[], object], Snapshot]] = {}

    def register(self, component: str, owner: object, snapshot: Snapshot) -> None:
        try:
            ref: Callable[[], object] = weakref.ref(owner)
        except TypeError:
            ref = lambda: owner  # noqa: E731
        with self._lock:
            self._sources[component] = (ref, snapshot)

    def unregister(self, component: str) -> None:
        with self._lock:
            self._sources.pop(component, None)

    def snapshots(self) -> dict[str, Mapping[str, object]]:
        with self._lock:
            sources = dict(self._sources)
        out: dict[str, Mapping[str, object]] = {}
        for component, (ref, snapshot) in sources.items():
            owner = ref()
            if owner is None:
                continue
            try:
                out[component] = snapshot(owner)
            except Exception:  # a broken snapshot must not break the scrape of the others
                logger.warning("metrics snapshot of %s failed", component, exc_info=True)
        return out

    def collect(self) -> Iterator[Metric]:
        snapshots = self.snapshots()
        for m in METRICS:
            snap = snapshots.get(m.source)
            if snap is None:
                continue
            family: CounterMetricFamily | GaugeMetricFamily
            labels = [m.label] if m.label else []
            if m.kind == "counter":
                family = CounterMetricFamily(m.name, m.help, labels=labels)
            else:
                family = GaugeMetricFamily(m.name, m.help, labels=labels)
            for label_values, value in _samples(m, snap):
                family.add_metric(label_values, value * m.scale)
            yield family


def _samples(m: MetricDef, snap: Mapping[str, object]) -> Iterator[tuple[list[str], float]]:
    if m.keys:
        for key in m.keys:
            if key in snap:
                yield [key], _number(snap[key])
    elif m.label:
        table = snap.get(m.key) or {}
        if not isinstance(table, Mapping):
            raise TypeError(f"metric {m.name}: snapshot key {m.key!r} must hold a table, got {type(table).__name__}")
        for key, value in sorted(table.items()):
            yield [str(key)], _number(value)
    elif m.key in snap:
        yield [], _number(snap[m.key])


def _number(value: object) -> float:
    """A snapshot's value as a sample: anything ``float`` takes (numpy numbers included)."""
    if not isinstance(value, SupportsFloat | str):
        raise TypeError(f"a metrics snapshot value must be a number, got {type(value).__name__}")
    return float(value)


_SOURCES = _Sources()
REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(_SOURCES)
REGISTRY.register(ProcessCollector(registry=None))  # the standard process_* names dashboards expect


def register_source(component: str, owner: _T, snapshot: Callable[[_T], Mapping[str, object]]) -> None:
    """Export ``snapshot(owner)`` as ``component``'s metrics at every scrape (the newest owner wins).

    ``snapshot`` must be cheap and thread-safe: it runs in the HTTP server's thread."""
    if component not in SOURCES:
        raise ValueError(f"unknown metrics source {component!r} (known: {', '.join(sorted(SOURCES))})")
    _SOURCES.register(component, owner, snapshot)


def unregister_source(component: str) -> None:
    _SOURCES.unregister(component)


def render() -> bytes:
    """The Prometheus text exposition of this process's metrics."""
    return generate_latest(REGISTRY)


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint (a daemon thread); ``close()`` is idempotent."""

    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5.0)


class RepeatFilter(logging.Filter):
    """Lets one line of each kind through per ``interval_s`` (the kind: the text after librdkafka's prefix).

    For librdkafka's own log lines: it reports every reconnect attempt while a broker is away or refuses
    the client's credentials."""

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = record.getMessage().rsplit("]: ", 1)[-1][:120]
        now = time.monotonic()
        if now - self._last.get(key, -self.interval_s) < self.interval_s:
            return False
        if len(self._last) > 1000:
            self._last.clear()
        self._last[key] = now
        return True


def serve(port: int, host: str = "127.0.0.1") -> MetricsServer | None:
    """Serve ``GET /metrics`` on ``host:port`` in a daemon thread; ``port`` 0 means off (None).

    Loopback unless ``metrics_host`` says otherwise: a Prometheus on another machine needs it set.

    A port already in use raises ``OSError``: a start-up configuration error."""
    if port == 0:
        return None
    server, thread = start_http_server(port, addr=host, registry=REGISTRY)
    bound = int(server.server_address[1])
    logger.info("Prometheus metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(port=bound, _server=server, _thread=thread)
