"""Blame by what-if: a signal stands where fixing its ranks saves time, priced at that saving; victims, healthy
rings and the ranks of a slow stage fall out of the arithmetic (toy jobs run by their own physics,
``pipeline_toy``: a slow rank delays every member of its collectives, a stage's p2p partners wait for it)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from pipeline_toy import ToyJob, period_ns, run

from fleetscope.schemas import Category, FunctionKind
from fleetscope.schemas.categories import REGISTRY
from fleetscope.streams.analysis.attribution import (
    CREDITED_BY,
    AttributionConfig,
    Priced,
    SavingHistory,
    attribute,
    claims_of,
    credits_of,
    iteration_noise_ns,
    priced_ranks,
)
from fleetscope.streams.analysis.findings import FindingTracker
from fleetscope.streams.analysis.links import LINK_SAMPLE_METRICS, RING_PACE_METRIC, compared_rings
from fleetscope.streams.analysis.replay import call_graph
from fleetscope.streams.analysis.roles import role_codes
from fleetscope.streams.analysis.signals import RankSignal
from fleetscope.streams.analysis.whatif import CLAIMED, Cause, what_if

BUDGET_SHARE = 0.01


def _signal(category: str, rank: int, loss_ns: float = 5e6, **fields: Any) -> RankSignal:
    return RankSignal(
        rank=rank, host="", category=category, function=fields.pop("function", "compute"),
        metric=fields.pop("metric", "mean_ns"), value=1.0, peer_median=1.0, score=9.0, loss_ns=loss_ns, **fields,
    )  # fmt: skip


def _judged(job: ToyJob, signals: list[RankSignal], iterations: int = 6) -> list[RankSignal]:
    """``signals`` raised in every iteration of ``job``; what attribution keeps of them in its last."""
    history = SavingHistory(AttributionConfig().window)
    kept: list[RankSignal] = []
    for records, timelines in run(job, iterations):
        records = [{**r, "kind": [int(FunctionKind.COLLECTIVE)] * len(r["function"])} for r in records]
        roles = role_codes(records)
        graph = call_graph(records, timelines)
        credits = credits_of(what_if(records, roles, graph))
        history.observe(int(records[0].get("iteration", len(kept))), credits)
        budget = BUDGET_SHARE * float(np.median([r["iteration_ns"] for r in records]))
        kept = attribute(signals, credits, history, budget, priced_ranks(records, roles, graph))
    return kept


def _true_cost(job: ToyJob) -> float:
    healthy = ToyJob(dp=job.dp, pp=job.pp, allreduce_bytes=job.allreduce_bytes, jitter=job.jitter, seed=job.seed)
    return period_ns(job) - period_ns(healthy)


def test_a_slow_workers_pipeline_partner_is_no_culprit_and_the_worker_is_priced_at_its_cost() -> None:
    """dp4 x pp4, rank 5 (stage 1) computing 2x: the last stage of its pipeline (rank 13) waits for it in its
    receives and arrives late at its ring; a late-arrival rule would name it. Its own fix saves nothing."""
    job = ToyJob(dp=4, pp=4, compute={5: 2.0}, jitter=0.01)
    kept = _judged(job, [_signal(Category.GPU_SLOW, 5), _signal(Category.STRAGGLER, 13)])
    assert [(s.category, s.rank) for s in kept] == [(Category.GPU_SLOW, 5)]
    assert kept[0].loss_ns == pytest.approx(_true_cost(job), rel=0.2)


def test_a_stage_slow_on_every_replica_is_the_stage_not_one_of_its_ranks() -> None:
    job = ToyJob(dp=2, pp=4, compute={6: 1.5, 7: 1.5})
    kept = _judged(job, [_signal(Category.GPU_SLOW, 6)])
    assert [(s.category, s.member_ranks()) for s in kept] == [(Category.STAGE_IMBALANCE, (6, 7))]
    assert kept[0].loss_ns == pytest.approx(_true_cost(job), rel=0.2)


def test_rings_of_stages_moving_different_bytes_are_not_slow_and_a_slow_ring_among_like_ones_is() -> None:
    """Each stage reduces its own layers: its ring moves its own bytes at its own pace. Against rings of
    other sizes there is no pace to bring it to; among rings of the same bytes the slow one saves time."""
    sizes = dict(allreduce_bytes=(8 << 20, 16 << 20, 32 << 20, 64 << 20), allreduce_ns=(4e5, 8e5, 1.6e6, 3.2e6))
    rings = [_signal(Category.LINK_SLOW, -1, metric=RING_PACE_METRIC, ranks=(2 * s, 2 * s + 1)) for s in range(4)]
    assert _judged(ToyJob(dp=2, pp=4, **sizes), rings) == []
    slow = ToyJob(dp=2, pp=4, ring={0: 3.0})
    assert [s.member_ranks() for s in _judged(slow, rings)] == [(0, 1)]


def test_a_signal_the_replay_cannot_price_keeps_its_own_evidence_and_loss() -> None:
    """A rank without a peer of its role has no level to be brought to: the detector's word stands."""
    sig = _signal(Category.GPU_SLOW, 3, loss_ns=7e6)
    history = SavingHistory(8)
    credits = credits_of([])
    history.observe(0, credits)
    assert attribute([sig], credits, history, 1e6, Priced()) == [sig]
    assert attribute([sig], credits, history, 1e6, Priced(work=frozenset({3}))) == []  # priced, saves nothing


