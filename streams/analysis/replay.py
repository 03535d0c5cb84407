"""The iteration replayed from its ranks' timelines: who waits for whom, as a longest path over call instances.

Model (one iteration; each rank starts where ``callmatch`` puts its start on the job's common clock):
1. A rank's calls depend on its own work: each call is entered ``work`` after the latest of its earlier calls
   to have ended before it was entered (the previous call, unless calls overlap, as asynchronous ones do),
   or after the start; ``work`` is the measured gap. The rank ends ``tail`` after its last call to end.
2. The members of one call instance (the same process group and sequence number; a send and the receive that
   matches it, ``callmatch``) all leave it at the latest member's arrival plus its transfer. The transfer is
   what the last to arrive spent in it: the shortest member's measured time (it did not wait). A call with
   no other member present keeps its own measured time.
3. The job's iteration time is its steady period (``steady_period``): iterations replayed back to back, each
   rank starting the next where it ended, so a rank late at the end holds the others at the next iteration's
   first collective.

Limits: one dependency per call, so a call entered after an asynchronous one ended is tied to it (DDP's
buckets overlapping the backward: a faster bucket pulls the next calls earlier than their compute allows);
a send and its receive are one instance only where they end together (NCCL; gloo's send returns when its
bytes are written, so most of a gloo pipeline's transfers stay alone and keep their measured times).

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

from fleetscope.streams.analysis.callmatch import COLLECTIVE, RECV, SEND, match_calls
from fleetscope.streams.analysis.patterns import collective_class, process_group_of
from fleetscope.streams.analysis.timeline import RankTimeline, timeline_of

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]
Floats = npt.NDArray[np.floating[Any]]
"""Times of a replay: float64, or float32 for what-if scenarios."""

_NO_CALL = (0.0, 0.0, 0.0, 0.0)
P2P_OPS = ("send", "recv")
"""The point-to-point ops: a call of one matches a call of the other on another rank."""
FEW_MEMBERS = 16
"""Instances of at most this many members are reduced member by member (a pair: one maximum)."""
_OP_RE = re.compile(r"^[^:\[]*:([^\[]*)")


@functools.lru_cache(maxsize=65536)
def call_kind(function: str) -> tuple[str, int, str]:
    """(process group, 0 collective / 1 send / 2 recv, the class its peers share) of a call's function."""
    m = _OP_RE.match(function)
    op = m.group(1) if m else ""
    kind = (SEND, RECV)[P2P_OPS.index(op)] if op in P2P_OPS else COLLECTIVE
    return process_group_of(function), kind, "p2p" if kind else collective_class(function)


@dataclass(frozen=True, slots=True)
class Level:
    """One round of the instances' order: its calls are ``order[lo:hi]`` of ``Levels``."""

    lo: int
    hi: int
    deps: I64
    """Where each call's dependency's instance is in ``Levels.instances`` (``len(instances) + record``: the
    record's start): a replay keeps one leave per instance, its members all leave together."""
    blocks: tuple[tuple[int, int, int, int, int], ...]
    """Runs of the level's instances of one size: (first call, end call, first instance, end instance, members
    each), calls in the order, instances in ``Levels.instances``; an instance's members are contiguous, so a
    run's latest arrivals are one reduction over a (instances, members) view."""


