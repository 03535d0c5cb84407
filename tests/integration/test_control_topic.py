"""On-demand profiling requests travel through the real broker to the ranks of the right job."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid

import pytest

from fleetscope.broker import ensure_topics
from fleetscope.config import load_config
from fleetscope.producers.control import (
    ControlListener,
    ControlRequest,
    request_profile,
)
from fleetscope.schemas import Topics
from fleetscope.wiring import control_listener_config

pytestmark = pytest.mark.integration


def test_listeners_get_the_requests_of_their_job_only_including_one_sent_before_they_started(
    broker: str,
) -> None:
    prefix = f"ctl{uuid.uuid4().hex[:6]}"
    ensure_topics({"bootstrap.servers": broker}, Topics(prefix=prefix), 2, 2)
    config = load_config(env={}, overrides={"kafka.bootstrap_servers": broker, "kafka.topic_prefix": prefix})
    early = request_profile(config, "job-a", 30, "before the rank started", start_in_s=1)

    got: dict[str, list[ControlRequest]] = {"job-a": [], "job-b": []}
    arrived = threading.Event()

    def listener(job: str) -> ControlListener:
        def on_request(request: ControlRequest) -> None:
            got[job].append(request)
            if len(got["job-a"]) == 2:
                arrived.set()

        return ControlListener(control_listener_config(config), job, on_request)

    listeners = [listener("job-a"), listener("job-b")]
    for each in listeners:
        each.start()
    try:
        late = request_profile(config, "job-a", 5, "slow step", start_in_s=2)
        assert arrived.wait(20), got
    finally:
        for each in listeners:
            each.stop()
            each.stop()
    assert [r.request_id for r in got["job-a"]] == [early.request_id, late.request_id]
    assert got["job-b"] == []
    assert late.start_at_ns > early.start_at_ns


def test_cli_profile_publishes_a_request(broker: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE")}
    run = subprocess.run(
        [sys.executable, "-m", "fleetscope", "profile", "--bootstrap", broker, "--job", "j", "--seconds", "3",
         "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert '"job": "j"' in run.stdout and '"duration_s": 3.0' in run.stdout
