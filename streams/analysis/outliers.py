"""Differential scoring of one iteration: which rank differs from its peers, and why.

Physics (DESIGN.md, "How faults show up"): a collective ends on every member at the latest arrival
plus the transfer time, so a slow rank makes everyone *else's* collective long and its own short.
Therefore collective durations are only read as arrival lateness (the rank that waits least
arrived last), never as slowness; compute kernels and host functions are compared directly; a
slow link is seen in its throughput during transfers (low peak or low active throughput), not in
durations. Ranks of one host flagged together become one host finding (shared NIC, CPU, power);
a whole pipeline stage that computes longer than the other stages is a stage finding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Protocol

import numpy as np

from fleetscope.schemas import FunctionKind
from fleetscope.streams.analysis.stats import F64, RobustScores, quiet_nan_warnings, robust_scores

LINK_FAMILIES = ("nvlink", "pcie")
LINK_IN_USE_SHARE = 0.25
"""A rank whose link peaks below this share of the best rank's during a collective does not route
that collective over this link (e.g. p2p inside a host never touches PCIe): it is not compared."""


class OutlierScorer(Protocol):
    """Scores each row of a (ranks x functions) matrix against its column's peers."""

    def __call__(self, x: F64, abs_scale_floor: float = 0.0) -> RobustScores: ...


@dataclass(frozen=True, kw_only=True)
class ScoringConfig:
    """Thresholds of the per-iteration differential test."""

    z_threshold: float = 5.0
    min_relative_gap: float = 0.05
    min_loss_fraction: float = 0.01
    min_peers: int = 4
    rel_scale_floor: float = 0.01
    host_share_floor: float = 0.002
    """Scale floor for host functions compared as a share of the iteration (0.2 %)."""
    host_min_relative_gap: float = 0.2
    """Hosts' link fluctuation must differ this much: hosts are few and their traffic mixes."""
    host_group_min_share: float = 0.75
    """Ranks of one host flagged together become a host finding when they are this share of it."""

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
        if not 0 < self.host_group_min_share <= 1:
            errors.append("host_group_min_share must be in (0, 1]")
        if errors:
            raise ValueError("; ".join(errors))

    def scorer(self) -> OutlierScorer:
        def score(x: F64, abs_scale_floor: float = 0.0) -> RobustScores:
            return robust_scores(x, self.rel_scale_floor, abs_scale_floor, self.min_peers)

        return score


@dataclass(frozen=True, slots=True)
class RankSignal:
    """One rank (or host, stage) that stands out in one iteration, for one category, with evidence.

    ``rank`` is -1 for a group; ``subject`` names what the finding is about ("rank:7",
    "host:node003", "stage:2", "job") so that findings of different scopes never merge.
    """

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
    ranks: tuple[int, ...] = ()
    subject: str = ""

    def key(self) -> tuple[str, str]:
        return (self.subject or f"rank:{self.rank}", self.category)

    def member_ranks(self) -> tuple[int, ...]:
        return self.ranks or (self.rank,)


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
        """1. Intern function names in first-seen order (one C-level pass over every record's names);
        2. one (row, column) index pair per pattern entry; 3. scatter each feature's concatenated
        values into its NaN-filled matrix in one assignment (rank order kept: a later rank's kind wins).
        """
        names = [rec["function"] for rec in records]
        fid = {f: j for j, f in enumerate(dict.fromkeys(chain.from_iterable(names)))}
        lengths = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
        total = int(lengths.sum())
        cols = np.fromiter(map(fid.__getitem__, chain.from_iterable(names)), dtype=np.int64, count=total)
        rows = np.repeat(np.arange(len(records), dtype=np.int64), lengths)
        n, m = len(records), len(fid)
        kind = np.full(m, -1, dtype=np.int64)
        kind[cols] = _concat(records, "kind", lengths, total, np.int64)
        mats = {name: np.full((n, m), np.nan) for name in features}
        for name in features:
            mats[name][rows, cols] = _concat(records, name, lengths, total, np.float64)
        return cls(
            ranks=np.array([r["rank"] for r in records], dtype=np.int64),
            hosts=[r["host"] for r in records],
            functions=list(fid),
            kind=kind,
            iteration_ns=np.array([r["iteration_ns"] for r in records], dtype=np.float64),
            features=mats,
        )


