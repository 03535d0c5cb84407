"""Peers that do the same work, stages compared with each other, causes rather than victims, time saved."""

import json

import numpy as np
import pytest

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import FunctionKind
from fleetscope.schemas.vocabulary import GC_PAUSE, LAUNCH_WAIT_FUNCTION
from fleetscope.streams.analysis.hostspans import host_self_ns
from fleetscope.streams.analysis.outliers import score_iteration
from fleetscope.streams.analysis.roles import late_by_compute
from fleetscope.streams.analysis.stages import score_stages
from fleetscope.streams.offline import OfflinePipeline


def analyse(cfg: SimulatorConfig) -> tuple[list[dict], list[dict]]:
    pipeline = OfflinePipeline(keep_patterns=True).add_all(simulate(cfg))
    return pipeline.patterns, pipeline.finish().findings


def _iteration(patterns: list[dict], it: int) -> list[dict]:
    return [dict(p) for p in patterns if p["iteration"] == it]


def _without(rec: dict, function: str) -> dict:
    keep = [i for i, f in enumerate(rec["function"]) if f != function]
    return {k: ([v[i] for i in keep] if isinstance(v, (list, np.ndarray)) and len(v) == len(rec["function"]) else v)
            for k, v in rec.items()}  # fmt: skip


@pytest.fixture(scope="module")
def pipeline_job() -> list[dict]:
    patterns, findings = analyse(SimulatorConfig(ranks=16, pp=4, iterations=4, seed=5))
    assert findings == []
    return patterns


def test_a_host_function_only_the_first_stage_runs_is_not_compared_on_the_other_stages(pipeline_job):
    records = [r if r["pp_rank"] == 0 else _without(r, "dataloader.next") for r in _iteration(pipeline_job, 2)]
    assert sum("dataloader.next" in list(r["function"]) for r in records) == 4
    assert score_iteration(records) == []


def test_without_a_layout_every_rank_is_one_peer_group_as_before(pipeline_job):
    """No coordinates: the first stage's data loader stands out against the others' zero (today's rule)."""
    records = [r if r["pp_rank"] == 0 else _without(r, "dataloader.next") for r in _iteration(pipeline_job, 2)]
    records = [dict(r, pp_rank=-1, tp_rank=-1, dp_rank=-1) for r in records]
    flagged = {s.rank for s in score_iteration(records) if s.category == "host_slow"}
    assert flagged == {0, 1, 2, 3}


def test_a_slow_last_stage_is_one_stage_finding_and_nothing_else():
    cfg = SimulatorConfig(ranks=16, pp=4, iterations=10, seed=7, faults=(parse_fault("stage_imbalance:3:1.25"),))
    _, findings = analyse(cfg)
    assert [(f["category"], f["subject"], f["ranks"]) for f in findings] == [
        ("stage_imbalance", "stage:3", [12, 13, 14, 15])
    ]
    ev = json.loads(findings[0]["evidence"])
    assert ev["stage"] == 3 and ev["stage_ranks"] == [12, 13, 14, 15]
    assert ev["compute_excess_ns"] > 0 and set(ev["others_wait_ns"]) == {"0", "1", "2"}
    assert all(w > 0 for w in ev["others_wait_ns"].values())
    assert 0 < findings[0]["est_loss_ns"] <= ev["compute_excess_ns"]
    assert ev["saved_ns"]["rank"] == 0 and ev["saved_ns"]["stage"] > 0


def test_a_slow_worker_is_found_and_its_pipeline_and_tensor_partners_are_not():
    cfg = SimulatorConfig(ranks=32, tp=2, pp=2, iterations=10, seed=9, faults=(parse_fault("slow_gpu:21:2.35"),))
    _, findings = analyse(cfg)
    assert [(f["rank"], f["category"]) for f in findings] == [(21, "gpu_slow")]
    ev = json.loads(findings[0]["evidence"])
    assert 0 < ev["saved_ns"]["rank"] <= ev["excess_ns"] and findings[0]["est_loss_ns"] > 0


def test_self_time_leaves_out_children_and_blocking_calls():
    # forward [0, 100) with a child [10, 30); backward [100, 300) waits in a sync [120, 290);
    # a sync call's own time is waiting; a span of the next iteration is never a child.
    start = np.array([0, 10, 100, 120, 0], dtype=np.int64)
    dur = np.array([100, 20, 200, 170, 50], dtype=np.int64)
    depth = np.array([0, 1, 0, 1, 1], dtype=np.int32)
    it = np.array([0, 0, 0, 0, 1])
    sync = np.array([False, False, False, True, False])
    assert host_self_ns(it, start, dur, depth, sync).tolist() == [80, 20, 30, 0, 50]