@dataclass(frozen=True, slots=True)
class Levels:
    """The calls in dependency order, level by level (within a level by instance size, then instance), so that
    a replay reads and writes each level as one slice."""

    order: I64
    position: I64
    """Per call: where it is in ``order``."""
    instances: I64
    """Every instance once, in the order its calls take."""
    slot: I64
    """Per call: where its instance is in ``instances``."""
    rounds: tuple[Level, ...]
    given: tuple[I64, I64, I64]
    """What the order was built from (each call's dependency, its instance and its record): a graph of the same
    takes the order as it is (``call_graph``'s ``like``)."""
    cut: bool
    """Whether a cycle was cut (which call was released depends on the times: the order is not to be reused)."""

    def __len__(self) -> int:
        return len(self.rounds)

    def same_structure(self, dep: I64, instance: I64, row: I64) -> bool:
        """Whether a graph of these dependencies, instances and records has this order."""
        return not self.cut and all(map(np.array_equal, self.given, (dep, instance, row)))


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
    """The call each call waits for on its rank (``len(row) + record``: the record's iteration start)."""
    work_ns: F64
    """Measured time from ``dep``'s leave (or the start) to the call's enter."""
    leads: npt.NDArray[np.bool_]
    """Per call: whether it is the first of the calls its rank entered together after the same dependency (a
    batched send and receive share one work): sums of work over a rank count only these."""
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
    start_ns: F64
    """Per record: where its iteration starts on the job's common clock (``callmatch``)."""
    groups: tuple[str, ...]
    classes: tuple[str, ...]
    levels: Levels
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
    """Per rank: from its start to its end, one pass from the measured starts."""
    measured_ns: F64
    error: F64
    """Per rank: (replayed - measured) / measured."""
    job_ns: float
    """The job's replayed iteration time, the iteration repeated (``steady_period``)."""
    job_measured_ns: float
    """The median rank's measured iteration time (ranks held together by collectives take about as long)."""
    job_error: float


