"""The windower and the differential stage on simulated jobs, without Kafka (the offline path)."""

import dataclasses
import json

import numpy as np
import pytest

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import FunctionKind
from fleetscope.streams.analysis.outliers import ScoringConfig, score_peer_group
from fleetscope.streams.analysis.timeline import TIMELINE_FIELDS
from fleetscope.streams.offline import OfflinePipeline


def analyse(cfg: SimulatorConfig):
    pipeline = OfflinePipeline(keep_patterns=True).add_all(simulate(cfg))
    result = pipeline.finish()
    return result.iterations, pipeline.patterns, result.findings


@pytest.mark.parametrize(
    ("fault", "category"),
    [("slow_gpu:5:1.5", "gpu_slow"), ("slow_link:9", "link_slow"), ("host_slow:2", "host_slow")],
)
def test_the_faulty_rank_and_only_it_is_found_with_its_category(fault, category):
    cfg = SimulatorConfig(ranks=12, iterations=12, faults=(parse_fault(fault),), seed=3)
    _, _, findings = analyse(cfg)
    assert [(f["rank"], f["category"]) for f in findings] == [(cfg.faults[0].rank, category)]
    f = findings[0]
    assert f["est_loss_ns"] > 0
    # a host excess counts once the peers wait for it: in iteration 0 the slow host's work comes after the
    # step's collectives (no peer waited yet), from iteration 1 on they wait for it at every collective
    assert f["iteration_first"] == (1 if category == "host_slow" else 0) and f["iteration_last"] == 11
    assert json.loads(f["evidence"])["functions"]


@pytest.mark.parametrize("fault", ["slow_link:9", "host_slow:2", "hang:4@7"])
def test_iterations_patterns_and_findings_do_not_depend_on_how_producers_batch(fault):
    """Real producers ship 500 ms of events per message, spanning several iterations."""
    cfg = SimulatorConfig(ranks=12, iterations=14, faults=(parse_fault(fault),), seed=3)

    def canonical(rows: list[dict]) -> list[str]:
        clockless = ({k: v for k, v in r.items() if k != "emitted_ns"} for r in rows)  # wall clock of the run
        return sorted(json.dumps(r, sort_keys=True, default=lambda a: a.tolist()) for r in clockless)

    per_iteration = analyse(cfg)
    shaped = analyse(dataclasses.replace(cfg, flush_interval_ms=500))
    assert per_iteration[2], "the fault must be found for the comparison to mean something"
    for rows, rows_shaped in zip(per_iteration, shaped, strict=True):
        assert canonical(rows_shaped) == canonical(rows)


def test_healthy_job_with_clock_skew_has_no_findings():
    _, _, findings = analyse(SimulatorConfig(ranks=16, iterations=15, clock_skew_ms=5.0, seed=11))
    assert findings == []


def test_slow_gpu_is_found_despite_clock_skew_between_hosts():
    cfg = SimulatorConfig(ranks=16, iterations=10, clock_skew_ms=8.0, faults=(parse_fault("slow_gpu:13:1.3"),))
    _, _, findings = analyse(cfg)
    assert [(f["rank"], f["category"]) for f in findings] == [(13, "gpu_slow")]


def test_every_iteration_of_every_rank_is_cut_once():
    cfg = SimulatorConfig(ranks=4, iterations=7)
    iterations, patterns, _ = analyse(cfg)
    assert sorted((i["rank"], i["iteration"]) for i in iterations) == [(r, s) for r in range(4) for s in range(7)]
    for it in iterations:
        assert it["gpu_busy_ns"] <= it["duration_ns"]
        assert it["compute_ns"] <= it["gpu_busy_ns"]
        assert it["idle_ns"] + it["gpu_busy_ns"] == it["duration_ns"]
    pat = patterns[0]
    kinds = dict(zip(pat["function"], pat["kind"], strict=True))
    assert kinds["dataloader.next"] == FunctionKind.PYTHON
    assert kinds["flash_fwd_kernel"] == FunctionKind.COMPUTE
    coll = [i for i, k in enumerate(pat["kind"]) if k == FunctionKind.COLLECTIVE]
    assert coll and all(pat["busbw_gbps"][i] > 0 and pat["nbytes"][i] > 0 for i in coll)
    assert not any(name.startswith("ProfilerStep#") for name in pat["function"])


