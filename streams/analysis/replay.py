"""The iteration replayed from its ranks' timelines: who waits for whom, as a longest path over call instances.

Model (one iteration; each rank's times relative to its own start, every rank starting at 0):
1. A rank's calls depend on its own work: each call is entered ``work`` after the latest of its earlier calls
   to have ended before it was entered (the previous call, unless calls overlap, as asynchronous ones do),
   or after the start; ``work`` is the measured gap. The rank ends ``tail`` after its last call to end.
2. The members of one call instance (the same process group and sequence number; a send and the receive that
   matches it, ``match_p2p``) all leave it at the latest member's arrival plus its transfer. The transfer is
   what the last to arrive spent in it: the shortest member's measured time (it did not wait). A call with
   no other member present keeps its own measured time.
3. The job's iteration time is the latest rank's end: a late rank holds every rank at the next iteration's
   first collective.

The instances are ordered once (Kahn's algorithm, one level per round); a replay is then one pass over the
levels, vectorised over every call of a level and over several scenarios at once (``replay_times``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.streams.analysis.patterns import collective_class, process_group_of
from fleetscope.streams.analysis.timeline import RankTimeline, timeline_of

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

P2P_OPS = ("send", "recv")
"""The point-to-point ops: a call of one matches a call of the other on another rank."""
_OP_RE = re.compile(r"^[^:\[]*:([^\[]*)")
_COLLECTIVE, _SEND, _RECV = 0, 1, 2


@functools.lru_cache(maxsize=65536)
def call_kind(function: str) -> tuple[str, int, str]:
    """(process group, 0 collective / 1 send / 2 recv, the class its peers share) of a call's function."""
    m = _OP_RE.match(function)
    op = m.group(1) if m else ""
    kind = P2P_OPS.index(op) + 1 if op in P2P_OPS else _COLLECTIVE
    return process_group_of(function), kind, "p2p" if kind else collective_class(function)


@dataclass(frozen=True, slots=True)
class CallGraph:
    """Every call of one iteration of a job, flattened rank by rank, with who waits for whom."""

    row: I64
    """The record (rank) each call belongs to; a rank's calls are contiguous, in the order it entered them."""
    first: I64
    """Per record: the index of its first call (``first[r + 1] - first[r]`` calls; records without: none)."""
    enter_ns: F64
    leave_ns: F64
    compute_ns: F64
    """GPU compute in the work before each call; NaN where the rank's kernels are unknown."""
    dep: I64
    """The call each call waits for on its rank (``len(row)``: the iteration's start)."""
    work_ns: F64
    """Measured time from ``dep``'s leave (or the start) to the call's enter."""
    instance: I64
    """The call instance each call is a member of."""
    group: I64
    """Per instance: its process group's code (``groups``)."""
    klass: I64
    """Per instance: the code of what its like instances share (``classes``): op and size class, or p2p."""
    nbytes: F64
    """Per instance: bytes per call (the function's mean on the first member), 0 where unknown."""
    transfer_ns: F64
    """Per instance: the shortest member's measured time in it."""
    members: I64
    """Per instance: how many calls are members."""
    last: I64
    """Per record: its call that ended last (-1: no calls)."""
    tail_ns: F64
    """Per record: its iteration after its last call ended (the whole iteration where it has no calls)."""
    tail_compute_ns: F64
    """Per record: the GPU compute in its tail; NaN where unknown."""
    iteration_ns: F64
    groups: tuple[str, ...]
    classes: tuple[str, ...]
    levels: tuple[tuple[I64, I64, I64, I64], ...]
    """Per level: (its calls, the calls they wait for, reduceat offsets per instance, its instances)."""
    matched_p2p: int
    unmatched_p2p: int

    @property
    def calls(self) -> int:
        return int(self.row.size)


@dataclass(frozen=True, slots=True)
class Replay:
    """One iteration replayed: per rank and for the job, with the error against what was measured."""

    ranks: I64
    replayed_ns: F64
    measured_ns: F64
    error: F64
    """Per rank: (replayed - measured) / measured."""
    job_ns: float
    """The latest rank's replayed end."""
    job_measured_ns: float
    """The median rank's measured iteration time (ranks held together by collectives take about as long)."""
    job_error: float


