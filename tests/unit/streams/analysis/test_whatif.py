"""What-if: the cause is what saves the most when brought to its peers' level, its cost is that saving, and
victims fall out (toy jobs whose true cost is the difference with the healthy job, ``pipeline_toy``)."""

from __future__ import annotations

import numpy as np
import pytest
from pipeline_toy import ToyJob, period_ns, run

from fleetscope.schemas.categories import Credit
from fleetscope.streams.analysis.replay import call_graph, replay, steady_period
from fleetscope.streams.analysis.roles import role_codes
from fleetscope.streams.analysis.timeline import compute_total_ns
from fleetscope.streams.analysis.whatif import (
    CLAIMED,
    Cause,
    Claim,
    _cuts,
    _rank_candidates,
    _savings,
    _stage_candidates,
    culprit,
    median_of_others,
    others_named,
    what_if,
)


def _priced(job: ToyJob) -> tuple[list[Cause], float, float]:
    """The causes of the job's last iteration, its replayed time and the true cost of its fault."""
    records, timelines = run(job)[-1]
    g = call_graph(records, timelines)
    healthy = ToyJob(dp=job.dp, pp=job.pp, allreduce_bytes=job.allreduce_bytes, jitter=job.jitter, seed=job.seed)
    return what_if(records, graph=g), replay(records, g).job_ns, period_ns(job) - period_ns(healthy)


def test_a_healthy_job_with_jitter_names_no_culprit() -> None:
    causes, job_ns, _ = _priced(ToyJob(dp=4, pp=4, jitter=0.02, seed=2))
    assert culprit(causes, job_ns) is None
    assert others_named(causes, job_ns) == []


def test_a_slow_worker_is_the_culprit_at_its_cost_and_its_pipeline_is_no_victim() -> None:
    """dp4 x pp4, one stage-1 rank computing 2x: its fix saves the true cost; the ranks that wait for it
    through the pipeline and the data-parallel ring save nothing once it is fixed."""
    causes, job_ns, true_ns = _priced(ToyJob(dp=4, pp=4, compute={5: 2.0}, jitter=0.01))
    top = culprit(causes, job_ns)
    assert top is not None and (top.kind, top.ranks) == ("rank_compute", (5,))
    assert top.saving_ns == pytest.approx(true_ns, rel=0.05)
    assert others_named(causes, job_ns) == []


def test_a_stage_slow_on_every_replica_is_the_stage() -> None:
    causes, job_ns, true_ns = _priced(ToyJob(dp=2, pp=4, compute={6: 1.5, 7: 1.5}))
    top = culprit(causes, job_ns)
    assert top is not None and (top.kind, top.stage, top.ranks) == ("stage_compute", 3, (6, 7))
    assert top.saving_ns == pytest.approx(true_ns, rel=0.05)
    assert all(c.saving_ns < top.saving_ns for c in causes if c.kind.startswith("rank_"))


def test_a_slow_ring_is_priced_against_rings_moving_the_same_bytes_only() -> None:
    """Stage 0's all-reduce 3x slow: with the same bytes as stage 1's it is the cause at its cost; with
    different bytes the rings are not compared and no transfer is a candidate."""
    causes, job_ns, true_ns = _priced(ToyJob(dp=4, ring={0: 3.0}))
    top = culprit(causes, job_ns)
    assert top is not None and (top.kind, top.ranks) == ("group_transfer", (0, 1, 2, 3))
    assert top.saving_ns == pytest.approx(true_ns, rel=0.05)
    unlike, _, _ = _priced(ToyJob(dp=4, ring={0: 3.0}, allreduce_bytes=(64 << 20, 32 << 20)))
    assert not [c for c in unlike if c.kind.endswith("_transfer")]


def test_host_work_after_the_last_call_is_the_ranks_host() -> None:
    causes, job_ns, true_ns = _priced(ToyJob(tail={1: 3e6}))
    top = culprit(causes, job_ns)
    assert top is not None and (top.kind, top.ranks) == ("rank_host", (1,))
    assert top.saving_ns == pytest.approx(true_ns, rel=0.05)


def test_the_median_of_the_others_leaves_each_value_out() -> None:
    values = np.array([[1.0, 5.0], [2.0, 5.0], [10.0, 5.0]])
    assert median_of_others(values).tolist() == [[6.0, 5.0], [5.5, 5.0], [1.5, 5.0]]
    assert median_of_others(np.array([[1.0], [3.0]])).tolist() == [[3.0], [1.0]]