def call_graph(
    records: Sequence[Mapping[str, Any]],
    timelines: Sequence[RankTimeline | None] | None = None,
    like: CallGraph | None = None,
) -> CallGraph:
    """The call graph of one iteration's pattern records (one per rank; records without a timeline have no
    calls and end at their measured iteration time); ``timelines``: the records' own, already read. A record
    whose timeline no windower writes raises ``timeline_of``'s ``ValueError`` (its one reason).

    ``like``: a graph of an earlier iteration of the job (the caller keeps it): where this one has the same
    dependencies and instances (a job repeats its calls), its order is taken as it is rather than sorted
    again. The result is the same either way."""
    n_rec = len(records)
    pg_codes: dict[str, int] = {}
    class_codes: dict[str, int] = {}
    parts: dict[str, list[Any]] = {k: [] for k in ("enter", "leave", "comp", "seq", "fn")}
    counts = np.zeros(n_rec, dtype=np.int64)
    iteration = np.zeros(n_rec, dtype=np.float64)
    tail_compute = np.full(n_rec, np.nan)
    lut: list[tuple[float, float, float, float]] = []  # per function index of each record: group, kind, class, bytes
    bases = np.zeros(n_rec, dtype=np.int64)  # per record: where its functions start in ``lut``
    for r, rec in enumerate(records):
        iteration[r] = float(rec.get("iteration_ns", 0))
        tail_compute[r] = _tail_compute(tl := timeline_of(rec) if timelines is None else timelines[r])
        if tl is None:
            continue
        names = rec["function"]
        calls, total = rec.get("calls", ()), rec.get("nbytes", ())  # lists, or numpy arrays (the fast decoder's)
        used = sorted(set(tl.function.tolist()))
        base = len(lut)
        lut.extend([_NO_CALL] * (used[-1] + 1))
        for f in used:
            group, op_kind, klass = call_kind(names[f])
            known = f < len(calls) and f < len(total) and calls[f]
            per_call = float(total[f]) / float(calls[f]) if known else 0.0
            lut[base + f] = (pg_codes.setdefault(group, len(pg_codes)), op_kind,
                             class_codes.setdefault(klass, len(class_codes)), per_call)  # fmt: skip
        counts[r] = tl.function.size
        parts["enter"].append(tl.enter_ns)
        parts["leave"].append(tl.leave_ns)
        parts["comp"].append(tl.compute_ns if tl.compute_ns is not None else tl.function.size)  # a size: unknown
        parts["seq"].append(tl.seq)
        parts["fn"].append(tl.function)
        bases[r] = base
    unknown = np.full(int(counts.max()) if n_rec else 0, np.nan)
    parts["comp"] = [unknown[:c] if isinstance(c, int) else c for c in parts["comp"]]
    cat = {k: np.concatenate(v) if v else np.zeros(0) for k, v in parts.items()}
    fn = (cat["fn"] + np.repeat(bases, counts)).astype(np.int64)
    table = np.array(lut, dtype=np.float64).reshape(-1, 4)  # one column at a time: each call gathers from each
    pg, kind, cls = (table[:, k].astype(np.int64)[fn] for k in range(3))
    cat |= {"row": np.repeat(np.arange(n_rec), counts), "pg": pg, "kind": kind, "cls": cls, "by": table[:, 3][fn]}
    row = cat["row"].astype(np.int64)
    enter = cat["enter"].astype(np.float64)
    leave = np.maximum(cat["leave"].astype(np.float64), enter)
    first = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    dep, work = _dependencies(row, enter, leave)
    seq = cat["seq"].astype(np.int64)
    m = match_calls(records, row, leave, kind, pg, seq)
    graph = _graph(records, row, first, enter, leave, cat, dep, work, m.instance, iteration, pg_codes, class_codes,
                   m.matched_p2p, m.unmatched_p2p, like)  # fmt: skip
    return dataclasses.replace(graph, tail_compute_ns=np.minimum(tail_compute, graph.tail_ns), start_ns=m.start_ns)


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
    like: CallGraph | None,
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
    if row.size:  # each rank's latest leave, the last of its calls that has it (the rank's calls are contiguous)
        has = first[1:] > first[:-1]
        starts = first[:-1][has]
        latest = np.maximum.reduceat(leave, starts)
        at_latest = np.where(leave == np.repeat(latest, np.diff(np.r_[starts, row.size])), np.arange(row.size), -1)
        last[has] = np.maximum.reduceat(at_latest, starts)
        tail[has] = np.maximum(iteration[has] - leave[last[has]], 0.0)
    if like is not None and like.levels.same_structure(dep, instance, row):
        dep, levels = like.dep, like.levels
    else:
        dep, levels = _levels(dep, instance, members, enter, row)
    work = np.where(dep >= row.size, enter, work)
    leads = np.ones(row.size, dtype=bool)
    leads[1:] = (row[1:] != row[:-1]) | (dep[1:] != dep[:-1]) | (enter[1:] != enter[:-1])
    return CallGraph(
        leads=leads,
        row=row, first=first, enter_ns=enter, leave_ns=leave,
        compute_ns=_window_compute(cat["comp"], row, first, dep, work),
        dep=dep, work_ns=work, instance=instance, group=cat["pg"].astype(np.int64)[head],
        klass=cat["cls"].astype(np.int64)[head], nbytes=cat["by"].astype(np.float64)[head],
        transfer_ns=transfer, members=members, last=last, tail_ns=tail, tail_compute_ns=np.full(n_rec, np.nan),
        iteration_ns=iteration, start_ns=np.zeros(n_rec),
        groups=tuple(pg_codes), classes=tuple(class_codes), levels=levels, matched_p2p=matched,
        unmatched_p2p=unmatched,
    )  # fmt: skip


def _window_compute(compute: F64, row: I64, first: I64, dep: I64, work: F64) -> F64:
    """The GPU compute in each call's work (from its dependency's enter to its own; its dependency's call
    itself computes nothing, it waits): the difference of the rank's cumulative compute, at most the work. Calls
    entered together (a batched send and receive) so share the compute before them; NaN stays unknown."""
    c = np.nan_to_num(compute.astype(np.float64))
    if c.size == 0:
        return c
    total = np.cumsum(c)
    has = first[1:] > first[:-1]
    at = first[:-1][has]  # each rank's first call: its cumulative compute starts there
    cum = total - np.repeat(total[at] - c[at], np.diff(first)[has])
    before = np.where(dep < row.size, cum[np.minimum(dep, row.size - 1)], 0.0)
    return np.where(np.isnan(compute), np.nan, np.clip(cum - before, 0.0, work))


