"""What-if: each candidate cause brought to its peers' level, the iteration replayed; the time saved is its cost.

Candidates (``CAUSE_KINDS``), each with its own excess over its peers, the ranks of the same role
(``roles.role_codes``: pipeline stage and tensor slot) that made the same calls:
1. ``rank_compute``: a rank's GPU compute before each call, above its peers' median at that call;
2. ``rank_host``: the rest of its work between calls (host work, launch gaps) and after its last call; all
   of its work where its kernels are unknown;
3. ``stage_compute``: every rank of a pipeline stage, its work scaled to the median stage's;
4. ``group_transfer``: a process group's transfers at the pace of the groups moving the same bytes in the
   same op (rings of different stages move different bytes: only like is compared with like);
5. ``rank_transfer``: every group of one rank at that pace, where two or more of them are slow (a slow link
   paces each ring the rank is in).
A peer's median leaves the rank itself out (two replicas: the other one is the level).

The saving is the job's replayed iteration time now minus with the cause fixed. A removed excess of E saves
at most E (the longest path loses at most what was taken from it), so only the candidates with the largest
excess, and every stage, are replayed exactly (``top``). A rank that only waits has no excess of its own and
saves nothing: victims fall out of the arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetscope.streams.analysis.replay import F64, I64, CallGraph, call_graph, steady_period
from fleetscope.streams.analysis.roles import role_codes

CAUSE_KINDS = ("rank_compute", "rank_host", "stage_compute", "group_transfer", "rank_transfer")
"""The kinds of candidate cause, in the order they are built."""
TOP_CANDIDATES = 24
"""Candidates replayed exactly (by excess), besides every stage."""
SCENARIOS_PER_PASS = 8
"""Candidates replayed together, as columns of one pass."""
MIN_SAVING_SHARE = 0.03
"""A top cause saving less than this share of the iteration names no culprit (``culprit``)."""


@dataclass(frozen=True, slots=True)
class Cause:
    """One candidate cause and what fixing it saves."""

    kind: str
    ranks: tuple[int, ...]
    """The ranks it covers (their ``rank``)."""
    group: str
    """The process group (``group_transfer``), else ""."""
    stage: int
    """The pipeline stage (``stage_compute``), else -1."""
    excess_ns: float
    """Its own time above its peers' level: at most what fixing it can save."""
    saving_ns: float


@dataclass(slots=True)
class _Candidate:
    kind: str
    rows: I64
    group: str = ""
    stage: int = -1
    calls: I64 | None = None
    work_cut: F64 | None = None
    tail_cut: F64 | None = None
    """Per row of ``rows``."""
    instances: I64 | None = None
    transfer_cut: F64 | None = None

    @property
    def excess(self) -> float:
        return float(sum(np.sum(a) for a in (self.work_cut, self.tail_cut, self.transfer_cut) if a is not None))