def test_each_saving_is_its_cause_fixed_alone_and_a_like_graph_prices_the_same() -> None:
    """The savings of candidates priced together (float32 columns, each cutting only its own entries) are each
    candidate's own dense replay in float64, to float32 rounding; with the top fixed as the base, likewise; and
    the next iteration's graph built from the previous one's prices exactly as one built afresh."""
    job = ToyJob(dp=4, pp=4, compute={5: 2.0}, jitter=0.01)
    (r0, t0), (records, timelines) = run(job, 2)
    g = call_graph(records, timelines)
    roles = role_codes(records)
    stages = np.array([r["pp_rank"] for r in records])
    chosen = _rank_candidates(g, roles, 4) + _stage_candidates(g, stages)
    now = float(steady_period(g)[0])
    for base in (None, chosen[0]):
        fixed = _cuts(g, base)
        base_ns = float(steady_period(g, g.work_ns - fixed[0], g.transfer_ns - fixed[2], g.tail_ns - fixed[1])[0])
        for c, saving in zip(chosen, _savings(g, chosen, base), strict=True):
            work, tail, transfer = _cuts(g, c, fixed)
            alone = float(steady_period(g, g.work_ns - work, g.transfer_ns - transfer, g.tail_ns - tail)[0])
            assert saving == pytest.approx(base_ns - alone, abs=1e-6 * now)
    assert max(_savings(g, chosen)) > 0.1 * now  # the slow worker's fix saves much
    assert what_if(records, graph=call_graph(records, timelines, like=call_graph(r0, t0))) == what_if(records, graph=g)


def _bucketed(rank: int, slow: bool, healthy: bool = False) -> dict[str, object]:
    """One rank of a flat 4-rank job with two gradient buckets, as the windower writes it (times in us): with
    ``healthy`` False, rank 2 computes 2x and its peers compute their second bucket while they wait for it."""
    if healthy:
        gap, dur, less_gap = [10_000, 4_000], [1_000, 1_000], [0, 0]
    elif slow:
        gap, dur, less_gap = [20_000, 8_000], [1_000, 1_000], [0, 0]
    else:
        gap, dur, less_gap = [10_000, 0], [11_000, 9_000], [0, 4_000]
    return {"rank": rank, "pp_rank": 0, "dp_rank": rank, "tp_rank": 0, "host": "node000",
            "iteration_ns": (sum(gap) + sum(dur) + 1_000) * 1000, "function": ["nccl:allreduce[pg=dp0,<=32MiB]"],
            "calls": [2], "nbytes": [2 * (32 << 20)], "sync_function": [0, 0], "sync_seq": [0, 1], "sync_gap_us": gap,
            "sync_dur_us": dur, "sync_compute_less_gap_us": less_gap, "sync_tail_compute_us": 1_000}  # fmt: skip


def test_compute_a_peer_ran_while_it_waited_is_no_excess_of_the_slow_rank() -> None:
    """Rank 2 computes 29 ms, its peers 15 ms (their second bucket's 4 ms while they waited in the first): the
    slow rank's fix saves 14 ms, the true cost (31 ms against 17 healthy), not the 18 ms its work exceeds its
    peers' visible work by (they show none before their second call); the healthy job prices nothing."""
    records = [_bucketed(r, r == 2) for r in range(4)]
    assert compute_total_ns(records[0]) == 15e6 and compute_total_ns(records[2]) == 29e6
    top = culprit(what_if(records), 31e6)
    assert top is not None and (top.kind, top.ranks) == ("rank_compute", (2,))
    assert top.saving_ns == pytest.approx(14e6, rel=0.02) and top.excess_ns == pytest.approx(14e6, rel=0.02)
    healthy = [_bucketed(r, False, healthy=True) for r in range(4)]
    assert culprit(what_if(healthy), 17e6) is None
    assert np.isnan(compute_total_ns({**healthy[0], "sync_compute_less_gap_us": [], "sync_tail_compute_us": -1}))


