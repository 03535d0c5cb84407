"""The stream stages deployed apart, as apps of their own: a windower-only app cuts iterations and finds
nothing; a differential-only app, started later on the same topics, finds the slow rank."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from harness import wait_until

from fleetscope.config import ConfigError, load_config
from fleetscope.demo import publish_simulation
from fleetscope.producers import SimulatorConfig, parse_fault
from fleetscope.progress import Progress
from fleetscope.sinks import current_findings
from fleetscope.stack import EmbeddedStack, StreamWorkerProcess
from tests.integration.worker_runs import quiet_s, run_config, stage_config, wait_settled

pytestmark = pytest.mark.integration

SIM = SimulatorConfig(job="split-job", ranks=8, iterations=12, faults=(parse_fault("slow_gpu:3:1.5"),))


def test_a_windower_app_and_a_differential_app_find_the_slow_rank(tmp_path: Path, chdb_path: Path, broker: str) -> None:
    config = run_config(tmp_path, broker, f"chdb://{chdb_path}")
    with EmbeddedStack(stage_config(config, "windower")) as stack:
        assert stack.sink is not None and stack.client is not None
        sink = stack.sink
        publish_simulation(stack.config, SIM, Progress(enabled=False))
        expected = SIM.ranks * SIM.expected_iterations
        assert wait_until(lambda: sink.stats["iterations"] >= expected, 120), "iteration rows of the windower-only app"
        time.sleep(quiet_s(config))  # a differential in this worker would have flushed the idle job by now
        assert sink.stats["finding_updates"] == 0

        differential = StreamWorkerProcess(stage_config(stack.config, "differential"), name="differential")
        differential.start()
        try:
            wait_settled(
                lambda: sink.stats["finding_updates"],
                lambda: sink.stats["finding_updates"] > 0,
                quiet_s(config),
                120,
            )
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
