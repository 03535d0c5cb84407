"""What-if: each candidate cause brought to its peers' level, the iteration replayed; the time saved is its cost.

Candidates (``CAUSE_KINDS``), each with its own excess over its peers, the ranks of the same role
(``roles.role_codes``: pipeline stage and tensor slot) that made the same calls:
1. ``rank_compute``: a rank's GPU compute before each call, above its peers' median at that call;
2. ``rank_host``: the rest of its work between calls (host work, launch gaps) and after its last call; all
   of its work where its kernels are unknown;
3. ``stage_compute``: every rank of a pipeline stage less the stage's excess (its least rank's work) over the
   median of the other stages';
4. ``group_transfer``: a process group's transfers at the pace of the groups moving the same bytes in the
   same op (rings of different stages move different bytes: only like is compared with like);
5. ``rank_transfer``: every group of one rank at that pace, where two or more of them are slow (a slow link
   paces each ring the rank is in); ``host_transfer``: every group with a member on one host (its NIC).
A peer's median leaves the rank itself out (two replicas: the other one is the level).

The saving is the job's replayed iteration time now minus with the cause fixed. A removed excess of E saves
at most E (the longest path loses at most what was taken from it), so only the candidates with the largest
excess, and every stage, are replayed exactly (``top``). A rank that only waits has no excess of its own and
saves nothing: victims fall out of the arithmetic. The top cause is then taken as fixed and the others that
saved much are priced again beyond it (``residual_ns``): a host whose rings are slow only through the top's.
A detector's claim is priced beyond the top and beyond the other claims that cut its rings more than it does
(``_pacers``): a ring moves at its slowest member's pace, and its other members' links idle under it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas.categories import Credit
from fleetscope.streams.analysis.links import like_rings
from fleetscope.streams.analysis.replay import F64, I64, CallGraph, call_graph, steady_period
from fleetscope.streams.analysis.roles import role_codes
from fleetscope.streams.analysis.timeline import compute_total_ns, compute_windows_ns

CAUSE_KINDS = ("rank_compute", "rank_host", "stage_compute", "group_transfer", "rank_transfer", "host_transfer")
"""The kinds of candidate cause, in the order they are built."""
CLAIMED = {Credit.WORK: "claimed_work", Credit.TRANSFER: "claimed_transfer"}
"""The cause kind of a detector's claim (``Claim``), by what it claims is slow."""
TOP_CANDIDATES = 8
"""Candidates replayed exactly (by excess), besides every stage."""
SCENARIOS_PER_PASS = 16
"""Candidates replayed together, as columns of one pass."""
RESIDUAL_SHARE = 0.2
"""Causes saving this share of the top's, or more, are priced again with the top fixed."""
SAME_SAVING = 0.95
"""A cause of fewer ranks saving this share of the top's, or more, is the top cause (the more specific)."""
MIN_SAVING_SHARE = 0.01
"""A top cause saving less than this share of the iteration names no culprit (``culprit``)."""


@dataclass(frozen=True, slots=True)
class Cause:
    """One candidate cause and what fixing it saves."""

    kind: str
    ranks: tuple[int, ...]
    """The ranks it covers (their ``rank``)."""
    group: str
    """The process group (``group_transfer``) or host (``host_transfer``), else ""."""
    stage: int
    """The pipeline stage (``stage_compute``), else -1."""
    excess_ns: float
    """Its own time above its peers' level: at most what fixing it can save."""
    saving_ns: float
    """The job's replayed iteration time now minus with this cause fixed."""
    residual_ns: float
    """What it saves once the top cause is fixed (the top cause: its saving): a victim of the top saves nothing."""


