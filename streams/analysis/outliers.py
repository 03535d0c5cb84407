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
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import FunctionKind
from fleetscope.streams.analysis.links import (
    LINK_FAMILIES,
    _slow_links,
    ring_groups,
    score_hosts,
    score_transfers,
)
from fleetscope.streams.analysis.peermatrix import FunctionIndex, PeerMatrices, PeerMatrix
from fleetscope.streams.analysis.roles import absent_as_zero, late_by_compute, peer_group_rows, role_codes
from fleetscope.streams.analysis.shards import Columns, ShardColumns, assemble, first_keys, split_records
from fleetscope.streams.analysis.signals import (
    OutlierScorer,
    RankSignal,
    ScoringConfig,
    flagged,
    robust_z,
    row_signal,
    top_functions,
)
from fleetscope.streams.analysis.stages import score_stages, staged
from fleetscope.streams.analysis.stats import F64, I64, nan_median, quiet_nan_warnings
from fleetscope.streams.analysis.timelost import bound_by_lateness, split_shares

__all__ = [  # names other modules import from here
    "OutlierScorer", "RankSignal", "ScoringConfig", "build_matrices", "gather_matrices", "group_by_host",
    "merge_columns", "peer_group_rows", "score_columns", "score_hosts", "score_iteration", "score_peer_group",
    "score_stages",
]  # fmt: skip

_COMPUTE, _COLLECTIVE, _PYTHON = int(FunctionKind.COMPUTE), int(FunctionKind.COLLECTIVE), int(FunctionKind.PYTHON)
READS: dict[int, tuple[str, ...]] = {
    _COMPUTE: ("mean_ns",),
    _COLLECTIVE: (
        "mean_ns",
        "calls",
        "nbytes",
        "pcie_mean_bps",
        *(f"{f}_{x}" for f in LINK_FAMILIES for x in ("peak_bps", "cv")),
    ),
    _PYTHON: ("self_ns",),
}
"""What the tests below read, by kind of function; gather converts no more. Stages add compute totals."""
GATHERED_SHARE = 0.5
"""A late rank's lateness gathers in one call when its peers' longest call outlasts its own by this share of
its lateness over all its calls (``_step_lateness``)."""
_STAGE_READS = {**READS, _COMPUTE: (*READS[_COMPUTE], "total_ns")}
_ON_DEMAND = {_COMPUTE: ("calls",), _COLLECTIVE: ("max_ns",)}
"""Converted when some rank is flagged only: calls weigh a kernel's excess time, a collective's longest call
gives a late rank's lateness in one step (``_step_lateness``); nothing else reads them."""
_EVERY_READ = {k: (*names, *_ON_DEMAND.get(k, ())) for k, names in _STAGE_READS.items()}


def gather_matrices(
    records: Sequence[dict[str, Any]], index: FunctionIndex | None = None, staged: bool = False
) -> PeerMatrices | None:
    """The matrices every test reads (``PeerMatrices.gather``); ``staged`` adds compute totals."""
    return PeerMatrices.gather(with_self_time(records), _STAGE_READS if staged else READS, index, _ON_DEMAND)


def build_matrices(records: Sequence[dict[str, Any]]) -> PeerMatrices:
    """The same from ``PeerMatrix.build``: any records, every entry of every feature converted."""
    features = tuple(dict.fromkeys(name for names in _EVERY_READ.values() for name in names))
    return PeerMatrices.split(PeerMatrix.build(with_self_time(records), features), _EVERY_READ)


