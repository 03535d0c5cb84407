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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fleetscope.schemas import FunctionKind
from fleetscope.streams.analysis.peermatrix import FunctionIndex, PeerMatrices, PeerMatrix
from fleetscope.streams.analysis.stats import F64, I64, RobustScores, nan_median, quiet_nan_warnings, robust_scores

LINK_FAMILIES = ("nvlink", "pcie")
LINK_IN_USE_SHARE = 0.25
"""A rank whose link peaks below this share of the best rank's during a collective does not route
that collective over this link (e.g. p2p inside a host never touches PCIe): it is not compared."""
HOST_MEMBER_MIN_SCORE = 0.25
"""A rank joins its host's finding only when it scores at least this share of the host's top scorer."""


class OutlierScorer(Protocol):
    """Scores each row of a (ranks x functions) matrix against its column's peers; ``x`` is shared
    by several tests, so a scorer must not write to it."""

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


_COMPUTE, _COLLECTIVE, _PYTHON = int(FunctionKind.COMPUTE), int(FunctionKind.COLLECTIVE), int(FunctionKind.PYTHON)
READS: dict[int, tuple[str, ...]] = {
    _COMPUTE: ("mean_ns",),
    _COLLECTIVE: (
        "mean_ns",
        "calls",
        "pcie_mean_bps",
        *(f"{f}_{x}" for f in LINK_FAMILIES for x in ("peak_bps", "cv")),
    ),
    _PYTHON: ("total_ns",),
}
"""What the tests below read, by kind of function; gather converts no more. Stages add compute totals."""
_STAGE_READS = {**READS, _COMPUTE: (*READS[_COMPUTE], "total_ns")}
_ON_DEMAND = {_COMPUTE: ("calls",)}
"""Converted for flagged ranks only: calls weigh a kernel's excess time, nothing else reads them."""
_EVERY_READ = {k: (*names, *_ON_DEMAND.get(k, ())) for k, names in _STAGE_READS.items()}


def gather_matrices(
    records: Sequence[dict[str, Any]], index: FunctionIndex | None = None, staged: bool = False
) -> PeerMatrices | None:
    """The matrices every test reads (``PeerMatrices.gather``); ``staged`` adds compute totals."""
    return PeerMatrices.gather(records, _STAGE_READS if staged else READS, index, _ON_DEMAND)


def build_matrices(records: Sequence[dict[str, Any]]) -> PeerMatrices:
    """The same from ``PeerMatrix.build``: any records, every entry of every feature converted."""
    features = tuple(dict.fromkeys(name for names in _EVERY_READ.values() for name in names))
    return PeerMatrices.split(PeerMatrix.build(records, features), _EVERY_READ)


