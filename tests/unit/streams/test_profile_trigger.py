"""The differential stage asks a slowed-down or hung job for a profiling window (PerfTracker's trigger),
once per job and interval, for the configured categories only, and not at all when switched off."""

import pytest

from fleetscope.config import ConfigError, load_config
from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.producers.control import ControlRequest
from fleetscope.schemas import decode, encode
from fleetscope.stack import stream_app_config
from fleetscope.streams.offline import OfflinePipeline
from fleetscope.streams.profiling import ProfilePolicy, ProfileRequestConfig

MIN = 60 * 10**9


def test_job_regression_opens_and_its_profile_request_is_a_valid_control_record():
    cfg = SimulatorConfig(ranks=8, iterations=40, faults=(parse_fault("job_slowdown:-:1.2@20"),))
    result = OfflinePipeline().add_all(simulate(cfg)).finish()
    opened = [u for u in result.finding_updates if u["status"] == "open"]
    assert [u["category"] for u in opened] == ["job_regression"]
    assert 20 < opened[0]["iteration_last"] <= 25
    request = ProfilePolicy().request(opened[0], now_ns=0)
    assert request is not None
    subject, record = decode(encode("control", request))
    control = ControlRequest.from_record(record)
    assert subject == "control" and control.job == cfg.job and control.duration_s == 20.0
    assert control.start_at_ns > record["issued_ns"]  # a common start in the future, for every rank


def finding(job: str, category: str, rank: int, status: str = "open") -> dict:
    return {"finding_id": f"{job}/{category}/rank:{rank}/3", "version": 1, "job": job, "category": category,
            "status": status, "rank": rank}  # fmt: skip


def test_one_request_per_job_and_interval_whatever_the_number_of_ranks_or_findings():
    policy = ProfilePolicy(ProfileRequestConfig(min_interval_ms=600_000))
    hangs = [finding("a", "hang", r) for r in range(4)]
    assert sum(policy.request(f, now_ns=0) is not None for f in hangs) == 1
    assert policy.request(finding("a", "job_regression", -1), now_ns=9 * MIN) is None
    assert policy.request(finding("b", "hang", 0), now_ns=9 * MIN) is not None  # another job
    assert policy.request(finding("a", "straggler", 2), now_ns=10 * MIN) is not None
    assert policy.suppressed == 4


def test_only_configured_categories_and_openings_ask_and_the_switch_turns_requests_off():
    policy = ProfilePolicy()
    assert policy.request(finding("a", "host_slow", 1), 0) is None
    assert policy.request(finding("a", "straggler", 1, status="update"), 0) is None
    assert policy.request(finding("a", "straggler", 1), 0) is not None
    off = ProfilePolicy(ProfileRequestConfig(auto=False))
    assert off.request(finding("a", "hang", 1), 0) is None
    only_hang = ProfilePolicy(ProfileRequestConfig(categories=("hang",)))
    assert only_hang.request(finding("a", "job_regression", -1), 0) is None


def test_profiling_settings_come_from_the_configuration():
    cfg = load_config(env={"FLEETSCOPE__STREAMS__PROFILING__AUTO": "off",
                           "FLEETSCOPE__STREAMS__PROFILING__CATEGORIES": "hang,straggler",
                           "FLEETSCOPE__STREAMS__PROFILING__MIN_INTERVAL_MS": "900000"})  # fmt: skip
    app = stream_app_config(cfg)
    assert app.profiling == ProfileRequestConfig(auto=False, categories=("hang", "straggler"), min_interval_ms=900_000)
    assert ProfileRequestConfig().min_interval_ms >= 600_000
    with pytest.raises(ConfigError, match="categories"):
        load_config(env={"FLEETSCOPE__STREAMS__PROFILING__CATEGORIES": "hang,slowness"})
