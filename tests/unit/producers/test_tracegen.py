"""The independent trace generator writes real-format Kineto traces whose layout the parser recovers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from fleetscope.producers.kineto import parse_trace
from fleetscope.producers.trace_layout import GroupNotes, job_layouts, with_layout
from fleetscope.producers.tracegen import EXPERT_GEMM, TraceJob, documents, main, simulate, write_traces
from fleetscope.schemas import EventKind
from fleetscope.schemas.layout import ProcessGroup
from fleetscope.schemas.vocabulary import LAUNCH_WAIT_FUNCTION
from fleetscope.streams.offline import OfflinePipeline
from fleetscope.traces_cli import analyze_traces
from fleetscope.verdict import sentence

JOBS = {
    "pp4_dp4": TraceJob(dp=4, pp=4, steps=3),
    "dp2_pp2_tp2_mesh": TraceJob(dp=2, pp=2, tp=2, names="mesh", steps=3),
    "tp_pp_dp_order": TraceJob(dp=2, pp=2, tp=2, order=("tp", "pp", "dp"), steps=3),
    "unnamed": TraceJob(dp=2, pp=3, tp=2, names="none", layers=6, steps=3),
    "unnamed_pp_first": TraceJob(dp=2, pp=2, order=("pp", "dp", "tp"), names="none", steps=3),
    "zero_moe": TraceJob(dp=4, ep=2, zero=True, steps=3),
}


def traces_of(job: TraceJob, directory: Path) -> list:
    return [parse_trace(p, job="gen") for p in write_traces(job, directory)]


@pytest.mark.parametrize("name", sorted(JOBS))
def test_parsed_layout_equals_the_generated_one(name: str, tmp_path: Path) -> None:
    job = JOBS[name]
    traces = traces_of(job, tmp_path)
    layout = job_layouts(traces)["gen"]
    for r in range(job.world_size):
        want = job.coordinates(r)
        role = layout.role(r)
        assert (role.tp_rank, role.pp_rank, role.dp_rank) == (want["tp"], want["pp"], want["dp"]), (r, layout.sources)
        assert (role.tp_size, role.pp_size, role.dp_size) == (job.tp, job.pp, job.dp)
        if job.ep > 1:
            assert (role.ep_rank, role.ep_size) == (want["ep"], job.ep)
    if job.zero:
        assert layout.role(0).shard_size == job.dp  # the optimizer shards over the data-parallel group
    header = with_layout(traces[3], layout).batches[0].header
    assert (header.pp_rank, header.dp_rank, header.pp_size) == (
        layout.role(traces[3].rank).pp_rank,
        layout.role(traces[3].rank).dp_rank,
        job.pp,
    )


def test_unnamed_reversed_stage_order_follows_the_p2p_direction(tmp_path: Path) -> None:
    """pp fastest and unnamed groups: the pipeline family is found by its p2p traffic, stage 0 by its first send."""
    job = TraceJob(dp=2, pp=4, order=("pp", "dp", "tp"), names="none", steps=2)
    traces = traces_of(job, tmp_path)
    layout = job_layouts(traces)["gen"]
    assert layout.sources["pp"] == "traffic"
    assert {t.rank: t.first_p2p for t in traces}[0] == "send" and {t.rank: t.first_p2p for t in traces}[3] == "recv"
    assert [layout.role(r).pp_rank for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_overrides_and_no_metadata(tmp_path: Path) -> None:
    traces = traces_of(TraceJob(dp=4, pp=2, steps=2), tmp_path)
    given = job_layouts(traces, tp=2)["gen"]
    assert given.role(3).header_fields()["tp_rank"] == 1 and given.role(3).pp_size == 1
    bare = [dataclasses.replace(t, groups=(), p2p=()) for t in traces]
    assert not job_layouts(bare)["gen"].known
    assert with_layout(bare[0], job_layouts(bare)["gen"]).batches[0].header.pp_rank == -1


def test_documents_are_modern_kineto(tmp_path: Path) -> None:
    job = TraceJob(dp=2, pp=2, tp=2, steps=4, gpus_per_host=4, skew_ms=8.0, seed=3)
    docs = documents(job)
    d = docs[5]
    info = d["distributedInfo"]
    assert info["rank"] == 5 and info["world_size"] == 8 and d["baseTimeNanoseconds"] % 1000 == 0
    descs = {"default_pg", "TENSOR_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP", "PIPELINE_MODEL_PARALLEL_GROUP"}
    assert {g["pg_desc"] for g in info["pg_config"]} == descs
    kernels = [e for e in d["traceEvents"] if e.get("cat") == "kernel"]
    nccl = [e for e in kernels if e["name"].startswith("ncclDevKernel_")]
    assert nccl and all(json.loads(e["args"]["Process Group Ranks"]) for e in nccl)
    p2p = [e for e in nccl if e["args"]["Collective name"] in ("send", "recv")]
    assert p2p and all(("Dst Rank" in e["args"]) != ("Src Rank" in e["args"]) for e in p2p)
    steps = [e["name"] for e in d["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
    assert steps == [f"ProfilerStep#{10 + i}" for i in range(4)]
    # Hosts' clocks disagree by milliseconds: the same step starts apart on the two hosts.
    first = [min(e["ts"] for e in doc["traceEvents"] if e.get("name") == "ProfilerStep#10") for doc in docs]
    assert max(abs(first[0] - first[4]), abs(first[1] - first[5])) > 1000.0
    trace = parse_trace(write_traces(job, tmp_path)[5])
    assert (
        trace.steps == (10, 11, 12, 13)
        and trace.skipped_events == 0
        and trace.count(EventKind.COLLECTIVES) == len(nccl)
    )


def compute_ms(doc: dict) -> float:
    return (
        sum(e["dur"] for e in doc["traceEvents"] if e.get("cat") == "kernel" and not e["name"].startswith("nccl"))
        / 1000
    )


@pytest.mark.parametrize(
    ("job", "factor"),
    [
        (TraceJob(dp=4, pp=2, steps=3, fault="slow_stage"), 1.25),
        (TraceJob(dp=4, pp=2, tp=2, steps=3, fault="slow_worker", fault_rank=5), 2.35),
        (TraceJob(dp=4, ep=4, steps=3, fault="a2a_imbalance", fault_rank=2), None),
        (TraceJob(dp=4, pp=2, steps=3), 1.0),
    ],
)
def test_faults_act_on_their_culprits_only(job: TraceJob, factor: float | None) -> None:
    docs = documents(job)
    ms = np.array([compute_ms(d) for d in docs])
    culprits = list(job.culprits())
    others = [r for r in range(job.world_size) if r not in culprits]
    assert np.ptp(ms[others]) / np.median(ms[others]) < 0.05  # healthy peers agree within noise
    if job.fault == "healthy":
        assert culprits == []
    elif factor is not None:
        assert ms[culprits].mean() / np.median(ms[others]) == pytest.approx(factor, rel=0.04)
    else:  # twice the tokens: the expert GEMMs of one rank take twice as long
        expert = [
            sum(e["dur"] for e in d["traceEvents"] if e.get("cat") == "kernel" and e["name"] == EXPERT_GEMM)
            for d in docs
        ]
        assert expert[2] / np.median([expert[r] for r in others]) == pytest.approx(2.0, rel=0.05)


def test_slow_stage_makes_the_next_stages_wait_in_recv() -> None:
    """Physics: the stage after a slow one spends longer in ``recv`` than in a healthy run."""

    def recv_ms(job: TraceJob, rank: int) -> float:
        doc = documents(job)[rank]
        return sum(e["dur"] for e in doc["traceEvents"] if e.get("args", {}).get("Collective name") == "recv") / 1000

    healthy, slow = TraceJob(dp=1, pp=4, steps=3), TraceJob(dp=1, pp=4, steps=3, fault="slow_stage")
    assert recv_ms(slow, 0) > recv_ms(healthy, 0) * 1.2  # gradients come back later from the slow last stage


def test_iterations_carry_the_coordinates_from_metadata(tmp_path: Path) -> None:
    """Generated trace -> parser -> job layout -> headers -> the windower's iteration records."""
    job = TraceJob(dp=2, pp=2, tp=2, steps=4)
    write_traces(job, tmp_path / "job", compress=True)
    traces = [parse_trace(p, job="gen") for p in sorted((tmp_path / "job").iterdir())]
    layout = job_layouts(traces)["gen"]
    pipeline = OfflinePipeline()
    for t in traces:
        pipeline.add_all(with_layout(t, layout).batches)
    iterations = pipeline.finish().iterations
    assert len(iterations) >= 8 * 3
    for it in iterations:
        c = job.coordinates(it["rank"])
        assert (it["tp_rank"], it["pp_rank"], it["dp_rank"]) == (c["tp"], c["pp"], c["dp"])
    assert {r.rank for r in analyze_traces([tmp_path / "job"]).ranks} == set(range(8))


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path), "--dp", "2", "--pp", "2", "--steps", "2", "--fault", "slow_stage"]) == 0
    assert len(capsys.readouterr().out.split()) == 4 and (tmp_path / "rank-3.pt.trace.json").exists()