def test_the_saving_history_is_a_mean_over_its_window_and_forgets_ranks_that_stopped_saving() -> None:
    history = SavingHistory(window=4)
    for it in range(4):
        saving = 8e6 if it % 2 == 0 else 0.0
        causes = [Cause("rank_host", (3,), "", -1, saving, saving, saving)] if saving else []
        history.observe(it, credits_of(causes))
    assert history.mean(("work", 3)) == pytest.approx(4e6)
    for it in range(4, 9):
        history.observe(it, credits_of([]))
    assert history.mean(("work", 3)) == 0.0 and not history._entries


def test_transfers_are_priced_exactly_where_the_what_if_compares_rings() -> None:
    """One like-ring rule (``links.compared_rings``): two stages' rings moving the same bytes are compared, so
    a slow one is a candidate and its ranks' transfers are priced; moving different bytes, neither ring is
    (the pipeline's transfers, alike in every replica, still are)."""
    for ring_bytes, compared in (((32 << 20, 32 << 20), True), ((64 << 20, 32 << 20), False)):
        records, timelines = run(ToyJob(dp=4, ring={0: 3.0}, allreduce_bytes=ring_bytes), 1)[-1]
        graph = call_graph(records, timelines)
        rings = graph.members == 4
        assert rings.sum() == 2 and (compared_rings(graph)[rings] == compared).all()
        transfers = [c for c in what_if(records, graph=graph) if c.kind == "group_transfer"]
        assert bool(transfers) is compared
        assert priced_ranks(records, role_codes(records), graph).transfer == frozenset(range(8))


def test_a_signal_with_no_peer_to_price_is_its_own_excess_replayed() -> None:
    """A flat ring's link_slow (no like ring: not priced by a peer) claims 4 ms; the replay of that claim saves
    2 ms: its loss becomes 2 ms. An iteration without timelines (no claim priced) keeps the detector's loss."""
    sig = _signal(Category.LINK_SLOW, -1, 4e6, ranks=(0, 1, 2, 3), subject="group:dp0", metric="pcie_cv")
    (claim,) = claims_of([sig], Priced())
    assert (claim.ranks, claim.excess_ns) == ((0, 1, 2, 3), 4e6)
    replayed = Cause(kind=CLAIMED[claim.what], ranks=claim.ranks, group="", stage=-1, excess_ns=4e6,
                     saving_ns=2e6, residual_ns=2e6)  # fmt: skip
    history = SavingHistory()
    (kept,) = attribute([sig], credits_of([replayed]), history, 1e5, Priced())
    assert kept.loss_ns == 2e6 and kept.evidence["replayed_saving_ns"] == 2e6
    (unpriced,) = attribute([sig], credits_of([]), history, 1e5, Priced())
    assert unpriced.loss_ns == 4e6
    nothing = replace(replayed, saving_ns=0.0, residual_ns=0.0)  # its own fix saves nothing now: it stands not
    assert attribute([sig], credits_of([nothing]), SavingHistory(), 1e5, Priced()) == []