def _slow_kernels(pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: float) -> dict[int, RankSignal]:
    """Ranks whose compute kernels take longer than the same kernels on their peers (gpu_slow).

    Two ways: kernels that each stand out (robust z and relative gap per kernel), or a uniform
    slowdown of many short kernels whose per-kernel excess is lost in the peers' spread (a x1.2 on
    kernels of a few µs): the rank's typical ratio to its peers' medians (the mean over its kernels)
    stands out among the ranks' ratios. Either way the excess must cost ``budget`` (a share of the
    iteration's time), so short kernels are judged by what they add to the iteration, not skipped.
    """
    if not pm.functions:
        return {}
    mean = pm.features["mean_ns"]
    sc = pm.scored("mean_ns", scorer)
    flag = flagged(sc, cfg)
    excess = np.zeros(mean.shape, order="F")  # laid out as the scores, so row sums add in the same order
    suspects = np.flatnonzero(flag.any(axis=1))
    if suspects.size:  # calls matter only where flagged: converted for these ranks alone
        calls = np.nan_to_num(pm.feature_rows("calls", suspects))
        some = np.where(flag[suspects], (mean[suspects] - sc.median) * calls, 0.0)
        some[np.isnan(some)] = 0.0  # as nansum counts them, without copying the whole matrix
        excess[suspects] = some
    loss = excess.sum(axis=1)
    uniform = _uniformly_slow(_kernel_ratio(pm), cfg, scorer) & (loss < budget)
    rows = np.flatnonzero(uniform)
    if rows.size:  # every kernel's excess, net of the ones it runs faster
        calls = np.nan_to_num(pm.feature_rows("calls", rows))
        excess[rows] = np.nan_to_num((mean[rows] - sc.median) * calls)
        loss[rows] = excess[rows].sum(axis=1)
    out: dict[int, RankSignal] = {}
    for i in np.flatnonzero(loss >= budget).tolist():
        j = int(np.nanargmax(excess[i]))
        evidence = {
            "functions": top_functions(pm.functions, excess[i], mean[i], sc.median, sc.z[i]),
            "flagged_functions": int(flag[i].sum()),
            "compared_functions": int(np.sum(~np.isnan(mean[i]))),
        }
        if uniform[i]:
            with quiet_nan_warnings():
                evidence["typical_ratio"] = round(float(np.nanmean(mean[i] / sc.median)), 4)
        out[i] = row_signal(
            pm, i, category="gpu_slow", function=pm.functions[j], metric="mean_ns",
            value=float(mean[i, j]), peer_median=float(sc.median[j]), score=float(sc.z[i, j]),
            loss_ns=float(loss[i]), evidence=evidence,
        )  # fmt: skip
    return out


_RATIO = "mean_ratio"
"""Compute kernels' mean time as a ratio to the column's peer median (a feature, once ``mean_ns`` is scored)."""


def _kernel_ratio(pm: PeerMatrix) -> F64:
    """Each kernel's mean time over its peers' median (NaN where that is not positive), computed once."""
    got = pm.features.get(_RATIO)
    if got is None:
        median = pm.scores["mean_ns"].median
        with np.errstate(divide="ignore", invalid="ignore"):
            got = pm.features[_RATIO] = np.where(median > 0, pm.features["mean_ns"] / median, np.nan)
    return got


def _uniformly_slow(ratio: F64, cfg: ScoringConfig, scorer: OutlierScorer) -> npt.NDArray[np.bool_]:
    """Rows whose typical kernel (mean ratio to the column medians) is slower than the other rows' by
    the z threshold and the relative gap."""
    with quiet_nan_warnings():
        typical = np.nanmean(ratio, axis=1)[:, None]
    st = scorer(typical)
    with np.errstate(invalid="ignore"):
        return flagged(st, cfg)[:, 0]


def _slow_host(
    pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: float, role: I64 | None = None
) -> dict[int, RankSignal]:
    """Ranks that spend a larger share of the iteration in a host function's own work than their peers.

    Host functions are compared by self time per iteration (time in nested spans and in blocking
    calls left out: an annotation that only waits for the GPU or the peers is no work), absent
    counting as zero where ranks of the same role run the function (``roles.absent_as_zero``), so a
    function that only the culprit runs (a GC pause, a stall) still stands out against its peers'
    zero, and one that only some stages or tensor slots run is not compared on the others.
    """
    if not pm.functions:
        return {}
    share, it = _host_share(pm, role)
    sc = pm.scored(_SHARE, lambda x: scorer(x, cfg.host_share_floor))
    flag = (sc.z >= cfg.z_threshold) & (share - sc.median >= cfg.min_loss_fraction / 2)
    excess = np.where(flag, np.nan_to_num((share - sc.median) * it), 0.0)
    loss = excess.sum(axis=1)
    out: dict[int, RankSignal] = {}
    for i in np.flatnonzero(loss >= budget).tolist():
        j = int(np.argmax(excess[i]))
        total = share[i] * it
        out[i] = row_signal(
            pm, i, category="host_slow", function=pm.functions[j], metric="self_ns",
            value=float(total[j]), peer_median=float(sc.median[j] * it), score=float(sc.z[i, j]),
            loss_ns=float(loss[i]),
            evidence={
                "functions": top_functions(pm.functions, excess[i], total, sc.median * it, sc.z[i]),
                "flagged_functions": int(flag[i].sum()),
                "compared_functions": int(np.sum(~np.isnan(share[i]))),
            },
        )  # fmt: skip
    return out


