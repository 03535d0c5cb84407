"""The differential stage asks a slowed-down or hung job for a profiling window (PerfTracker's trigger)."""

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.producers.control import ControlRequest
from fleetscope.schemas import decode, encode
from fleetscope.streams.app import PROFILE_ON, profile_request
from fleetscope.streams.offline import OfflinePipeline


def test_job_regression_opens_and_its_profile_request_is_a_valid_control_record():
    cfg = SimulatorConfig(ranks=8, iterations=40, faults=(parse_fault("job_slowdown:-:1.2@20"),))
    result = OfflinePipeline().add_all(simulate(cfg)).finish()
    opened = [u for u in result.finding_updates if u["status"] == "open"]
    assert [u["category"] for u in opened] == ["job_regression"]
    assert opened[0]["category"] in PROFILE_ON
    assert 20 < opened[0]["iteration_last"] <= 30
    subject, record = decode(encode("control", profile_request(opened[0], 20.0)))
    request = ControlRequest.from_record(record)
    assert subject == "control" and request.job == cfg.job and request.duration_s == 20.0
    assert request.start_at_ns > record["issued_ns"]  # a common start in the future, for every rank