def test_an_annotation_whose_work_runs_on_another_thread_has_only_its_own_time():
    # `## backward ##` [0, 100) on the main thread, one op of its own [2, 6); the autograd engine's thread
    # runs the backward meanwhile: two outermost ops [10, 50) and [60, 90), one of them with a child; an op
    # of a background thread that starts inside and ends after it counts only for its part inside.
    start = np.array([0, 2, 10, 20, 60, 95], dtype=np.int64)
    dur = np.array([100, 4, 40, 10, 30, 20], dtype=np.int64)
    depth = np.array([0, 1, 0, 1, 0, 0], dtype=np.int32)
    it = np.zeros(6, dtype=np.int64)
    sync = np.zeros(6, dtype=bool)
    assert host_self_ns(it, start, dur, depth, sync).tolist() == [100 - 4 - 40 - 30 - 5, 4, 30, 10, 30, 20]


def test_an_annotation_that_only_waits_never_makes_a_rank_host_slow(pipeline_job):
    records = _iteration(pipeline_job, 2)
    for r in records:
        r["self_ns"] = np.asarray(r["self_ns"]).copy()
        r["total_ns"] = np.asarray(r["total_ns"]).copy()
    bwd = list(records[5]["function"]).index("backward")
    records[5]["total_ns"][bwd] *= 3  # waiting inside: total grows, self time does not
    assert score_iteration(records) == []
    records[5]["self_ns"][bwd] *= 3  # its own work grows
    assert [(s.rank, s.category, s.function) for s in score_iteration(records)] == [(5, "host_slow", "backward")]


def test_a_late_rank_is_late_by_its_gpu_where_its_compute_accounts_for_half_its_lateness():
    """Compute 1 ms above its peers' 30 ms, late by 1.5 ms: late by its GPU, which is 3 % slower, a healthy
    part (""); 2 ms above 30 ms (6.7 %): gpu_slow; 0.5 ms above, late by 1.5 ms: something else (None)."""
    assert late_by_compute(1.5e6, 1e6, 30e6, 0.05) == ""
    assert late_by_compute(1.5e6, 2e6, 30e6, 0.05) == "gpu_slow"
    assert late_by_compute(1.5e6, 0.5e6, 30e6, 0.05) is None
    assert late_by_compute(1.5e6, float("nan"), 30e6, 0.05) is None


def test_self_time_reaches_the_pattern_records(pipeline_job):
    rec = pipeline_job[0]
    kinds = np.asarray(rec["kind"])
    self_ns, total = np.asarray(rec["self_ns"]), np.asarray(rec["total_ns"])
    assert np.array_equal(self_ns[kinds != FunctionKind.PYTHON], total[kinds != FunctionKind.PYTHON])
    assert np.all(self_ns <= total)


def _spread_kernels(records: list[dict], slow_rank: int, factor: float, seed: int) -> list[dict]:
    """Compute kernels that differ by rank (±8 %, as ranks of a real job do: more than a x1.2 shows per
    kernel) and one rank x ``factor``."""
    rng = np.random.default_rng(seed)
    out = []
    for r in records:
        kinds = np.asarray(r["kind"])
        mean = np.asarray(r["mean_ns"], dtype=np.float64).copy()
        compute = kinds == FunctionKind.COMPUTE
        mean[compute] *= rng.uniform(0.92, 1.08, int(compute.sum()))
        if r["rank"] == slow_rank:
            mean[compute] *= factor
        out.append(dict(r, mean_ns=mean))
    return out


def test_a_uniform_slowdown_hidden_in_the_spread_of_short_kernels_is_judged_by_the_iteration_time():
    patterns, _ = analyse(SimulatorConfig(ranks=16, iterations=3, seed=4))
    records = _iteration(patterns, 1)
    healthy = _spread_kernels(records, slow_rank=-1, factor=1.0, seed=1)
    assert score_iteration(healthy) == []
    slow = _spread_kernels(records, slow_rank=11, factor=1.2, seed=1)
    signals = score_iteration(slow)
    assert [(s.rank, s.category) for s in signals] == [(11, "gpu_slow")]
    assert signals[0].evidence["typical_ratio"] > 1.1


