"""Pipeline stages compared with each other: a stage that computes longer than the others.

Every rank of a slow stage is slow alike, so no rank stands out within the stage; the stage stands
out against the other stages, which pay for it waiting in their p2p receives and sends. The finding
names the stage, its ranks, its compute excess and the time the other stages wait for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fleetscope.schemas import FunctionKind
from fleetscope.schemas.vocabulary import LAUNCH_WAIT_FUNCTION
from fleetscope.streams.analysis.peermatrix import PeerMatrix
from fleetscope.streams.analysis.signals import RankSignal, ScoringConfig
from fleetscope.streams.analysis.stats import F64, I64

P2P_PREFIXES = ("nccl:send[", "nccl:recv[")
"""Pattern names of pipeline p2p transfers (``collective_function_name`` of send/recv)."""


def staged(stages: Iterable[int]) -> bool:
    """Pipeline stages are known and there are several to compare."""
    stages = set(stages)
    return len(stages) >= 2 and -1 not in stages


def compute_ns(rec: dict[str, Any]) -> int:
    """A record's compute-kernel time in its iteration."""
    return sum(t for t, k in zip(rec["total_ns"], rec["kind"], strict=True) if k == FunctionKind.COMPUTE)


def runs_kernels(records: Sequence[dict[str, Any]]) -> bool:
    """Some rank ran a compute kernel: a GPU job (its first record has kernels), not a CPU-only one, whose
    collectives are CPU work that a shared host's contention slows like any other."""
    return any(np.any(np.asarray(r["kind"]) == FunctionKind.COMPUTE) for r in records)


def p2p_ns(rec: dict[str, Any]) -> int:
    """A record's time in pipeline p2p transfers (waiting for the neighbouring stages included)."""
    kinds, names = rec["kind"], rec["function"]
    return sum(
        t
        for t, k, f in zip(rec["total_ns"], kinds, names, strict=True)
        if k == FunctionKind.COLLECTIVE and f.startswith(P2P_PREFIXES)
    )


def _slow_member(
    rec: dict[str, Any], compute: float, others: float, stage: int, size: int, cfg: ScoringConfig
) -> RankSignal:
    """A rank that makes its stage slow while its stage-mates are not: gpu_slow on it, compared with
    the other stages (its stage holds fewer ranks than a peer group needs to compare them inside it)."""
    rank = int(rec["rank"])
    return RankSignal(
        rank=rank, host=str(rec["host"]), category="gpu_slow", function="compute", metric="compute_ns",
        value=compute, peer_median=others, score=(compute / others - 1) / cfg.min_relative_gap,
        loss_ns=compute - others, subject=f"rank:{rank}",
        evidence={"stage": stage, "compared_with": "the other stages' median", "stage_ranks": size,
                  "excess_ns": compute - others},
    )  # fmt: skip


def _replica_compute(
    records: Sequence[dict[str, Any]], comp: F64, stage_of: I64, slowest: int, members: I64, others: float
) -> F64:
    """Per member of the slowest stage, what the other stages of its own replica compute (their ranks' median):
    a replica's micro-batches pass through all its stages, so a batch with more work (sequences of varying
    length) makes every stage of that replica compute longer; ``others`` where its replica is unknown."""
    dp = np.array([int(rec.get("dp_rank", -1)) for rec in records], dtype=np.int64)
    rest = np.flatnonzero((stage_of != slowest) & (dp >= 0))
    rest = rest[np.argsort(dp[rest], kind="stable")]
    replicas, starts = np.unique(dp[rest], return_index=True)
    median = dict(zip(replicas.tolist(), (float(np.median(c)) for c in np.split(comp[rest], starts[1:])), strict=True))
    return np.array([median.get(int(dp[i]), others) for i in members.tolist()], dtype=np.float64)


