"""Per-iteration summaries of one rank: iteration figures and per-function behaviour patterns."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import FunctionKind, bus_bandwidth_factor, classify_kernel
from fleetscope.schemas.vocabulary import is_sync_call
from fleetscope.streams.analysis.capping import capped_functions
from fleetscope.streams.analysis.functions import (
    FunctionPlan,
    FunctionPlans,
    function_plan,
    plan_key,
)
from fleetscope.streams.analysis.functions import _collective_keys as _collective_keys
from fleetscope.streams.analysis.functions import _distinct as _distinct
from fleetscope.streams.analysis.functions import collective_function_name as collective_function_name
from fleetscope.streams.analysis.functions import size_bucket_label as size_bucket_label
from fleetscope.streams.analysis.hostspans import host_self_ns, with_depth
from fleetscope.streams.analysis.stats import (
    clip,
    covered_ns,
    group_duration_stats,
    link_stats,
    merge_intervals,
)
from fleetscope.streams.analysis.timeline import CoveredTime, build_timelines
from fleetscope.streams.settings import MAX_FUNCTION_CHARS, MAX_FUNCTIONS

Cols = dict[str, npt.NDArray[Any]]
I64 = npt.NDArray[np.int64]

LINK_FAMILIES = ("nvlink", "pcie")
THROUGHPUT_SUFFIX = "_bytes_per_s"
_COLLECTIVE = int(FunctionKind.COLLECTIVE)
_FAMILY_IDS = np.arange(len(LINK_FAMILIES) + 1)
ACTIVE_SHARE = 0.05
"""A link sample counts as active (moving data) above this share of the rank's peak in the iteration."""


class NameTable:
    """What each name of a growing name list is (kernel class, link family), worked out once per name."""

    def __init__(self) -> None:
        self.kind = np.zeros(0, dtype=np.int8)
        """``FunctionKind`` of the name as a GPU activity (``classify_kernel``)."""
        self.family = np.zeros(0, dtype=np.int8)
        """Index into ``LINK_FAMILIES`` of a link throughput metric; -1 for any other name."""
        self.sync = np.zeros(0, dtype=bool)
        """A host call that blocks (``is_sync_call``): waiting, never own host time."""
        self.plans = FunctionPlans()
        """The function numbering of the rank's recent steps, by their names and sizes."""

    def update(self, names: list[str]) -> NameTable:
        """Cover every name of ``names``, of which the names seen before must be a prefix."""
        new = names[self.kind.size :]
        if new:
            kinds = [classify_kernel(n) for n in new]
            families = [_link_family(n) for n in new]
            self.kind = np.concatenate((self.kind, np.array(kinds, dtype=np.int8)))
            self.family = np.concatenate((self.family, np.array(families, dtype=np.int8)))
            self.sync = np.concatenate((self.sync, np.array([is_sync_call(n) for n in new], dtype=bool)))
        return self


_bus_factor = functools.lru_cache(maxsize=4096)(bus_bandwidth_factor)
"""``bus_bandwidth_factor`` (pure) by (op, group size): a rank's collectives repeat every step."""


def _link_family(name: str) -> int:
    if name.endswith(THROUGHPUT_SUFFIX):
        for i, family in enumerate(LINK_FAMILIES):
            if name.startswith(family):
                return i
    return -1


@dataclass(slots=True)
class IterationEvents:
    """Everything one rank did in one iteration; ``*_id`` columns index ``names``."""

    step: int
    start_ns: int
    end_ns: int
    names: list[str]
    kernels: Cols = field(default_factory=dict)
    collectives: Cols = field(default_factory=dict)
    python: Cols = field(default_factory=dict)
    samples: Cols = field(default_factory=dict)
    table: NameTable | None = None
    """Facts about ``names``, kept by the caller across iterations; built here when None."""
    max_functions: int = MAX_FUNCTIONS
    max_function_chars: int = MAX_FUNCTION_CHARS


@functools.lru_cache(maxsize=65536)
def collective_class(function: str) -> str:
    """A collective function without its process-group instance (``nccl:recv[pg=pp3,<=8MiB]`` ->
    ``nccl:recv[<=8MiB]``): the same role's groups of different replicas (each rank's own tensor or
    pipeline group) compare as one."""
    return _PG_RE.sub("[", function)