def _overlapped(rank: int, slow_ms: float) -> dict[str, object]:
    """One rank of a flat 4-rank job whose two bucket all-reduces take ``slow_ms`` each while the backward
    computes on (its second bucket is ready 8 ms after the first, its GPU busy all along)."""
    dur = int(slow_ms * 1000)
    gap = [10_000, max(8_000 - dur, 0)]
    return {"rank": rank, "pp_rank": 0, "dp_rank": rank, "tp_rank": 0, "host": "node000",
            "iteration_ns": (sum(gap) + 2 * dur + 1_000) * 1000, "function": ["nccl:allreduce[pg=dp0,<=32MiB]"],
            "calls": [2], "nbytes": [2 * (32 << 20)], "sync_function": [0, 0], "sync_seq": [0, 1], "sync_gap_us": gap,
            "sync_dur_us": [dur, dur], "sync_compute_less_gap_us": [10_000 - gap[0], 8_000 - gap[1]],
            "sync_tail_compute_us": 1_000}  # fmt: skip


def test_a_claimed_slow_ring_the_backward_overlaps_costs_what_sticks_out_of_it() -> None:
    """All-reduces of 6 ms instead of 4 (a link's claim: 4 ms of transfer in excess, no like ring to measure
    it against): the first one ends inside the backward, which starts the second bucket no sooner for a
    faster one; only the last one's 2 ms stick out: the claim saves 2 ms (25 ms against 23 healthy), not 4.
    Without a claim a healthy job has no cause."""
    records = [_overlapped(r, 6.0) for r in range(4)]
    claims = [Claim(Credit.TRANSFER, (0, 1, 2, 3), 4e6)]
    causes = what_if(records, claims=claims)
    claimed = [c for c in causes if c.kind == CLAIMED[Credit.TRANSFER]]
    assert len(claimed) == 1 and claimed[0].saving_ns == pytest.approx(2e6, rel=0.02)
    assert claimed[0].residual_ns == pytest.approx(2e6, rel=0.02)
    assert culprit(causes, 25e6) is None and others_named(causes, 25e6) == []  # a claim is the detector's
    assert [c for c in what_if([_overlapped(r, 4.0) for r in range(4)]) if c.saving_ns > 0] == []


def _queued(rank: int, slow_ms: float) -> dict[str, object]:
    """One rank of a flat 4-rank job whose second bucket is ready 2 ms after the first all-reduce starts (its
    GPU then idles): the all-reduces of ``slow_ms`` each queue on the comm stream, back to back."""
    dur = int(slow_ms * 1000)
    return {"rank": rank, "pp_rank": 0, "dp_rank": rank, "tp_rank": 0, "host": "node000",
            "iteration_ns": (10_000 + 2 * dur + 1_000) * 1000, "function": ["nccl:allreduce[pg=dp0,<=32MiB]"],
            "calls": [2], "nbytes": [2 * (32 << 20)], "sync_function": [0, 0], "sync_seq": [0, 1],
            "sync_gap_us": [10_000, 0], "sync_dur_us": [dur, dur], "sync_compute_less_gap_us": [0, 2_000],
            "sync_tail_compute_us": 0}  # fmt: skip


def test_a_claimed_slow_ring_whose_buckets_queue_saves_all_its_excess_the_backward_does_not_overlap() -> None:
    """All-reduces of 6 ms instead of 4 whose second bucket was ready 2 ms into the first: at 4 ms the second
    starts 2 ms sooner, so the claim of 4 ms saves all 4 (23 ms against 19 healthy), not only the last one's 2
    (the 2 ms of compute that ran in the first all-reduce are no wait before the second). A healthy job: no
    cause."""
    records = [_queued(r, 6.0) for r in range(4)]
    claimed = [c for c in what_if(records, claims=[Claim(Credit.TRANSFER, (0, 1, 2, 3), 4e6)]) if c.kind != "rank_host"]
    assert [c.kind for c in claimed] == [CLAIMED[Credit.TRANSFER]]
    assert claimed[0].saving_ns == pytest.approx(4e6, rel=0.02)
    assert [c for c in what_if([_queued(r, 4.0) for r in range(4)]) if c.saving_ns > 0] == []


