"""A job slower because one rank is slow (the others wait for it) is that rank's finding, not a regression
of the job: job_regression is for slowdowns no peer explains."""

import pytest

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.streams.offline import OfflinePipeline


@pytest.mark.parametrize("fault", ["slow_gpu:2:1.5@6", "host_slow:5:1.4@6"])
def test_a_slowdown_that_a_peer_explains_opens_only_the_peers_finding(fault):
    cfg = SimulatorConfig(ranks=8, iterations=16, seed=3, faults=(parse_fault(fault),))
    result = OfflinePipeline().add_all(simulate(cfg)).finish()
    opened = {(u["category"], u["rank"]) for u in result.finding_updates if u["status"] == "open"}
    culprit = int(fault.split(":")[1])
    assert opened and all(rank == culprit for _, rank in opened), opened
    assert "job_regression" not in {category for category, _ in opened}


def test_the_same_slowdown_on_every_rank_is_a_regression():
    cfg = SimulatorConfig(ranks=8, iterations=16, seed=3, faults=(parse_fault("job_slowdown:-:1.3@6"),))
    result = OfflinePipeline().add_all(simulate(cfg)).finish()
    assert [u["category"] for u in result.finding_updates if u["status"] == "open"] == ["job_regression"]
