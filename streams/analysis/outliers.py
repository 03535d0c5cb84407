"""Differential scoring of one iteration: which rank differs from its peers, and why.

Physics (DESIGN.md, "How faults show up"): a collective ends on every member at the latest arrival
plus the transfer time, so a slow rank makes everyone *else's* collective long and its own short.
Therefore collective durations are only read as arrival lateness (the rank that waits least
arrived last), never as slowness; compute kernels and host functions are compared directly; a
slow link is seen in its throughput during transfers (low, steady peak), not in durations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fleetscope.schemas import FunctionKind
from fleetscope.streams.analysis.stats import F64, RobustScores, robust_scores

LINK_FAMILIES = ("nvlink", "pcie")


class OutlierScorer(Protocol):
    """Scores each row of a (ranks x functions) matrix against its column's peers."""

    def __call__(self, x: F64) -> RobustScores: ...


@dataclass(frozen=True, kw_only=True)
class ScoringConfig:
    """Thresholds of the per-iteration differential test."""

    z_threshold: float = 5.0
    min_relative_gap: float = 0.05
    min_loss_fraction: float = 0.01
    min_peers: int = 4
    rel_scale_floor: float = 0.01

    def __post_init__(self) -> None:
        errors = []
        if self.z_threshold <= 0:
            errors.append("z_threshold must be > 0")
        if not 0 <= self.min_relative_gap < 1:
            errors.append("min_relative_gap must be in [0, 1)")
        if not 0 <= self.min_loss_fraction < 1:
            errors.append("min_loss_fraction must be in [0, 1)")
        if self.min_peers < 3:
            errors.append("min_peers must be >= 3 (a median of fewer is no peer group)")
        if errors:
            raise ValueError("; ".join(errors))


@dataclass(frozen=True, slots=True)
class RankSignal:
    """One rank that stands out in one iteration, for one category, with its evidence."""

    rank: int
    host: str
    category: str
    function: str
    metric: str
    value: float
    peer_median: float
    score: float
    loss_ns: float
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class PeerMatrix:
    """Pattern records of one peer group in one iteration as (ranks x functions) matrices."""

    ranks: np.ndarray
    hosts: list[str]
    functions: list[str]
    kind: np.ndarray
    iteration_ns: F64
    features: dict[str, F64]

    @classmethod
    def build(cls, records: Sequence[dict[str, Any]], features: Sequence[str]) -> PeerMatrix:
        fid: dict[str, int] = {}
        idx_per_rank = []
        for rec in records:
            idx_per_rank.append(
                np.array([fid.setdefault(f, len(fid)) for f in rec["function"]], dtype=np.int64)
            )
        n, m = len(records), len(fid)
        kind = np.full(m, -1, dtype=np.int64)
        mats = {name: np.full((n, m), np.nan) for name in features}
        for i, (rec, idx) in enumerate(zip(records, idx_per_rank, strict=True)):
            kind[idx] = rec["kind"]
            for name in features:
                mats[name][i, idx] = np.asarray(rec[name], dtype=np.float64)
        return cls(
            ranks=np.array([r["rank"] for r in records], dtype=np.int64),
            hosts=[r["host"] for r in records],
            functions=list(fid),
            kind=kind,
            iteration_ns=np.array([r["iteration_ns"] for r in records], dtype=np.float64),
            features=mats,
        )


_FEATURES = ("mean_ns", "calls", *(f"{fam}_{s}" for fam in LINK_FAMILIES for s in ("peak_bps", "cv")))


def _top(
    functions: list[str], cols: np.ndarray, excess: F64, value: F64, med: F64, z: F64, k: int = 5
) -> list[dict]:
    order = np.argsort(-excess)[:k]
    return [
        {
            "function": functions[cols[j]],
            "value": float(value[j]),
            "peer_median": float(med[j]),
            "z": float(np.round(z[j], 2)),
            "excess_ns": float(np.round(excess[j])),
        }
        for j in order
        if excess[j] > 0
    ]


def _slow_functions(
    pm: PeerMatrix, kind: FunctionKind, category: str, cfg: ScoringConfig, scorer: OutlierScorer, budget: F64
) -> dict[int, RankSignal]:
    """Ranks whose functions of one kind take longer than their peers' (gpu_slow, host_slow)."""
    cols = np.flatnonzero(pm.kind == kind)
    if cols.size == 0:
        return {}
    mean = pm.features["mean_ns"][:, cols]
    calls = np.nan_to_num(pm.features["calls"][:, cols])
    sc = scorer(mean)
    flag = (sc.z >= cfg.z_threshold) & (sc.rel_gap >= cfg.min_relative_gap)
    excess = np.where(flag, (mean - sc.median) * calls, 0.0)
    loss = np.nansum(excess, axis=1)
    out: dict[int, RankSignal] = {}
    for i in np.flatnonzero(loss >= budget):
        top = _top(pm.functions, cols, excess[i], mean[i], sc.median, sc.z[i])
        j = int(np.nanargmax(excess[i]))
        out[i] = RankSignal(
            rank=int(pm.ranks[i]),
            host=pm.hosts[i],
            category=category,
            function=pm.functions[cols[j]],
            metric="mean_ns",
            value=float(mean[i, j]),
            peer_median=float(sc.median[j]),
            score=float(sc.z[i, j]),
            loss_ns=float(loss[i]),
            evidence={
                "functions": top,
                "flagged_functions": int(flag[i].sum()),
                "compared_functions": int(np.sum(~np.isnan(mean[i]))),
            },
        )
    return out