def test_a_claim_on_the_top_causes_own_work_is_priced_alone_one_elsewhere_beyond_the_top() -> None:
    """dp4, rank 1 running 3 ms of host work after its last call: its own work is the top cause. A host
    function's claim of 2 ms on rank 1 is a part of that work: fixing rank 1 whole leaves it nothing, but it
    saves its 2 ms alone, its price. The same claim on rank 2, which only waits for rank 1, saves nothing
    beyond the top, nor alone."""
    records, timelines = run(ToyJob(dp=4, pp=1, tail={1: 3e6}))[-1]
    claims = [Claim(Credit.WORK, (1,), 2e6), Claim(Credit.WORK, (2,), 2e6)]
    causes = what_if(records, graph=call_graph(records, timelines), claims=claims)
    assert causes[0].kind == "rank_host" and causes[0].ranks == (1,)
    on = {c.ranks: c for c in causes if c.kind == CLAIMED[Credit.WORK]}
    assert on[(1,)].residual_ns == pytest.approx(on[(1,)].saving_ns) == pytest.approx(2e6, rel=0.05)
    assert on[(2,)].saving_ns == on[(2,)].residual_ns == pytest.approx(0.0, abs=1e4)


def test_a_link_claim_on_a_ring_another_members_link_paces_saves_nothing_beyond_it() -> None:
    """All-reduces of 6 ms instead of 4, queued (``_queued``): rank 1's link claims 4 ms of its ring's transfer,
    rank 2's 2 ms (its samples peak low while the ring waits on rank 1's link). The ring moves at rank 1's pace:
    rank 1's claim saves its 4 ms beyond the other's too, rank 2's nothing beyond rank 1's, whatever it saves
    alone; claimed by itself, rank 2's link saves its 2 ms."""
    records = [_queued(r, 6.0) for r in range(4)]
    claims = [Claim(Credit.TRANSFER, (1,), 4e6), Claim(Credit.TRANSFER, (2,), 2e6)]
    claimed = {c.ranks: c for c in what_if(records, claims=claims) if c.kind == CLAIMED[Credit.TRANSFER]}
    assert claimed[(1,)].residual_ns == pytest.approx(4e6, rel=0.02)
    assert claimed[(2,)].saving_ns == pytest.approx(2e6, rel=0.02) and claimed[(2,)].residual_ns == 0.0
    alone = [c for c in what_if(records, claims=claims[1:]) if c.kind == CLAIMED[Credit.TRANSFER]]
    assert len(alone) == 1 and alone[0].residual_ns == pytest.approx(2e6, rel=0.02)


def test_link_claims_on_rings_of_their_own_are_each_priced_in_full() -> None:
    """Two ranks of a 4-rank job whose data-parallel ring is their only one, each claiming 2 ms of it: the same
    cut on the same ring, neither larger, so neither paces the other and each saves its 2 ms (no link is found
    free of cost because another claims as much)."""
    records = [_queued(r, 6.0) for r in range(4)]
    claims = [Claim(Credit.TRANSFER, (1,), 2e6), Claim(Credit.TRANSFER, (2,), 2e6)]
    claimed = [c for c in what_if(records, claims=claims) if c.kind == CLAIMED[Credit.TRANSFER]]
    assert [c.residual_ns for c in claimed] == pytest.approx([2e6, 2e6], rel=0.02)


def test_a_hosts_nic_claim_paces_another_hosts_link_claim_but_not_its_own_ranks() -> None:
    """Ranks 0-1 on node000, 2-3 on node001; node000's NIC claims 4 ms of the ring's transfer, rank 2's and rank
    1's links 2 ms each. Rank 2's ring moves at node000's pace: its claim saves nothing beyond it. Rank 1's
    claim may be what node000's claim sees from its host: it is not paced by it and saves its 2 ms."""
    records = [{**_queued(r, 6.0), "host": f"node00{r // 2}"} for r in range(4)]
    claims = [Claim(Credit.TRANSFER, (0, 1), 4e6), Claim(Credit.TRANSFER, (2,), 2e6), Claim(Credit.TRANSFER, (1,), 2e6)]
    claimed = {c.ranks: c for c in what_if(records, claims=claims) if c.kind == CLAIMED[Credit.TRANSFER]}
    assert claimed[(0, 1)].residual_ns == pytest.approx(4e6, rel=0.02)
    assert claimed[(2,)].saving_ns == pytest.approx(2e6, rel=0.02) and claimed[(2,)].residual_ns == 0.0
    assert claimed[(1,)].residual_ns == pytest.approx(2e6, rel=0.02)