def _concat(
    records: Sequence[dict[str, Any]], name: str, lengths: np.ndarray, total: int, dtype: type[np.generic]
) -> np.ndarray:
    """Every record's ``name`` column end to end; each must be as long as the record's functions."""
    cols = [rec[name] for rec in records]
    if any(len(c) != k for c, k in zip(cols, lengths.tolist(), strict=True)):
        raise ValueError(f"pattern column {name!r} is not as long as the record's functions")
    if all(isinstance(c, list) for c in cols):
        return np.fromiter(chain.from_iterable(cols), dtype=dtype, count=total)
    return np.concatenate([np.asarray(c, dtype=dtype) for c in cols]) if cols else np.zeros(0, dtype)


_FEATURES = (
    "mean_ns",
    "total_ns",
    "calls",
    *(f"{fam}_{s}" for fam in LINK_FAMILIES for s in ("peak_bps", "mean_bps", "cv")),
)


def _top(
    functions: list[str], cols: np.ndarray, excess: F64, value: F64, med: F64, z: F64, k: int = 5
) -> list[dict]:
    order = np.argsort(-np.nan_to_num(excess))[:k]
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


def _signal(pm: PeerMatrix, i: int, **fields: Any) -> RankSignal:
    return RankSignal(rank=int(pm.ranks[i]), host=pm.hosts[i], **fields)


def _slow_kernels(
    pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: float
) -> dict[int, RankSignal]:
    """Ranks whose compute kernels take longer than the same kernels on their peers (gpu_slow)."""
    cols = np.flatnonzero(pm.kind == FunctionKind.COMPUTE)
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
        j = int(np.nanargmax(excess[i]))
        out[i] = _signal(
            pm, i, category="gpu_slow", function=pm.functions[cols[j]], metric="mean_ns",
            value=float(mean[i, j]), peer_median=float(sc.median[j]), score=float(sc.z[i, j]),
            loss_ns=float(loss[i]),
            evidence={
                "functions": _top(pm.functions, cols, excess[i], mean[i], sc.median, sc.z[i]),
                "flagged_functions": int(flag[i].sum()),
                "compared_functions": int(np.sum(~np.isnan(mean[i]))),
            },
        )  # fmt: skip
    return out


def _slow_host(
    pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: float
) -> dict[int, RankSignal]:
    """Ranks that spend a larger share of the iteration in a host function than their peers.

    Host functions are compared as time per iteration, absent counting as zero, so a function that
    only the culprit runs (a GC pause, a stall) still stands out against its peers' zero.
    """
    cols = np.flatnonzero(pm.kind == FunctionKind.PYTHON)
    if cols.size == 0:
        return {}
    it = float(np.median(pm.iteration_ns))
    share = np.nan_to_num(pm.features["total_ns"][:, cols]) / it
    sc = scorer(share, cfg.host_share_floor)
    flag = (sc.z >= cfg.z_threshold) & (share - sc.median >= cfg.min_loss_fraction / 2)
    excess = np.where(flag, (share - sc.median) * it, 0.0)
    loss = excess.sum(axis=1)
    out: dict[int, RankSignal] = {}
    for i in np.flatnonzero(loss >= budget):
        j = int(np.argmax(excess[i]))
        total = share[i] * it
        out[i] = _signal(
            pm, i, category="host_slow", function=pm.functions[cols[j]], metric="total_ns",
            value=float(total[j]), peer_median=float(sc.median[j] * it), score=float(sc.z[i, j]),
            loss_ns=float(loss[i]),
            evidence={
                "functions": _top(pm.functions, cols, excess[i], total, sc.median * it, sc.z[i]),
                "flagged_functions": int(flag[i].sum()),
                "compared_functions": int(cols.size),
            },
        )  # fmt: skip
    return out