def test_a_links_samples_claim_the_transfer_it_would_save_at_its_peers_pace_also_among_like_rings() -> None:
    """Rank 5's PCIe peaks low in its samples (``_slow_links``: 3 ms of transfer at its peers' pace); its rings
    have like rings (priced by their pace) whose pace hides it (saving 0): its claim, replayed, saves 1 ms, its
    loss. Where the claim saves nothing in this iteration, it stands not, whatever it saved before."""
    sig = _signal(Category.LINK_SLOW, 5, 3e6, metric=LINK_SAMPLE_METRICS[1])
    priced = Priced(transfer=frozenset(range(8)))
    (claim,) = claims_of([sig], priced)
    assert (claim.ranks, claim.excess_ns) == ((5,), 3e6)
    history = SavingHistory()
    for it, saving in enumerate((1e6, 0.0)):
        credits = credits_of([Cause(CLAIMED[claim.what], (5,), "", -1, 3e6, saving, saving)])
        history.observe(it, credits)
        kept = attribute([sig], credits, history, 1e6, priced)
        assert [s.loss_ns for s in kept] == ([1e6] if saving else [])


_CAUSE_OF = {Category.GPU_SLOW: "rank_compute", Category.STRAGGLER: "rank_compute", Category.HOST_SLOW: "claimed_work",
             Category.LINK_SLOW: "group_transfer", Category.STAGE_IMBALANCE: "stage_compute"}  # fmt: skip
"""The what-if cause that credits a signal of each priced category (``CREDITED_BY``)."""


def _saving_signal(category: Category) -> tuple[RankSignal, list[int]]:
    """A signal of ``category`` and the ranks its cause covers: a stage's two ranks, or rank 3."""
    if category == Category.STAGE_IMBALANCE:
        return _signal(category, -1, ranks=(2, 3), subject="stage:1", evidence={"stage": 1}), [2, 3]
    return _signal(category, 3), [3]


@pytest.mark.parametrize("category", list(REGISTRY))
def test_a_finding_opens_while_its_saving_stands_out_from_the_jobs_noise_and_closes_when_it_no_longer_does(
    category: Category,
) -> None:
    """Steps that jitter by 2 ms (one checkpoint 50 ms long aside): a saving of 4 ms in one iteration only
    opens nothing, and carries no signal of the iterations after it that save nothing (a one-off hiccup on a
    victim of a late rank); in 6 iterations in a row 10 ms opens the finding; then 0.2 ms a step, twice the
    budget's floor but 1.6 ms over 8 iterations, within the noise, closes it (with no noise, it would stay
    open).
    A job-level category is not the replay's: its signal passes whatever the savings (its own test opens it)."""
    noise = iteration_noise_ns([100e6, 98e6, 102e6] * 3 + [150e6])
    assert noise == pytest.approx(2e6)
    if category not in CREDITED_BY:
        assert REGISTRY[category].job_level
        sig = _signal(category, -1, ranks=(0, 1))
        history = SavingHistory(8)
        history.observe(0, credits_of([]))
        assert attribute(
            [sig], credits_of([]), history, 1e6, Priced(frozenset({0, 1}), frozenset({0, 1})), None, noise
        ) == [sig]
        return
    sig, ranks = _saving_signal(category)
    priced = Priced(work=frozenset(ranks), transfer=frozenset(ranks))
    history, tracker = SavingHistory(AttributionConfig().window), FindingTracker("job")
    savings = [0.0] * 9 + [4e6] + [0.0] * 8 + [10e6] * 6 + [0.2e6] * 20
    opened: list[int] = []
    closed: list[int] = []
    for it, saving in enumerate(savings):
        stage = 1 if category == Category.STAGE_IMBALANCE else -1
        credits = credits_of([Cause(_CAUSE_OF[category], tuple(ranks), "", stage, saving, saving, saving)])
        history.observe(it, credits)
        kept = attribute([sig], credits, history, 1e6, priced, None, noise)
        assert all(s.category == category for s in kept)
        for record in tracker.observe(it, kept):
            (opened if record["status"] == "open" else closed if record["status"] == "closed" else []).append(it)
    assert opened == [20] and len(closed) == 1 and closed[0] > 23