_SHARE = "self_share"
"""Host functions' self time as a share of the group's median iteration, absent as zero by role (a feature)."""


def _host_share(pm: PeerMatrix, role: I64 | None) -> tuple[F64, float]:
    """Each host function's self time per iteration as a share of it (``_slow_host``), computed once."""
    it = float(np.median(pm.iteration_ns))
    share = pm.features.get(_SHARE)
    if share is None:
        own = pm.features["self_ns"]
        own = absent_as_zero(own, role, pm.functions) if role is not None else np.nan_to_num(own)
        share = pm.features[_SHARE] = own / it
    return share, it


def _late_arrivals(
    pm: PeerMatrix, cfg: ScoringConfig, scorer: OutlierScorer, budget: float
) -> tuple[dict[int, RankSignal], F64]:
    """Ranks that arrive last at collectives: they wait least, so their collectives are the shortest;
    and every rank's arrival lateness (largest over its collectives, NaN where none is compared). Whether
    a late rank is a cause or a victim is the replay's to say (``attribution``).

    Uses durations on each rank's own clock only, so clock skew between hosts does not matter.
    """
    if not pm.functions:
        return {}, np.full(pm.ranks.size, np.nan)
    mean = pm.features["mean_ns"]
    sc = pm.scored("mean_ns", scorer)
    flag = flagged(sc, cfg, low=True)
    per_call = sc.median - mean
    # A late rank delays the job by its lateness once, however many collectives it is late for.
    step = _step_lateness(pm, per_call) if flag.any() else per_call
    lateness = np.where(flag, step, 0.0)
    loss = np.nanmax(np.nan_to_num(lateness), axis=1)
    with quiet_nan_warnings():
        arrival = np.nanmax(np.where(np.isnan(sc.z), np.nan, per_call), axis=1)
    out: dict[int, RankSignal] = {}
    for i in np.flatnonzero(loss >= budget).tolist():
        j = int(np.nanargmax(lateness[i]))
        out[i] = row_signal(
            pm, i, category="straggler", function=pm.functions[j], metric="arrival_lateness_ns",
            value=float(sc.median[j] - mean[i, j]), peer_median=0.0, score=float(-sc.z[i, j]),
            loss_ns=float(loss[i]),
            evidence={
                "functions": top_functions(pm.functions, lateness[i], mean[i], sc.median, sc.z[i]),
                "flagged_collectives": int(flag[i].sum()),
            },
        )  # fmt: skip
    return out, arrival


def _step_lateness(pm: PeerMatrix, per_call: F64) -> F64:
    """How long a rank late at a collective keeps its peers waiting in one step. Its lateness per call,
    except where that lateness gathers in one call: a rank that starts its step late holds its peers at
    the step's first call, then runs in step with them, and the mean over the step's calls thins that wait
    out. There the peers' longest call is longer than its own by at least half its lateness over all its
    calls, and that difference, bounded by the whole, is the step's wait. A rank behind by about the same
    at every call (overlapped data-parallel buckets) keeps its lateness per call: the step loses that once."""
    every = np.arange(pm.ranks.size)
    longest = pm.feature_rows("max_ns", every)
    whole = per_call * np.nan_to_num(pm.feature_rows("calls", every))
    in_one_call = nan_median(longest, axis=0) - longest
    gathered = in_one_call >= GATHERED_SHARE * whole  # NaN (a column without its longest call): not gathered
    out: F64 = np.where(gathered, np.fmax(per_call, np.minimum(in_one_call, whole)), per_call)
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
    records = with_self_time(records)
    pms = gather_matrices(records) or build_matrices(records)
    return _score_group(pms, cfg, scorer or robust_z(cfg), role_codes(records), _one_stage(records))


def with_self_time(records: Sequence[dict[str, Any]]) -> Sequence[dict[str, Any]]:
    """The records, each with host self times: a producer that predates ``self_ns`` sent none (its
    total stands in for it)."""
    if all(len(r.get("self_ns", ())) == len(r["function"]) for r in records):
        return records
    return [r if len(r.get("self_ns", ())) == len(r["function"]) else {**r, "self_ns": r["total_ns"]} for r in records]