def score_stages(
    records: Sequence[dict[str, Any]], config: ScoringConfig | None = None, compute: PeerMatrix | None = None
) -> list[RankSignal]:
    """The stage whose ranks compute longer than the other stages' (stage_imbalance), or none; or,
    where only some of that stage's ranks compute longer, gpu_slow on those ranks.

    1. Per stage, the median compute time of its ranks; the slowest stage against the median of the
       others: its relative gap and its excess. 2. The time the other stages wait for it: their p2p
       time minus the slow stage's (the slow stage waits least). 3. Time saved if fixed (what-if,
       approximated): the compute excess, bounded by that wait when p2p transfers were recorded (a
       stage whose excess the others do not wait for costs nothing). ``compute``, when given, holds
       the compute kernels' ``total_ns`` of every record.
    """
    cfg = config or ScoringConfig()
    pp = [int(rec.get("pp_rank", -1)) for rec in records]
    stages = dict.fromkeys(pp)
    if not staged(stages):
        return []
    if compute is not None:
        comp = np.nansum(compute.features["total_ns"], axis=1)
    else:
        comp = np.array([compute_ns(rec) for rec in records], dtype=np.float64)
    stage_of = np.array(pp, dtype=np.int64)
    budget = cfg.min_loss_fraction * float(np.median([r["iteration_ns"] for r in records]))
    med, slowest, others = _slowest_stage(comp, stage_of)
    excess = med[slowest] - others
    if others <= 0 or excess / others < cfg.min_relative_gap or excess < budget:
        return _launch_bound(records, cfg, comp, stage_of, budget)
    gap = med[slowest] / others - 1
    members = np.flatnonzero(stage_of == slowest)
    slow = members[comp[members] >= _replica_compute(records, comp, stage_of, slowest, members, others)
                   * (1 + cfg.min_relative_gap)]  # fmt: skip
    if 0 < slow.size < members.size:  # not the stage: some of its ranks, too few to be told apart inside it
        return [_slow_member(records[i], comp[i], others, slowest, members.size, cfg) for i in slow.tolist()]
    p2p = np.array([p2p_ns(rec) for rec in records], dtype=np.float64)
    p2p_med = {s: float(np.median(p2p[stage_of == s])) for s in stages}
    waits = {s: max(v - p2p_med[slowest], 0.0) for s, v in p2p_med.items() if s != slowest}
    wait = float(np.median(list(waits.values())))
    saved = min(excess, wait) if p2p_med[slowest] > 0 or wait > 0 else excess
    ranks = tuple(sorted(int(rec["rank"]) for rec, s in zip(records, pp, strict=True) if s == slowest))
    return [
        RankSignal(
            rank=-1, host="", category="stage_imbalance", function="compute", metric="compute_ns",
            value=med[slowest], peer_median=others, score=gap / cfg.min_relative_gap, loss_ns=saved,
            evidence={"stage": slowest, "stage_ranks": list(ranks),
                      "stage_compute_ns": {str(s): v for s, v in sorted(med.items())},
                      "compute_excess_ns": excess, "relative_gap": round(gap, 4),
                      "others_wait_ns": {str(s): v for s, v in sorted(waits.items())},
                      "saved_ns": {"rank": 0.0, "stage": saved}},
            ranks=ranks, subject=f"stage:{slowest}",
        )
    ]  # fmt: skip


def _launch_bound(
    records: Sequence[dict[str, Any]], cfg: ScoringConfig, comp: F64, stage_of: I64, budget: float
) -> list[RankSignal]:
    """The ranks of the stage the others wait for whose GPU waits for its host to launch kernels: host_slow on
    ``LAUNCH_WAIT_FUNCTION``, or none. A stage's pace is its GPU's time per step, its kernels and the gaps
    in which it waited for the next launch; a launch-bound rank's kernels take no longer than anyone's, so
    the compute test above does not see it, and a stage of one rank (dp1 x pp8) has no peer to compare it
    with. It is found as the stage whose kernels and launch waits together exceed the other stages' by
    ``min_relative_gap`` and the budget, most of it launch wait, and whose neighbours wait for it: the
    other stages' p2p time exceeds its own by at least half that excess."""
    launch = np.array([_launch_wait_ns(rec) for rec in records], dtype=np.float64)
    if not launch.any():
        return []
    busy = comp + launch
    med, slowest, others = _slowest_stage(busy, stage_of)
    excess = med[slowest] - others
    if others <= 0 or excess / others < cfg.min_relative_gap or excess < budget:
        return []
    rest = stage_of != slowest
    others_launch = float(np.median(launch[rest]))
    members = np.flatnonzero(stage_of == slowest)
    p2p = np.array([p2p_ns(rec) for rec in records], dtype=np.float64)
    waited = float(np.median(p2p[rest])) - float(np.median(p2p[members]))
    bound = members[launch[members] - others_launch >= max(0.5 * excess, budget)]
    if waited < 0.5 * excess or not bound.size:
        return []
    out = []
    for i in bound.tolist():
        rec, above = records[i], float(launch[i]) - others_launch
        out.append(RankSignal(
            rank=int(rec["rank"]), host=str(rec["host"]), category="host_slow", function=LAUNCH_WAIT_FUNCTION,
            metric="self_ns", value=float(launch[i]), peer_median=others_launch,
            score=(float(busy[i]) / others - 1) / cfg.min_relative_gap, loss_ns=min(above, waited),
            subject=f"rank:{int(rec['rank'])}",
            evidence={"stage": slowest, "compared_with": "the other stages' median", "stage_ranks": members.size,
                      "launch_wait_above_others_ns": above, "others_wait_ns": waited,
                      "saved_ns": {"rank": min(above, waited), "stage": 0.0}},
        ))  # fmt: skip
    return out


def _slowest_stage(per_rank: F64, stage_of: I64) -> tuple[dict[int, float], int, float]:
    """Per stage, the median of its ranks' ``per_rank``; the stage where it is largest; the median of the
    other stages' medians (what the slowest is held to, by the compute test and the launch-bound one)."""
    med = {s: float(np.median(per_rank[stage_of == s])) for s in np.unique(stage_of).tolist()}
    slowest = max(med, key=lambda s: med[s])
    return med, slowest, float(np.median([v for s, v in med.items() if s != slowest]))


def _launch_wait_ns(rec: dict[str, Any]) -> float:
    """A record's time its GPU waited for its host to launch the next kernel (0 where none was measured)."""
    try:
        return float(rec["total_ns"][list(rec["function"]).index(LAUNCH_WAIT_FUNCTION)])
    except ValueError:
        return 0.0