def test_the_lateness_of_a_late_ranks_victim_names_the_late_rank_and_a_healthy_jobs_names_none() -> None:
    """dp4 x pp4, rank 1 (stage 0) running 3 ms of host work after its last call (it starts each step late):
    the last stage of its pipeline (rank 13) waits for it in its receives and is the one the arrival order
    names late; its own fix saves nothing, and the lateness is the rank's whose own fix saves the most,
    priced at its cost. The healthy twin, the same signal raised: nothing (its ranks' own fixes save less
    than the budget a detector's signal must reach)."""
    job = ToyJob(dp=4, pp=4, tail={1: 3e6}, jitter=0.01)
    kept = _judged(job, [_signal(Category.STRAGGLER, 13, loss_ns=3e6)])
    assert [(s.category, s.rank, s.evidence["waited_by"]) for s in kept] == [(Category.STRAGGLER, 1, [13])]
    assert kept[0].loss_ns == pytest.approx(_true_cost(job), rel=0.2)
    healthy = ToyJob(dp=4, pp=4, jitter=0.01)
    assert _judged(healthy, [_signal(Category.STRAGGLER, 13, loss_ns=3e6)]) == []


def test_a_victims_straggler_and_a_host_signal_its_stage_credits_are_dropped_the_culprits_kept() -> None:
    """The judge's arithmetic on one iteration's causes (sim dp x tp and tg dp x tp x pp cases of the quality
    bench): rank 16 late by 25 ms whose own fix saves 3.5 ms mostly waited; a late starter saving 5.6 ms of
    5.6 ms late is the straggler; a host signal on rank 11 whose claim saves 0.1 ms (its stage's compute saves
    as little) is dropped, rank 10's claim saving 2 ms (its rank's own work as much) keeps its; a stage saving
    0.4 ms of a 0.77 ms budget names no stage."""
    causes = [
        Cause("rank_compute", (16,), "", -1, 5e6, 3.5e6, 3.5e6),
        Cause("rank_compute", (1,), "", -1, 5.6e6, 5.6e6, 5.6e6),
        Cause("claimed_work", (10,), "", -1, 3.8e6, 2e6, 2e6),
        Cause("rank_host", (10,), "", -1, 2e6, 2e6, 2e6),
        Cause("claimed_work", (11,), "", -1, 3.8e6, 1e5, 1e5),
        Cause("stage_compute", (10, 11), "", 1, 1e5, 1e5, 1e5),
        Cause("stage_compute", (12, 13), "", 2, 4e5, 4e5, 4e5),
    ]
    credits = credits_of(causes)
    history = SavingHistory(8)
    history.observe(0, credits)
    signals = [
        _signal(Category.STRAGGLER, 16, loss_ns=25e6),
        _signal(Category.STRAGGLER, 1, loss_ns=5.6e6),
        _signal(Category.HOST_SLOW, 10, loss_ns=3.8e6),
        _signal(Category.HOST_SLOW, 11, loss_ns=3.8e6),
        _signal(Category.STRAGGLER, 13, loss_ns=4e6),
    ]
    priced = Priced(work=frozenset({1, 10, 11, 12, 13, 16}))
    kept = attribute(signals, credits, history, 0.77e6, priced)
    assert [(s.category, s.rank, s.loss_ns) for s in kept] == [
        (Category.STRAGGLER, 1, 5.6e6),
        (Category.HOST_SLOW, 10, 2e6),
    ]
    alone = credits_of(causes[:1])  # rank 16's own 3.5 ms the top: judged a wait, not named by its victims either
    assert attribute(signals[:1], alone, SavingHistory(8), 0.77e6, priced) == []


