"""Alert lines and payloads, and webhook delivery: retries with backoff, permanent errors, bounded queue."""

from __future__ import annotations

import json
import shlex
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from fleetscope.broker import free_port
from fleetscope.schemas import Category
from fleetscope.schemas.categories import REGISTRY
from fleetscope.sinks.alerts import WebhookConfig, WebhookSender, alert_payload, format_alert, format_next_checks
from fleetscope.sinks.retry import RetryPolicy

FINDING = {
    "finding_id": "demo/gpu_slow/7/0",
    "status": "open",
    "version": 1,
    "job": "demo",
    "rank": 7,
    "ranks": [7],
    "host": "node000",
    "category": "gpu_slow",
    "function": "ampere_bf16_s16816gemm_bf16_64x128_ldg8_f2f_tn",
    "metric": "mean_ns",
    "value": 2.13e6,
    "peer_median": 1.4e6,
    "score": 52.06,
    "iteration_first": 0,
    "iteration_last": 39,
    "est_loss_ns": 40_630_000,
    "evidence": json.dumps({"compared_functions": 10}),
    "emitted_ns": 1_767_225_600_123_000_000,
}


class Endpoint:
    """A webhook receiver answering a scripted list of status codes (then 200)."""

    def __init__(self, statuses: list[int] | None = None, delay_s: float = 0.0) -> None:
        self.received: list[dict[str, Any]] = []
        self.attempts = 0
        script = list(statuses or [])
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                endpoint.attempts += 1
                time.sleep(delay_s)
                status = script.pop(0) if script else 200
                if status == 200:
                    endpoint.received.append(json.loads(body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hook"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    e = Endpoint([503, 429])
    yield e
    e.close()


def fast(url: str, attempts: int = 4, **kwargs: Any) -> WebhookConfig:
    retry = RetryPolicy(max_attempts=attempts, initial_backoff_ms=10, max_backoff_ms=40)
    return WebhookConfig(url=url, timeout_s=1.0, retry=retry, **kwargs)


def test_the_alert_line_says_what_happened_where_and_by_how_much() -> None:
    line = format_alert(alert_payload(FINDING))
    assert line.startswith("2026-01-01T00:00:00.123+00:00  NEW ")
    parts = ["demo", "rank 7 (node000)", "gpu_slow", "mean 2.13 ms vs peers 1.40 ms (+52%)", "score 52.1"]
    parts += ["iterations 0-39", "loss 40.6 ms/iter", "[demo/gpu_slow/7/0 v1]"]
    for part in parts:
        assert part in line
    assert "\n" not in line and "e+0" not in line
    closed = format_alert(alert_payload(FINDING | {"status": "closed", "rank": -1, "ranks": [3, 4]}))
    assert " CLOSED " in closed and "ranks 3,4" in closed
    host = format_alert(alert_payload(FINDING | {"rank": -1, "ranks": [3, 4], "subject": "host:node001"}))
    assert "host node001" in host and "rank -1" not in host
    late = FINDING | {"category": "straggler", "metric": "arrival_lateness_ns", "value": 11.2e6, "peer_median": 0.0}
    late_line = format_alert(alert_payload(late))
    assert "arrival_lateness 11.2 ms  score" in late_line and "nan" not in late_line
    on_gpu = format_alert(
        alert_payload(FINDING | {"local_rank": 3, "gpu_uuid": "GPU-1a2b", "pci_bus_id": "0000:3b:00.0"})
    )
    assert "(node000, GPU 3 (GPU-1a2b, 0000:3b:00.0))" in on_gpu
    assert "UPDATED" in format_alert(alert_payload(FINDING | {"status": "update"}))


def test_the_payload_is_the_findings_json_with_parsed_evidence() -> None:
    payload = alert_payload(FINDING)
    assert payload["event"] == "new" and payload["evidence"] == {"compared_functions": 10}
    for key in ("job", "rank", "ranks", "host", "category", "function", "metric", "value", "peer_median",
                "score", "iteration_first", "iteration_last", "est_loss_ns", "evidence"):  # fmt: skip
        assert key in payload
    assert json.loads(json.dumps(payload)) == payload
    assert alert_payload(FINDING | {"evidence": "not json"})["evidence"] == {"raw": "not json"}


def test_a_new_findings_alert_says_what_it_means_and_what_to_check_next() -> None:
    """The payload carries the category's meaning and next checks (the finding's own query parameters); the
    follower prints them under a new finding's line; a category this version does not know adds nothing."""
    payload = alert_payload(FINDING)
    assert payload["meaning"] == REGISTRY[Category.GPU_SLOW].meaning
    checks = payload["next_checks"]
    assert checks["params"] == {"job": "demo", "ranks": "[7]"} and "throttle_reasons" in checks["nvml"]
    lines = format_next_checks(payload)
    assert [line.split(":", 1)[0] for line in lines] == ["    means", "    likely", "    NVML", "    shows it"]
    argv = shlex.split(lines[-1].split(": ", 1)[1])
    assert argv == ["fleetscope", "sql", checks["sql"], "--param", "job=demo", "--param", "ranks=[7]"]
    group = alert_payload(FINDING | {"category": "link_slow", "rank": -1, "ranks": [3, 4], "function": "allreduce"})
    assert group["next_checks"]["params"] == {"job": "demo", "ranks": "[3,4]", "function": "allreduce"}
    unknown = alert_payload(FINDING | {"category": "from_a_newer_differential"})
    assert "meaning" not in unknown and format_next_checks(unknown) == []
    print(f"webhook payload: {len(json.dumps(unknown))} -> {len(json.dumps(payload))} bytes with its next checks")


def test_retryable_answers_are_retried_with_backoff_then_delivered(endpoint: Endpoint) -> None:
    sender = WebhookSender(fast(endpoint.url))
    assert sender.post(alert_payload(FINDING)) is True
    assert endpoint.attempts == 3 and len(endpoint.received) == 1
    assert endpoint.received[0]["finding_id"] == "demo/gpu_slow/7/0"
    assert sender.stats == {"sent": 1, "failed": 0, "dropped": 0, "retries": 2}


def test_permanent_errors_are_not_retried_and_never_raise() -> None:
    e = Endpoint([400])
    try:
        sender = WebhookSender(fast(e.url))
        assert sender.post(alert_payload(FINDING)) is False
        assert e.attempts == 1 and sender.stats["failed"] == 1
    finally:
        e.close()
    dead = WebhookSender(fast(f"http://127.0.0.1:{free_port()}/hook", attempts=3))
    t0 = time.monotonic()
    assert dead.post(alert_payload(FINDING)) is False
    assert time.monotonic() - t0 < 2.0, "bounded retries"
    assert dead.stats == {"sent": 0, "failed": 1, "dropped": 0, "retries": 2}


def test_a_slow_endpoint_never_blocks_the_caller_and_the_queue_is_bounded() -> None:
    slow = Endpoint(delay_s=0.3)
    try:
        sender = WebhookSender(fast(slow.url, queue_max=2))
        sender.start()
        t0 = time.monotonic()
        accepted = [sender.submit(alert_payload(FINDING | {"version": v})) for v in range(6)]
        assert time.monotonic() - t0 < 0.1
        assert accepted.count(False) >= 2 and sender.stats["dropped"] == accepted.count(False)
        sender.stop(timeout_s=5)
        assert sender.stats["sent"] == accepted.count(True) == len(slow.received)
        sender.stop()
    finally:
        slow.close()


def test_webhook_config_rejects_other_schemes() -> None:
    with pytest.raises(ValueError, match="url"):
        WebhookConfig(url="file:///etc/passwd")


def test_the_readme_consumer_example_compiles_against_the_real_api() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme.split("Your own alert consumer", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    compile(snippet, "README.md", "exec")
    assert "from fleetscope.schemas import decode" in snippet
    assert "fleetscope.findings" in snippet


def _state(version: int, status: str, loss_ms: float = 2.0, rank: int = 3, function: str = "gemm") -> dict:
    return {"finding_id": "j/gpu_slow/rank:3/4", "version": version, "status": status, "category": "gpu_slow",
            "rank": rank, "function": function, "est_loss_ns": int(loss_ms * 1e6)}  # fmt: skip


def test_the_pager_hears_openings_closes_and_significant_changes_only():
    from fleetscope.sinks.alerts import AlertFilter

    send = AlertFilter(loss_change=0.5)
    states = [
        _state(1, "open"),
        _state(2, "update", 2.2),  # the same finding, a little more loss: no page
        _state(3, "update", 2.5),
        _state(2, "update", 2.2),  # a replayed record
        _state(4, "update", 3.5),  # loss +75 % since the last one sent
        _state(5, "update", 3.5, function="flash_fwd"),  # another function now
        _state(6, "update", 3.6),
        _state(7, "closed", 3.6),
        _state(7, "closed", 3.6),  # read twice
    ]
    assert [s["version"] for s in states if send(s)] == [1, 4, 5, 6, 7]
    assert send.suppressed == 4