def _slow_links(
    pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: float
) -> dict[int, RankSignal]:
    """Ranks whose link cannot reach the peak their peers' links reach during the same collectives.

    A degraded link (NVLink lanes down, PCIe gen/width downgrade) saturates at a lower rate: a low,
    steady peak. The whole ring is paced by it, so the loss is the share of the transfer (the
    shortest rank's collective) that the lower rate costs. Congestion, which fluctuates and is
    shared by a host's ranks, is judged per host (``score_hosts``).
    """
    cols = np.flatnonzero(pm.kind == FunctionKind.COLLECTIVE)
    if cols.size == 0:
        return {}
    mean_ns = pm.features["mean_ns"][:, cols]
    calls = np.nan_to_num(pm.features["calls"][:, cols])
    with quiet_nan_warnings():
        transfer = np.nanmin(mean_ns, axis=0)
    out: dict[int, RankSignal] = {}
    for fam in LINK_FAMILIES:
        ratios = []
        for feature in ("peak_bps",):
            x = pm.features[f"{fam}_{feature}"][:, cols].copy()
            if np.all(np.isnan(x)):
                continue
            with quiet_nan_warnings():
                x[x < LINK_IN_USE_SHARE * np.nanmax(x)] = np.nan  # this link does not carry it
            sc = scorer(x)
            flag = (sc.z <= -cfg.z_threshold) & (sc.rel_gap <= -cfg.min_relative_gap)
            with np.errstate(invalid="ignore", divide="ignore"):
                ratios.append((feature, np.where(flag, x / sc.median, 1.0), x, sc))
        if not ratios:
            continue
        ratio = np.nan_to_num(np.minimum.reduce([r for _, r, _, _ in ratios]), nan=1.0)
        cv = pm.features[f"{fam}_cv"][:, cols]
        with quiet_nan_warnings():
            steadier = cv < np.nanmedian(cv, axis=0)  # the link that paces a ring is its steadiest
        ratio = np.where(steadier, ratio, 1.0)
        excess = np.nan_to_num(transfer * (1 - ratio) * calls)
        loss = excess.sum(axis=1)
        for i in np.flatnonzero(loss >= budget):
            if i in out and out[i].loss_ns >= loss[i]:
                continue
            j = int(np.argmax(excess[i]))
            feature, _, x, sc = min(ratios, key=lambda r: r[1][i, j])
            with quiet_nan_warnings():
                peer_cv = float(np.nanmedian(cv[:, j]))
            pattern = "steady"
            out[i] = _signal(
                pm, i, category="link_slow", function=pm.functions[cols[j]], metric=f"{fam}_{feature}",
                value=float(x[i, j]), peer_median=float(sc.median[j]), score=float(sc.z[i, j]),
                loss_ns=float(loss[i]),
                evidence={
                    "link": fam,
                    "pattern": pattern,
                    "throughput_cv": float(cv[i, j]),
                    "peer_throughput_cv": peer_cv,
                    "functions": _top(pm.functions, cols, excess[i], x[i], sc.median, sc.z[i]),
                    "flagged_collectives": int(np.sum(ratio[i] < 1)),
                },
            )  # fmt: skip
    return out


def _late_arrivals(
    pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: float
) -> dict[int, RankSignal]:
    """Ranks that arrive last at collectives: they wait least, so their collectives are the shortest.

    Uses durations on each rank's own clock only, so clock skew between hosts does not matter.
    """
    cols = np.flatnonzero(pm.kind == FunctionKind.COLLECTIVE)
    if cols.size == 0:
        return {}
    mean = pm.features["mean_ns"][:, cols]
    sc = scorer(mean)
    flag = (sc.z <= -cfg.z_threshold) & (sc.rel_gap <= -cfg.min_relative_gap)
    # A late rank delays the job by its lateness once, however many collectives it is late for.
    lateness = np.where(flag, sc.median - mean, 0.0)
    loss = np.nanmax(np.nan_to_num(lateness), axis=1)
    out: dict[int, RankSignal] = {}
    for i in np.flatnonzero(loss >= budget):
        j = int(np.nanargmax(lateness[i]))
        out[i] = _signal(
            pm, i, category="straggler", function=pm.functions[cols[j]], metric="arrival_lateness_ns",
            value=float(sc.median[j] - mean[i, j]), peer_median=0.0, score=float(-sc.z[i, j]),
            loss_ns=float(loss[i]),
            evidence={
                "functions": _top(pm.functions, cols, lateness[i], mean[i], sc.median, sc.z[i]),
                "flagged_collectives": int(flag[i].sum()),
            },
        )  # fmt: skip
    return out