def test_a_signal_is_priced_at_what_its_cause_saves_alone_and_no_more_than_beyond_the_top() -> None:
    """Rank 3 gpu-slow. In an iteration that a one-off glitch on rank 7 holds (the top, 3 ms), fixing rank 3
    saves nothing now, though 2 ms beyond the glitch: it is still named (its saving beyond the top), at 0. Its
    stage, which holds rank 7, saves 7 ms alone but 1.4 ms beyond the glitch: 1.4 ms is the price it gives.
    Where rank 3 is the top, its saving; a healthy iteration (no cause) drops the signal."""
    sig, priced = _signal(Category.GPU_SLOW, 3), Priced(work=frozenset(range(8)))
    glitch = Cause("rank_host", (7,), "", -1, 3e6, 3e6, 3e6)
    mine = Cause("rank_compute", (3,), "", -1, 2.5e6, 0.0, 2e6)
    stage = Cause("stage_compute", tuple(range(8)), "", 0, 9e6, 7e6, 1.4e6)

    def judged(causes: list[Cause]) -> list[RankSignal]:
        history, credits = SavingHistory(), credits_of(causes)
        history.observe(0, credits)
        return attribute([sig], credits, history, 1e7, priced)

    (kept,) = judged([glitch, mine])
    assert kept.loss_ns == 0.0
    (kept,) = judged([glitch, mine, stage])
    assert kept.loss_ns == pytest.approx(1.4e6)
    (kept,) = judged([Cause("rank_compute", (3,), "", -1, 2.5e6, 2e6, 2e6)])
    assert kept.loss_ns == pytest.approx(2e6)
    assert judged([]) == []


def test_a_host_functions_claim_stands_out_from_its_own_savings_noise_not_the_jobs_whole_work() -> None:
    """Micro-batches of random lengths make the job's steps vary by 200 ms (its noise); rank 2's data loader
    stalls 30 ms a step (``claims_its_excess``: its claim, not its rank's whole work, prices it), saving 30 ms
    in two steps of three, the third on another rank's longer batch: it stands out from its own savings and
    the finding opens, where the job's noise would hide it. A ``## backward ##`` annotation 11 ms longer on a
    rank that waited inside it for its tensor-parallel partner (late by as much) saves 0.04 ms replayed: less
    than half its lateness, it waited, and is dropped, though over the budget's floor and its own noise."""
    assert REGISTRY[Category.HOST_SLOW].claims_its_excess and not REGISTRY[Category.GPU_SLOW].claims_its_excess
    noise, budget = 200e6, 12e6
    sig = _signal(Category.HOST_SLOW, 2, 30e6, function="dataloader.next", evidence={"excess_ns": 30e6})
    priced = Priced(work=frozenset(range(4)))
    assert [(c.ranks, c.excess_ns) for c in claims_of([replace(sig, loss_ns=0.0)], priced)] == [((2,), 30e6)]
    history, tracker, opened = SavingHistory(AttributionConfig().window), FindingTracker("job"), []
    for it in range(12):
        saving = 0.0 if it % 3 == 2 else 30e6
        credits = credits_of([Cause("claimed_work", (2,), "", -1, 30e6, saving, saving),
                              Cause("rank_compute", (it % 4,), "", -1, 400e6, 400e6, 400e6)])  # fmt: skip
        history.observe(it, credits)
        kept = attribute([sig], credits, history, budget, priced, None, noise)
        opened += [it for u in tracker.observe(it, kept) if u["status"] == "open"]
    assert opened and opened[0] <= 6
    echo = _signal(Category.HOST_SLOW, 6, 11e6, function="## backward ##", evidence={"excess_ns": 11e6})
    history = SavingHistory(AttributionConfig().window)
    for it in range(8):
        credits = credits_of([Cause("claimed_work", (6,), "", -1, 11e6, 4e4, 4e4 + 1e4 * (it % 2))])
        history.observe(it, credits)
        assert attribute([echo], credits, history, 0.27e6, priced, None, 4e4) == []


def test_a_host_claim_judges_the_signal_and_its_ranks_work_at_its_peers_level_prices_it() -> None:
    """A host function 64 ms over its peers' that ran partly while its rank's GPU computed: its claim, replayed
    as work between calls spread in proportion, saves 64 ms, but the rank's own work brought to its peers'
    saves 44 ms: the finding's price is 44 ms. A rank with no peer of its role keeps its claim's."""
    sig = _signal(Category.HOST_SLOW, 2, 64e6, function="backward", evidence={"excess_ns": 64e6})
    causes = [Cause("claimed_work", (2,), "", -1, 64e6, 64e6, 64e6), Cause("rank_host", (2,), "", -1, 44e6, 44e6, 44e6)]
    for priced, price in ((Priced(work=frozenset(range(4))), 44e6), (Priced(), 64e6)):
        history, credits = SavingHistory(), credits_of(causes)
        history.observe(0, credits)
        (kept,) = attribute([sig], credits, history, 1e6, priced)
        assert kept.loss_ns == price