def _dependencies(row: I64, enter: F64, leave: F64) -> tuple[I64, F64]:
    """Per call, the call of its rank it waits for (none: the start, ``len(row)``) and the measured work
    between: the latest-ending call that ended before it was entered (the previous call, unless calls
    overlap: an asynchronous all-reduce then holds the calls entered after it ended)."""
    n = row.size
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    span = float(max(np.max(leave), np.max(enter))) + 1.0
    dep = _latest_ended(row, enter, leave, np.ones(n, dtype=bool), span)
    found = dep < n
    work = np.where(found, enter - leave[np.minimum(dep, n - 1)], enter)
    return dep, np.maximum(work, 0.0)


def _latest_ended(row: I64, enter: F64, leave: F64, eligible: npt.NDArray[np.bool_], span: float) -> I64:
    """Per call, the eligible call of its rank with the latest leave at or before its enter, not itself
    (``len(row)``: none): one search in the eligible calls sorted by (rank, leave)."""
    n = row.size
    idx = np.flatnonzero(eligible)
    if idx.size == 0:
        return np.full(n, n, dtype=np.int64)
    key = row[idx] * span + leave[idx]
    query = row * span + enter
    if idx.size == n and bool(np.all(key[1:] >= key[:-1])):  # sorted as entered (calls do not overlap): no sort
        order, srt = idx, key
        pos = _last_at_or_before(srt, query)
    else:
        order = idx[np.argsort(key, kind="stable")]
        srt = row[order] * span + leave[order]
        pos = np.searchsorted(srt, query, side="right") - 1
    found = order[np.maximum(pos, 0)]
    own = found == np.arange(n)  # a zero-length call ending at its own enter: the one before it
    pos = np.where(own, pos - 1, pos)
    found = order[np.maximum(pos, 0)]
    ok = (pos >= 0) & (row[found] == row) & (found != np.arange(n))
    return np.where(ok, found, n).astype(np.int64)


def _last_at_or_before(srt: F64, query: F64) -> I64:
    """``searchsorted(srt, query, side="right") - 1`` where each query mostly falls just before its own element
    (a call is entered after the previous one left, before it leaves itself): that guess checked, the rest
    searched."""
    n = srt.size
    guess = np.arange(-1, n - 1)
    ok = srt > query
    ok[1:] &= srt[:-1] <= query[1:]
    pos: I64 = guess
    miss = np.flatnonzero(~ok)
    if miss.size:
        pos[miss] = np.searchsorted(srt, query[miss], side="right") - 1
    return pos