def test_p2p_peers_are_mapped_from_group_local_to_global_ranks() -> None:
    notes = GroupNotes(rank=6)
    notes.note("recv", "7", "PIPELINE_MODEL_PARALLEL_GROUP", (2, 6, 10, 14), 0)  # group-local: rank 2
    notes.note("send", "7", None, None, 2)  # group-local 2: rank 10
    notes.note("send", "0", None, None, 9)  # beyond the group's size: already global
    notes.note("allreduce", "3", "DATA_PARALLEL_GROUP", (4, 5, 6, 7), None)
    groups = notes.groups([ProcessGroup(name="0", ranks=tuple(range(16)), desc="default_pg")])
    assert {g.name: g.ops for g in groups} == {"0": {"send"}, "7": {"send", "recv"}, "3": {"allreduce"}}
    assert notes.p2p(groups) == (((2, 6), (6, 10), (6, 9)), "recv")


def test_knobs_left_at_zero_draw_nothing() -> None:
    """rank_spread, work_spread, stall_rate and the regression are drawn only when asked: jobs without them (the
    bench's, the seeds above) keep their random sequence."""
    base = TraceJob(dp=4, pp=2, steps=3, seed=5)
    assert simulate(base)[1] == simulate(dataclasses.replace(base, stall_ms=9.0))[1]
    for knob in ({"rank_spread": 0.02}, {"work_spread": 0.05}, {"stall_rate": 0.5}):
        assert simulate(dataclasses.replace(base, **knob))[1] != simulate(base)[1], knob
    assert TraceJob(fault="regression").expected_category == "job_regression"
    assert TraceJob(dp=2, fault="regression").culprits() == (0, 1)
    with pytest.raises(ValueError, match="stall_rate"):
        TraceJob(stall_rate=1.5)


