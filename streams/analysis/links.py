"""Links compared with their peers: a degraded link per rank (low, steady peak throughput during
collectives), congestion per host (on/off fluctuation shared by a host's ranks), and, from kernel times
alone, a collective group whose transfer is slower than equivalent groups' (``score_transfers``); and which of a
replayed iteration's rings have like rings to be compared with (``like_rings``, ``compared_rings``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas.vocabulary import RING_COLLECTIVES
from fleetscope.streams.analysis.patterns import collective_class, process_group_of
from fleetscope.streams.analysis.peermatrix import PeerMatrix
from fleetscope.streams.analysis.replay import CallGraph
from fleetscope.streams.analysis.signals import (
    OutlierScorer,
    RankSignal,
    ScoringConfig,
    flagged,
    robust_z,
    row_signal,
    top_functions,
)
from fleetscope.streams.analysis.stages import runs_kernels
from fleetscope.streams.analysis.stats import F64, I64, nan_median, quiet_nan_warnings

LINK_FAMILIES = ("nvlink", "pcie")
LINK_IN_USE_SHARE = 0.25
"""A rank whose link peaks below this share of the best rank's during a collective does not route
that collective over this link (e.g. p2p inside a host never touches PCIe): it is not compared."""

RING_PACE_METRIC = "transfer_ns"
"""A group's transfer time against like groups' (``score_transfers``): a claim about its ring's pace."""
LINK_SAMPLE_METRICS = tuple(f"{fam}_peak_bps" for fam in LINK_FAMILIES)
"""A rank's link against its peers' from its samples (``_slow_links``): its loss is the transfer time its rings
would save at the peers' pace, which the replay sees only where its rings' pace stands out from like rings'."""


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
            flag = flagged(sc, cfg, low=True)
            with np.errstate(invalid="ignore", divide="ignore"):
                ratios.append((feature, np.where(flag, x / sc.median, 1.0), x, sc))
        if not ratios:
            continue
        ratio = np.nan_to_num(np.minimum.reduce([r for _, r, _, _ in ratios]), nan=1.0)
        cv = pm.features[f"{fam}_cv"]
        with quiet_nan_warnings():
            steadier = cv < nan_median(cv, axis=0)  # the link that paces a ring is its steadiest
        ratio = np.where(steadier, ratio, 1.0)
        excess = np.nan_to_num(transfer * (1 - ratio) * calls)
        loss = excess.sum(axis=1)
        for i in np.flatnonzero(loss >= budget).tolist():
            if i in out and out[i].loss_ns >= loss[i]:
                continue
            j = int(np.argmax(excess[i]))
            feature, _, x, sc = min(ratios, key=lambda r: r[1][i, j])
            peer_cv = float(nan_median(cv[:, j]))
            pattern = "steady"
            out[i] = row_signal(
                pm, i, category="link_slow", function=pm.functions[j], metric=f"{fam}_{feature}",
                value=float(x[i, j]), peer_median=float(sc.median[j]), score=float(sc.z[i, j]),
                loss_ns=float(loss[i]),
                evidence={
                    "link": fam,
                    "pattern": pattern,
                    "throughput_cv": float(cv[i, j]),
                    "peer_throughput_cv": peer_cv,
                    "functions": top_functions(pm.functions, excess[i], x[i], sc.median, sc.z[i]),
                    "flagged_collectives": int(np.sum(ratio[i] < 1)),
                },
            )  # fmt: skip
    return out


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
    shares the pattern, so hosts (median over their ranks) are compared, not ranks. The host's NIC paces
    every ring it is in, so the other hosts' links move the same bytes below their reach: the loss is the
    share of its collectives' transfer (all of them, once one is flagged) that their links idle
    (``_paced_share``), what the transfer saves at their own pace. ``pm``: every rank's collectives.
    """
    cfg = config or ScoringConfig()
    score = scorer or robust_z(cfg)
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
    flag = flagged(sc, cfg, min_gap=cfg.host_min_relative_gap) & (sm.z >= cfg.z_threshold)
    paced = _paced_share(active_mean, _median_by_group(pm.features["pcie_peak_bps"], host_idx, len(hosts)))
    # the host's NIC paces every ring it is in, flagged in this iteration or not
    loss = np.where(flag.any(axis=1, keepdims=True), np.nan_to_num(transfer * calls * paced), 0.0).sum(axis=1)
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


def _paced_share(active_mean: F64, peak: F64) -> F64:
    """Per host and collective, the share of the transfer the other hosts' links idle: one less the median
    of their active mean over the median of their peak (0 where unknown).

    A ring moves at its slowest member's pace: under one congested NIC the others send the same bytes at
    that pace, below what their links reach, so at their own pace the transfer takes this share less. On a
    healthy ring they run near their reach and the share is small."""
    hosts = active_mean.shape[0]
    others = np.nonzero(~np.eye(hosts, dtype=bool))[1].reshape(hosts, max(hosts - 1, 0))  # each host's others
    with np.errstate(invalid="ignore", divide="ignore"):  # every host at once: one sort, as np.nanmedian gives
        used = nan_median(active_mean[others], axis=1) / nan_median(peak[others], axis=1)
    return np.nan_to_num(np.clip(1.0 - used, 0.0, 1.0))


_RINGS = tuple(f"nccl:{op}[" for op in RING_COLLECTIVES)


@dataclass(frozen=True)
class RingGroups:
    """The groups of one iteration's ring collectives (one per collective column), read from their members
    only: who they are, the transfer (the shortest member's mean kernel: a ring ends on every member at the
    last arrival plus the transfer), one call's message size, the calls, and what makes groups equivalent."""

    columns: list[int]
    """The collective's column in the peer matrix, per group."""
    members: list[I64]
    """The peer matrix rows of each group's members."""
    transfer: F64
    size: F64
    calls: F64
    shape: list[tuple[Any, ...]]
    """Groups that do the same work share a shape: the operation and size class, the member count, and
    which layout dimensions vary among the members (tensor-parallel, pipeline, data-parallel); and, where
    the ranks run no kernels, the group's pipeline stage (``ring_groups``)."""
    hosts: I64
    """How many hosts each group's members are on."""
    linked: npt.NDArray[np.bool_]
    """Whether a link carries the group's data. Not where no rank runs a kernel and the members share one
    host: a CPU job's collective there is a copy through the host's memory, which the host's CPUs do, so its
    pace is theirs, slowed by any contention, and no link can be slow."""