def _levels(dep: I64, instance: I64, members: I64, enter: F64, row: I64) -> tuple[I64, Levels]:
    """Instances in dependency order, one level per round of Kahn's algorithm. An instance on a cycle
    (inconsistent input: a wrong match) has its members' dependencies cut: they enter when measured."""
    given = (dep, instance, row)
    n = dep.size
    n_inst = members.size
    dep = dep.copy()
    has = dep < n
    waits = np.bincount(instance[has], minlength=n_inst)
    # the calls that wait for a call, grouped by the instance they wait for (its dependents)
    waiting = np.flatnonzero(has)
    waited = instance[dep[waiting]]
    e_inst = instance[waiting[np.argsort(waited, kind="stable")]]
    e_start = np.concatenate(([0], np.cumsum(np.bincount(waited, minlength=n_inst))))
    by_inst = np.argsort(instance, kind="stable")
    i_start = np.concatenate(([0], np.cumsum(members)))
    level = np.full(n_inst, -1, dtype=np.int64)
    frontier = np.flatnonzero(waits == 0)
    done, lv, cut = 0, 0, False
    while done < n_inst:
        if frontier.size == 0:  # a cycle: release the pending instance entered first
            pending = np.flatnonzero(level < 0)
            first_enter = np.full(n_inst, np.inf)
            np.minimum.at(first_enter, instance, enter)
            stuck = pending[np.argmin(first_enter[pending])]
            dep[by_inst[i_start[stuck] : i_start[stuck + 1]]] = n
            frontier, cut = np.array([stuck]), True
        level[frontier] = lv
        done += frontier.size
        lv += 1
        # (a released instance, its dependencies cut, is leveled already: counting it again changes nothing)
        after_inst = _ranges(e_inst, e_start[frontier], e_start[frontier + 1])
        if after_inst.size == 0:
            frontier = np.zeros(0, dtype=np.int64)
            continue
        touched, hit = np.unique(after_inst, return_counts=True)
        waits[touched] -= hit
        frontier = touched[(waits[touched] == 0) & (level[touched] < 0)]
    dep = np.where(dep == n, n + row, dep)  # each record's own start
    # instances by (level, size, instance) (one int key where it fits), then each one's calls in their order
    # (``by_inst``): the calls sorted by (level, size, instance, index) without sorting every call
    m1 = int(members.max()) + 1 if n_inst else 1
    fits = (int(level.max()) + 1 if n_inst else 1) * m1 * max(n_inst, 1) < 2**62
    ids = np.arange(n_inst)
    by_level = np.argsort((level * m1 + members) * n_inst + ids) if fits else np.lexsort((ids, members, level))
    order = _ranges(by_inst, i_start[by_level], i_start[by_level + 1])
    position = np.empty(n, dtype=np.int64)  # where each call is in that order
    position[order] = np.arange(n)
    lv_of, size = level[by_level], members[by_level]
    slot = np.empty(n + row.size, dtype=np.int64)  # where each call's instance (then each start) is in by_level
    slot[order] = np.repeat(np.arange(n_inst), size)
    slot[n:] = np.arange(n_inst, n_inst + row.size)
    new_level = np.r_[True, lv_of[1:] != lv_of[:-1]][:n_inst]
    b_inst = np.r_[np.flatnonzero(new_level | np.r_[True, size[1:] != size[:-1]][:n_inst]), n_inst]  # blocks' firsts
    b_call = np.r_[np.cumsum(size) - size, n][b_inst]
    b_level = np.cumsum(new_level)[b_inst[:-1]] - 1
    blocks = list(zip(b_call[:-1].tolist(), b_call[1:].tolist(), b_inst[:-1].tolist(), b_inst[1:].tolist(),
                      size[b_inst[:-1]].tolist(), strict=True))  # fmt: skip
    l_block = np.r_[np.searchsorted(b_level, np.arange(int(new_level.sum()))), len(blocks)].tolist()
    out = []
    for k in range(len(l_block) - 1):
        lo, hi = blocks[l_block[k]][0], blocks[l_block[k + 1] - 1][1]
        out.append(Level(lo, hi, slot[dep[order[lo:hi]]], tuple(blocks[l_block[k] : l_block[k + 1]])))
    return dep, Levels(order, position, by_level, slot[:n], tuple(out), given, cut)