def _one_stage(records: Sequence[dict[str, Any]]) -> bool:
    """Whether the records are of one known pipeline stage (a peer group of ranks doing the same work)."""
    stages = {int(r.get("pp_rank", -1)) for r in records}
    return len(stages) == 1 and -1 not in stages


def _score_group(
    pms: PeerMatrices,
    cfg: ScoringConfig,
    score: OutlierScorer,
    role: I64 | None = None,
    one_stage: bool = False,
) -> list[RankSignal]:
    """1. A rank's excess time must cost at least ``min_loss_fraction`` of the median iteration to
    matter; 2. gpu_slow from compute kernels, host_slow from host functions' self time, link_slow
    from link throughput during collectives; 3. a late arrival with none of these causes is a
    straggler; with a cause, it corroborates the cause; 4. a cause's loss is the time saved if it
    were fixed (``timelost``). ``role``: each row's role code (``roles.role_codes``). ``one_stage``: the
    ranks are of one known stage, so their compute compares (``_without_healthy_spread``).
    """
    budget = cfg.min_loss_fraction * float(np.median(pms.iteration_ns))
    collectives = pms.of_kind(_COLLECTIVE)
    late, arrival = _late_arrivals(collectives, cfg, score, budget)
    gpu = bound_by_lateness(_slow_kernels(pms.of_kind(_COMPUTE), cfg, score, budget), arrival)
    host = bound_by_lateness(_slow_host(pms.of_kind(_PYTHON), cfg, score, budget, role), arrival)
    host = _without_gpu_echo(host, gpu)
    causes = [gpu, host, _slow_links(collectives, cfg, score, budget)]
    signals: list[RankSignal] = []
    for found in causes:
        for i, sig in found.items():
            if i in late:
                sig.evidence["arrival_lateness_ns"] = late[i].loss_ns
            signals.append(sig)
    explained = {i for found in causes for i in found}
    alone = {i: sig for i, sig in late.items() if i not in explained}
    if one_stage:
        alone = _without_healthy_spread(alone, pms.of_kind(_COMPUTE), cfg)
    signals += alone.values()
    return signals


GPU_ECHO_SHARE = 1.25
"""A host span that grows by no more than this times its rank's GPU excess only waits for its GPU."""


def _without_gpu_echo(host: dict[int, RankSignal], gpu: dict[int, RankSignal]) -> dict[int, RankSignal]:
    """Host signals less those of ranks whose slow GPU explains them: a CPU annotation around GPU work
    (``## backward ##`` that ends when its kernels end) grows with the kernels; the GPU's evidence
    keeps what the host spans waited (``host_wait_ns``)."""
    out = {}
    for i, sig in host.items():
        cause = gpu.get(i)
        host_excess = float(sig.evidence.get("excess_ns", sig.loss_ns))
        if cause is not None and host_excess <= GPU_ECHO_SHARE * float(cause.evidence.get("excess_ns", cause.loss_ns)):
            cause.evidence["host_wait_ns"] = host_excess
            continue
        out[i] = sig
    return out


def _without_healthy_spread(late: dict[int, RankSignal], pm: PeerMatrix, cfg: ScoringConfig) -> dict[int, RankSignal]:
    """Stragglers with no cause of their own less those late by a GPU that computes less than
    ``min_relative_gap`` longer than its peers (``roles.late_by_compute``): the slowest healthy GPU of a stage."""
    if not late or not pm.functions:
        return late
    total = pm.features.get("total_ns")
    if total is None:  # gathered without compute totals: calls are converted on demand
        total = pm.features["mean_ns"] * pm.feature_rows("calls", np.arange(pm.ranks.size))
    compute = np.nansum(total, axis=1)
    median = float(np.median(compute))
    return {
        i: sig
        for i, sig in late.items()
        if late_by_compute(sig.loss_ns, float(compute[i]) - median, median, cfg.min_relative_gap) != ""
    }


HOST_MEMBER_MIN_SCORE = 0.25
"""A rank joins its host's finding only when it scores at least this share of the host's top scorer."""


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