def median_of_others(values: F64) -> F64:
    """Per element of (k, n) ``values``, the median of its column without it (k >= 2)."""
    k = values.shape[0]
    order = np.argsort(values, axis=0, kind="stable")
    srt = np.take_along_axis(values, order, axis=0)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(k)[:, None].repeat(values.shape[1], axis=1), axis=0)
    m = k - 1  # the others' count; their sorted list is srt without the element's own position

    def others_at(i: int) -> F64:
        return np.where(rank > i, srt[i], srt[min(i + 1, k - 1)])

    if m % 2:
        return others_at(m // 2)
    return 0.5 * (others_at(m // 2 - 1) + others_at(m // 2))


def _rank_candidates(graph: CallGraph, roles: I64) -> list[_Candidate]:
    """Per rank: its compute and its other work above its peers' at each call (peers: same role, same count)."""
    counts = np.diff(graph.first)
    out: list[_Candidate] = []
    key = roles * (int(counts.max()) + 2 if counts.size else 1) + counts
    for k in np.unique(key):
        rows = np.flatnonzero(key == k)
        n = int(counts[rows[0]])
        if rows.size < 2:
            continue
        calls = graph.first[rows][:, None] + np.arange(n)
        work = np.concatenate([graph.work_ns[calls], graph.tail_ns[rows][:, None]], axis=1)
        tail_comp = np.nan_to_num(graph.tail_compute_ns[rows], nan=0.0)[:, None]  # unknown: host work
        comp = np.concatenate([graph.compute_ns[calls], tail_comp], axis=1)
        known = bool(n) and not np.isnan(comp).any()
        parts = [("rank_host", work)]
        if known:
            comp = np.minimum(comp, work)
            parts = [("rank_compute", comp), ("rank_host", work - comp)]
        for kind, values in parts:
            cut = np.maximum(values - median_of_others(values), 0.0)
            for i in np.flatnonzero(cut.sum(axis=1) > 0):
                out.append(_Candidate(kind, rows[i : i + 1], calls=calls[i], work_cut=cut[i, :n],
                                      tail_cut=cut[i, n:]))  # fmt: skip
    return out


def _stage_candidates(graph: CallGraph, stages: I64) -> list[_Candidate]:
    """Per pipeline stage: its ranks' work (compute where known) scaled to the median of the other stages'."""
    known = stages >= 0
    levels = {int(s): 0.0 for s in np.unique(stages[known])}
    if len(levels) < 2:
        return []
    comp_known = not np.isnan(graph.compute_ns).any()
    per_call = graph.compute_ns if comp_known else graph.work_ns
    total = np.bincount(graph.row, weights=np.minimum(per_call, graph.work_ns), minlength=stages.size)
    if not comp_known:
        total = total + graph.tail_ns
    for s in levels:
        levels[s] = float(np.median(total[stages == s]))
    out = []
    for s, level in levels.items():
        ref = float(np.median([v for t, v in levels.items() if t != s]))
        if not level > ref > 0:
            continue
        f = 1.0 - ref / level
        rows = np.flatnonzero(stages == s)
        calls = np.flatnonzero(np.isin(graph.row, rows))
        out.append(_Candidate("stage_compute", rows, stage=s, calls=calls,
                              work_cut=np.minimum(per_call[calls], graph.work_ns[calls]) * f,
                              tail_cut=graph.tail_ns[rows] * (0.0 if comp_known else f)))  # fmt: skip
    return out


def _transfer_candidates(graph: CallGraph) -> list[_Candidate]:
    """Per process group: its transfers at the median pace of the other groups of the same op and bytes; per
    rank, every such group it is in, where two or more are slow."""
    multi = np.flatnonzero(graph.members >= 2)
    if multi.size == 0:
        return []
    like = graph.klass[multi] * 1_000_003 + np.rint(np.log2(np.maximum(graph.nbytes[multi], 1.0)) * 16)
    pair = np.unique(np.stack([like, graph.group[multi]]), axis=1, return_inverse=True)
    (like_of, group_of), which = pair[0], pair[1].reshape(-1)
    mean = np.bincount(which, weights=graph.transfer_ns[multi]) / np.bincount(which)
    factor = np.ones(mean.size)
    for lk in np.unique(like_of):
        idx = np.flatnonzero(like_of == lk)
        if idx.size >= 2:
            ref = median_of_others(mean[idx][:, None])[:, 0]
            factor[idx] = np.minimum(1.0, ref / np.maximum(mean[idx], 1.0))
    cut = graph.transfer_ns[multi] * (1.0 - factor[which])
    slow = cut > 0
    out = []
    rows_of_instance = {}
    for g in np.unique(group_of[factor < 1.0]):
        sel = slow & (group_of[which] == g)
        inst = multi[sel]
        rows = np.unique(graph.row[np.isin(graph.instance, inst)])
        rows_of_instance[int(g)] = (inst, cut[sel], rows)
        out.append(_Candidate("group_transfer", rows, group=graph.groups[int(g)], instances=inst,
                              transfer_cut=cut[sel]))  # fmt: skip
    by_rank: dict[int, list[int]] = {}
    for g, (_, _, rows) in rows_of_instance.items():
        for r in rows.tolist():
            by_rank.setdefault(r, []).append(g)
    for r, gs in by_rank.items():
        if len(gs) >= 2:
            inst = np.concatenate([rows_of_instance[g][0] for g in gs])
            out.append(_Candidate("rank_transfer", np.array([r]), instances=inst,
                                  transfer_cut=np.concatenate([rows_of_instance[g][1] for g in gs])))  # fmt: skip
    return out


def _savings(graph: CallGraph, candidates: Sequence[_Candidate]) -> F64:
    """The job's replayed iteration time now minus with each candidate fixed, several per pass."""
    now = float(steady_period(graph)[0])
    out = np.zeros(len(candidates))
    for lo in range(0, len(candidates), SCENARIOS_PER_PASS):
        chunk = candidates[lo : lo + SCENARIOS_PER_PASS]
        s = len(chunk)
        work = np.repeat(graph.work_ns[:, None], s, axis=1)
        transfer = np.repeat(graph.transfer_ns[:, None], s, axis=1)
        tail = np.repeat(graph.tail_ns[:, None], s, axis=1)
        for j, c in enumerate(chunk):
            if c.calls is not None and c.work_cut is not None:
                work[c.calls, j] -= c.work_cut
            if c.tail_cut is not None:
                tail[c.rows, j] -= c.tail_cut
            if c.instances is not None and c.transfer_cut is not None:
                transfer[c.instances, j] -= c.transfer_cut
        out[lo : lo + s] = now - steady_period(graph, work, transfer, tail)[0]
    return out


def what_if(
    records: Sequence[Mapping[str, Any]],
    roles: I64 | None = None,
    graph: CallGraph | None = None,
    top: int = TOP_CANDIDATES,
) -> list[Cause]:
    """Candidate causes of one iteration and what fixing each saves, the largest saving first.

    ``roles``: one code per record for its role (default ``roles.role_codes``)."""
    g = call_graph(records) if graph is None else graph
    role = role_codes(records) if roles is None else roles
    stages = np.array([int(r.get("pp_rank", -1)) for r in records], dtype=np.int64)
    ranked = sorted(_rank_candidates(g, role) + _transfer_candidates(g), key=lambda c: -c.excess)
    chosen = _stage_candidates(g, stages) + [c for c in ranked[:top] if c.excess > 0]
    saving = _savings(g, chosen)
    ids = [int(r.get("rank", i)) for i, r in enumerate(records)]
    causes = [
        Cause(kind=c.kind, ranks=tuple(ids[i] for i in c.rows.tolist()), group=c.group, stage=c.stage,
              excess_ns=c.excess, saving_ns=float(max(s, 0.0)))
        for c, s in zip(chosen, saving, strict=True)
    ]  # fmt: skip
    return sorted(causes, key=lambda c: -c.saving_ns)


def culprit(causes: Sequence[Cause], iteration_ns: float, min_share: float = MIN_SAVING_SHARE) -> Cause | None:
    """The cause whose fix saves the most, where that is ``min_share`` of the iteration or more: a stage is
    the cause only where it saves more than any one of its ranks."""
    best = max(causes, key=lambda c: c.saving_ns, default=None)
    if best is None or best.saving_ns < min_share * iteration_ns:
        return None
    return best