def _slow_links(
    pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: F64
) -> dict[int, RankSignal]:
    """Ranks whose link runs at a lower peak than their peers' during the same collectives."""
    cols = np.flatnonzero(pm.kind == FunctionKind.COLLECTIVE)
    if cols.size == 0:
        return {}
    mean = pm.features["mean_ns"][:, cols]
    calls = np.nan_to_num(pm.features["calls"][:, cols])
    with np.errstate(all="ignore"):
        transfer = np.nanmin(mean, axis=0) if mean.size else mean
    out: dict[int, RankSignal] = {}
    for fam in LINK_FAMILIES:
        peak = pm.features[f"{fam}_peak_bps"][:, cols]
        if np.all(np.isnan(peak)):
            continue
        sc = scorer(peak)
        flag = (sc.z <= -cfg.z_threshold) & (sc.rel_gap <= -cfg.min_relative_gap)
        with np.errstate(invalid="ignore", divide="ignore"):
            excess = np.where(flag, transfer * (1 - peak / sc.median) * calls, 0.0)
        loss = np.nansum(excess, axis=1)
        cv = pm.features[f"{fam}_cv"][:, cols]
        for i in np.flatnonzero(loss >= budget):
            if i in out and out[i].loss_ns >= loss[i]:
                continue
            j = int(np.nanargmax(excess[i]))
            with np.errstate(all="ignore"):
                peer_cv = float(np.nanmedian(cv[:, j]))
            out[i] = RankSignal(
                rank=int(pm.ranks[i]),
                host=pm.hosts[i],
                category="link_slow",
                function=pm.functions[cols[j]],
                metric=f"{fam}_peak_bps",
                value=float(peak[i, j]),
                peer_median=float(sc.median[j]),
                score=float(sc.z[i, j]),
                loss_ns=float(loss[i]),
                evidence={
                    "link": fam,
                    "functions": _top(pm.functions, cols, excess[i], peak[i], sc.median, sc.z[i]),
                    "throughput_cv": float(cv[i, j]),
                    "peer_throughput_cv": peer_cv,
                    "flagged_collectives": int(flag[i].sum()),
                },
            )
    return out


def _late_arrivals(
    pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: F64
) -> dict[int, RankSignal]:
    """Ranks that arrive last at collectives: they wait least, so their collectives are the shortest.

    Uses durations on each rank's own clock only, so clock skew between hosts does not matter.
    """
    cols = np.flatnonzero(pm.kind == FunctionKind.COLLECTIVE)
    if cols.size == 0:
        return {}
    mean = pm.features["mean_ns"][:, cols]
    calls = np.nan_to_num(pm.features["calls"][:, cols])
    sc = scorer(mean)
    flag = (sc.z <= -cfg.z_threshold) & (sc.rel_gap <= -cfg.min_relative_gap)
    lateness = np.where(flag, (sc.median - mean) * calls, 0.0)
    loss = np.nansum(lateness, axis=1)
    out: dict[int, RankSignal] = {}
    for i in np.flatnonzero(loss >= budget):
        j = int(np.nanargmax(lateness[i]))
        out[i] = RankSignal(
            rank=int(pm.ranks[i]),
            host=pm.hosts[i],
            category="straggler",
            function=pm.functions[cols[j]],
            metric="arrival_lateness_ns",
            value=float(sc.median[j] - mean[i, j]),
            peer_median=0.0,
            score=float(-sc.z[i, j]),
            loss_ns=float(loss[i]),
            evidence={
                "functions": _top(pm.functions, cols, lateness[i], mean[i], sc.median, sc.z[i]),
                "flagged_collectives": int(flag[i].sum()),
            },
        )
    return out


def score_peer_group(
    records: Sequence[dict[str, Any]],
    config: ScoringConfig | None = None,
    scorer: OutlierScorer | None = None,
) -> list[RankSignal]:
    """Signals for one iteration of one peer group (ranks expected to behave alike).

    1. Build (ranks x functions) matrices; 2. a rank's excess time must cost at least
    ``min_loss_fraction`` of the median iteration to matter; 3. gpu_slow from compute kernels,
    host_slow from host functions, link_slow from link peaks during collectives; 4. a late arrival
    with none of these causes is a straggler; with a cause, the lateness corroborates the cause.
    """
    cfg = config or ScoringConfig()
    score = scorer or (lambda x: robust_scores(x, cfg.rel_scale_floor))
    if len(records) < cfg.min_peers:
        return []
    pm = PeerMatrix.build(records, _FEATURES)
    budget = cfg.min_loss_fraction * float(np.median(pm.iteration_ns))
    causes = [
        _slow_functions(pm, FunctionKind.COMPUTE, "gpu_slow", cfg, score, budget),
        _slow_functions(pm, FunctionKind.PYTHON, "host_slow", cfg, score, budget),
        _slow_links(pm, cfg, score, budget),
    ]
    late = _late_arrivals(pm, cfg, score, budget)
    signals: list[RankSignal] = []
    for found in causes:
        for i, sig in found.items():
            if i in late:
                sig.evidence["arrival_lateness_ns"] = late[i].loss_ns
            signals.append(sig)
    explained = {i for found in causes for i in found}
    signals += [sig for i, sig in late.items() if i not in explained]
    return signals


def peer_groups(records: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Ranks that should behave alike: the same pipeline stage (all ranks when unknown)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault(int(rec.get("pp_rank", -1)), []).append(rec)
    return list(groups.values())
