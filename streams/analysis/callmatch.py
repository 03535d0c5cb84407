"""Which calls of one iteration are one instance, and where each rank's iteration starts on a common clock.

Every member of a collective, and both ends of a send and its receive, leave the call at the same moment.
Each rank's times are relative to its own iteration start, and the starts differ (a pipeline's last stage
finishes, so starts, its iteration earlier than the first; clocks of hosts differ by milliseconds), so:
1. collectives are instances by (process group, sequence number), the same on every member;
2. the sequence number of a p2p call may not be: the producers number them differently (the torch hook per
   pair of ranks, the simulator per pipeline pass, a Kineto trace per process group or by NCCL's count).
   Between two pipeline neighbours (same replica and tensor slot, one stage apart), sends and receives of
   equal numbers give their clocks' offset where most agree on one; else every send of one and receive of
   the other (the first ``MAX_PAIR_CALLS``) give a candidate offset, and the true transfers all give the same
   one, so the most frequent (``BIN_NS`` wide) is taken;
3. each rank's start offset follows from these differences (collective members and p2p neighbours, the
   median per pair of ranks), along a spanning tree of the ranks;
4. on that common clock, a send matches the receive of its group on a neighbour that ended nearest to it,
   within ``MATCH_TOLERANCE_NS``; each receive at most one send. Where a call is left unmatched on a rank
   whose pair was settled by sequence numbers, those may have agreed by chance: the pair is settled again by
   its ends alone (step 2's second way) and the calls matched again. The rest stay alone: they keep their
   measured time in the replay.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fleetscope.schemas.fields import as_int

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

COLLECTIVE, SEND, RECV = 0, 1, 2
BIN_NS = 100_000
"""Width of the bins in which the offsets two neighbours' transfers give are counted."""
MATCH_TOLERANCE_NS = 250_000
"""A send and a receive whose ends differ by more than this on the common clock are not one transfer."""
MAX_PAIR_CALLS = 32
SEQ_AGREEMENT = 0.4
"""Share of two neighbours' equal-numbered sends and receives that must agree on their clocks' offset (a
count per pair of ranks numbers a middle stage's calls to both neighbours alike: half may be another pair's)."""
"""Sends (and receives) of one rank in one group that give candidate offsets: enough for a clear mode."""


@dataclass(frozen=True, slots=True)
class Matched:
    instance: I64
    """Per call: its instance."""
    start_ns: F64
    """Per record: its iteration's start on the common clock."""
    matched_p2p: int
    unmatched_p2p: int


def match_calls(records: Sequence[Mapping[str, object]], row: I64, leave: F64, kind: I64, pg: I64, seq: I64) -> Matched:
    """Instances of every call and each record's start offset (see the module's steps)."""
    n_rec = len(records)
    key = np.full(row.size, -1, dtype=np.int64)
    coll = kind == COLLECTIVE
    if coll.any():
        s = seq[coll] - seq[coll].min()
        key[coll] = pg[coll] * (int(s.max()) + 1) + s
    _, coll_inst = np.unique(key[coll], return_inverse=True)
    neighbours = pipeline_neighbours(records)
    p2p = _p2p_calls(row, kind, pg, n_rec)
    within, comp = _offsets(n_rec, [_collective_edges(row[coll], leave[coll], coll_inst.reshape(-1))])
    by_seq = _lifted(_seq_combos(neighbours, row, leave, pg, seq, p2p), within, comp)
    seq_edges, settled = _modes(*by_seq, n_rec, SEQ_AGREEMENT)
    start = _aligned(neighbours, row, leave, pg, p2p, within, comp, seq_edges, settled)
    sends, recvs = _nearest(neighbours, row, leave + start[row], pg, p2p)
    doubtful = _unsettled(settled, sends, recvs, row, kind, comp, n_rec)
    if doubtful.size:  # numbers that agreed by chance (a per-group count): those pairs by their ends alone
        kept = ~np.isin(settled, doubtful)
        seq_edges = (seq_edges[0][kept], seq_edges[1][kept], seq_edges[2][kept])
        start = _aligned(neighbours, row, leave, pg, p2p, within, comp, seq_edges, settled[kept])
        sends, recvs = _nearest(neighbours, row, leave + start[row], pg, p2p)
    # instances numbered as the sorted keys would: the collectives', then each transfer, then the calls alone
    instance = np.empty(row.size, dtype=np.int64)
    instance[coll] = coll_inst.reshape(-1)
    base = int(coll_inst.max()) + 1 if coll.any() else 0
    instance[sends] = instance[recvs] = base + np.arange(sends.size)
    alone = kind != COLLECTIVE
    alone[sends] = alone[recvs] = False
    instance[alone] = base + sends.size + np.arange(int(alone.sum()))
    return Matched(instance, start - start.min() if n_rec else start, int(sends.size), int(alone.sum()))