def _top(functions: list[str], excess: F64, value: F64, med: F64, z: F64, k: int = 5) -> list[dict]:
    order = np.argsort(-np.nan_to_num(excess))[:k]
    return [
        {
            "function": functions[j],
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


def _slow_kernels(pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: float) -> dict[int, RankSignal]:
    """Ranks whose compute kernels take longer than the same kernels on their peers (gpu_slow)."""
    if not pm.functions:
        return {}
    mean = pm.features["mean_ns"]
    sc = scorer(mean)
    flag = (sc.z >= cfg.z_threshold) & (sc.rel_gap >= cfg.min_relative_gap)
    excess = np.zeros(mean.shape, order="F")  # laid out as the scores, so row sums add in the same order
    suspects = np.flatnonzero(flag.any(axis=1))
    if suspects.size:  # calls matter only where flagged: converted for these ranks alone
        calls = np.nan_to_num(pm.feature_rows("calls", suspects))
        some = np.where(flag[suspects], (mean[suspects] - sc.median) * calls, 0.0)
        some[np.isnan(some)] = 0.0  # as nansum counts them, without copying the whole matrix
        excess[suspects] = some
    loss = excess.sum(axis=1)
    out: dict[int, RankSignal] = {}
    for i in np.flatnonzero(loss >= budget):
        j = int(np.nanargmax(excess[i]))
        out[i] = _signal(
            pm, i, category="gpu_slow", function=pm.functions[j], metric="mean_ns",
            value=float(mean[i, j]), peer_median=float(sc.median[j]), score=float(sc.z[i, j]),
            loss_ns=float(loss[i]),
            evidence={
                "functions": _top(pm.functions, excess[i], mean[i], sc.median, sc.z[i]),
                "flagged_functions": int(flag[i].sum()),
                "compared_functions": int(np.sum(~np.isnan(mean[i]))),
            },
        )  # fmt: skip
    return out


def _slow_host(pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: float) -> dict[int, RankSignal]:
    """Ranks that spend a larger share of the iteration in a host function than their peers.

    Host functions are compared as time per iteration, absent counting as zero, so a function that
    only the culprit runs (a GC pause, a stall) still stands out against its peers' zero.
    """
    if not pm.functions:
        return {}
    it = float(np.median(pm.iteration_ns))
    share = np.nan_to_num(pm.features["total_ns"]) / it
    sc = scorer(share, cfg.host_share_floor)
    flag = (sc.z >= cfg.z_threshold) & (share - sc.median >= cfg.min_loss_fraction / 2)
    excess = np.where(flag, (share - sc.median) * it, 0.0)
    loss = excess.sum(axis=1)
    out: dict[int, RankSignal] = {}
    for i in np.flatnonzero(loss >= budget):
        j = int(np.argmax(excess[i]))
        total = share[i] * it
        out[i] = _signal(
            pm, i, category="host_slow", function=pm.functions[j], metric="total_ns",
            value=float(total[j]), peer_median=float(sc.median[j] * it), score=float(sc.z[i, j]),
            loss_ns=float(loss[i]),
            evidence={
                "functions": _top(pm.functions, excess[i], total, sc.median * it, sc.z[i]),
                "flagged_functions": int(flag[i].sum()),
                "compared_functions": len(pm.functions),
            },
        )  # fmt: skip
    return out


def _slow_links(pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: float) -> dict[int, RankSignal]:
    """Ranks whose link cannot reach the peak their peers' links reach during the same collectives.

    A degraded link (NVLink lanes down, PCIe gen/width downgrade) saturates at a lower rate: a low,
    steady peak. The whole ring is paced by it, so the loss is the share of the transfer (the
    shortest rank's collective) that the lower rate costs. Congestion, which fluctuates and is
    shared by a host's ranks, is judged per host (``score_hosts``).
    """
    if not pm.functions:
        return {}
    mean_ns = pm.features["mean_ns"]
    calls = np.nan_to_num(pm.features["calls"])
    with quiet_nan_warnings():
        transfer = np.nanmin(mean_ns, axis=0)
    out: dict[int, RankSignal] = {}
    for fam in LINK_FAMILIES:
        ratios = []
        for feature in ("peak_bps",):
            x = pm.features[f"{fam}_{feature}"].copy()
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
        cv = pm.features[f"{fam}_cv"]
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
                pm, i, category="link_slow", function=pm.functions[j], metric=f"{fam}_{feature}",
                value=float(x[i, j]), peer_median=float(sc.median[j]), score=float(sc.z[i, j]),
                loss_ns=float(loss[i]),
                evidence={
                    "link": fam,
                    "pattern": pattern,
                    "throughput_cv": float(cv[i, j]),
                    "peer_throughput_cv": peer_cv,
                    "functions": _top(pm.functions, excess[i], x[i], sc.median, sc.z[i]),
                    "flagged_collectives": int(np.sum(ratio[i] < 1)),
                },
            )  # fmt: skip
    return out


def _late_arrivals(pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: float) -> dict[int, RankSignal]:
    """Ranks that arrive last at collectives: they wait least, so their collectives are the shortest.

    Uses durations on each rank's own clock only, so clock skew between hosts does not matter.
    """
    if not pm.functions:
        return {}
    mean = pm.features["mean_ns"]
    sc = scorer(mean)
    flag = (sc.z <= -cfg.z_threshold) & (sc.rel_gap <= -cfg.min_relative_gap)
    # A late rank delays the job by its lateness once, however many collectives it is late for.
    lateness = np.where(flag, sc.median - mean, 0.0)
    loss = np.nanmax(np.nan_to_num(lateness), axis=1)
    out: dict[int, RankSignal] = {}
    for i in np.flatnonzero(loss >= budget):
        j = int(np.nanargmax(lateness[i]))
        out[i] = _signal(
            pm, i, category="straggler", function=pm.functions[j], metric="arrival_lateness_ns",
            value=float(sc.median[j] - mean[i, j]), peer_median=0.0, score=float(-sc.z[i, j]),
            loss_ns=float(loss[i]),
            evidence={
                "functions": _top(pm.functions, lateness[i], mean[i], sc.median, sc.z[i]),
                "flagged_collectives": int(flag[i].sum()),
            },
        )  # fmt: skip
    return out


def score_peer_group(
    records: Sequence[dict[str, Any]],
    config: ScoringConfig | None = None,
    scorer: OutlierScorer | None = None,
) -> list[RankSignal]:
    """Rank signals for one iteration of one peer group (ranks expected to behave alike)."""
    cfg = config or ScoringConfig()
    if len(records) < cfg.min_peers:
        return []
    pms = gather_matrices(records) or build_matrices(records)
    return _score_group(pms, cfg, scorer or cfg.scorer())


def _score_group(pms: PeerMatrices, cfg: ScoringConfig, score: OutlierScorer) -> list[RankSignal]:
    """1. A rank's excess time must cost at least ``min_loss_fraction`` of the median iteration to
    matter; 2. gpu_slow from compute kernels, host_slow from host functions, link_slow from link
    throughput during collectives; 3. a late arrival with none of these causes is a straggler; with
    a cause, it corroborates the cause.
    """
    budget = cfg.min_loss_fraction * float(np.median(pms.iteration_ns))
    collectives = pms.of_kind(_COLLECTIVE)
    causes = [
        _slow_kernels(pms.of_kind(_COMPUTE), cfg, score, budget),
        _slow_host(pms.of_kind(_PYTHON), cfg, score, budget),
        _slow_links(collectives, cfg, score, budget),
    ]
    late = _late_arrivals(collectives, cfg, score, budget)
    signals: list[RankSignal] = []
    for found in causes:
        for i, sig in found.items():
            if i in late:
                sig.evidence["arrival_lateness_ns"] = late[i].loss_ns
            signals.append(sig)
    explained = {i for found in causes for i in found}
    signals += [sig for i, sig in late.items() if i not in explained]
    return signals


def group_by_host(signals: list[RankSignal], records: Sequence[dict[str, Any]], min_share: float) -> list[RankSignal]:
    """Merge same-category signals of most ranks of one host into one host signal (shared NIC, CPU).

    Each member must be a real outlier on its own: a rank scoring far below the host's top scorer (less
    than ``HOST_MEMBER_MIN_SCORE`` of it) is noise next to one culprit, not a victim of a shared cause, so
    it stays a rank signal and does not count towards the host. A job on a single host has no host to
    compare with: its signals stay per rank."""
    host_size: dict[str, int] = {}
    for rec in records:
        host_size[rec["host"]] = host_size.get(rec["host"], 0) + 1
    if len(host_size) < 2:
        return signals
    by_key: dict[tuple[str, str], list[RankSignal]] = {}
    for sig in signals:
        by_key.setdefault((sig.host, sig.category), []).append(sig)
    out: list[RankSignal] = []
    for (host, category), sigs in by_key.items():
        strongest = max((abs(s.score) for s in sigs), default=0.0)
        members = [s for s in sigs if abs(s.score) >= HOST_MEMBER_MIN_SCORE * strongest]
        if len(members) < 2 or len(members) < min_share * host_size.get(host, 1):
            out += sigs
            continue
        out += [s for s in sigs if abs(s.score) < HOST_MEMBER_MIN_SCORE * strongest]
        sigs = members
        top = max(sigs, key=lambda s: abs(s.score))
        ranks = tuple(sorted(s.rank for s in sigs))
        evidence = dict(top.evidence, scope="host", rank_scores={str(s.rank): round(s.score, 2) for s in sigs})
        out.append(
            RankSignal(
                rank=-1, host=host, category=category, function=top.function, metric=top.metric,
                value=top.value, peer_median=top.peer_median, score=top.score,
                loss_ns=max(s.loss_ns for s in sigs), evidence=evidence, ranks=ranks, subject=f"host:{host}",
            )
        )  # fmt: skip
    return out


def score_stages(
    records: Sequence[dict[str, Any]], config: ScoringConfig | None = None, compute: PeerMatrix | None = None
) -> list[RankSignal]:
    """A pipeline stage whose ranks compute longer than the other stages' (stage_imbalance).

    Every rank of a slow stage is slow alike, so no rank stands out within the stage; the stage
    stands out against the others, and the other stages pay for it waiting in p2p receives.
    ``compute``, when given, holds the compute kernels' ``total_ns`` of every record.
    """
    cfg = config or ScoringConfig()
    pp = [int(rec.get("pp_rank", -1)) for rec in records]
    stages = dict.fromkeys(pp)
    if not _staged(stages):
        return []
    if compute is not None:
        compute_ns = np.nansum(compute.features["total_ns"], axis=1)
    else:
        compute_ns = np.array([_compute_ns(rec) for rec in records], dtype=np.float64)
    stage_of = np.array(pp, dtype=np.int64)
    med = {s: float(np.median(compute_ns[stage_of == s])) for s in stages}
    slowest = max(med, key=lambda s: med[s])
    others = float(np.median([v for s, v in med.items() if s != slowest]))
    if others <= 0:
        return []
    gap = med[slowest] / others - 1
    budget = cfg.min_loss_fraction * float(np.median([r["iteration_ns"] for r in records]))
    loss = med[slowest] - others
    if gap < cfg.min_relative_gap or loss < budget:
        return []
    ranks = tuple(sorted(int(rec["rank"]) for rec, s in zip(records, pp, strict=True) if s == slowest))
    return [
        RankSignal(
            rank=-1, host="", category="stage_imbalance", function="compute", metric="compute_ns",
            value=med[slowest], peer_median=others, score=gap / cfg.min_relative_gap, loss_ns=loss,
            evidence={"stage": slowest, "stage_compute_ns": {str(s): v for s, v in sorted(med.items())},
                      "relative_gap": round(gap, 4)},
            ranks=ranks, subject=f"stage:{slowest}",
        )
    ]  # fmt: skip


def _staged(stages: Iterable[int]) -> bool:
    """Pipeline stages are known and there are several to compare."""
    stages = set(stages)
    return len(stages) >= 2 and -1 not in stages


def _compute_ns(rec: dict[str, Any]) -> int:
    return sum(t for t, k in zip(rec["total_ns"], rec["kind"], strict=True) if k == FunctionKind.COMPUTE)


def _median_by_group(x: F64, group: I64, n_groups: int) -> F64:
    """Column medians (NaN ignored, NaN when none) of each group's rows, as ``np.nanmedian`` gives
    them: the two middle values summed and halved. Groups of one size share one sort."""
    sizes = np.bincount(group, minlength=n_groups)
    order = np.argsort(group, kind="stable")
    starts = np.cumsum(sizes) - sizes
    out = np.full((n_groups, x.shape[1]), np.nan)
    for size in np.unique(sizes[sizes > 0]).tolist():
        groups = np.flatnonzero(sizes == size)
        out[groups] = nan_median(x[order[starts[groups][:, None] + np.arange(size)]], axis=1)
    return out


def score_hosts(
    pm: PeerMatrix, config: ScoringConfig | None = None, scorer: OutlierScorer | None = None
) -> list[RankSignal]:
    """Hosts whose NIC/PCIe traffic fluctuates more than other hosts' during the same collectives.

    Congestion on a host's network path makes its transfers stall and burst; every rank of the host
    shares the pattern, so hosts (median over their ranks) are compared, not ranks. The estimated
    loss is an upper bound: the transfer time of the collectives concerned. ``pm``: every rank's collectives.
    """
    cfg = config or ScoringConfig()
    score = scorer or cfg.scorer()
    hosts = sorted(set(pm.hosts))
    if len(hosts) < cfg.min_peers:
        return []
    if not pm.functions:
        return []
    where = {h: i for i, h in enumerate(hosts)}
    host_idx = np.fromiter(map(where.__getitem__, pm.hosts), dtype=np.int64, count=len(pm.hosts))
    per_host = _median_by_group(pm.features["pcie_cv"], host_idx, len(hosts))
    active_mean = _median_by_group(pm.features["pcie_mean_bps"], host_idx, len(hosts))
    with quiet_nan_warnings():
        transfer = np.nanmin(pm.features["mean_ns"], axis=0)
    calls = nan_median(pm.features["calls"])
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
                rank=-1, host=hosts[h], category="link_slow", function=pm.functions[j],
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


def peer_group_rows(records: Sequence[dict[str, Any]]) -> list[I64]:
    """Rows of ranks that should behave alike: the same pipeline stage (all ranks when unknown)."""
    groups: dict[int, list[int]] = {}
    for i, rec in enumerate(records):
        groups.setdefault(int(rec.get("pp_rank", -1)), []).append(i)
    return [np.array(rows, dtype=np.int64) for rows in groups.values()]


def score_iteration(
    records: Sequence[dict[str, Any]],
    config: ScoringConfig | None = None,
    scorer: OutlierScorer | None = None,
    index: FunctionIndex | None = None,
) -> list[RankSignal]:
    """Every signal of one iteration of one job: per peer group, grouped by host, plus hosts and stages.

    One set of matrices serves every test; ``index`` (the job's, kept across iterations) spares
    re-interning function names. Where ``gather`` cannot be used, ``PeerMatrix.build`` per group.
    """
    cfg = config or ScoringConfig()
    score = scorer or cfg.scorer()
    staged = _staged(int(rec.get("pp_rank", -1)) for rec in records)
    gathered = gather_matrices(records, index, staged)
    pms = gathered or build_matrices(records)
    signals: list[RankSignal] = []
    for rows in peer_group_rows(records):
        if rows.size < cfg.min_peers:
            continue
        if gathered is None and rows.size < len(records):
            group = build_matrices([records[i] for i in rows.tolist()])
        else:
            group = pms.rows(rows)
        signals += _score_group(group, cfg, score)
    signals = explain_late_ranks(signals, records)
    signals = group_by_host(signals, records, cfg.host_group_min_share)
    compute = gathered.of_kind(_COMPUTE) if gathered is not None and staged else None
    return signals + score_hosts(pms.of_kind(_COLLECTIVE), cfg, score) + score_stages(records, cfg, compute)