def call_graph(
    records: Sequence[Mapping[str, Any]], timelines: Sequence[RankTimeline | None] | None = None
) -> CallGraph:
    """The call graph of one iteration's pattern records (one per rank; records without a timeline have no
    calls and end at their measured iteration time); ``timelines``: the records' own, already read."""
    n_rec = len(records)
    pg_codes: dict[str, int] = {}
    class_codes: dict[str, int] = {}
    parts: dict[str, list[Any]] = {k: [] for k in ("row", "enter", "leave", "comp", "seq", "pg", "kind", "cls", "by")}
    counts = np.zeros(n_rec, dtype=np.int64)
    iteration = np.zeros(n_rec, dtype=np.float64)
    tail_compute = np.full(n_rec, np.nan)
    for r, rec in enumerate(records):
        iteration[r] = float(rec.get("iteration_ns", 0))
        tail_compute[r] = _tail_compute(tl := timeline_of(rec) if timelines is None else timelines[r])
        if tl is None:
            continue
        names = rec["function"]
        used, inverse = np.unique(tl.function, return_inverse=True)
        codes = np.empty((used.size, 3), dtype=np.int64)
        per_call = np.zeros(used.size, dtype=np.float64)
        calls, total = rec.get("calls"), rec.get("nbytes")
        for i, f in enumerate(used.tolist()):
            group, op_kind, like = call_kind(names[f])
            codes[i] = (
                pg_codes.setdefault(group, len(pg_codes)),
                op_kind,
                class_codes.setdefault(like, len(class_codes)),
            )
            if calls is not None and total is not None and f < len(calls) and calls[f] > 0:
                per_call[i] = float(total[f]) / float(calls[f])
        n = len(tl)
        counts[r] = n
        parts["row"].append(np.full(n, r, dtype=np.int64))
        parts["enter"].append(tl.enter_ns)
        parts["leave"].append(tl.leave_ns)
        parts["comp"].append(tl.compute_ns if tl.compute_ns is not None else np.full(n, np.nan))
        parts["seq"].append(tl.seq)
        parts["pg"].append(codes[inverse, 0])
        parts["kind"].append(codes[inverse, 1])
        parts["cls"].append(codes[inverse, 2])
        parts["by"].append(per_call[inverse])
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in parts.items()}
    row = cat["row"].astype(np.int64)
    enter = cat["enter"].astype(np.float64)
    leave = np.maximum(cat["leave"].astype(np.float64), enter)
    first = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    dep, work = _dependencies(row, enter, leave)
    kind, pg, seq = cat["kind"].astype(np.int64), cat["pg"].astype(np.int64), cat["seq"].astype(np.int64)
    instance, matched, unmatched = _instances(records, row, leave, kind, pg, seq)
    graph = _graph(records, row, first, enter, leave, cat, dep, work, instance, iteration, pg_codes, class_codes,
                   matched, unmatched)  # fmt: skip
    return dataclasses.replace(graph, tail_compute_ns=np.minimum(tail_compute, graph.tail_ns))


def _tail_compute(tl: RankTimeline | None) -> float:
    """GPU compute after the rank's last call entered (the timeline's, where it has it); NaN: unknown."""
    value = getattr(tl, "tail_compute_ns", None)
    return float(value) if value is not None else np.nan


def _graph(
    records: Sequence[Mapping[str, Any]],
    row: I64,
    first: I64,
    enter: F64,
    leave: F64,
    cat: dict[str, np.ndarray],
    dep: I64,
    work: F64,
    instance: I64,
    iteration: F64,
    pg_codes: dict[str, int],
    class_codes: dict[str, int],
    matched: int,
    unmatched: int,
) -> CallGraph:
    n_inst = int(instance.max()) + 1 if instance.size else 0
    members = np.bincount(instance, minlength=n_inst).astype(np.int64)
    transfer = np.full(n_inst, np.inf)
    np.minimum.at(transfer, instance, leave - enter)
    head = np.full(n_inst, -1, dtype=np.int64)
    head[instance[::-1]] = np.arange(instance.size - 1, -1, -1)
    n_rec = len(records)
    last = np.full(n_rec, -1, dtype=np.int64)
    tail = iteration.copy()
    if row.size:
        order = np.lexsort((leave, row))
        ends = np.r_[np.flatnonzero(np.diff(row[order])), row.size - 1]
        last[row[order[ends]]] = order[ends]
        has = last >= 0
        tail[has] = np.maximum(iteration[has] - leave[last[has]], 0.0)
    dep, levels = _levels(dep, instance, members, enter)
    work = np.where(dep == row.size, enter, work)
    return CallGraph(
        row=row, first=first, enter_ns=enter, leave_ns=leave, compute_ns=cat["comp"].astype(np.float64),
        dep=dep, work_ns=work, instance=instance, group=cat["pg"].astype(np.int64)[head],
        klass=cat["cls"].astype(np.int64)[head], nbytes=cat["by"].astype(np.float64)[head],
        transfer_ns=transfer, members=members, last=last, tail_ns=tail, tail_compute_ns=np.full(n_rec, np.nan),
        iteration_ns=iteration,
        groups=tuple(pg_codes), classes=tuple(class_codes), levels=levels, matched_p2p=matched,
        unmatched_p2p=unmatched,
    )  # fmt: skip