def _lifted(edges: Edges, within: F64, comp: I64) -> Edges:
    """Record-pair offsets as offsets between their sets of ranks held together by collectives (within them
    the collectives decide); pairs inside one set dropped."""
    a, b, d = edges
    ca, cb = comp[a], comp[b]
    apart = ca != cb
    return ca[apart], cb[apart], (d - within[b] + within[a])[apart]


def _aligned(
    neighbours: I64,
    row: I64,
    leave: F64,
    pg: I64,
    p2p: P2PCalls,
    within: F64,
    comp: I64,
    seq_edges: Edges,
    settled: I64,
) -> F64:
    """Each record's start: its set's offset (sequence-number offsets where settled, else the most frequent of
    all combinations, pooled over every pair of ranks joining two sets) plus its offset within its set."""
    n_rec = comp.size
    combos = _lifted(_all_combos(neighbours, row, leave, pg, p2p, comp, settled), within, comp)
    combo_edges = _modes(*combos, n_rec, 0.0)[0] if combos[0].size else _NONE
    between, _ = _offsets(n_rec, [seq_edges, combo_edges])
    out: F64 = between[comp] + within
    return out


def _unsettled(settled: I64, sends: I64, recvs: I64, row: I64, kind: I64, comp: I64, n_rec: int) -> I64:
    """The set pairs settled by sequence numbers that have a p2p call left unmatched on one of their ranks."""
    alone = np.ones(row.size, dtype=bool)
    alone[sends] = alone[recvs] = False
    lonely = np.unique(comp[row[alone & (kind != COLLECTIVE)]])
    if lonely.size == 0 or settled.size == 0:
        return np.zeros(0, dtype=np.int64)
    out: I64 = settled[np.isin(settled // n_rec, lonely) | np.isin(settled % n_rec, lonely)]
    return out


@dataclass(frozen=True, slots=True)
class P2PCalls:
    """The p2p calls of one iteration, found once: the sends in call order, and the receives sorted by
    (process group, rank), a rank's in the order it entered them, with each (group, rank)'s key and its
    [lo, hi) in that order. The three lookups of a send's receives on a neighbour (by sequence number, all of
    them, the nearest-ending) search this one order rather than each sorting the receives its own way."""

    sends: I64
    recvs: I64
    key: I64
    """Per receive of ``recvs``: ``group * records + rank``, non-decreasing."""
    uniq: I64
    """Each (group, rank) that receives, its key once, ascending."""
    bounds: I64
    """Where each of ``uniq`` starts in ``recvs``, and the end."""


def _p2p_calls(row: I64, kind: I64, pg: I64, n_rec: int) -> P2PCalls:
    sends, recvs = np.flatnonzero(kind == SEND), np.flatnonzero(kind == RECV)
    key = pg[recvs] * n_rec + row[recvs]
    order = np.argsort(key, kind="stable")  # a rank's calls are contiguous: runs timsort merges in linear time
    recvs, key = recvs[order], key[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if key.size else np.zeros(0, np.int64)
    return P2PCalls(sends, recvs, key, key[starts], np.r_[starts, key.size].astype(np.int64))


def pipeline_neighbours(records: Sequence[Mapping[str, object]]) -> I64:
    """Per record, the records one pipeline stage before and after it in its replica and tensor slot (-1:
    none); both -2 where its coordinates are unknown."""
    where: dict[tuple[int, int, int], int] = {}
    coords = []
    for r, rec in enumerate(records):
        c = (_coordinate(rec, "dp_rank"), _coordinate(rec, "tp_rank"), _coordinate(rec, "pp_rank"))
        coords.append(c)
        where[c] = r
    out = np.full((len(records), 2), -1, dtype=np.int64)
    for r, (dp, tp, pp) in enumerate(coords):
        if pp < 0:
            out[r] = -2
            continue
        out[r, 0] = where.get((dp, tp, pp - 1), -1)
        out[r, 1] = where.get((dp, tp, pp + 1), -1)
    return out


def _coordinate(rec: Mapping[str, object], field: str) -> int:
    """A layout coordinate (-1: absent); a plain ``int`` as it is (``as_int``'s protocol check costs more than
    the rest of the lookup, ten thousand records per iteration)."""
    value = rec.get(field, -1)
    return value if type(value) is int else as_int(value)


Edges = tuple[I64, I64, F64]
"""(a, b, o_b - o_a): what one instance says of two records' start offsets."""


def _collective_edges(row: I64, leave: F64, inst: I64) -> Edges:
    """Each member against its instance's first: they left together, so o_b - o_a = l_a - l_b."""
    if row.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    head = np.full(int(inst.max()) + 1, -1, dtype=np.int64)
    head[inst[::-1]] = np.arange(inst.size - 1, -1, -1)
    a = row[head[inst]]
    keep = a != row
    return a[keep], row[keep], (leave[head[inst]] - leave)[keep]


def _groups(values: I64) -> tuple[I64, I64, I64]:
    """Calls sorted by ``values`` and each distinct value's [lo, hi) in that order."""
    order = np.argsort(values, kind="stable")
    srt = values[order]
    uniq, lo = np.unique(srt, return_index=True)
    return order, uniq, np.r_[lo, srt.size][: uniq.size + 1]


_NONE: Edges = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))


def _seq_combos(neighbours: I64, row: I64, leave: F64, pg: I64, seq: I64, p2p: P2PCalls) -> Edges:
    """Every send with the receive of equal sequence number on a pipeline neighbour (the first received where
    several are): (sender, receiver, the offset their ends give)."""
    sends, recvs = p2p.sends, p2p.recvs
    n_rec = neighbours.shape[0]
    if sends.size == 0 or recvs.size == 0:
        return _NONE
    s_seq, r_seq = seq[sends], seq[recvs]
    lo_seq = int(min(s_seq.min(), r_seq.min()))
    span = int(max(s_seq.max(), r_seq.max())) - lo_seq + 1
    r_key = p2p.key * span + (r_seq - lo_seq)
    order = np.argsort(r_key, kind="stable")  # sorted by (group, rank) already: by number within each
    srt, by_key = r_key[order], recvs[order]
    s_row = row[sends]
    s_key = pg[sends] * n_rec * span + (s_seq - lo_seq)
    a_l, b_l, d_l = [], [], []
    for cand in (neighbours[s_row, 0], neighbours[s_row, 1]):
        want = s_key + np.maximum(cand, 0) * span
        at = np.minimum(np.searchsorted(srt, want), srt.size - 1)
        ok = (cand >= 0) & (srt[at] == want)
        r = by_key[at[ok]]
        a_l.append(s_row[ok])
        b_l.append(row[r])
        d_l.append(leave[sends[ok]] - leave[r])
    return np.concatenate(a_l), np.concatenate(b_l), np.concatenate(d_l)


def _modes(a: I64, b: I64, d: F64, n_rec: int, min_share: float) -> tuple[Edges, I64]:
    if a.size == 0:
        return _NONE, np.zeros(0, np.int64)
    return _modes_of(a, b, d, n_rec, min_share)


def _modes_of(a: I64, b: I64, d: F64, n_rec: int, min_share: float) -> tuple[Edges, I64]:
    """Per pair of records, the most frequent offset (``BIN_NS`` bins, the median of the winning bin) where
    its bin holds two values or more and ``min_share`` of the pair's; and the pairs' keys."""
    lo_r, hi_r = np.minimum(a, b), np.maximum(a, b)
    d = np.where(a == lo_r, d, -d)  # o_hi - o_lo
    pair = lo_r * n_rec + hi_r
    bins = np.floor(d / BIN_NS).astype(np.int64)
    bins -= bins.min()
    width = int(bins.max()) + 1
    cells, inverse, count = _unique(pair * width + bins)
    c_pair = cells // width
    per_pair = np.bincount(np.searchsorted(np.unique(c_pair), c_pair), weights=count)
    best = np.lexsort((-count, c_pair))
    first = best[np.r_[True, c_pair[best][1:] != c_pair[best][:-1]]]
    total = per_pair[np.searchsorted(np.unique(c_pair), c_pair[first])]
    first = first[(count[first] >= 2) & (count[first] >= min_share * total)]
    chosen = np.zeros(count.size, dtype=bool)
    chosen[first] = True
    sel = chosen[inverse.reshape(-1)]
    p_sel, d_sel = pair[sel], d[sel]
    order = np.lexsort((d_sel, p_sel))
    p_sel, d_sel = p_sel[order], d_sel[order]
    bounds = np.r_[0, np.flatnonzero(np.diff(p_sel)) + 1, p_sel.size] if p_sel.size else np.zeros(1, np.int64)
    mid = (bounds[:-1] + bounds[1:] - 1) // 2
    keys = p_sel[bounds[:-1]]
    return (keys // n_rec, keys % n_rec, d_sel[mid]), keys


def _unique(values: I64) -> tuple[I64, I64, I64]:
    """``np.unique(values, return_inverse=True, return_counts=True)`` by a stable sort: the pairs' offsets come
    mostly in order, runs timsort merges faster than quicksort sorts them."""
    perm = np.argsort(values, kind="stable")
    srt = values[perm]
    new = np.ones(srt.size, dtype=bool)
    np.not_equal(srt[1:], srt[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    inverse = np.empty(srt.size, dtype=np.int64)
    inverse[perm] = np.cumsum(new) - 1
    return srt[starts], inverse, np.diff(np.r_[starts, srt.size])


def _all_combos(neighbours: I64, row: I64, leave: F64, pg: I64, p2p: P2PCalls, comp: I64, settled: I64) -> Edges:
    """Every send with every receive of its group on a pipeline neighbour (the first ``MAX_PAIR_CALLS`` of
    each), but toward a neighbour of its own set (``comp``) or of a set pair ``settled`` already: (sender,
    receiver, the offset)."""
    sends, recvs = p2p.sends, p2p.recvs
    known = neighbours[:, 0] != -2
    if sends.size == 0 or recvs.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    n_rec = neighbours.shape[0]
    r_uniq, r_bounds = p2p.uniq, p2p.bounds
    # the first MAX_PAIR_CALLS sends of each (group, rank)
    s_key = pg[sends] * n_rec + row[sends]
    s_order, _, s_bounds = _groups(s_key)
    pos = np.arange(sends.size) - np.repeat(s_bounds[:-1], np.diff(s_bounds))
    s_take = sends[s_order[pos < MAX_PAIR_CALLS]]
    t_row = row[s_take]
    a_all, b_all, d_all = [], [], []
    for col in (0, 1):
        cand = neighbours[t_row, col]
        c_own, c_other = comp[t_row], comp[np.maximum(cand, 0)]
        lo_c, hi_c = np.minimum(c_own, c_other), np.maximum(c_own, c_other)
        skip = np.isin(lo_c * n_rec + hi_c, settled) | (lo_c == hi_c)
        ok = (cand >= 0) & known[t_row] & ~skip
        want = pg[s_take] * n_rec + np.maximum(cand, 0)
        at = np.searchsorted(r_uniq, want)
        ok &= at < r_uniq.size
        ok &= r_uniq[np.minimum(at, r_uniq.size - 1)] == want
        s_ok, at = s_take[ok], at[ok]
        lo, hi = r_bounds[at], np.minimum(r_bounds[at + 1], r_bounds[at] + MAX_PAIR_CALLS)
        size = hi - lo
        s_rep = np.repeat(s_ok, size)
        r_rep = recvs[np.repeat(lo - np.r_[0, np.cumsum(size)[:-1]], size) + np.arange(int(size.sum()))]
        a_all.append(row[s_rep])
        b_all.append(row[r_rep])
        d_all.append(leave[s_rep] - leave[r_rep])
    return np.concatenate(a_all), np.concatenate(b_all), np.concatenate(d_all)


def _offsets(n_rec: int, edges: Sequence[Edges]) -> tuple[F64, I64]:
    """Each record's start offset from the pairwise differences: the median per pair, then a spanning tree
    (breadth first from the lowest record of each connected set, which starts at 0); and each record's set."""
    a = np.concatenate([e[0] for e in edges])
    b = np.concatenate([e[1] for e in edges])
    d = np.concatenate([e[2] for e in edges])
    start = np.zeros(n_rec)
    comp = np.arange(n_rec)
    if a.size == 0:
        return start, comp
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    d = np.where(a == lo, d, -d)
    pair = lo * n_rec + hi
    order = np.lexsort((d, pair))
    pair, d = pair[order], d[order]
    bounds = np.r_[0, np.flatnonzero(np.diff(pair)) + 1, pair.size]
    mid = (bounds[:-1] + bounds[1:] - 1) // 2
    p_lo, p_hi, p_d = pair[mid] // n_rec, pair[mid] % n_rec, d[mid]
    src = np.concatenate([p_lo, p_hi])
    dst = np.concatenate([p_hi, p_lo])
    diff = np.concatenate([p_d, -p_d])
    by = np.argsort(src, kind="stable")
    src, dst, diff = src[by], dst[by], diff[by]
    at = np.searchsorted(src, np.arange(n_rec + 1))
    seen = np.zeros(n_rec, dtype=bool)
    dst_l, diff_l, at_l = dst.tolist(), diff.tolist(), at.tolist()
    for root in range(n_rec):
        if seen[root]:
            continue
        seen[root] = True
        queue = deque([root])
        while queue:
            u = queue.popleft()
            for k in range(at_l[u], at_l[u + 1]):
                v = dst_l[k]
                if not seen[v]:
                    seen[v] = True
                    start[v] = start[u] + diff_l[k]
                    comp[v] = root
                    queue.append(v)
    return start, comp


def _nearest(neighbours: I64, row: I64, aligned: F64, pg: I64, p2p: P2PCalls) -> tuple[I64, I64]:
    """(send, receive) pairs: each send's nearest-ending receive of its group on a neighbour (any rank of the
    group where the layout is unknown) within ``MATCH_TOLERANCE_NS``; a receive keeps its nearest send."""
    sends = p2p.sends
    if sends.size == 0 or p2p.recvs.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    n_rec = neighbours.shape[0]
    unknown = neighbours[:, 0] == -2  # per record
    r_sorted, g_key = _by_end(row, aligned, pg, p2p, unknown)
    # each (group, rank)'s run: its key, where it starts; one sorted array of every run shifted past the last
    g_starts = np.flatnonzero(np.r_[True, g_key[1:] != g_key[:-1]])
    g_uniq, g_bounds = g_key[g_starts], np.r_[g_starts, g_key.size]
    values = aligned[r_sorted]
    span = float(np.max(np.abs(values))) * 2 + 2.0
    shifted = values + np.repeat(np.arange(g_uniq.size), np.diff(g_bounds)) * span
    r_row = row[r_sorted]
    best = np.full(sends.size, np.inf)
    pick = np.full(sends.size, -1, dtype=np.int64)
    s_row, s_end = row[sends], aligned[sends]
    s_unknown = unknown[s_row]
    s_group = pg[sends] * (n_rec + 1)
    for col in (0, 1):
        cand = np.where(s_unknown, n_rec, neighbours[s_row, col])
        want = s_group + np.maximum(cand, 0)
        run = np.minimum(np.searchsorted(g_uniq, want), g_uniq.size - 1)
        hit = (g_uniq[run] == want) & (cand >= 0)
        q = np.flatnonzero(hit)  # the sends whose candidate rank receives in their group
        lo, hi, run = g_bounds[run[q]], g_bounds[run[q] + 1], run[q]
        at = np.clip(np.searchsorted(shifted, s_end[q] + run * span), lo, hi)
        for p in (at - 1, at):
            pc = np.clip(p, 0, r_sorted.size - 1)
            inside = (p >= lo) & (p < hi) & (r_row[pc] != s_row[q])
            gap = np.where(inside, np.abs(values[pc] - s_end[q]), np.inf)
            better = gap < best[q]
            upd = q[better]
            best[upd], pick[upd] = gap[better], r_sorted[pc[better]]
    found = best <= MATCH_TOLERANCE_NS
    s_idx, r_idx, gap = sends[found], pick[found], best[found]
    first = np.lexsort((gap, r_idx))
    keep = first[np.r_[True, r_idx[first][1:] != r_idx[first][:-1]]] if first.size else first
    return s_idx[keep].astype(np.int64), r_idx[keep].astype(np.int64)


def _by_end(row: I64, aligned: F64, pg: I64, p2p: P2PCalls, unknown: npt.NDArray[np.bool_]) -> tuple[I64, I64]:
    """The receives sorted by (group, rank where its layout is known, else one for all, end; then the order
    entered) and each one's (group, rank) key. Where every rank is known and its receives end in the order
    entered, that is ``p2p``'s order as it is: only a check, no sort."""
    n_rec = unknown.size
    recvs = p2p.recvs
    if not unknown[row[recvs]].any():
        values = aligned[recvs]
        same_run = p2p.key[1:] == p2p.key[:-1]
        if not np.any(same_run & ~(values[1:] >= values[:-1])):
            return recvs, (p2p.key // n_rec) * (n_rec + 1) + p2p.key % n_rec
    recvs = np.sort(recvs)
    r_rank = np.where(unknown[row[recvs]], n_rec, row[recvs])
    r_group = pg[recvs] * (n_rec + 1) + r_rank
    order = np.lexsort((aligned[recvs], r_group))
    return recvs[order], r_group[order]