def test_expected_categories() -> None:
    assert TraceJob(pp=2, fault="slow_stage").expected_category == "stage_imbalance"
    assert TraceJob(fault="slow_worker").expected_category == "gpu_slow"
    assert TraceJob().expected_category == "" and TraceJob().culprits() == ()


def _written(job: TraceJob, folder: Path) -> Path:
    write_traces(job, folder)
    return folder


@pytest.mark.parametrize(
    "job",
    [
        TraceJob(dp=4, pp=4, steps=6, seed=103, fault="slow_stage", names="none", skew_ms=9.0),
        TraceJob(dp=2, tp=2, pp=4, steps=8, seed=211, fault="slow_worker", fault_rank=11, names="mesh"),
        TraceJob(dp=4, tp=2, pp=2, steps=8, seed=313, noise=0.04),
        TraceJob(dp=2, tp=2, pp=2, steps=8, seed=417, fault="host_bound", fault_rank=6),
        TraceJob(dp=8, steps=8, seed=419, fault="host_bound", fault_rank=3, names="none"),
        TraceJob(dp=4, tp=2, pp=2, steps=8, seed=421, fault="slow_link", fault_rank=13),
        TraceJob(dp=2, tp=2, pp=2, steps=8, seed=423, fault="slow_link", fault_rank=6, names="none", skew_ms=9.0),
        TraceJob(dp=4, tp=4, steps=8, seed=433, gpus_per_host=6, inter_host_factor=2.5),
        TraceJob(dp=4, tp=4, steps=8, seed=437, gpus_per_host=6, inter_host_factor=2.5, fault="slow_worker",
                 fault_rank=5),
        TraceJob(dp=1, tp=4, pp=2, steps=8, seed=613, fault="late_start", fault_rank=2),
        TraceJob(dp=2, tp=2, pp=2, steps=8, seed=611, fault="late_start", fault_rank=0),
        TraceJob(dp=8, ep=4, steps=8, seed=617, fault="late_start", fault_rank=4),
        TraceJob(dp=4, tp=2, pp=2, steps=8, seed=619, fault="late_start", fault_rank=3, names="none", skew_ms=9.0),
        TraceJob(dp=2, pp=4, steps=12, seed=623, fault="late_start", fault_rank=1, skew_ms=9.0),
        TraceJob(dp=2, pp=4, steps=12, seed=629, noise=0.06),
        TraceJob(dp=3, tp=2, steps=8, seed=631, fault="late_start", fault_rank=3, noise=0.04),
        TraceJob(dp=2, tp=3, pp=2, layers=8, steps=8, seed=641, fault="late_start", fault_rank=4),
        TraceJob(dp=2, tp=3, pp=2, layers=8, steps=8, seed=643, gpus_per_host=4, inter_host_factor=3.0),
        TraceJob(dp=4, pp=2, steps=8, seed=647, fault="slow_link", fault_rank=6, names="none"),
        TraceJob(dp=2, pp=4, steps=10, seed=653, fault="host_bound", fault_rank=5),
        TraceJob(dp=16, steps=16, seed=709, rank_spread=0.015, noise=0.04),
        TraceJob(dp=2, pp=4, steps=24, seed=733, fault="regression"),
        TraceJob(dp=4, tp=2, pp=2, steps=24, seed=743, fault="regression", noise=0.05, stall_rate=0.05),
        TraceJob(dp=4, tp=2, pp=2, steps=14, seed=751, work_spread=0.1, noise=0.04, rank_spread=0.01),
        TraceJob(dp=2, pp=4, steps=10, seed=787, work_spread=0.08, fault="slow_worker", fault_rank=6),
        TraceJob(dp=2, pp=4, steps=10, seed=797, work_spread=0.08, fault="slow_worker", fault_rank=6),
        TraceJob(dp=4, pp=4, steps=10, seed=60145, fault="late_start", fault_rank=7, names="none", stall_rate=0.03,
                 stall_ms=4.0),
        TraceJob(dp=1, pp=8, steps=10, seed=99032, fault="host_bound", fault_rank=6),
        TraceJob(dp=1, pp=4, steps=10, seed=99038, fault="host_bound", fault_rank=2, work_spread=0.08),
        TraceJob(dp=1, pp=8, steps=10, seed=99041, noise=0.06, stall_rate=0.05, stall_ms=5.0),
    ],
    ids=[
        "pp4xdp4_slow_last_stage", "dpxppxtp_slow_worker", "healthy_noisy", "dp2xtp2xpp2_host_bound",
        "dp8_host_bound", "dp4xtp2xpp2_slow_link", "dp2xtp2xpp2_slow_link", "dp4xtp4_a_tp_group_across_hosts",
        "dp4xtp4_slow_worker_in_the_replica_across_hosts", "tp4xpp2_late_start", "dp2xtp2xpp2_late_start",
        "dp8xep4_late_start", "dp4xtp2xpp2_late_start", "dp2xpp4_late_start", "dp2xpp4_healthy_noisy",
        "dp3xtp2_late_start", "dp2xtp3xpp2_late_start", "dp2xtp3xpp2_a_tp_group_across_hosts", "dp4xpp2_slow_link",
        "dp2xpp4_host_bound", "dp16_healthy_gpus_1.5pct_apart",
        "dp2xpp4_regression", "dp4xtp2xpp2_regression_with_host_hiccups", "dp4xtp2xpp2_batches_of_varying_work",
        "dp2xpp4_slow_worker_varying_work", "dp2xpp4_slow_worker_varying_work_2", "dp4xpp4_late_start_with_hiccups",
        "dp1xpp8_host_bound", "dp1xpp4_host_bound_varying_work", "dp1xpp8_healthy_noisy_with_hiccups",
    ],
)  # fmt: skip
def test_acceptance_on_seeds_the_bench_does_not_use(job: TraceJob, tmp_path: Path) -> None:
    """A slow last stage is one stage_imbalance on its ranks (the first stage's data loader never
    flagged); one slow worker is gpu_slow on it alone; a launch-bound rank is host_slow on it alone (its
    GPU waits for its host; the ranks that wait for it in collectives are no culprits); a rank whose link
    slows its tensor- and data-parallel rings is link_slow on it alone, from kernel times (no link samples),
    and no rank of its late replica is a straggler; a healthy job has nothing, also where one replica's
    tensor-parallel group is split over two hosts (6 GPUs per host: its slower transfer makes the replica
    late at every data-parallel all-reduce, by its placement and no fault), and a slow GPU in that replica is
    still named. A first-stage rank that starts every step late is a straggler, and no rank that waits for it is
    named: its tensor-parallel partners wait at the step's first call only (tp4 x pp2: its lateness gathers in
    one call), the annotation of a partner that waited is no host fault of its own (dp2 x tp2 x pp2, where 4 peers
    per stage cannot score it and its own history names it), nor are its expert partners' (dp8 x ep4). In
    dp2 x pp4 every rank has one data-parallel partner and the whole late replica is late in its pairs: the
    straggler is the one of them that did not wait in its pipeline recv; a noisy healthy dp2 x pp4 job has
    nothing. Where a rank has one pair partner and a larger group (dp3 x tp2: its tensor pair and a ring of 3;
    dp2 x tp3 x pp2: its data-parallel pair and a tensor group of 3), the straggler is the one its larger
    group waited for, not the partners late with it; a tensor group of 3 split over two hosts makes its
    replica late in every pair, and held up no one: nothing. In dp4 x pp2 each stage's data-parallel ring has
    one equivalent (the other stage's): the slow one is its ring, held to the faster one. A launch-bound rank
    with one data-parallel partner per stage (dp2 x pp4: too few peers to compare) is late in its pair by its
    GPU's wait for launches: host_slow on that wait, not a straggler. Healthy GPUs differ by a percent or two:
    the slowest of 16 (4 % slower than the median) arrives last at every all-reduce, and is no finding. A job
    whose every rank computes 12 % longer from the middle of the run is a job_regression on every rank, also
    in a pipeline, whose stages wait in send/recv by their schedule (no rank is late for it), and with random
    host hiccups (one rank in 20 starts a step up to 5 ms late). Batches whose work varies by 10 % from step to
    step and replica to replica (sequences of varying length) make a different replica last each step: nothing;
    with a slow worker in a stage of 2 (dp2 x pp4), it alone is gpu_slow, and its stage-mate, whose replica's
    batch is larger in some steps (so is every stage's of that replica), makes no stage_imbalance. In dp4 x pp4
    with host hiccups, a second-stage rank that starts late makes every rank of its replica late at its
    data-parallel all-reduce, each held up a little in its send or recv: the straggler is the one that waited
    least there, and no other rank of its replica is named. In a pipeline of one rank per stage (dp1 x pp8,
    dp1 x pp4), a launch-bound rank has no peer, and its kernels take no longer than anyone's: it is host_slow on
    its GPU's wait for launches, the stage the others wait for; a noisy healthy dp1 x pp8 job has nothing."""
    write_traces(job, tmp_path / "job")
    findings = analyze_traces([tmp_path / "job"]).findings
    got = [(f["category"], sorted(f["ranks"])) for f in findings]
    if job.fault == "slow_link" and job.tp == 1:  # a ring of 4 has no member its other groups can single out
        # dp4 x pp2: the slow ring is the second stage's, which ends before the first stage's ring does: the job
        # steps as fast as without the fault, so fixing the ring saves nothing and nothing is named
        twin = analyze_traces([_written(dataclasses.replace(job, fault="healthy"), tmp_path / "twin")]).ranks
        assert max(r.mean_iteration_ms for r in twin) == pytest.approx(
            max(r.mean_iteration_ms for r in analyze_traces([tmp_path / "job"]).ranks), rel=1e-3
        )
        assert got == []
        return
    assert got == ([(job.expected_category, sorted(job.culprits()))] if job.expected_category else [])
    if job.fault == "host_bound":  # named on the GPU's wait for its host, not on any function the host ran
        assert findings[0]["function"] == LAUNCH_WAIT_FUNCTION
        assert "waiting for its host to launch kernels" in sentence(findings, None)