def _dependencies(row: I64, enter: F64, leave: F64) -> tuple[I64, F64]:
    """Per call, the latest-ending earlier call of its rank that ended before it was entered (none: the
    start, ``len(row)``), and the measured work between: one search in the calls sorted by (rank, leave)."""
    n = row.size
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    span = float(max(np.max(leave), np.max(enter))) + 1.0
    key = row * span + leave
    order = np.argsort(key, kind="stable")
    pos = np.searchsorted(key[order], row * span + enter, side="right") - 1
    found = order[np.maximum(pos, 0)]
    same = (pos >= 0) & (row[found] == row)
    # a zero-length call ending at its own enter is not its own dependency: the one ending before it is
    own = same & (found == np.arange(n))
    prev = order[np.maximum(pos - 1, 0)]
    found = np.where(own, prev, found)
    same &= ~own | ((pos >= 1) & (row[prev] == row))
    dep = np.where(same, found, n)
    work = np.where(same, enter - leave[np.minimum(found, n - 1)], enter)
    return dep.astype(np.int64), np.maximum(work, 0.0)


def _instances(
    records: Sequence[Mapping[str, Any]], row: I64, leave: F64, kind: I64, pg: I64, seq: I64
) -> tuple[I64, int, int]:
    """Instance ids: collectives by (group, seq); a send with the receive ``match_p2p`` gives it; the rest alone."""
    n = row.size
    key = np.full(n, -1, dtype=np.int64)
    coll = kind == _COLLECTIVE
    if coll.any():
        s = seq[coll] - seq[coll].min()
        key[coll] = pg[coll] * (int(s.max()) + 1) + s
    sends, recvs = match_p2p(records, row, leave, kind, pg)
    p2p = kind != _COLLECTIVE
    base = int(key.max()) + 1 if coll.any() else 0
    key[sends] = base + np.arange(sends.size)
    key[recvs] = base + np.arange(sends.size)
    alone = p2p.copy()
    alone[sends] = alone[recvs] = False
    key[alone] = base + sends.size + np.arange(int(alone.sum()))
    _, instance = np.unique(key, return_inverse=True)
    return instance.astype(np.int64).reshape(-1), int(sends.size), int(alone.sum())