def process_group_of(function: str) -> str:
    """The process-group instance of a collective function (``nccl:recv[pg=pp3,<=8MiB]`` -> ``pp3``)."""
    m = _PG_RE.search(function)
    return m.group(1) if m else ""


_PG_RE = re.compile(r"\[pg=([^,\]]*),?")


def _empty(n: int = 0) -> npt.NDArray[np.int64]:
    return np.zeros(n, dtype=np.int64)


def _gpu_time(comp_s: I64, comp_e: I64, comm_s: I64, comm_e: I64, lo: int, hi: int) -> tuple[I64, CoveredTime]:
    """Busy, compute and collective time inside [lo, hi] (unions of intervals) and the largest idle gap,
    for an iteration whose span is too wide to shift (see ``_gpu_times``): one merge per class."""
    seg_s, seg_e = merge_intervals(clip(np.concatenate([comp_s, comm_s]), lo, hi),
                                   clip(np.concatenate([comp_e, comm_e]), lo, hi))  # fmt: skip
    gaps = np.concatenate((seg_s, [hi])) - np.concatenate(([lo], seg_e))
    busy = int(np.sum(seg_e - seg_s))
    figures = [busy, covered_ns(comp_s, comp_e, lo, hi), covered_ns(comm_s, comm_e, lo, hi), int(np.max(gaps))]
    compute = CoveredTime.of(*merge_intervals(clip(comp_s, lo, hi), clip(comp_e, lo, hi)), np.array([lo]),
                          np.array([hi]), _empty(1))  # fmt: skip
    return np.array([figures], dtype=np.int64), compute