@pytest.mark.parametrize("seed", [9187, 673, 677])
def test_a_tensor_partner_that_waited_for_a_late_starter_is_not_host_slow(seed: int, tmp_path: Path) -> None:
    """dp2 x tp2 x pp4, rank 5 (second stage) starts every step late: its tensor partner, rank 4, waits in
    their first all-reduce of the step, inside its ``## forward ##`` annotation, which grows by that wait. With
    4 peers per stage, one of them the late partner, the wait does not stand out per class of collective; it
    does against the pair's other member. The late start costs the step about 1 % (the pipeline's bubble
    hides most of it): nothing may name rank 4."""
    job = TraceJob(dp=2, tp=2, pp=4, names="mesh", noise=0.05, steps=10, seed=seed, fault="late_start", fault_rank=5)
    write_traces(job, tmp_path / "job")
    findings = analyze_traces([tmp_path / "job"]).findings
    assert [f for f in findings if set(f["ranks"]) - {5}] == []


def test_a_slow_link_is_named_on_the_one_rank_its_slow_rings_share_and_nowhere_else(tmp_path: Path) -> None:
    """dp 4 x tp 2: rank 5's link slows its tensor-parallel pair's all-reduces (against 3 equivalent pairs)
    and its data-parallel ring (against the other tensor slot's ring, the only equivalent: held to the faster
    one): rank 5 is the one member both share. No straggler, no host annotation of theirs."""
    job = TraceJob(dp=4, tp=2, steps=8, seed=431, fault="slow_link", fault_rank=5)
    write_traces(job, tmp_path / "job")
    findings = analyze_traces([tmp_path / "job"]).findings
    assert [(f["category"], f["rank"], sorted(f["ranks"])) for f in findings] == [("link_slow", 5, [5])]
    assert findings[0]["metric"] == "transfer_ns" and findings[0]["value"] > 2 * findings[0]["peer_median"]