def test_a_slow_rank_is_never_blamed_on_the_ranks_that_wait_for_it():
    """The waiters' collectives are long and the slow rank's short; only the slow rank is flagged."""
    cfg = SimulatorConfig(ranks=8, iterations=3, faults=(parse_fault("slow_gpu:4:2.0"),))
    _, patterns, _ = analyse(cfg)
    one_iteration = [p for p in patterns if p["iteration"] == 1]
    coll = [i for i, k in enumerate(one_iteration[0]["kind"]) if k == FunctionKind.COLLECTIVE][0]
    durations = {p["rank"]: p["mean_ns"][coll] for p in one_iteration}
    assert min(durations, key=durations.get) == 4  # the slow rank waits least
    signals = score_peer_group(one_iteration)
    assert {s.rank for s in signals} == {4}
    assert {s.category for s in signals} == {"gpu_slow"}


def test_a_late_rank_without_a_visible_cause_is_a_straggler():
    cfg = SimulatorConfig(ranks=8, iterations=2, faults=(parse_fault("slow_gpu:6:1.6"),))
    _, patterns, _ = analyse(cfg)
    records = [p for p in patterns if p["iteration"] == 1]
    hidden = []
    for p in records:  # hide the cause: drop compute kernels from every rank's patterns
        keep = [i for i, k in enumerate(p["kind"]) if k != FunctionKind.COMPUTE]
        hidden.append({k: ([v[i] for i in keep] if isinstance(v, list) and k not in TIMELINE_FIELDS else v)
                       for k, v in p.items()})  # fmt: skip
    signals = score_peer_group(hidden)
    assert [(s.rank, s.category) for s in signals] == [(6, "straggler")]
    assert signals[0].value > 0


def _late_by(lateness_ns: float, calls_late: str) -> dict[int, float]:
    """One simulated iteration of 8 ranks whose peers wait longer for rank 3 at the data-parallel all-reduce
    of 5 calls, by the same mean per call either way: ``lateness_ns`` in one call (their longest call that
    much longer) or a fifth of it at every call (each call that much longer). The straggler signals' losses
    (a budget of 0.1 % of the iteration, below both)."""
    _, patterns, _ = analyse(SimulatorConfig(ranks=8, iterations=2))
    records = [p for p in patterns if p["iteration"] == 1]
    kinds, calls = records[0]["kind"], records[0]["calls"]
    j = next(i for i, (k, n) in enumerate(zip(kinds, calls, strict=True)) if k == FunctionKind.COLLECTIVE and n == 5)
    for p in records:
        if p["rank"] != 3:
            p["mean_ns"][j] += lateness_ns / 5
            p["total_ns"][j] += lateness_ns
            p["max_ns"][j] += lateness_ns if calls_late == "one" else lateness_ns / 5
    signals = score_peer_group(records, ScoringConfig(min_loss_fraction=0.001))
    return {s.rank: s.loss_ns for s in signals if s.category == "straggler"}


def test_a_rank_that_holds_its_peers_in_one_call_of_a_step_costs_that_wait_one_behind_at_every_call_once():
    """A rank that starts its step late keeps its peers waiting at the step's first call only (the mean over
    the step's calls thins that out); one behind by the same at every overlapped bucket costs the step its
    lateness per call once, not once per call (DESIGN: a late rank delays the step by its lateness once)."""
    in_one = _late_by(5e6, calls_late="one")
    at_every = _late_by(5e6, calls_late="every")
    assert set(in_one) == set(at_every) == {3}
    assert 0.9 * 5e6 <= in_one[3] <= 1.1 * 5e6
    assert 0.9 * 5e6 / 5 <= at_every[3] <= 1.1 * 5e6 / 5


def test_findings_need_persistence_within_a_window_and_close_after_recovery():
    from fleetscope.streams.analysis.findings import FindingTracker, LifecycleConfig
    from fleetscope.streams.analysis.outliers import RankSignal

    cfg = LifecycleConfig(persist_iterations=3, window_iterations=4, recover_iterations=2, update_every=100)
    tracker = FindingTracker("j", cfg)
    sig = RankSignal(
        rank=1,
        host="h",
        category="gpu_slow",
        function="k",
        metric="mean_ns",
        value=2.0,
        peer_median=1.0,
        score=9.0,
        loss_ns=10.0,
    )
    flags = [1, 0, 0, 0, 1, 0, 0, 0, 1]  # one-off glitches, never 3 within 4 iterations
    assert [r for i, f in enumerate(flags) for r in tracker.observe(i, [sig] if f else [])] == []
    assert tracker.observe(9, []) == [] and tracker.observe(10, [sig]) == []
    opened = tracker.observe(11, [sig])  # intermittent: 8, 10, 11 are 3 flags within 4 iterations
    assert [(r["status"], r["iteration_first"], r["iteration_last"]) for r in opened] == [("open", 8, 11)]
    assert tracker.observe(12, []) == []
    closed = tracker.observe(13, [])
    assert [(r["status"], r["version"]) for r in closed] == [("closed", 2)]
    assert np.isclose(closed[0]["est_loss_ns"], 10)


