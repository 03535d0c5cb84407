"""Blame by what-if: a signal stands where fixing its ranks saves time, priced at that saving; victims, healthy
rings and the ranks of a slow stage fall out of the arithmetic (toy jobs run by their own physics,
``pipeline_toy``: a slow rank delays every member of its collectives, a stage's p2p partners wait for it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pipeline_toy import ToyJob, period_ns, run

from fleetscope.schemas import Category, FunctionKind
from fleetscope.streams.analysis.attribution import (
    AttributionConfig,
    Priced,
    SavingHistory,
    attribute,
    claims_of,
    credits_of,
    priced_ranks,
)
from fleetscope.streams.analysis.links import RING_PACE_METRIC
from fleetscope.streams.analysis.replay import call_graph
from fleetscope.streams.analysis.roles import role_codes
from fleetscope.streams.analysis.signals import RankSignal
from fleetscope.streams.analysis.whatif import CLAIMED, Cause, compared_rings, what_if

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
    sig = _signal(Category.HOST_SLOW, 3, loss_ns=7e6)
    history = SavingHistory(8)
    credits = credits_of([])
    history.observe(0, credits)
    assert attribute([sig], credits, history, 1e6, Priced()) == [sig]
    assert attribute([sig], credits, history, 1e6, Priced(work=frozenset({3}))) == []  # priced, saves nothing


def test_the_saving_history_is_a_mean_over_its_window_and_forgets_ranks_that_stopped_saving() -> None:
    from fleetscope.streams.analysis.whatif import Cause

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
    """One like-ring rule (``whatif.compared_rings``): two stages' rings moving the same bytes are compared, so
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


def test_a_signal_is_priced_at_what_its_cause_saves_alone_and_no_more_than_beyond_the_top() -> None:
    """Rank 3 host-slow. In an iteration that a one-off glitch on rank 7 holds (the top, 3 ms), fixing rank 3
    saves nothing now, though 2 ms beyond the glitch: it is still named (its saving beyond the top), at 0. Its
    stage, which holds rank 7, saves 7 ms alone but 1.4 ms beyond the glitch: 1.4 ms is the price it gives.
    Where rank 3 is the top, its saving; a healthy iteration (no cause) drops the signal."""
    sig, priced = _signal(Category.HOST_SLOW, 3), Priced(work=frozenset(range(8)))
    glitch = Cause("rank_host", (7,), "", -1, 3e6, 3e6, 3e6)
    mine = Cause("rank_host", (3,), "", -1, 2.5e6, 0.0, 2e6)
    stage = Cause("stage_compute", tuple(range(8)), "", 0, 9e6, 7e6, 1.4e6)

    def judged(causes: list[Cause]) -> list[RankSignal]:
        history, credits = SavingHistory(), credits_of(causes)
        history.observe(0, credits)
        return attribute([sig], credits, history, 1e7, priced)

    (kept,) = judged([glitch, mine])
    assert kept.loss_ns == 0.0
    (kept,) = judged([glitch, mine, stage])
    assert kept.loss_ns == pytest.approx(1.4e6)
    (kept,) = judged([Cause("rank_host", (3,), "", -1, 2.5e6, 2e6, 2e6)])
    assert kept.loss_ns == pytest.approx(2e6)
    assert judged([]) == []
