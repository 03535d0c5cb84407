"""Prometheus metrics: one definition per metric, the text exposition format, the /metrics endpoint."""

from __future__ import annotations

import dataclasses
import gc
import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetscope import telemetry
from fleetscope.broker import free_port
from fleetscope.producers import PublisherStats
from fleetscope.sinks import Sink, SinkConfig
from fleetscope.streams.app import StageCounters

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


@pytest.fixture(autouse=True)
def clean_sources() -> Iterator[None]:
    yield
    for source in telemetry.SOURCES:
        telemetry.unregister_source(source)


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def idle_sink() -> Sink:
    """A real sink, never started: its stats exist from construction."""
    writer = SimpleNamespace(write_iterations=len, write_patterns=len, write_findings=len)
    return Sink(SinkConfig(bootstrap_servers="127.0.0.1:1"), writer)  # type: ignore[arg-type]


def test_every_metric_is_defined_once_and_maps_to_a_real_counter() -> None:
    names = [m.name for m in telemetry.METRICS]
    assert len(names) == len(set(names))
    assert all(_NAME.match(n) and n.startswith("fleetscope_") for n in names)
    assert all(not n.endswith("_total") for n in names), "the client appends _total to counters"

    known = {
        "stream": {f.name for f in dataclasses.fields(StageCounters)},
        "sink": set(idle_sink().stats),
        "publisher": {f.name for f in dataclasses.fields(PublisherStats)},
    }
    assert set(known) == telemetry.SOURCES
    for m in telemetry.METRICS:
        for key in m.keys or (m.key,):
            assert key in known[m.source], f"{m.name} reads {m.source}.{key}, which does not exist"


def test_exposition_has_help_type_and_values_of_registered_components() -> None:
    counters = StageCounters(raw_batches=3, raw_events=12_000, iterations=2, findings=1)
    counters.per_reason.update({"schema": 2, "header": 1})
    telemetry.register_source("stream", counters, dataclasses.asdict)
    sink = idle_sink()  # registers itself
    sink._stats["iterations"] = 320
    sink._stats["last_flush_ns"] = 1_767_225_600_000_000_000

    text = telemetry.render().decode()
    assert "# HELP fleetscope_stream_raw_events_total Events inside the decoded raw batches." in text
    assert "# TYPE fleetscope_stream_raw_events_total counter" in text
    assert "# TYPE fleetscope_sink_consumer_lag gauge" in text
    fams = families(text)
    events = fams["fleetscope_stream_raw_events"]
    assert events.type == "counter" and events.samples[0].value == 12_000
    dead = {s.labels["reason"]: s.value for s in fams["fleetscope_stream_dead_letters"].samples}
    assert dead == {"header": 1.0, "schema": 2.0}
    rows = {s.labels["table"]: s.value for s in fams["fleetscope_sink_rows_written"].samples}
    assert rows == {"iterations": 320.0, "function_patterns": 0.0, "finding_updates": 0.0}
    assert fams["fleetscope_sink_last_flush_timestamp_seconds"].samples[0].value == pytest.approx(1_767_225_600)
    assert fams["fleetscope_sink_consumer_lag"].samples[0].value == -1
    assert "fleetscope_publisher_messages_dropped" not in fams, "no publisher in this process"
    assert "process_cpu_seconds" in fams and "process_resident_memory_bytes" in fams, "standard names"
    assert not any(name.startswith("fleetscope_process_") for name in fams)


def test_metrics_endpoint_serves_the_exposition_and_holds_its_port() -> None:
    telemetry.register_source("publisher", PublisherStats(published=5, dropped=2), dataclasses.asdict)
    server = telemetry.serve(free_port(), host="127.0.0.1")
    assert server is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            fams = families(resp.read().decode())
        assert fams["fleetscope_publisher_messages_dropped"].samples[0].value == 2
        assert fams["fleetscope_publisher_messages_published"].samples[0].name.endswith("_total")
        with pytest.raises(OSError), socket.create_server(("127.0.0.1", server.port)):
            pass  # the port is taken by the endpoint
        with pytest.raises(OSError):
            telemetry.serve(server.port, host="127.0.0.1")
    finally:
        server.close()
        server.close()


def test_port_zero_is_off_and_a_stopped_component_disappears() -> None:
    assert telemetry.serve(0) is None
    counters = StageCounters(raw_batches=1)
    telemetry.register_source("stream", counters, dataclasses.asdict)
    assert "fleetscope_stream_raw_batches" in families(telemetry.render().decode())
    del counters
    gc.collect()
    assert "fleetscope_stream_raw_batches" not in families(telemetry.render().decode())
    with pytest.raises(ValueError, match="unknown metrics source"):
        telemetry.register_source("nope", object(), lambda _: {})


def test_a_broken_snapshot_does_not_break_the_scrape() -> None:
    holder = PublisherStats()
    telemetry.register_source("publisher", holder, lambda _: 1 / 0)  # type: ignore[arg-type, return-value]
    sink = idle_sink()
    assert "fleetscope_sink_messages" in families(telemetry.render().decode())
    del sink


def test_sink_lag_comes_from_librdkafka_statistics() -> None:
    sink = idle_sink()
    stats = {
        "topics": {
            "fs.patterns": {"partitions": {"0": {"consumer_lag": 7}, "1": {"consumer_lag": 5}, "-1": {}}},
            "fs.findings": {"partitions": {"0": {"consumer_lag": -1}}},
        }
    }
    sink._on_statistics(json.dumps(stats))
    assert sink.stats["consumer_lag"] == 12
    sink._on_statistics(json.dumps({"topics": {}}))
    assert sink.stats["consumer_lag"] == -1


def test_the_metrics_endpoint_binds_loopback_unless_configured() -> None:
    server = telemetry.serve(free_port())
    assert server is not None
    try:
        assert server._server.server_address[0] == "127.0.0.1"
    finally:
        server.close()
    from fleetscope.config import load_config

    assert load_config(env={}).metrics_host == "127.0.0.1"
    assert load_config(env={"FLEETSCOPE__METRICS_HOST": "0.0.0.0"}).metrics_host == "0.0.0.0"  # noqa: S104


def test_stream_consumer_lag_from_the_monitor_offsets() -> None:
    from fleetscope.streams.app import consumer_lag

    assert consumer_lag({"p0": 100, "p1": 50}, {"p0": 90, "p1": None}) == 10
    assert consumer_lag({"p0": 100}, {"p0": 120}) == 0, "never negative"
    assert consumer_lag({}, {}) == -1 and consumer_lag(None, None) == -1
    counters = StageCounters(consumer_lag=7)  # held: sources are weak references
    telemetry.register_source("stream", counters, dataclasses.asdict)
    try:
        assert b"fleetscope_stream_consumer_lag 7.0" in telemetry.render()
    finally:
        telemetry.unregister_source("stream")