def match_p2p(records: Sequence[Mapping[str, Any]], row: I64, leave: F64, kind: I64, pg: I64) -> tuple[I64, I64]:
    """Matched (send, receive) call indices.

    The producers number p2p calls differently (the torch hook per pair of ranks, a Kineto trace per process
    group or by NCCL's own count, the simulator per pipeline pass), so the sequence number is not used. Both
    ends of a transfer end at once: a send on rank r matches the receive of its process group that ended
    nearest to it on one of r's pipeline neighbours (the same replica and tensor slot, one stage away; any
    other rank of the group where the layout is unknown); each receive matches at most one send, the nearest.
    """
    sends, recvs = np.flatnonzero(kind == _SEND), np.flatnonzero(kind == _RECV)
    if sends.size == 0 or recvs.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    span = float(np.max(leave)) + 1.0
    neighbours = _pipeline_neighbours(records)
    n_rec = len(records)
    # recvs sorted by (pg, row, leave); a candidate row's receives are one contiguous run of that order
    rkey = (pg[recvs] * n_rec + row[recvs]) * span + leave[recvs]
    order = np.argsort(rkey, kind="stable")
    rsorted = rkey[order]
    best = np.full(sends.size, np.inf)
    pick = np.full(sends.size, -1, dtype=np.int64)
    s_row, s_pg, s_leave = row[sends], pg[sends], leave[sends]
    for cand in neighbours[s_row].T:  # two columns: the stage before and the stage after
        ok = cand >= 0
        gkey = (s_pg * n_rec + np.maximum(cand, 0)).astype(np.float64)
        lo = np.searchsorted(rsorted, gkey * span, side="left")
        hi = np.searchsorted(rsorted, (gkey + 1) * span, side="left")
        at = np.searchsorted(rsorted, gkey * span + s_leave)
        for p in (at - 1, at):
            inside = ok & (p >= lo) & (p < hi)
            j = np.clip(p, 0, rsorted.size - 1)
            gap = np.where(inside, np.abs(rsorted[j] - (gkey * span + s_leave)), np.inf)
            better = gap < best
            best, pick = np.where(better, gap, best), np.where(better, order[j], pick)
    unknown = neighbours[s_row, 0] == -2
    if unknown.any():
        pick, best = _nearest_in_group(unknown, s_row, s_pg, s_leave, row[recvs], pg[recvs], leave[recvs], pick, best)
    found = pick >= 0
    s_idx, r_idx, gap = sends[found], recvs[pick[found]], best[found]
    first = np.lexsort((gap, r_idx))
    keep = first[np.r_[True, r_idx[first][1:] != r_idx[first][:-1]]]
    return s_idx[keep].astype(np.int64), r_idx[keep].astype(np.int64)


def _nearest_in_group(
    unknown: npt.NDArray[np.bool_],
    s_row: I64,
    s_pg: I64,
    s_leave: F64,
    r_row: I64,
    r_pg: I64,
    r_leave: F64,
    pick: I64,
    best: F64,
) -> tuple[I64, F64]:
    """Where the layout is unknown: the nearest-ending receive of the send's group on another rank."""
    order = np.lexsort((r_leave, r_pg))
    rpg, rleave, rrow = r_pg[order], r_leave[order], r_row[order]
    for i in np.flatnonzero(unknown):  # rare: a layout that says nothing; a few per iteration at most
        lo, hi = np.searchsorted(rpg, s_pg[i]), np.searchsorted(rpg, s_pg[i], side="right")
        if hi > lo:
            gap = np.where(rrow[lo:hi] != s_row[i], np.abs(rleave[lo:hi] - s_leave[i]), np.inf)
            j = int(np.argmin(gap))
            if np.isfinite(gap[j]):
                pick[i], best[i] = int(order[lo + j]), float(gap[j])
    return pick, best


def _pipeline_neighbours(records: Sequence[Mapping[str, Any]]) -> I64:
    """Per record, the records one pipeline stage before and after it in its replica and tensor slot (-1:
    none); both -2 where its coordinates are unknown."""
    where: dict[tuple[int, int, int], int] = {}
    coords = []
    for r, rec in enumerate(records):
        c = (int(rec.get("dp_rank", -1)), int(rec.get("tp_rank", -1)), int(rec.get("pp_rank", -1)))
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