def _ranges(values: I64, lo: I64, hi: I64) -> I64:
    """``values[lo[k]:hi[k]]`` for every k, concatenated."""
    size = hi - lo
    total = int(size.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(lo - np.concatenate(([0], np.cumsum(size)[:-1])), size)
    out: I64 = values[offsets + np.arange(total)]
    return out


def replay_times(
    graph: CallGraph,
    work_ns: Floats | None = None,
    transfer_ns: Floats | None = None,
    tail_ns: Floats | None = None,
    start_ns: Floats | None = None,
    ordered: bool = False,
) -> Floats:
    """Each record's replayed end, (records,) or (records, S) where any of ``work_ns`` (calls, S),
    ``transfer_ns`` (instances, S), ``tail_ns`` or ``start_ns`` (records, S) give S scenarios; in the work's
    precision (what-if scenarios run in float32: half the memory traffic, 8 ns at 100 ms). ``ordered``: the
    given work and transfers are in the levels' order already (``Levels.order``, ``Levels.instances``: what-if
    builds its scenarios so, once for all its passes)."""
    given = [x for x in (work_ns, transfer_ns, tail_ns, start_ns) if x is not None and x.ndim == 2]
    s = given[0].shape[1] if given else 0

    def cols(v: Floats) -> Floats:
        return v if not s or v.ndim == 2 else np.repeat(v[:, None], s, axis=1)

    lv = graph.levels
    work = cols(work_ns if ordered and work_ns is not None else
                (graph.work_ns if work_ns is None else work_ns)[lv.order])  # fmt: skip
    transfer = cols(transfer_ns if ordered and transfer_ns is not None else
                    (graph.transfer_ns if transfer_ns is None else transfer_ns)[lv.instances])  # fmt: skip
    tail = cols(graph.tail_ns if tail_ns is None else tail_ns)
    start = cols(graph.start_ns if start_ns is None else start_ns)
    n_inst = lv.instances.size
    leave = np.empty((n_inst + start.shape[0], *work.shape[1:]), dtype=work.dtype)  # per instance, in level order
    leave[n_inst:] = start
    arrive = np.empty((max((r.hi - r.lo for r in lv.rounds), default=0), *work.shape[1:]), dtype=work.dtype)
    for r in lv.rounds:
        here = arrive[: r.hi - r.lo]
        np.take(leave, r.deps, axis=0, out=here)
        here += work[r.lo : r.hi]
        for c_lo, c_hi, i_lo, i_hi, size in r.blocks:
            members = here[c_lo - r.lo : c_hi - r.lo].reshape(i_hi - i_lo, size, *work.shape[1:])
            end = leave[i_lo:i_hi]
            if size > FEW_MEMBERS:
                np.add(members.max(axis=1), transfer[i_lo:i_hi], out=end)
                continue
            if size == 1:
                np.add(members[:, 0], transfer[i_lo:i_hi], out=end)
                continue
            np.maximum(members[:, 0], members[:, 1], out=end)
            for j in range(2, size):  # a few members: one maximum each beats a reduction over a short axis
                np.maximum(end, members[:, j], out=end)
            end += transfer[i_lo:i_hi]
    last = np.where(graph.last >= 0, lv.slot[np.maximum(graph.last, 0)], n_inst + np.arange(graph.last.size))
    out: Floats = leave[last] + tail
    return out


STEADY_PASSES = 2
"""Iterations replayed back to back (each rank's next start is its end) to reach the job's steady period."""


def steady_period(
    graph: CallGraph,
    work_ns: Floats | None = None,
    transfer_ns: Floats | None = None,
    tail_ns: Floats | None = None,
    passes: int = STEADY_PASSES,
    ordered: bool = False,
) -> tuple[Floats, Floats]:
    """The job's iteration time when the iteration repeats, (S,) or a scalar, and the first pass's ends.

    Each rank starts the next iteration where it ended this one, so a rank that ends late (its tail) holds
    the others at the next iteration's first collective; the period is the median rank's advance in the
    last pass (a max-plus system reaches its cycle time in a few passes). ``ordered``: as ``replay_times``'s."""
    start: Floats | None = None
    first: Floats = np.zeros(0)
    prev: Floats = np.zeros(0)
    for k in range(passes):
        ends = replay_times(graph, work_ns, transfer_ns, tail_ns, start, ordered)
        prev = graph.start_ns if start is None else start
        if k == 0:
            first = ends
        if k < passes - 1:
            start = ends
    advance = ends - (prev if ends.ndim == 1 else (prev if prev.ndim == 2 else prev[:, None]))
    return np.median(advance, axis=0), first


def replay(records: Sequence[Mapping[str, Any]], graph: CallGraph | None = None) -> Replay:
    """The iteration replayed from the records' timelines, per rank and for the job, against the measured."""
    g = call_graph(records) if graph is None else graph
    period, ends = steady_period(g)
    ends = ends - g.start_ns
    measured = g.iteration_ns
    job_measured = float(np.median(measured)) if measured.size else 0.0
    job = float(period) if ends.size else 0.0
    return Replay(
        ranks=np.array([int(r.get("rank", i)) for i, r in enumerate(records)], dtype=np.int64),
        replayed_ns=ends,
        measured_ns=measured,
        error=np.where(measured > 0, (ends - measured) / np.maximum(measured, 1.0), 0.0),
        job_ns=job,
        job_measured_ns=job_measured,
        job_error=(job - job_measured) / job_measured if job_measured > 0 else 0.0,
    )