@dataclass(frozen=True, slots=True)
class Claim:
    """A detector's excess where the what-if has no peer to bring it to (a rank alone in its role, a ring with
    no ring like it): its ranks' work, or their rings' transfers, this much longer than they should be."""

    what: Credit
    ranks: tuple[int, ...]
    excess_ns: float


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
    back_calls: I64 | None = None
    back_ns: F64 | None = None
    """Work given back after a shortened call (``_overlap_back``): the compute that ran while it lasted."""
    back_rows: I64 | None = None
    back_tail_ns: F64 | None = None

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
        at: F64 = np.where(rank > i, srt[i], srt[min(i + 1, k - 1)])
        return at

    if m % 2:
        return others_at(m // 2)
    return 0.5 * (others_at(m // 2 - 1) + others_at(m // 2))


def _rank_candidates(graph: CallGraph, roles: I64, top: int, compute_total: F64 | None = None) -> list[_Candidate]:
    """Per rank: its compute and its other work above its peers' at each call (peers: same role, same count);
    only the ``top`` by excess are built (in the order they come, among equals).

    A rank's compute excess is at most its whole iteration's compute above its peers' (``compute_total``, per
    record, NaN: unknown): a peer that kept computing while it waited for the slow rank shows no work before
    its next call, and that call's median would take the slow rank's whole work there for excess."""
    counts = np.diff(graph.first)
    key = roles * (int(counts.max()) + 2 if counts.size else 1) + counts
    parts: list[tuple[str, I64, I64, F64]] = []  # (kind, rows, calls, cut) of each role and part
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
        split = [("rank_host", work)]
        if known:
            comp = np.minimum(comp, work)
            split = [("rank_compute", comp), ("rank_host", work - comp)]
        cuts = [np.maximum(values - median_of_others(values), 0.0) for _, values in split]
        totals = compute_total[rows] if compute_total is not None and known else None
        if totals is not None and not np.isnan(totals).any():
            cap = np.maximum(totals - median_of_others(totals[:, None])[:, 0], 0.0)
            counted = np.concatenate([graph.leads[calls], np.ones((rows.size, 1), dtype=bool)], axis=1)
            summed = np.where(counted, cuts[0], 0.0).sum(axis=1)  # calls entered together share one work
            cuts[0] = cuts[0] * np.where(summed > cap, cap / np.maximum(summed, 1.0), 1.0)[:, None]
        parts += [(kind, rows, calls, cut) for (kind, _), cut in zip(split, cuts, strict=True)]
    if not parts:
        return []
    # each candidate's excess as its property sums it (the calls', then the tail's), in the order they come
    which = [np.flatnonzero(cut.sum(axis=1) > 0) for _, _, _, cut in parts]
    excess = np.concatenate(
        [cut[i, :-1].sum(axis=1) + cut[i, -1] for (_, _, _, cut), i in zip(parts, which, strict=True)]
    )
    part = np.repeat(np.arange(len(parts)), [i.size for i in which])
    at = np.concatenate(which)
    out: list[_Candidate] = []
    for j in np.argsort(-excess, kind="stable")[:top].tolist():
        kind, rows, calls, cut = parts[int(part[j])]
        i = int(at[j])
        out.append(_Candidate(kind, rows[i : i + 1], calls=calls[i], work_cut=cut[i, :-1], tail_cut=cut[i, -1:]))
    return out


def _stage_candidates(graph: CallGraph, stages: I64) -> list[_Candidate]:
    """Per pipeline stage: its ranks' work (compute where known) less the stage's excess over the median of
    the other stages'.

    A stage's level is its least rank's work: a stage slow on every replica is slow on its fastest, while
    one slow rank (its own candidate) leaves its stage's level alone; each rank loses the stage's excess in
    proportion to its work, so a slow rank keeps its own excess."""
    known = stages >= 0
    levels = {int(s): 0.0 for s in np.unique(stages[known])}
    if len(levels) < 2:
        return []
    comp_known = not np.isnan(graph.compute_ns).any()
    per_call = np.minimum(graph.compute_ns, graph.work_ns) if comp_known else graph.work_ns
    total = np.bincount(graph.row[graph.leads], weights=per_call[graph.leads], minlength=stages.size).astype(float)
    if not comp_known:
        total = total + graph.tail_ns
    for s in levels:
        levels[s] = float(np.min(total[stages == s]))
    out = []
    for s, level in levels.items():
        ref = float(np.median([v for t, v in levels.items() if t != s]))
        if not level > ref > 0:
            continue
        rows = np.flatnonzero(stages == s)
        f = (level - ref) / np.maximum(total[rows], 1.0)  # each rank loses the stage's excess, no more
        f_call = np.zeros(stages.size)
        f_call[rows] = f
        calls = np.flatnonzero(np.isin(graph.row, rows))
        tail_cut = graph.tail_ns[rows] * (0.0 if comp_known else f)
        out.append(_Candidate("stage_compute", rows, stage=s, calls=calls,
                              work_cut=per_call[calls] * f_call[graph.row[calls]], tail_cut=tail_cut))  # fmt: skip
    return out


def _transfer_candidates(graph: CallGraph, hosts: npt.NDArray[np.str_], top: int) -> list[_Candidate]:
    """Per process group: its transfers at the median pace of the other groups of the same op and bytes; per
    rank and per host, every such group it is in (has a member on), where two or more are slow. Only the
    ``top`` of each kind by excess are built."""
    multi, like = like_rings(graph)
    if multi.size == 0:
        return []
    groups_n = len(graph.groups) + 1
    cells, which = np.unique(like * groups_n + graph.group[multi], return_inverse=True)
    which = which.reshape(-1)
    like_of = cells // groups_n
    mean = np.bincount(which, weights=graph.transfer_ns[multi]) / np.bincount(which)
    factor = np.ones(mean.size)
    order = np.argsort(like_of, kind="stable")
    bounds = np.r_[0, np.flatnonzero(np.diff(like_of[order])) + 1, order.size]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if hi - lo >= 2:
            idx = order[lo:hi]
            ref = median_of_others(mean[idx][:, None])[:, 0]
            factor[idx] = np.minimum(1.0, ref / np.maximum(mean[idx], 1.0))
    cut = graph.transfer_ns[multi] * (1.0 - factor[which])
    slow = cut > 0
    if not slow.any():
        return []
    inst, inst_cut = multi[slow], cut[slow]
    cut_of = np.zeros(graph.members.size)
    cut_of[inst] = inst_cut
    member = np.flatnonzero(cut_of[graph.instance] > 0)  # calls in a slow instance
    m_row, m_inst = graph.row[member], graph.instance[member]
    m_group = graph.group[m_inst]
    host_code = np.unique(hosts, return_inverse=True)[1].reshape(-1)
    out: list[_Candidate] = []
    for kind, key in (("group_transfer", m_group), ("rank_transfer", m_row), ("host_transfer", host_code[m_row])):
        # each key's slow instances (once each), its excess, and how many slow groups it has
        pairs = np.unique(key * (int(m_inst.max()) + 1) + m_inst)
        k_of, i_of = pairs // (int(m_inst.max()) + 1), pairs % (int(m_inst.max()) + 1)
        excess = np.bincount(k_of, weights=cut_of[i_of])
        n_groups = np.bincount(np.unique(key * groups_n + m_group) // groups_n, minlength=excess.size)
        eligible = np.flatnonzero((excess > 0) & ((n_groups >= 2) | (kind == "group_transfer")))
        if kind == "host_transfer":
            eligible = eligible[hosts[_first_row(host_code, eligible)] != ""]
        for k in eligible[np.argsort(-excess[eligible], kind="stable")][:top].tolist():
            ins = i_of[k_of == k]
            rows = np.unique(m_row[key == k]) if kind != "host_transfer" else np.flatnonzero(host_code == k)
            group = (
                graph.groups[k]
                if kind == "group_transfer"
                else (str(hosts[rows[0]]) if kind == "host_transfer" else "")
            )
            out.append(_Candidate(kind, rows, group=group, instances=ins, transfer_cut=cut_of[ins]))
    return out


def _claim_candidates(graph: CallGraph, ids: Sequence[int], claims: Sequence[Claim]) -> list[_Candidate]:
    """Each claim as a cut: its ranks' work (between calls and after the last), or their rings' transfers,
    shortened in proportion by the claimed excess (at most all of it)."""
    row_of = {r: i for i, r in enumerate(ids)}
    out = []
    for claim in claims:
        rows = np.array(sorted({row_of[r] for r in claim.ranks if r in row_of}), dtype=np.int64)
        calls = np.flatnonzero(np.isin(graph.row, rows))
        kind = CLAIMED[claim.what]
        if claim.what is Credit.WORK:
            total = float(np.sum(graph.work_ns[calls][graph.leads[calls]]) + np.sum(graph.tail_ns[rows]))
            f = min(1.0, claim.excess_ns / total) if total > 0 else 0.0
            out.append(_Candidate(kind, rows, calls=calls, work_cut=graph.work_ns[calls] * f,
                                  tail_cut=graph.tail_ns[rows] * f))  # fmt: skip
            continue
        ins = np.unique(graph.instance[calls])
        ins = ins[graph.members[ins] >= 2]
        total = float(np.sum(graph.transfer_ns[ins]))
        f = min(1.0, claim.excess_ns / total) if total > 0 else 0.0
        out.append(_Candidate(kind, rows, instances=ins, transfer_cut=graph.transfer_ns[ins] * f))
    return out


def hidden_compute(graph: CallGraph, records: Sequence[Mapping[str, Any]]) -> tuple[F64, F64]:
    """Per call, the GPU compute the rank ran from its dependency's enter to its own enter beyond the work
    between them (compute that ran while it waited in the dependency); per record, the same for its tail
    (from its last-ending call's enter). Zero where the rank's kernels are unknown."""
    calls, tails = np.zeros(graph.calls), np.zeros(graph.tail_ns.size)
    for i, rec in enumerate(records):
        lo, hi = int(graph.first[i]), int(graph.first[i + 1])
        windows = compute_windows_ns(rec) if hi > lo else None
        if windows is None or windows.size != hi - lo + 1:
            continue
        cum = np.cumsum(windows[:-1])
        dep = graph.dep[lo:hi]
        own = dep < graph.calls
        before = np.where(own, cum[np.clip(dep - lo, 0, hi - lo - 1)], 0.0)
        calls[lo:hi] = np.maximum(cum - before - graph.work_ns[lo:hi], 0.0)
        last = int(graph.last[i]) - lo
        tails[i] = max(float(cum[-1] + windows[-1] - cum[last]) - float(graph.tail_ns[i]), 0.0)
    return calls, tails


def _given_back(cut: F64, hidden: F64, lasted: F64) -> F64:
    """What a call cut by ``cut`` gives back to the work after it, where ``hidden`` compute ran while it
    ``lasted``: the compute is taken to run first, from the call's enter, so the next call could start
    ``lasted - hidden`` before the call ended (its bucket was ready then: DDP's buckets queue on the comm
    stream while the backward runs ahead). Only the cut beyond that slack is waited for again, at most the
    hidden compute; with no slack (the GPU busy throughout) all of the cut."""
    out: F64 = np.clip(cut - (lasted - hidden), 0.0, np.minimum(cut, hidden))
    return out


def _overlap_back(graph: CallGraph, c: _Candidate, hidden: tuple[F64, F64]) -> None:
    """A shortened call gives back to the work after it the compute that ran while it lasted, less the
    slack before the end (``_given_back``): a rank whose GPU kept computing through a slow all-reduce starts
    its next call no sooner for a faster one (DDP's buckets overlap the backward)."""
    if c.instances is None or c.transfer_cut is None:
        return
    cut_of = np.zeros(graph.transfer_ns.size)
    cut_of[c.instances] = c.transfer_cut
    x = cut_of[graph.instance]  # per call, its instance's cut
    lasted = graph.leave_ns - graph.enter_ns
    has_dep = graph.dep < graph.calls
    dep = np.minimum(graph.dep, graph.calls - 1)
    back = np.where(has_dep, _given_back(x[dep], hidden[0], lasted[dep]), 0.0)
    at = np.flatnonzero(back > 0)
    c.back_calls, c.back_ns = at, back[at]
    rows = np.flatnonzero(graph.last >= 0)
    last = graph.last[rows]
    tail_back = _given_back(x[last], hidden[1][rows], lasted[last])
    keep = tail_back > 0
    c.back_rows, c.back_tail_ns = rows[keep], tail_back[keep]


def _first_row(codes: I64, wanted: I64) -> I64:
    """Per wanted code, the first row with it."""
    first = np.full(int(codes.max()) + 1, -1, dtype=np.int64)
    first[codes[::-1]] = np.arange(codes.size - 1, -1, -1)
    out: I64 = first[wanted]
    return out


def _cuts(graph: CallGraph, c: _Candidate | None, into: tuple[F64, F64, F64] | None = None) -> tuple[F64, F64, F64]:
    """A candidate's cuts as dense (work, tail, transfer) vectors; with ``into``, the larger of both per entry
    (two causes fixed together: each entry brought to its peers' level once)."""
    work, tail, transfer = (x.copy() for x in into) if into is not None else (
        np.zeros(graph.calls), np.zeros(graph.tail_ns.size), np.zeros(graph.transfer_ns.size))  # fmt: skip
    if c is not None:
        for dense, at, cut in ((work, c.calls, c.work_cut), (tail, c.rows, c.tail_cut),
                               (transfer, c.instances, c.transfer_cut)):  # fmt: skip
            if at is not None and cut is not None:
                dense[at] = np.maximum(dense[at], cut)
        for dense, at, back in ((work, c.back_calls, c.back_ns), (tail, c.back_rows, c.back_tail_ns)):
            if at is not None and back is not None:
                dense[at] -= back
    return work, tail, transfer


def _savings(graph: CallGraph, candidates: Sequence[_Candidate], base: _Candidate | None = None) -> F64:
    """The job's replayed iteration time with ``base`` fixed (None: as measured) minus with each candidate
    fixed too, several candidates per pass (float32 columns, the baseline alike). Each column is the base's
    (built once, in the levels' order) with the candidate's own entries cut: a candidate touches a few."""
    f32 = np.float32
    fixed = _cuts(graph, base)
    lv = graph.levels
    where = np.empty(graph.transfer_ns.size, dtype=np.int64)  # each instance's place in the levels' order
    where[lv.instances] = np.arange(lv.instances.size)
    measured = (
        graph.work_ns[lv.order].astype(f32),
        graph.tail_ns.astype(f32),
        graph.transfer_ns[lv.instances].astype(f32),
    )
    if base is None:  # nothing fixed (x - 0 is x): the measured times, already in the levels' order
        now = float(steady_period(graph, measured[0], measured[2], measured[1], ordered=True)[0])
        columns = list(measured)
    else:
        work_left = (graph.work_ns - fixed[0]).astype(f32)
        transfer_left = (graph.transfer_ns - fixed[2]).astype(f32)
        now = float(steady_period(graph, work_left, transfer_left, (graph.tail_ns - fixed[1]).astype(f32))[0])
        fixed_ordered = (fixed[0][lv.order], fixed[1], fixed[2][lv.instances])
        columns = [m - f.astype(f32) for m, f in zip(measured, fixed_ordered, strict=True)]
    out = np.zeros(len(candidates))
    for lo in range(0, len(candidates), SCENARIOS_PER_PASS):
        chunk = candidates[lo : lo + SCENARIOS_PER_PASS]
        work, tail, transfer = (np.repeat(c[:, None], len(chunk), axis=1) for c in columns)
        for j, c in enumerate(chunk):
            for m, f, col, at, place, cut in (
                (measured[0], fixed[0], work, c.calls, lv.position, c.work_cut),
                (measured[1], fixed[1], tail, c.rows, None, c.tail_cut),
                (measured[2], fixed[2], transfer, c.instances, where, c.transfer_cut),
            ):
                if at is not None and cut is not None:
                    p = at if place is None else place[at]
                    col[p, j] = m[p] - np.maximum(f[at], cut).astype(f32)
            for col, at, place, back in ((work, c.back_calls, lv.position, c.back_ns),
                                         (tail, c.back_rows, None, c.back_tail_ns)):  # fmt: skip
                if at is not None and back is not None:
                    col[at if place is None else place[at], j] += back.astype(f32)
        out[lo : lo + len(chunk)] = now - steady_period(graph, work, transfer, tail, ordered=True)[0]
    return out


def _pacers(graph: CallGraph, c: _Candidate, claims: Sequence[_Candidate]) -> _Candidate | None:
    """The transfer cuts of the other ``claims`` (none covering ``c``'s ranks) on ``c``'s rings that are larger
    than ``c``'s own there, as one candidate (None: none is). A ring moves at its slowest member's pace: where
    another member's link (or another host's NIC) cuts an instance more than ``c`` does, it paces it, and the
    members it paces idle between their bursts (their link samples peak low) at no cost of their own. Only a
    detector's claim says whose link is slow: a ring's pace against like rings' (``_transfer_candidates``) may
    be ``c``'s own link seen from the ring, and a claim covering ``c``'s ranks its own seen from their host."""
    if c.instances is None or c.transfer_cut is None:
        return None
    cut = np.zeros(graph.transfer_ns.size)
    for o in claims:
        if o.instances is not None and o.transfer_cut is not None and not np.isin(c.rows, o.rows).any():
            np.maximum.at(cut, o.instances, o.transfer_cut)
    theirs = cut[c.instances]
    larger = theirs > c.transfer_cut
    if not larger.any():
        return None
    return _Candidate("pacers", c.rows[:0], instances=c.instances[larger], transfer_cut=theirs[larger])


def _together(graph: CallGraph, parts: Sequence[_Candidate], hidden: tuple[F64, F64]) -> _Candidate:
    """Several causes fixed at once, as one candidate: each entry cut by the largest of their cuts (brought to
    its peers' level once), the compute a shortened call gives back taken from the combined cut
    (``_overlap_back``)."""
    work, tail, transfer = np.zeros(graph.calls), np.zeros(graph.tail_ns.size), np.zeros(graph.transfer_ns.size)
    for p in parts:
        for dense, at, cut in ((work, p.calls, p.work_cut), (tail, p.rows, p.tail_cut),
                               (transfer, p.instances, p.transfer_cut)):  # fmt: skip
            if at is not None and cut is not None:
                np.maximum.at(dense, at, cut)
    calls, rows, instances = np.flatnonzero(work), np.flatnonzero(tail), np.flatnonzero(transfer)
    out = _Candidate("together", rows, calls=calls, work_cut=work[calls], tail_cut=tail[rows], instances=instances,
                     transfer_cut=transfer[instances])  # fmt: skip
    if instances.size:
        _overlap_back(graph, out, hidden)
    return out


def _first_of(candidates: Sequence[_Candidate], saving: F64) -> int:
    """The top cause: the largest saving, or a cause of fewer ranks within it that saves nearly as much
    (``SAME_SAVING``): a rank's links before its host's, a rank before its stage."""
    best = int(np.argmax(saving))
    for i, c in enumerate(candidates):
        narrower = set(c.rows.tolist()) < set(candidates[best].rows.tolist())
        if narrower and saving[i] >= SAME_SAVING * saving[best]:
            best = i
    return best


def what_if(
    records: Sequence[Mapping[str, Any]],
    roles: I64 | None = None,
    graph: CallGraph | None = None,
    top: int = TOP_CANDIDATES,
    claims: Sequence[Claim] = (),
) -> list[Cause]:
    """Candidate causes of one iteration and what fixing each saves: the top cause first (``_first_of``),
    then by saving; then each of ``claims`` (kind ``CLAIMED``), priced beyond the top cause (on the top's own
    work, a part of it: not beyond it) and the other claims that pace its rings (``_beyond``), and never the top.

    ``roles``: one code per record for its role (default ``roles.role_codes``)."""
    g = call_graph(records) if graph is None else graph
    role = role_codes([dict(r) for r in records]) if roles is None else roles
    stages = np.array([int(r.get("pp_rank", -1)) for r in records], dtype=np.int64)
    hosts = np.array([str(r.get("host", "")) for r in records])
    ids = [int(r.get("rank", i)) for i, r in enumerate(records)]
    compute_total = np.array([compute_total_ns(r) for r in records])
    rank_candidates = _rank_candidates(g, role, top, compute_total)
    ranked = sorted(rank_candidates + _transfer_candidates(g, hosts, top), key=lambda c: -c.excess)
    chosen = _stage_candidates(g, stages) + [c for c in ranked[:top] if c.excess > 0]
    claimed = _claim_candidates(g, ids, claims)
    shortened = [c for c in (*chosen, *claimed) if c.transfer_cut is not None and c.transfer_cut.any()]
    hidden = hidden_compute(g, records) if shortened else (np.zeros(g.calls), np.zeros(g.tail_ns.size))
    for c in shortened:
        _overlap_back(g, c, hidden)
    causes: list[Cause] = []
    top_candidate: _Candidate | None = None
    if chosen:
        saving = _savings(g, chosen)
        best = _first_of(chosen, saving)
        # a cause whose own excess could save a share of the top's is priced again with the top fixed: a
        # second fault saves little alone while the top one holds the same collectives, and its own excess
        big = [i for i in range(len(chosen)) if i != best and chosen[i].excess >= RESIDUAL_SHARE * saving[best]]
        residual = np.zeros(len(chosen))
        residual[best] = saving[best]
        if big and saving[best] > 0:
            residual[big] = _savings(g, [chosen[i] for i in big], chosen[best])
        causes = [_cause(c, ids, s, x) for c, s, x in zip(chosen, saving, residual, strict=True)]
        first = causes.pop(best)
        causes = [first, *sorted(causes, key=lambda c: -c.saving_ns)]
        top_candidate = chosen[best] if saving[best] > 0 else None
    if claimed:
        alone = _savings(g, claimed)
        beyond = np.array([_beyond(g, c, top_candidate, claimed, hidden) for c in claimed])
        causes += [_cause(c, ids, s, x) for c, s, x in zip(claimed, alone, beyond, strict=True)]
    return causes


def _within(claim: _Candidate, top: _Candidate) -> bool:
    """Whether a claim cuts what the top cause cuts already: work of the top's own ranks, or their transfers."""
    same = (claim.work_cut is None) == (top.work_cut is None)
    return same and bool(np.isin(claim.rows, top.rows).all())


def _beyond(
    graph: CallGraph, c: _Candidate, top: _Candidate | None, claims: Sequence[_Candidate], hidden: tuple[F64, F64]
) -> float:
    """What a claim saves beyond what already explains it: the top cause (a part of it, ``_within``: alone), and
    where it shortens transfers, the other claims that pace its rings (``_pacers``: a link's samples peak low
    in a ring another member's link holds back, at no cost of its own)."""
    if top is not None and _within(c, top):  # a part of the top: not priced beyond it
        top = None
    pacers = _pacers(graph, c, claims)
    parts = [p for p in (top, pacers) if p is not None]
    base = None if not parts else parts[0] if len(parts) == 1 else _together(graph, parts, hidden)
    return float(_savings(graph, [c], base)[0])


def _cause(c: _Candidate, ids: Sequence[int], saving: float, residual: float) -> Cause:
    ranks = tuple(ids[i] for i in c.rows.tolist())
    return Cause(kind=c.kind, ranks=ranks, group=c.group, stage=c.stage, excess_ns=c.excess,
                 saving_ns=float(max(saving, 0.0)), residual_ns=float(max(residual, 0.0)))  # fmt: skip


def culprit(causes: Sequence[Cause], iteration_ns: float, min_share: float = MIN_SAVING_SHARE) -> Cause | None:
    """The top cause of ``what_if`` where it saves ``min_share`` of the iteration or more. A stage is so the
    cause only where it saves more than any one of its ranks."""
    if not causes or causes[0].kind in CLAIMED.values() or causes[0].saving_ns < min_share * iteration_ns:
        return None  # a claim is a detector's, priced, never the what-if's own culprit
    return causes[0]


def others_named(causes: Sequence[Cause], iteration_ns: float, min_share: float = MIN_SAVING_SHARE) -> list[Cause]:
    """Causes besides the top that still save ``min_share`` of the iteration once it is fixed."""
    return [c for c in causes[1:] if c.residual_ns >= min_share * iteration_ns and c.kind not in CLAIMED.values()]