def _levels(dep: I64, instance: I64, members: I64, enter: F64) -> tuple[I64, tuple[tuple[I64, I64, I64, I64], ...]]:
    """Instances in dependency order, one level per round of Kahn's algorithm. An instance on a cycle
    (inconsistent input: a wrong match) has its members' dependencies cut: they enter when measured."""
    n = dep.size
    n_inst = members.size
    dep = dep.copy()
    has = dep < n
    waits = np.bincount(instance[has], minlength=n_inst)
    # dependents of each call, grouped by the call they wait for
    by_dep = np.argsort(np.where(has, dep, n), kind="stable")[: int(has.sum())]
    d_start = np.searchsorted(dep[by_dep], np.arange(n + 1))
    by_inst = np.argsort(instance, kind="stable")
    i_start = np.concatenate(([0], np.cumsum(members)))
    level = np.full(n_inst, -1, dtype=np.int64)
    frontier = np.flatnonzero(waits == 0)
    done, lv = 0, 0
    while done < n_inst:
        if frontier.size == 0:  # a cycle: release the pending instance entered first
            pending = np.flatnonzero(level < 0)
            first_enter = np.full(n_inst, np.inf)
            np.minimum.at(first_enter, instance, enter)
            stuck = pending[np.argmin(first_enter[pending])]
            cut = by_inst[i_start[stuck] : i_start[stuck + 1]]
            dep[cut] = n
            frontier = np.array([stuck])
        level[frontier] = lv
        done += frontier.size
        lv += 1
        calls = _ranges(by_inst, i_start[frontier], i_start[frontier + 1])
        after = _ranges(by_dep, d_start[calls], d_start[calls + 1])
        after = after[dep[after] < n]
        if after.size == 0:
            frontier = np.zeros(0, dtype=np.int64)
            continue
        hit = np.bincount(instance[after], minlength=n_inst)
        touched = np.flatnonzero(hit)
        waits[touched] -= hit[touched]
        frontier = touched[(waits[touched] == 0) & (level[touched] < 0)]
    order = np.lexsort((instance, level[instance]))
    lv_of = level[instance[order]]
    bounds = np.r_[0, np.flatnonzero(np.diff(lv_of)) + 1, order.size]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        calls = order[a:b]
        inst = instance[calls]
        starts = np.r_[0, np.flatnonzero(np.diff(inst)) + 1]
        out.append((calls, dep[calls], starts, inst[starts]))
    return dep, tuple(out)


def _ranges(values: I64, lo: I64, hi: I64) -> I64:
    """``values[lo[k]:hi[k]]`` for every k, concatenated."""
    size = hi - lo
    total = int(size.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(lo - np.concatenate(([0], np.cumsum(size)[:-1])), size)
    return values[offsets + np.arange(total)]


def replay_times(graph: CallGraph, work_ns: F64 | None = None, transfer_ns: F64 | None = None) -> F64:
    """Each record's replayed end, (records,) or (records, scenarios) where ``work_ns`` (calls, S) or
    ``transfer_ns`` (instances, S) give S scenarios; the tail of each record is its ``tail_ns``."""
    work = graph.work_ns if work_ns is None else work_ns
    transfer = graph.transfer_ns if transfer_ns is None else transfer_ns
    s = max(work.shape[1] if work.ndim == 2 else 1, transfer.ndim == 2 and transfer.shape[1] or 1)
    two_d = work.ndim == 2 or transfer.ndim == 2
    shape = (graph.calls + 1, s) if two_d else (graph.calls + 1,)
    leave = np.zeros(shape)  # the last row is the iteration's start, 0
    if two_d:
        work = np.broadcast_to(work if work.ndim == 2 else work[:, None], (graph.calls, s))
        transfer = np.broadcast_to(transfer if transfer.ndim == 2 else transfer[:, None], (transfer.shape[0], s))
    for calls, deps, starts, inst in graph.levels:
        arrive = leave[deps] + work[calls]
        end = np.maximum.reduceat(arrive, starts, axis=0) + transfer[inst]
        leave[calls] = np.repeat(end, np.diff(np.r_[starts, calls.size]), axis=0)
    return _ends(graph, leave, two_d)


def _ends(graph: CallGraph, leave: F64, two_d: bool) -> F64:
    has = graph.last >= 0
    tail = graph.tail_ns[:, None] if two_d else graph.tail_ns
    out = np.broadcast_to(tail, (graph.last.size, leave.shape[1]) if two_d else graph.last.shape).copy()
    out[has] += leave[graph.last[has]]
    return out


def replay(records: Sequence[Mapping[str, Any]], graph: CallGraph | None = None) -> Replay:
    """The iteration replayed from the records' timelines, per rank and for the job, against the measured."""
    g = call_graph(records) if graph is None else graph
    ends = replay_times(g)
    measured = g.iteration_ns
    job_measured = float(np.median(measured)) if measured.size else 0.0
    job = float(ends.max()) if ends.size else 0.0
    return Replay(
        ranks=np.array([int(r.get("rank", i)) for i, r in enumerate(records)], dtype=np.int64),
        replayed_ns=ends,
        measured_ns=measured,
        error=np.where(measured > 0, (ends - measured) / np.maximum(measured, 1.0), 0.0),
        job_ns=job,
        job_measured_ns=job_measured,
        job_error=(job - job_measured) / job_measured if job_measured > 0 else 0.0,
    )