def _feed(patterns, skip, arrival_s, config=None):
    """Feed pattern records in order of arrival with the worker's input clock; return the stage and findings."""
    from fleetscope.streams.analysis.differential import JobDifferential

    differential = JobDifferential(patterns[0]["job"], config)
    findings = []
    records = [p for p in patterns if not skip(p)]
    for p in sorted(records, key=lambda p: (arrival_s(p), p["iteration"], p["rank"])):
        findings += differential.add(p, now_ns=int(arrival_s(p) * 1e9))
    return differential, findings


def test_a_rank_that_stops_reporting_does_not_stall_the_job_and_is_reported_as_hung():
    """Rank 5 stops after iteration 4: once its peers advanced the timeout (10 iterations) in event time
    since its last record, the iterations it lacks are scored without it and it is reported."""
    from fleetscope.streams.analysis.differential import DifferentialConfig

    iterations, gone_after = 30, 4
    _, patterns, _ = analyse(SimulatorConfig(ranks=8, iterations=iterations, seed=5))
    iteration_ms = float(np.median([p["iteration_ns"] for p in patterns])) / 1e6
    config = DifferentialConfig(missing_rank_timeout_ms=max(int(10 * iteration_ms), 1))
    differential, findings = _feed(
        patterns,
        skip=lambda p: p["rank"] == 5 and p["iteration"] > gone_after,
        arrival_s=lambda p: p["iteration"],
        config=config,
    )
    assert differential.scored_upto == iterations - 1  # iterations without rank 5 are scored, not held
    assert {(f["rank"], f["category"], f["metric"]) for f in findings} == {(5, "hang", "missing_iterations")}
    assert findings[0]["status"] == "open"
    assert json.loads(findings[0]["evidence"])["missing_since_iteration"] == gone_after + 1
    offline, _ = _feed(patterns, skip=lambda p: p["rank"] == 5 and p["iteration"] > gone_after, arrival_s=lambda p: 0)
    assert offline.scored_upto == gone_after  # no clock: the job's records wait for its flush


def test_a_rank_whose_records_lag_behind_its_peers_is_waited_for_not_reported():
    """Rank 5's records come 6 iterations behind its peers' (many seconds of input clock): its peers advanced
    less than the timeout in event time meanwhile, so it is a backlog, not a silent rank."""
    from fleetscope.streams.analysis.differential import DifferentialConfig

    _, patterns, _ = analyse(SimulatorConfig(ranks=8, iterations=30, seed=5))
    iteration_ms = float(np.median([p["iteration_ns"] for p in patterns])) / 1e6
    config = DifferentialConfig(missing_rank_timeout_ms=max(int(10 * iteration_ms), 1))
    lag_s = 6
    differential, findings = _feed(
        patterns,
        skip=lambda p: False,
        arrival_s=lambda p: p["iteration"] + (lag_s if p["rank"] == 5 else 0),
        config=config,
    )
    assert differential.late_records == 0 and differential.scored_upto == 29
    assert findings == []


def test_gaps_in_the_workers_input_are_never_silence():
    """The worker reads the job in bursts a minute apart (a consumer that stalls and catches up), rank 5's
    records half a minute after its peers': many timeouts of input clock, but no rank fell behind its peers
    in event time, so every iteration is scored with all its ranks and nothing is reported."""
    _, patterns, _ = analyse(SimulatorConfig(ranks=8, iterations=30, seed=5))
    differential, findings = _feed(
        patterns, skip=lambda p: False, arrival_s=lambda p: 60 * p["iteration"] + (30 if p["rank"] == 5 else 0)
    )
    assert differential.late_records == 0 and differential.scored_upto == 29
    assert findings == []