def _gpu_times(gpu: _Intervals, comm: npt.NDArray[np.intp], lo: I64, width: list[int]) -> tuple[I64, CoveredTime]:
    """Per iteration: busy, compute and collective time inside [lo, lo + width] and the largest idle gap; and
    the compute's segments (in their ranges), for the compute before any time. ``comm``: 1 for each GPU
    interval that is collective, 0 for compute.

    All unions come from one merge: every iteration's compute, collective and all intervals, clipped,
    are shifted into disjoint time ranges (three per iteration, one per class), so no segment spans two
    classes or two iterations; each range's covered time is a difference of one cumulative sum."""
    m = lo.size
    w = np.asarray(width, dtype=np.int64)
    hi = lo + w
    span = w + 1
    span3 = 3 * span
    base = span3.cumsum() - span3
    edges = base[:, None] + _CLASSES * span[:, None]
    shift = edges - lo[:, None]
    # Each interval clipped to its iteration, shifted into its class's range and into its all range.
    it = gpu.it
    lo_it, hi_it = lo[it], hi[it]
    s, e = clip(gpu.start, lo_it, hi_it), clip(gpu.end, lo_it, hi_it)
    own, every = shift.ravel()[3 * it + comm], shift[it, 2]
    seg_s, seg_e = merge_intervals(np.concatenate((s + own, s + every)), np.concatenate((e + own, e + every)))
    cuts = np.empty(3 * m + 1, dtype=np.int64)  # every range's start, then the end of the last
    cuts[:-1] = edges.ravel()
    cuts[-1] = base[-1] + span3[-1]
    at = seg_s.searchsorted(cuts)
    covered = np.zeros(seg_s.size + 1, dtype=np.int64)  # the time covered before each segment, and in all
    np.cumsum(seg_e - seg_s, out=covered[1:])
    per_class = (covered[at[1:]] - covered[at[:-1]]).reshape(m, 3)
    # The idle gaps of the all-intervals class: between its segments and to the range's two ends.
    first, stop = at[2::3], at[3::3]
    some = stop > first
    open_at = edges[:, 2]
    prev_end = np.empty_like(seg_e)  # np.roll(seg_e, 1), without its overhead
    prev_end[1:] = seg_e[:-1]
    prev_end[:1] = seg_e[-1:]
    prev_end[first[some]] = open_at[some]
    last_end = open_at.copy()
    last_end[some] = seg_e[stop[some] - 1]
    max_gap = open_at + w - last_end
    block = cuts[:-1].searchsorted(seg_s, side="right") - 1
    mine = block % 3 == 2
    np.maximum.at(max_gap, block[mine] // 3, seg_s[mine] - prev_end[mine])
    figures = np.empty((m, 4), dtype=np.int64)  # busy, compute, collective (classes all, compute, collective)
    figures[:, 0], figures[:, 1:3], figures[:, 3] = per_class[:, 2], per_class[:, :2], max_gap
    return figures, CoveredTime.of(seg_s, seg_e, lo, hi, shift[:, 0], covered)


_CLASSES = np.arange(3)
"""The ranges of an iteration's GPU time in ``_gpu_times``: compute, collective, all."""
_REL_BITS = 41
"""A launch wait's times are relative to its iteration's start, below 2**41 ns (36 min), so one int64 key
(iteration, time) orders and prefix-maxes every iteration of a batch at once."""


def _launch_waits(evs: Sequence[IterationEvents], lo: I64) -> tuple[I64, I64, npt.NDArray[np.bool_]]:
    """The gaps in which the GPU waited for its host to launch (``LAUNCH_WAIT_FUNCTION``): each gap's
    iteration and length, and per iteration whether its kernels carry launch times at all (``_gpu_waits``),
    from the kernels and collectives that carry launch times (``assign_ns``)."""
    m = len(evs)
    parts = [
        (cols["start_ns"], cols["dur_ns"], cols["assign_ns"], i)
        for i, ev in enumerate(evs)
        for cols in (ev.kernels, ev.collectives)
        if cols and "assign_ns" in cols and cols["start_ns"].size
    ]
    if not parts:
        return _empty(), _empty(), np.zeros(m, bool)
    start = np.concatenate([p[0] for p in parts]).astype(np.int64)
    end = start + np.concatenate([p[1] for p in parts]).astype(np.int64)
    launch = np.concatenate([p[2] for p in parts]).astype(np.int64)
    it = np.repeat(np.array([p[3] for p in parts], dtype=np.int64), [p[0].size for p in parts])
    return _gpu_waits(start, end, launch, it, lo)


def _gpu_waits(start: I64, end: I64, launch: I64, it: I64, lo: I64) -> tuple[I64, I64, npt.NDArray[np.bool_]]:
    """The launch waits of GPU work (kernels and collectives, each iteration's in the order given: ties of
    start keep it): each gap's iteration and length, and per iteration whether launch times are known.

    A gap between the end of all GPU work so far (every stream, collectives included) and the next
    kernel's start is the host's when that kernel was launched after the gap began: the GPU had nothing
    queued. A kernel launched earlier waited for a dependency (an event, another stream), not the host.
    Gaps before the step's first kernel are left out (a late start is a late arrival, not launch-bound
    work). Without launch times (``assign_ns`` is the start itself) nothing is known."""
    m = lo.size
    if start.size == 0:
        return _empty(), _empty(), np.zeros(m, bool)
    known = np.bincount(it, weights=launch < start, minlength=m) > 0
    order = np.lexsort((start, it))
    start, end, launch, it = start[order], end[order], launch[order], it[order]
    base = lo[it]
    top = (1 << _REL_BITS) - 1
    key = (it << _REL_BITS) + clip(end - base, 0, top)
    prev_end = np.empty_like(start)
    prev_end[0] = start[0]
    prev_end[1:] = (np.maximum.accumulate(key)[:-1] - (it[1:] << _REL_BITS)) + base[1:]
    first = np.ones(start.size, dtype=bool)
    first[1:] = it[1:] != it[:-1]
    starved = ~first & (start > prev_end) & (launch > prev_end) & known[it]
    return it[starved], (start - prev_end)[starved], known


@dataclass(frozen=True, slots=True)
class _Intervals:
    start: I64
    end: I64
    it: npt.NDArray[np.intp]
    """Iteration (index into the batch) of each interval."""


class _Batch:
    """One kind of events of every iteration of a batch, concatenated in iteration order; a column of
    ``_UNKNOWN`` that a part lacks reads as its unknown value."""

    def __init__(self, parts: list[Cols], columns: dict[str, type[np.generic]]) -> None:
        first = next(iter(columns))
        sizes = [p[first].size if p else 0 for p in parts]
        self.counts = np.array(sizes, dtype=np.int64)
        present = [p for p in parts if p]
        if len(parts) == 1:  # one iteration: its columns as they are (read only), no concatenation
            self.it = np.zeros(sizes[0], dtype=np.intp)
            self.cols = {name: _column(present[0], name).astype(dtype, copy=False) if present else np.zeros(0, dtype)
                         for name, dtype in columns.items()}  # fmt: skip
            return
        self.it = np.repeat(np.arange(len(parts)), self.counts)
        self.cols = {name: _joined([_column(p, name) for p in present], dtype) for name, dtype in columns.items()}

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        return self.cols[name]


def _column(part: Cols, name: str) -> npt.NDArray[Any]:
    values = part.get(name)
    if values is None and name in _UNKNOWN:
        return np.full(part["start_ns"].size, _UNKNOWN[name], dtype=np.int64)
    return part[name]


def _joined(arrays: list[npt.NDArray[Any]], dtype: type[np.generic]) -> npt.NDArray[Any]:
    """``np.concatenate(arrays).astype(dtype, copy=False)``, a new array; one copy where one array."""
    if len(arrays) == 1 and arrays[0].ndim == 1:
        return np.array(arrays[0], dtype=dtype)
    return np.concatenate(arrays or [np.zeros(0, dtype)]).astype(dtype, copy=False)


def _functions(
    k: _Batch,
    c: _Batch,
    p: _Batch,
    launch_known: npt.NDArray[np.bool_],
    kind_of: npt.NDArray[np.int8],
    name_base: I64,
    evs: Sequence[IterationEvents],
    table: NameTable | None,
) -> FunctionPlan:
    """The batch's function numbering; kept by ``table`` (the batch's one rank's) for the steps like it."""
    key = b""
    if table is not None:
        key = plan_key([k.counts, k["name_id"], c.counts, c["op_id"], c["pg_id"], c["nbytes"], p.counts,
                        p["name_id"], launch_known])  # fmt: skip
        kept = table.plans.get(key)
        if kept is not None:
            return kept
    plan = function_plan(k.it, k["name_id"], c.it, (c["op_id"], c["pg_id"], c["nbytes"]), p.it, p["name_id"],
                         launch_known, kind_of, name_base, [ev.names for ev in evs])  # fmt: skip
    if table is not None:
        table.plans.keep(key, plan)
    return plan


def _link_shifts(spans: tuple[I64, I64, I64], s: _Batch, lo: I64, width: list[int]) -> I64 | None:
    """Per iteration, what moves every time its link statistics compare (samples, function intervals
    ``spans``: start, end, iteration, the step) into a range of its own, the ranges consecutive in iteration
    order; None when iterations are too wide for that, or for ``_gpu_times``'s shifts (they then go one by
    one)."""
    start, end, ev_it = spans
    t_lo, t_hi = lo.copy(), lo + np.maximum(np.asarray(width), 0)
    it = np.concatenate((ev_it, s.it))
    np.minimum.at(t_lo, it, np.concatenate((start, s["t_ns"])))
    np.maximum.at(t_hi, it, np.concatenate((end, s["t_ns"])))
    low = t_lo.tolist()
    ranges = [b - a for a, b in zip(low, t_hi.tolist(), strict=True)]
    if min(low) < -_MAX_SHIFTED or not all(0 <= w < _MAX_SHIFTED for w in width + ranges):
        return None
    if 3 * sum(width) + sum(ranges) + 4 * len(width) >= _MAX_SHIFTED:
        return None
    size = np.array(ranges, dtype=np.int64) + 1
    return np.cumsum(size) - size - t_lo


_SPANS: dict[str, type[np.generic]] = {"start_ns": np.int64, "dur_ns": np.int64, "name_id": np.int32}
_COLLECTIVES: dict[str, type[np.generic]] = {
    "start_ns": np.int64, "dur_ns": np.int64, "op_id": np.int32, "pg_id": np.int32, "nbytes": np.int64,
    "group_size": np.int32, "seq": np.int64,
}  # fmt: skip
_UNKNOWN = {"seq": -1}
_SAMPLES: dict[str, type[np.generic]] = {"t_ns": np.int64, "metric_id": np.int32, "value": np.float64}
_HOST_SPANS: dict[str, type[np.generic]] = {**_SPANS, "depth": np.int32}
_MAX_SHIFTED = 2**61
"""Batched iterations are shifted into consecutive time ranges; wider than this they go one by one."""


def summarize_iteration(ev: IterationEvents) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return (iteration figures, pattern columns) for one rank's iteration (see ``summarize_iterations``)."""
    return summarize_iterations([ev])[0]


def summarize_iterations(evs: Sequence[IterationEvents]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Return (iteration figures, pattern columns) for each iteration, of any ranks, in one numpy pass.

    Steps: 1. iteration figures from the union of GPU intervals (busy, compute, collective,
    exposed collective = busy minus compute, idle and the largest idle gap inside the step);
    2. functions = kernels by name, collectives by (op, process group, size class), host
    functions by name; 3. duration statistics per function; 4. collectives get message size and
    algorithm/bus bandwidth (nccl-tests); 5. link throughput samples inside each function's
    executions give the peak, the mean of the active samples and the CV of all samples.
    Functions are numbered across the batch (iteration by iteration) and every iteration's times are
    shifted into a range of its own, so one group-by serves all: the cost of a numpy call is paid per
    batch, not per iteration. The result equals summarizing each iteration alone, bit for bit. With each
    iteration's timeline (``timeline.build_timelines``): its calls in entry order, the compute between them.
    """
    m = len(evs)
    if m == 0:
        return []
    k = _Batch([ev.kernels for ev in evs], _SPANS)
    c = _Batch([ev.collectives for ev in evs], _COLLECTIVES)
    p_parts = [with_depth(ev.python) for ev in evs]
    p_all = _Batch(p_parts, _HOST_SPANS)
    p_fns = p_all["depth"] >= 0  # busy stretches and waits (THREAD_BUSY_DEPTH, SPAN_CPU_WAIT_DEPTH): self time only
    if p_fns.all():
        p = p_all
    else:
        p = _Batch([{col: v[part["depth"] >= 0] for col, v in part.items()} for part in p_parts], _HOST_SPANS)
    s = _Batch([ev.samples for ev in evs], _SAMPLES)
    lo = np.array([ev.start_ns for ev in evs], dtype=np.int64)
    width = [ev.end_ns - ev.start_ns for ev in evs]
    duration = [max(w, 1) for w in width]

    # Every span (kernels, collectives, host functions: the functions' events, in that order) at once.
    start = np.concatenate([k["start_ns"], c["start_ns"], p["start_ns"]])
    dur = np.concatenate([k["dur_ns"], c["dur_ns"], p["dur_ns"]])
    end = start + dur
    ev_it = np.concatenate([k.it, c.it, p.it])
    shift = _link_shifts((start, end, ev_it), s, lo, width) if m > 1 else None
    if m > 1 and shift is None:
        return [summarize_iterations([ev])[0] for ev in evs]

    # Names: each rank's table, concatenated; an id plus its iteration's base indexes the concatenation.
    ev_tables = [ev.table if ev.table is not None else NameTable() for ev in evs]
    tables: dict[int, NameTable] = {}
    for ev, table in zip(evs, ev_tables, strict=True):
        tables.setdefault(id(table), table).update(ev.names)
    offsets, size = {}, 0
    for key, table in tables.items():
        offsets[key], size = size, size + table.kind.size
    if len(tables) == 1:  # read only: one rank's own table needs no copy
        kind_of, family_of, sync_of = ev_tables[0].kind, ev_tables[0].family, ev_tables[0].sync
    else:
        kind_of = np.concatenate([t.kind for t in tables.values()])
        family_of = np.concatenate([t.family for t in tables.values()])
        sync_of = np.concatenate([t.sync for t in tables.values()])
    name_base = np.array([offsets[id(table)] for table in ev_tables], dtype=np.int64)
    n_k, n_c = k["start_ns"].size, c["start_ns"].size
    gpu_parts = [cols for kind in ("kernels", "collectives") for ev in evs if (cols := getattr(ev, kind))]
    if all("assign_ns" in cols for cols in gpu_parts):  # as ``start`` holds them: kernels, then collectives
        launch = _joined([cols["assign_ns"] for cols in gpu_parts], np.int64)
        wait_it, wait_ns, launch_known = _gpu_waits(start[: n_k + n_c], end[: n_k + n_c], launch,
                                                    ev_it[: n_k + n_c], lo)  # fmt: skip
    else:
        wait_it, wait_ns, launch_known = _launch_waits(evs, lo)
    fp = _functions(k, c, p, launch_known, kind_of, name_base, evs, ev_tables[0] if len(tables) == 1 else None)
    n, first_fn, fn_it, group, c_fn = fp.n, fp.first_fn, fp.fn_it, fp.group, fp.c_fn

    # 1. Iteration figures.
    k_start, k_end = k["start_ns"], end[:n_k]
    c_start, c_end = c["start_ns"], end[n_k : n_k + n_c]
    is_comm = fp.is_comm
    if m == 1 and not 0 <= width[0] < _MAX_SHIFTED:
        comp_s, comp_e = k_start[~is_comm], k_end[~is_comm]
        comm_s, comm_e = np.concatenate([c_start, k_start[is_comm]]), np.concatenate([c_end, k_end[is_comm]])
        gpu, compute = _gpu_time(comp_s, comp_e, comm_s, comm_e, evs[0].start_ns, evs[0].end_ns)
    else:  # kernels and collectives, as ``start`` holds them
        gpu_spans = _Intervals(start[: n_k + n_c], end[: n_k + n_c], ev_it[: n_k + n_c])
        gpu, compute = _gpu_times(gpu_spans, fp.gpu_class, lo, width)
    kernels = (k.counts + c.counts).tolist()

    # 2. Functions (``functions.function_plan``). 3. Duration statistics; host functions' self time (own work:
    # children and blocking calls left out).
    all_group = np.concatenate([group, fp.wait_at[wait_it]])  # the events', then the gaps'
    st = group_duration_stats(all_group, np.concatenate([dur, wait_ns]), n)
    empty_wait = fp.wait_fn[st.calls[fp.wait_fn] == 0]  # a launch wait without gaps: 0, not NaN (no calls)
    st.mean[empty_wait], st.p50[empty_wait], st.p99[empty_wait] = 0.0, 0.0, 0.0
    p_name = p_all["name_id"] if len(tables) == 1 else p_all["name_id"] + name_base[p_all.it]
    p_sync = sync_of[p_name]
    p_self = host_self_ns(p_all.it, p_all["start_ns"], p_all["dur_ns"], p_all["depth"], p_sync, p_name)[p_fns]
    self_ns = np.concatenate([k["dur_ns"], c["dur_ns"], p_self, wait_ns])  # a gap is all own time
    self_total = np.bincount(all_group, weights=self_ns, minlength=n)

    # 4. Collective sizes and bandwidths (bytes/ns == GB/s); each call's place in its rank's timeline.
    c_group = fp.c_group
    c_lo = lo[c.it]
    timelines = build_timelines(c.it, c_start - c_lo, c_end - c_lo, fp.c_local, c["seq"],
                                compute.since_start(c_start, c.it), gpu[:, 1], k.counts > 0)  # fmt: skip
    nbytes = c["nbytes"]
    nb = np.bincount(c_group, weights=nbytes, minlength=n)
    nbytes_mean = np.where(st.calls > 0, nb / np.maximum(st.calls, 1), 0.0)
    algbw = np.divide(nbytes_mean, st.mean, out=np.zeros(n), where=st.mean > 0)  # 0 where no time (or NaN)
    busbw = np.zeros(n)
    if fp.c_rows:
        gsize = np.bincount(c_group, weights=c["group_size"], minlength=n)[c_fn].tolist()
        calls_l, algbw_l = st.calls[c_fn].tolist(), algbw[c_fn].tolist()
        factors = [
            _bus_factor(evs[it].names[op], int(round(g / max(calls, 1))))
            for (it, op), g, calls in zip(fp.c_rows, gsize, calls_l, strict=True)
        ]
        busbw[c_fn] = np.asarray(algbw_l) * np.asarray(factors)

    # 5. Link throughput during each function's executions, every family and iteration at once: samples
    # by family, then iteration, then time (stable, like a per-iteration sort), times shifted by
    # iteration into consecutive ranges so each search only finds its own iteration's samples.
    family = family_of[s["metric_id"] if len(tables) == 1 else s["metric_id"] + name_base[s.it]]
    links = (family >= 0).nonzero()[0]  # the other metrics left out before the sort, not after
    family, t_it, t = family[links], s.it[links], s["t_ns"][links]
    order = np.lexsort((t, t_it, family))
    family, t_it, value = family[order], t_it[order], s["value"][links[order]]
    t = t[order] if shift is None else t[order] + shift[t_it]
    bounds = family.searchsorted(_FAMILY_IDS).tolist()
    # Mean while the link moves data (waiting inside a collective shows ~0 and would make every
    # waiter look slow); fluctuation over every sample, so on/off stalls of congestion count.
    active = np.zeros(value.size, dtype=bool)
    if value.size:
        block = family.astype(np.int64) * m + t_it
        new_block = np.empty(block.size, dtype=bool)
        new_block[0] = True
        np.not_equal(block[1:], block[:-1], out=new_block[1:])
        peak = np.maximum.reduceat(value, new_block.nonzero()[0])
        active = value >= (ACTIVE_SHARE * peak)[new_block.cumsum() - 1]
    if shift is not None:
        start, end = start + shift[ev_it], end + shift[ev_it]
    ls = link_stats(t, value, bounds, active, start, end, group, n)

    columns: dict[str, npt.NDArray[Any]] = {
        "kind": fp.fn_kind,
        "calls": st.calls,
        "total_ns": st.total,
        "self_ns": self_total.astype(np.int64),
        "mean_ns": st.mean,
        "p50_ns": st.p50,
        "p99_ns": st.p99,
        "max_ns": st.max,
        "cv": st.cv,
        "share": st.total / np.asarray(duration, dtype=np.float64)[fn_it],
        "nbytes": nbytes_mean.astype(np.int64),
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
        "row": fp.row,
    }
    for f, name in enumerate(LINK_FAMILIES):
        columns[f"{name}_mean_bps"] = ls.active_mean[f]
        columns[f"{name}_cv"] = ls.cv[f]
        columns[f"{name}_peak_bps"] = ls.peak[f]

    gpu_l, first_l, n_l = gpu.tolist(), first_fn.tolist(), fp.n_fn.tolist()
    out: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for i, ev in enumerate(evs):
        fn_names = list(fp.names[i])  # a record's own list: the plan may serve again
        busy, compute, comm_ns, max_gap = gpu_l[i]
        figures = {
            "iteration": ev.step,
            "start_ns": ev.start_ns,
            "end_ns": ev.end_ns,
            "duration_ns": duration[i],
            "gpu_busy_ns": busy,
            "compute_ns": compute,
            "collective_ns": comm_ns,
            "exposed_collective_ns": max(busy - compute, 0),
            "idle_ns": max(duration[i] - busy, 0),
            "max_idle_gap_ns": max(max_gap, 0),
            "kernels": kernels[i],
        }
        lo_f, hi_f = first_l[i], first_l[i] + n_l[i]
        listed = fn_names
        fn_names, fn_columns = capped_functions(
            listed,
            columns if m == 1 else {key: col[lo_f:hi_f] for key, col in columns.items()},
            ev.max_functions,
            ev.max_function_chars,
        )
        row = fn_columns.pop("row")
        kept = None  # capped: where each function's row went (the rest: into the last)
        if fn_names is not listed:
            kept = np.full(len(listed), len(fn_names) - 1, dtype=np.int64)
            kept[row[:-1]] = np.arange(len(fn_names) - 1)
        patterns: dict[str, Any] = {
            "iteration_start_ns": ev.start_ns,
            "iteration_ns": duration[i],
            "function": fn_names,
            **fn_columns,
            **timelines.record(i, kept),
        }
        out.append((figures, patterns))
    return out