def test_a_host_annotation_that_grows_with_its_own_slow_gpu_is_no_host_finding(tmp_path):
    """ZeRO job from the independent trace generator: the slow worker's ``## backward ##`` ends with its
    kernels; it is the GPU, once."""
    from fleetscope.producers.tracegen import TraceJob, write_traces
    from fleetscope.traces_cli import analyze_traces

    job = TraceJob(dp=8, zero=True, fault="slow_worker", fault_rank=3, steps=6)
    write_traces(job, tmp_path / "zero")
    findings = analyze_traces([tmp_path / "zero"]).findings
    assert [(f["rank"], f["category"]) for f in findings] == [(3, "gpu_slow")]
    assert json.loads(findings[0]["evidence"])["host_wait_ns"] > 0


def _stage_per_rank(launch_ms: dict[int, float], p2p_ms: dict[int, float]) -> list[dict]:
    """dp1 x pp8: each rank a stage of its own, 15 ms of kernels, its GPU's launch wait and its p2p time."""
    return [{"rank": r, "host": "h0", "pp_rank": r, "dp_rank": 0, "tp_rank": 0, "iteration_ns": 45_000_000,
             "function": ["gemm", LAUNCH_WAIT_FUNCTION, f"nccl:send[pg={r}]"], "kind": [0, 3, 2],
             "total_ns": [15_000_000, int(launch_ms.get(r, 0.0) * 1e6), int(p2p_ms.get(r, 32.0) * 1e6)]}
            for r in range(8)]  # fmt: skip


def test_a_stage_of_one_rank_whose_gpu_waits_for_its_host_is_host_slow_where_the_others_wait_for_it():
    """dp1 x pp8, rank 2 launch-bound: its kernels take 15 ms like everyone's, its GPU waits 9 ms more for
    launches, and the other stages wait ~10 ms longer in send/recv than it does. No stage has a peer to
    compare it with, and no stage computes longer: host_slow on rank 2's launch wait."""
    found = score_stages(_stage_per_rank({2: 9.0}, {2: 22.0}))
    assert [(s.rank, s.category, s.function) for s in found] == [(2, "host_slow", LAUNCH_WAIT_FUNCTION)]
    assert found[0].loss_ns == pytest.approx(9e6) and found[0].evidence["others_wait_ns"] == pytest.approx(10e6)


def test_launch_waits_no_stage_waits_for_or_every_stage_has_are_no_finding():
    """The same launch wait hidden in rank 2's bubble (the others wait no longer than it), launch waits of
    every rank alike, or none: no finding."""
    assert score_stages(_stage_per_rank({2: 9.0}, {})) == []
    assert score_stages(_stage_per_rank(dict.fromkeys(range(8), 9.0), {2: 22.0})) == []
    assert score_stages(_stage_per_rank({}, {2: 22.0})) == []


def test_a_slow_gpu_of_a_tensor_parallel_group_names_no_rank_that_shares_its_data_parallel_group():
    """16 ranks, tp4: rank 8 computes twice as slowly. Its data-parallel group (ranks of its tensor slot) ends
    last, so those ranks of the other replicas reach their next tensor-parallel call late once a step: its
    victims, not stragglers."""
    cfg = SimulatorConfig(ranks=16, tp=4, iterations=20, seed=0, faults=(parse_fault("slow_gpu:8:2.0@6"),))
    _, findings = analyse(cfg)
    assert [(f["category"], f["ranks"]) for f in findings] == [("gpu_slow", [8])]


def test_a_gc_pause_only_one_rank_takes_is_compared_with_every_rank_whatever_its_tensor_slot(pipeline_job):
    """16 ranks as 8 tensor slots of 2 (each slot's pair the only ranks of its role): rank 8 alone collects,
    for a tenth of the step. A function only some slots run is compared within its slot, where rank 8's
    pair is too few to judge; a GC pause is no slot's work (every Python process collects): host_slow on
    ``gc.collect``. The simulated iteration (rank 8 collecting briefly) stays clean. Seen on a real
    tp2 x dp2 job whose one rank collected: its slot's pair alone was too few to compare."""
    records = [dict(r, pp_rank=0, tp_rank=r["rank"] % 8, dp_rank=r["rank"] // 8) for r in _iteration(pipeline_job, 2)]
    assert score_iteration(records) == []
    (at,) = [i for i, r in enumerate(records) if GC_PAUSE in list(r["function"])]  # rank 8 collects, briefly
    gc = list(records[at]["function"]).index(GC_PAUSE)
    for key in ("self_ns", "total_ns"):
        records[at][key] = [v if i != gc else 0.1 * records[at]["iteration_ns"] for i, v in enumerate(records[at][key])]
    found = [(s.category, s.rank, s.function) for s in score_iteration(records)]
    assert records[at]["rank"] == 8 and found == [("host_slow", 8, GC_PAUSE)]