def ring_groups(pm: PeerMatrix, records: Sequence[dict[str, Any]]) -> RingGroups | None:
    """Every member of every ring collective at once (no Python loop per group); None without a layout
    (which groups do the same work is then unknown) or without ring collectives.

    Where no rank runs a kernel (gloo on CPUs), a collective's transfer is CPU work that runs beside its
    stage's own: groups of different pipeline stages are then not equivalent (each stage's compute slows
    its own transfers). A GPU's transfer runs on its links, whatever its stage computes."""
    if not pm.functions:
        return None
    mean_ns, calls, nbytes = pm.features["mean_ns"], pm.features["calls"], pm.features["nbytes"]
    coords = np.array([[int(r.get(c, -1)) for c in ("tp_rank", "pp_rank", "dp_rank")] for r in records], dtype=np.int64)
    if (coords < 0).any():
        return None
    rows_of = {int(r["rank"]): i for i, r in enumerate(records)}
    at = np.fromiter((rows_of.get(int(r), -1) for r in pm.ranks), np.int64, len(pm.ranks))
    if (at < 0).any():
        return None
    ring = [j for j, name in enumerate(pm.functions) if name.startswith(_RINGS)]
    if not ring:
        return None
    row, col = np.nonzero(~np.isnan(mean_ns[:, ring]))
    n = len(ring)
    count = np.bincount(col, minlength=n)
    varying: list[npt.NDArray[Any]] = []
    for c in coords[at].T:
        low, high = np.full(n, np.iinfo(np.int64).max), np.full(n, -1)
        np.minimum.at(low, col, c[row])
        np.maximum.at(high, col, c[row])
        varying.append(high > low)
    _, host = np.unique(np.asarray(pm.hosts), return_inverse=True)
    pairs = np.unique(col * (int(host.max()) + 1) + host[row])
    hosts = np.bincount(pairs // (int(host.max()) + 1), minlength=n)
    order = np.argsort(col, kind="stable")
    row, col = row[order], col[order]
    members = np.split(row, np.cumsum(count)[:-1])
    starts = np.cumsum(count) - count
    cell = np.asarray(ring)[col]
    some = count > 0
    transfer, size = np.full(n, np.nan), np.full(n, np.nan)
    transfer[some] = np.minimum.reduceat(mean_ns[row, cell], starts[some])
    size[some] = np.add.reduceat(np.nan_to_num(nbytes[row, cell]), starts[some]) / count[some]
    per_call = _median_by_group(calls[row, cell][:, None], col, n)[:, 0]
    stage = np.full(n, -1, dtype=np.int64)
    gpu = runs_kernels(records)
    if not gpu:
        stage[col] = np.where(varying[1][col], -1, coords[at][row, 1])
    shape = [
        (collective_class(pm.functions[j]), int(count[g]), *(bool(v[g]) for v in varying), int(stage[g]))
        for g, j in enumerate(ring)
    ]
    linked = np.ones(n, dtype=bool) if gpu else hosts > 1
    return RingGroups(ring, members, transfer, size, per_call, shape, hosts, linked)


def _per_byte(transfer: F64, size: F64) -> F64 | None:
    """Time per byte of each group; None where a message size is unknown."""
    with quiet_nan_warnings():
        per_byte = transfer / np.where(size > 0, size, np.nan)
    return None if np.isnan(per_byte).any() else per_byte


def _typical(size: F64, rate: float, peers: F64) -> F64:
    """The transfer the peers' typical rate (time per byte) and latency give each group: the larger of the
    rate times its size and the peers' median transfer."""
    return np.maximum(rate * size, float(np.median(peers)))


def score_transfers(
    pm: PeerMatrix, groups: RingGroups | None, cfg: ScoringConfig, scorer: OutlierScorer
) -> list[RankSignal]:
    """Collective groups whose transfer is slower than the same collective's on equivalent groups.

    A collective ends on every member at the latest arrival plus the transfer, so the member that waited
    least (its shortest mean kernel) shows the transfer itself. One slow link paces its whole ring: every
    member's kernel grows alike and no rank stands out among its own group, but the group stands out among
    the groups doing the same work (one per data-parallel replica for tensor-parallel groups): the same
    shape (``RingGroups.shape``) on as many hosts. Time per byte is compared (sizes differ within a size
    class), and the group must take longer outright too (a smaller message is latency-bound: more time per
    byte, not more time). Readable from traces alone (no link samples needed); the group's ranks are its
    subject (the slow link is one of theirs). Two or three equivalent groups are held to the fastest of the
    others (``_slower_than_the_fastest``); a group with none, a job's one ring, cannot be judged so."""
    if groups is None:
        return []
    classes: dict[tuple[Any, ...], list[int]] = {}
    for g, shape in enumerate(groups.shape):
        if shape[1] >= 2 and groups.linked[g]:
            classes.setdefault((*shape, int(groups.hosts[g])), []).append(g)
    budget = cfg.min_loss_fraction * float(np.median(pm.iteration_ns))
    out: list[RankSignal] = []
    for members in classes.values():
        if len(members) < 2:
            continue
        transfer, size = groups.transfer[members], groups.size[members]
        per_byte = _per_byte(transfer, size)
        if per_byte is None:
            continue
        if len(members) >= cfg.min_peers:
            sc = scorer(per_byte[:, None])
            # slower per byte, and slower outright: a group with smaller messages pays the fixed latency on fewer
            # bytes (more per byte, not more time), one with larger ones takes longer at the same rate
            longest = float(np.median(transfer)) * (1 + cfg.transfer_min_relative_gap)
            flag = flagged(sc, cfg, min_gap=cfg.transfer_min_relative_gap)[:, 0] & (transfer >= longest)
            typical, z = _typical(size, float(sc.median[0]), transfer), sc.z[:, 0]
        else:
            flag, typical, z = _slower_than_the_fastest(transfer, per_byte, size, cfg)
        few = len(members) < cfg.min_peers
        for i in np.flatnonzero(flag).tolist():
            g = members[i]
            j, rows = groups.columns[g], groups.members[g]
            loss = (transfer[i] - typical[i]) * groups.calls[g]
            if loss < budget:
                continue
            pg = process_group_of(pm.functions[j])
            out.append(
                RankSignal(
                    rank=-1, host="", category="link_slow", function=pm.functions[j], metric=RING_PACE_METRIC,
                    value=float(transfer[i]), peer_median=float(typical[i]), score=float(z[i]),
                    loss_ns=float(loss), ranks=tuple(sorted(int(pm.ranks[r]) for r in rows)), subject=f"group:{pg}",
                    evidence={"scope": "group", "pattern": "slow transfer", "groups_compared": len(members),
                              "process_group": pg, FEW_GROUPS: few},
                )
            )  # fmt: skip
    return _one_rank(out, pm)


FEW_GROUPS = "few_groups"
"""A transfer signal's evidence: judged among two or three equivalent groups (``_slower_than_the_fastest``),
which ``SteadyTransfers`` holds to its history."""


@dataclass
class SteadyTransfers:
    """A job's transfers judged among few groups, kept only where the same subject was slower in all but one
    of its latest ``iterations``. A degraded link slows its ring at every step; contention slows one group now
    and another next, which two or three groups cannot tell from a link without that history. Signals judged
    among more groups pass: their peers' spread is the yardstick."""

    iterations: int = 5
    _flagged: dict[tuple[str, str], deque[int]] = field(default_factory=dict)

    def keep(self, signals: list[RankSignal], iteration: int) -> list[RankSignal]:
        """The signals, less few-groups ``link_slow`` ones whose subject was not slower in all but one of its
        latest ``iterations``."""
        out = []
        for sig in signals:
            if sig.category != "link_slow" or not sig.evidence.get(FEW_GROUPS, False):
                out.append(sig)
                continue
            flagged_at = self._flagged.setdefault(sig.key(), deque(maxlen=self.iterations))
            flagged_at.append(iteration)
            if sum(1 for i in flagged_at if i > iteration - self.iterations) >= self.iterations - 1:
                out.append(sig)
        return out


def _slower_than_the_fastest(
    transfer: F64, per_byte: F64, size: F64, cfg: ScoringConfig
) -> tuple[npt.NDArray[np.bool_], F64, F64]:
    """Two or three equivalent groups (fewer than ``min_peers``: no median and spread to judge by): a group
    slower than the fastest of the others by ``transfer_min_relative_gap``, per byte and outright. A link
    cannot be faster than healthy, so the fastest group is the yardstick; a degraded one halves its rate or
    worse (lanes down, a PCIe downgrade), far beyond what arrival jitter leaves in the shortest member's
    kernel. Each group's flag, typical transfer (``_typical`` at the fastest other's rate) and its gap in
    units of the relative scale floor (the robust z whose spread is at its floor)."""
    itself = np.eye(transfer.size, dtype=bool)
    rate = np.where(itself, np.inf, per_byte).min(axis=1)
    fastest = np.where(itself, np.inf, transfer).min(axis=1)
    gap = 1 + cfg.transfer_min_relative_gap
    flag = (per_byte >= gap * rate) & (transfer >= gap * fastest)
    typical = np.maximum(rate * size, fastest)
    z = (per_byte - rate) / (cfg.rel_scale_floor * rate)
    return flag, typical, z


def _one_rank(groups: list[RankSignal], pm: PeerMatrix) -> list[RankSignal]:
    """Slow groups that all share one rank are that rank's link: it slows every ring it is in (its
    tensor-parallel and its data-parallel group), which no link of another member explains."""
    if len(groups) < 2:
        return groups
    common = set.intersection(*(set(g.ranks) for g in groups))
    if len(common) != 1:
        return groups
    rank = common.pop()
    row = int(np.flatnonzero(pm.ranks == rank)[0])
    top = max(groups, key=lambda g: g.loss_ns)
    evidence = {
        **top.evidence, "scope": "rank", "process_groups": [g.evidence["process_group"] for g in groups],
        "group_ranks": sorted({r for g in groups for r in g.ranks}),
        FEW_GROUPS: all(g.evidence[FEW_GROUPS] for g in groups),
    }  # fmt: skip
    return [replace(top, rank=rank, host=pm.hosts[row], ranks=(rank,), subject="", evidence=evidence)]


def like_rings(graph: CallGraph) -> tuple[I64, I64]:
    """The instances whose pace can be compared (two or more members) and, per each, what it shares with its
    like ones: the op and size class (``replay.call_kind``) and the bytes per call within 1/16 of an octave.
    Rings of different stages move different bytes: only like is compared with like."""
    multi = np.flatnonzero(graph.members >= 2)
    octave = np.rint(np.log2(np.maximum(graph.nbytes[multi], 1.0)) * 16).astype(np.int64)
    like: I64 = graph.klass[multi] * 4096 + octave
    return multi, like


def compared_rings(graph: CallGraph) -> npt.NDArray[np.bool_]:
    """Per instance: whether another process group runs instances like it (``like_rings``), so that its pace
    has a level to be brought to."""
    multi, like = like_rings(graph)
    out = np.zeros(graph.members.size, dtype=bool)
    if multi.size:
        cells = np.unique(like * (len(graph.groups) + 1) + graph.group[multi]) // (len(graph.groups) + 1)
        kinds, groups = np.unique(cells, return_counts=True)
        out[multi] = np.isin(like, kinds[groups >= 2])
    return out
