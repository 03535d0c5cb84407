"""The stream stages deployed apart, as apps of their own: a windower-only app cuts iterations and finds
nothing; a differential-only app, started later on the same topics, finds the slow rank."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetscope.config import ConfigError, load_config
from fleetscope.demo import publish_simulation
from fleetscope.producers import SimulatorConfig, parse_fault
from fleetscope.progress import Progress
from fleetscope.sinks import current_findings
from fleetscope.stack import EmbeddedStack, StreamWorkerProcess

pytestmark = pytest.mark.integration

SIM = SimulatorConfig(job="split-job", ranks=8, iterations=12, faults=(parse_fault("slow_gpu:3:1.5"),))


def _wait(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def test_a_windower_app_and_a_differential_app_find_the_slow_rank(
    tmp_path: Path, chdb_path: Path, database: str, broker: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path),
            "store.url": f"chdb://{chdb_path}",
            "store.database": database,
            "kafka.bootstrap_servers": broker,
            "kafka.topic_prefix": f"sp{tag}",
            "streams.app_id": f"windower-{tag}",
            "streams.stages": "windower",
        },
    )
    settle_s = (config.streams.job_idle_ms + config.streams.windower.idle_close_ms) / 1000 + 1.5
    with EmbeddedStack(config) as stack:
        assert stack.sink is not None and stack.client is not None
        sink = stack.sink
        publish_simulation(stack.config, SIM, Progress(enabled=False))
        expected = SIM.ranks * SIM.expected_iterations
        _wait(lambda: sink.stats["iterations"] >= expected, 120, "iteration rows of the windower-only app")
        time.sleep(settle_s)  # a differential in this worker would have flushed the idle job by now
        assert sink.stats["finding_updates"] == 0

        streams = dataclasses.replace(stack.config.streams, app_id=f"differential-{tag}", stages=("differential",))
        differential = StreamWorkerProcess(stack.config.replace(streams=streams), name="differential")
        differential.start()
        try:
            _wait(lambda: sink.stats["finding_updates"] > 0, 120, "findings of the differential-only app")
            time.sleep(settle_s)
            findings = current_findings(stack.client, stack.config.store.database, job=SIM.job)
        finally:
            differential.stop()
    assert [(f["rank"], f["category"]) for f in findings] == [(3, "gpu_slow")]
    assert sink.stats["iterations"] == expected


@pytest.mark.parametrize(
    ("stages", "message"),
    [("", "stages"), ("windower,windower", "each once"), ("windower,scorer", "one or both"), (3, "list of strings")],
)
def test_stages_are_validated(stages: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, overrides={"streams.stages": stages})


def test_stages_read_from_the_environment() -> None:
    config = load_config(env={"FLEETSCOPE__STREAMS__STAGES": "differential, windower"})
    assert config.streams.stages == ("differential", "windower")