def score_peer_group(
    records: Sequence[dict[str, Any]],
    config: ScoringConfig | None = None,
    scorer: OutlierScorer | None = None,
) -> list[RankSignal]:
    """Rank signals for one iteration of one peer group (ranks expected to behave alike).

    1. Build (ranks x functions) matrices; 2. a rank's excess time must cost at least
    ``min_loss_fraction`` of the median iteration to matter; 3. gpu_slow from compute kernels,
    host_slow from host functions, link_slow from link throughput during collectives; 4. a late
    arrival with none of these causes is a straggler; with a cause, it corroborates the cause.
    """
    cfg = config or ScoringConfig()
    score = scorer or cfg.scorer()
    if len(records) < cfg.min_peers:
        return []
    pm = PeerMatrix.build(records, _FEATURES)
    budget = cfg.min_loss_fraction * float(np.median(pm.iteration_ns))
    causes = [
        _slow_kernels(pm, cfg, score, budget),
        _slow_host(pm, cfg, score, budget),
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


def group_by_host(
    signals: list[RankSignal], records: Sequence[dict[str, Any]], min_share: float
) -> list[RankSignal]:
    """Merge same-category signals of most ranks of one host into one host signal (shared NIC, CPU)."""
    host_size: dict[str, int] = {}
    for rec in records:
        host_size[rec["host"]] = host_size.get(rec["host"], 0) + 1
    by_key: dict[tuple[str, str], list[RankSignal]] = {}
    for sig in signals:
        by_key.setdefault((sig.host, sig.category), []).append(sig)
    out: list[RankSignal] = []
    for (host, category), sigs in by_key.items():
        if len(sigs) < 2 or len(sigs) < min_share * host_size.get(host, 1):
            out += sigs
            continue
        top = max(sigs, key=lambda s: abs(s.score))
        ranks = tuple(sorted(s.rank for s in sigs))
        evidence = dict(
            top.evidence, scope="host", rank_scores={str(s.rank): round(s.score, 2) for s in sigs}
        )
        out.append(
            RankSignal(
                rank=-1, host=host, category=category, function=top.function, metric=top.metric,
                value=top.value, peer_median=top.peer_median, score=top.score,
                loss_ns=max(s.loss_ns for s in sigs), evidence=evidence, ranks=ranks, subject=f"host:{host}",
            )
        )  # fmt: skip
    return out


def score_stages(records: Sequence[dict[str, Any]], config: ScoringConfig | None = None) -> list[RankSignal]:
    """A pipeline stage whose ranks compute longer than the other stages' (stage_imbalance).

    Every rank of a slow stage is slow alike, so no rank stands out within the stage; the stage
    stands out against the others, and the other stages pay for it waiting in p2p receives.
    """
    cfg = config or ScoringConfig()
    stages: dict[int, list[tuple[int, float]]] = {}
    for rec in records:
        pp = int(rec.get("pp_rank", -1))
        compute = sum(
            t for t, k in zip(rec["total_ns"], rec["kind"], strict=True) if k == FunctionKind.COMPUTE
        )
        stages.setdefault(pp, []).append((int(rec["rank"]), float(compute)))
    if len(stages) < 2 or -1 in stages:
        return []
    med = {s: float(np.median([c for _, c in v])) for s, v in stages.items()}
    slowest = max(med, key=lambda s: med[s])
    others = float(np.median([v for s, v in med.items() if s != slowest]))
    if others <= 0:
        return []
    gap = med[slowest] / others - 1
    budget = cfg.min_loss_fraction * float(np.median([r["iteration_ns"] for r in records]))
    loss = med[slowest] - others
    if gap < cfg.min_relative_gap or loss < budget:
        return []
    ranks = tuple(sorted(r for r, _ in stages[slowest]))
    return [
        RankSignal(
            rank=-1, host="", category="stage_imbalance", function="compute", metric="compute_ns",
            value=med[slowest], peer_median=others, score=gap / cfg.min_relative_gap, loss_ns=loss,
            evidence={"stage": slowest, "stage_compute_ns": {str(s): v for s, v in sorted(med.items())},
                      "relative_gap": round(gap, 4)},
            ranks=ranks, subject=f"stage:{slowest}",
        )
    ]  # fmt: skip


def score_hosts(
    records: Sequence[dict[str, Any]],
    config: ScoringConfig | None = None,
    scorer: OutlierScorer | None = None,
) -> list[RankSignal]:
    """Hosts whose NIC/PCIe traffic fluctuates more than other hosts' during the same collectives.

    Congestion on a host's network path makes its transfers stall and burst; every rank of the host
    shares the pattern, so hosts (median over their ranks) are compared, not ranks. The estimated
    loss is an upper bound: the transfer time of the collectives concerned.
    """
    cfg = config or ScoringConfig()
    score = scorer or cfg.scorer()
    hosts = sorted({r["host"] for r in records})
    if len(hosts) < cfg.min_peers:
        return []
    pm = PeerMatrix.build(records, ("mean_ns", "calls", "pcie_cv", "pcie_mean_bps"))
    cols = np.flatnonzero(pm.kind == FunctionKind.COLLECTIVE)
    if cols.size == 0:
        return []
    host_idx = np.array([hosts.index(h) for h in pm.hosts])

    def by_host(feature: str) -> F64:
        x = pm.features[feature][:, cols]
        out = np.full((len(hosts), cols.size), np.nan)
        with quiet_nan_warnings():
            for h in range(len(hosts)):
                out[h] = np.nanmedian(x[host_idx == h], axis=0)
        return out

    per_host, active_mean = by_host("pcie_cv"), by_host("pcie_mean_bps")
    with quiet_nan_warnings():
        transfer = np.nanmin(pm.features["mean_ns"][:, cols], axis=0)
    calls = np.nanmedian(pm.features["calls"][:, cols], axis=0)
    sc, sm = score(per_host), score(active_mean)
    # On/off: full speed while it sends, stalled in between; the hosts it paces run at partial rates.
    flag = (sc.z >= cfg.z_threshold) & (sc.rel_gap >= cfg.host_min_relative_gap) & (sm.z >= cfg.z_threshold)
    loss = np.where(flag, np.nan_to_num(transfer * calls), 0.0).sum(axis=1)
    budget = cfg.min_loss_fraction * float(np.median(pm.iteration_ns))
    out: list[RankSignal] = []
    for h in np.flatnonzero(loss >= budget):
        j = int(np.nanargmax(np.where(flag[h], sc.z[h], -np.inf)))
        ranks = tuple(sorted(int(r) for r in pm.ranks[host_idx == h]))
        out.append(
            RankSignal(
                rank=-1, host=hosts[h], category="link_slow", function=pm.functions[cols[j]],
                metric="pcie_cv",
                value=float(per_host[h, j]), peer_median=float(sc.median[j]), score=float(sc.z[h, j]),
                loss_ns=float(loss[h]), ranks=ranks, subject=f"host:{hosts[h]}",
                evidence={"scope": "host", "pattern": "fluctuating", "link": "pcie",
                          "flagged_collectives": int(flag[h].sum()), "hosts_compared": len(hosts)},
            )
        )  # fmt: skip
    return out


def explain_late_ranks(signals: list[RankSignal], records: Sequence[dict[str, Any]]) -> list[RankSignal]:
    """Drop stragglers that a found cause delays: the other ranks of its model replica.

    A slow rank holds up its TP group (they wait for it layer by layer), the stages of its pipeline
    (they wait for its activations and gradients) and so, transitively, every rank with its
    data-parallel index; those ranks then arrive late at their own data-parallel collectives. They
    are symptoms; the cause's evidence lists them.
    """
    replica = {int(r["rank"]): int(r.get("dp_rank", -1)) for r in records}
    causes = [s for s in signals if s.category in ("gpu_slow", "host_slow", "link_slow") and s.rank >= 0]
    out: list[RankSignal] = []
    for sig in signals:
        if sig.category == "straggler" and replica.get(sig.rank, -1) >= 0:
            for cause in causes:
                if replica.get(cause.rank, -2) == replica[sig.rank]:
                    cause.evidence.setdefault("delays_ranks", []).append(sig.rank)
                    break
            else:
                out.append(sig)
        else:
            out.append(sig)
    return out


def peer_groups(records: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Ranks that should behave alike: the same pipeline stage (all ranks when unknown)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault(int(rec.get("pp_rank", -1)), []).append(rec)
    return list(groups.values())


def score_iteration(
    records: Sequence[dict[str, Any]],
    config: ScoringConfig | None = None,
    scorer: OutlierScorer | None = None,
) -> list[RankSignal]:
    """Every signal of one iteration of one job: per peer group, grouped by host, plus hosts and stages."""
    cfg = config or ScoringConfig()
    signals: list[RankSignal] = []
    for group in peer_groups(records):
        signals += score_peer_group(group, cfg, scorer)
    signals = explain_late_ranks(signals, records)
    signals = group_by_host(signals, records, cfg.host_group_min_share)
    return signals + score_hosts(records, cfg, scorer) + score_stages(records, cfg)