def score_iteration(
    records: Sequence[dict[str, Any]],
    config: ScoringConfig | None = None,
    scorer: OutlierScorer | None = None,
    index: FunctionIndex | None = None,
) -> list[RankSignal]:
    """Every signal of one iteration of one job: per peer group (ranks of one pipeline stage), victims
    explained by their causes, grouped by host, plus hosts and stages; each with its time saved.

    The column phase (``score_columns``) per shard of the functions (``config.shards``; one: all of them),
    then the merge (``merge_columns``): one code path, the same signals for any number of shards.
    ``index`` (the job's, kept across iterations) spares re-interning function names.
    """
    cfg = config or ScoringConfig()
    score = scorer or robust_z(cfg)
    records = with_self_time(records)
    index = index if index is not None else FunctionIndex()
    if cfg.shards == 1:
        parts = [score_columns(records, cfg, score, index)]
    else:
        subs = split_records(records, cfg.shards)
        parts = [score_columns(sub, cfg, score, index.shard(k)) for k, sub in enumerate(subs)]
    return merge_columns(parts, records, cfg, score)


SHARD_SCORED = (_COMPUTE, _COLLECTIVE)
"""Kinds whose ``mean_ns`` column scores a shard computes, with the kernels' ratios to their peers and the
host functions' shares (the merge reads them; what is derived across functions or hosts stays there)."""


def score_columns(
    records: Sequence[dict[str, Any]], cfg: ScoringConfig, scorer: OutlierScorer, index: FunctionIndex | None = None
) -> ShardColumns:
    """The column phase: one shard's records (``shards.split_records``; or the whole records) as matrices,
    for every rank and each peer group, with the per-function peer statistics of each group.

    One set of matrices serves every test. Where ``gather`` cannot be used, ``PeerMatrix.build`` per group.
    """
    index = index if index is not None else FunctionIndex()
    gathered = gather_matrices(records, index, staged(int(rec.get("pp_rank", -1)) for rec in records))
    pms = gathered or build_matrices(records)
    row_ids = gathered.row_ids if gathered is not None else None
    whole = Columns(pms, first_keys(pms, records, np.arange(len(records)), row_ids, index.names))
    out = ShardColumns(whole)
    roles = role_codes(records)
    for rows in peer_group_rows(records):
        if rows.size < cfg.min_peers:
            out.groups.append(None)
            continue
        if gathered is None and rows.size < len(records):
            group = build_matrices([records[i] for i in rows.tolist()])
        else:
            group = pms.rows(rows)
        for k in SHARD_SCORED:
            if k in group.by_kind:
                group.by_kind[k].scored("mean_ns", scorer)
        if _COMPUTE in group.by_kind:
            _kernel_ratio(group.by_kind[_COMPUTE])
        host = group.by_kind.get(_PYTHON)
        if host is not None:
            _host_share(host, roles[rows])
            host.scored(_SHARE, lambda x: scorer(x, cfg.host_share_floor))
        out.groups.append(
            whole if group is pms else Columns(group, first_keys(group, records, rows, row_ids, index.names))
        )
    return out


def merge_columns(
    parts: Sequence[ShardColumns], records: Sequence[dict[str, Any]], cfg: ScoringConfig, scorer: OutlierScorer
) -> list[RankSignal]:
    """The merge: the shards' columns in the unsharded order (``shards.assemble``), then what reads all
    of a rank's functions (per-rank sums, victims, hosts, stages). ``records``: every rank's, whole."""
    pms = assemble([p.whole for p in parts])
    roles = role_codes(records)
    signals: list[RankSignal] = []
    for g, rows in enumerate(peer_group_rows(records)):
        blocks = [p.groups[g] for p in parts]
        if any(b is None for b in blocks):
            continue
        whole = all(b is p.whole for b, p in zip(blocks, parts, strict=True))
        group = pms if whole else assemble([b for b in blocks if b is not None])
        one_stage = int(records[int(rows[0])].get("pp_rank", -1)) >= 0  # peer_group_rows: one pp_rank a group
        signals += _score_group(group, cfg, scorer, roles[rows], one_stage)
    gathered = all(p.whole.pms.row_ids is not None for p in parts)
    compute = pms.of_kind(_COMPUTE) if gathered and staged(int(r.get("pp_rank", -1)) for r in records) else None
    stages = score_stages(records, cfg, compute)
    signals += [s for s in stages if s.rank >= 0]  # slow members of a stage too small to compare inside
    stages = [s for s in stages if s.rank < 0]
    collectives = pms.of_kind(_COLLECTIVE)
    rings = ring_groups(collectives, records)
    transfers = score_transfers(collectives, rings, cfg, scorer)
    signals = group_by_host(signals, records, cfg.host_group_min_share)
    signals += score_hosts(collectives, cfg, scorer) + stages + transfers
    return split_shares(signals, records)
