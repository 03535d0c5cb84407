"""Per-iteration summaries of one rank: iteration figures and per-function behaviour patterns."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import FunctionKind, bus_bandwidth_factor, classify_kernel
from fleetscope.streams.analysis.stats import (
    clip,
    covered_ns,
    group_duration_stats,
    link_stats,
    merge_intervals,
)

Cols = dict[str, npt.NDArray[Any]]
I64 = npt.NDArray[np.int64]

LINK_FAMILIES = ("nvlink", "pcie")
THROUGHPUT_SUFFIX = "_bytes_per_s"
_COLLECTIVE = int(FunctionKind.COLLECTIVE)
ACTIVE_SHARE = 0.05
"""A link sample counts as active (moving data) above this share of the rank's peak in the iteration."""


class NameTable:
    """What each name of a growing name list is (kernel class, link family), worked out once per name."""

    def __init__(self) -> None:
        self.kind = np.zeros(0, dtype=np.int8)
        """``FunctionKind`` of the name as a GPU activity (``classify_kernel``)."""
        self.family = np.zeros(0, dtype=np.int8)
        """Index into ``LINK_FAMILIES`` of a link throughput metric; -1 for any other name."""

    def update(self, names: list[str]) -> NameTable:
        """Cover every name of ``names``, of which the names seen before must be a prefix."""
        new = names[self.kind.size :]
        if new:
            kinds = [classify_kernel(n) for n in new]
            families = [_link_family(n) for n in new]
            self.kind = np.concatenate((self.kind, np.array(kinds, dtype=np.int8)))
            self.family = np.concatenate((self.family, np.array(families, dtype=np.int8)))
        return self


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


def size_bucket_label(nbytes: int) -> str:
    """Power-of-two size class, so calls of a collective with similar sizes form one function."""
    if nbytes <= 0:
        return "0B"
    exp = int(np.ceil(np.log2(nbytes)))
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if exp >= shift:
            return f"{1 << (exp - shift)}{unit}"
    return f"{1 << exp}B"


def collective_function_name(op: str, pg: str, nbytes: int) -> str:
    """One function per process-group instance: only members of one group finish a collective together,
    so only they can be compared for arrival lateness."""
    return f"nccl:{op}[pg={pg},<={size_bucket_label(nbytes)}]"


def _empty(n: int = 0) -> npt.NDArray[np.int64]:
    return np.zeros(n, dtype=np.int64)


def _gpu_time(comp_s: I64, comp_e: I64, comm_s: I64, comm_e: I64, lo: int, hi: int) -> tuple[int, int, int, int]:
    """Busy, compute and collective time inside [lo, hi] (unions of intervals) and the largest idle gap.

    The three unions come from one merge: the compute, the collective and all the intervals, clipped,
    are shifted into disjoint time ranges (one per class), so no segment spans two classes.
    """
    width = hi - lo
    if not 0 <= width < 2**60:  # shifted times would overflow: one merge per class
        seg_s, seg_e = merge_intervals(clip(np.concatenate([comp_s, comm_s]), lo, hi),
                                       clip(np.concatenate([comp_e, comm_e]), lo, hi))  # fmt: skip
        gaps = np.concatenate((seg_s, [hi])) - np.concatenate(([lo], seg_e))
        busy = int(np.sum(seg_e - seg_s))
        return busy, covered_ns(comp_s, comp_e, lo, hi), covered_ns(comm_s, comm_e, lo, hi), int(np.max(gaps))
    span = width + 1
    shift = np.repeat(np.array([-lo, span - lo, 2 * span - lo]), [comp_s.size, comm_s.size, comp_s.size + comm_s.size])
    seg_s, seg_e = merge_intervals(clip(np.concatenate([comp_s, comm_s, comp_s, comm_s]), lo, hi) + shift,
                                   clip(np.concatenate([comp_e, comm_e, comp_e, comm_e]), lo, hi) + shift)  # fmt: skip
    cut = seg_s.searchsorted(np.array([span, 2 * span])).tolist()
    total = np.cumsum(seg_e - seg_s).tolist()
    covered = [0, *total]
    compute, comm, busy = covered[cut[0]], covered[cut[1]] - covered[cut[0]], covered[-1] - covered[cut[1]]
    gaps = np.concatenate((seg_s[cut[1] :], [2 * span + width])) - np.concatenate(([2 * span], seg_e[cut[1] :]))
    return busy, compute, comm, int(np.maximum.reduce(gaps))


def _first_ids(ids: npt.NDArray[np.integer], n_names: int) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.int64]]:
    """``np.unique(ids, return_inverse=True)`` for ids that index a name list, through a presence table."""
    present = np.zeros(n_names, dtype=bool)
    present[ids] = True
    uniq = present.nonzero()[0]
    rank = np.zeros(n_names, dtype=np.int64)
    rank[uniq] = np.arange(uniq.size)
    return uniq, rank[ids]


def summarize_iteration(ev: IterationEvents) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return (iteration figures, pattern columns) for one rank's iteration.

    Steps: 1. iteration figures from the union of GPU intervals (busy, compute, collective,
    exposed collective = busy minus compute, idle and the largest idle gap inside the step);
    2. functions = kernels by name, collectives by (op, process group, size class), host
    functions by name; 3. duration statistics per function; 4. collectives get message size and
    algorithm/bus bandwidth (nccl-tests); 5. link throughput samples inside each function's
    executions give the peak, the mean of the active samples and the CV of all samples.
    """
    names = ev.names
    table = (ev.table or NameTable()).update(names)
    k, c, p = ev.kernels, ev.collectives, ev.python
    k_start, k_dur = k.get("start_ns", _empty()), k.get("dur_ns", _empty())
    c_start, c_dur = c.get("start_ns", _empty()), c.get("dur_ns", _empty())
    p_start, p_dur = p.get("start_ns", _empty()), p.get("dur_ns", _empty())
    duration = max(ev.end_ns - ev.start_ns, 1)

    # 1. Iteration figures.
    k_ids = k.get("name_id", np.zeros(0, dtype=np.int32))
    k_end, c_end = k_start + k_dur, c_start + c_dur
    is_comm_kernel = table.kind[k_ids] == _COLLECTIVE
    if is_comm_kernel.any():
        comp_s, comp_e = k_start[~is_comm_kernel], k_end[~is_comm_kernel]
        comm_s = np.concatenate([c_start, k_start[is_comm_kernel]])
        comm_e = np.concatenate([c_end, k_end[is_comm_kernel]])
    else:
        comp_s, comp_e, comm_s, comm_e = k_start, k_end, c_start, c_end
    busy, compute, comm, max_gap = _gpu_time(comp_s, comp_e, comm_s, comm_e, ev.start_ns, ev.end_ns)
    iteration = {
        "iteration": ev.step,
        "start_ns": ev.start_ns,
        "end_ns": ev.end_ns,
        "duration_ns": duration,
        "gpu_busy_ns": busy,
        "compute_ns": compute,
        "collective_ns": comm,
        "exposed_collective_ns": max(busy - compute, 0),
        "idle_ns": max(duration - busy, 0),
        "max_idle_gap_ns": max(max_gap, 0),
        "kernels": int(k_start.size + c_start.size),
    }

    # 2. Functions: one integer group per function across the three sources.
    fn_names: list[str] = []
    fn_kind: list[int] = []
    k_group = np.zeros(0, dtype=np.int64)
    if k_ids.size:
        uniq, k_group = _first_ids(k_ids, len(names))
        fn_names += [names[i] for i in uniq.tolist()]
        fn_kind += table.kind[uniq].tolist()
    c_group = np.zeros(0, dtype=np.int64)
    c_rows: list[tuple[int, int, int]] = []
    if c_start.size:
        nbytes = c["nbytes"]
        exp = np.where(nbytes > 0, np.ceil(np.log2(np.maximum(nbytes, 1))), 0).astype(np.int64)
        uniq_rows, inv = _collective_keys(c["op_id"], c["pg_id"], exp, len(names))
        c_group = inv + len(fn_names)
        for op_id, pg_id, e in uniq_rows:
            fn_names.append(collective_function_name(names[op_id], names[pg_id], 1 << e if e else 0))
            fn_kind.append(int(FunctionKind.COLLECTIVE))
            c_rows.append((op_id, pg_id, e))
    p_group = np.zeros(0, dtype=np.int64)
    if p_start.size:
        uniq, p_group = _first_ids(p["name_id"], len(names))
        p_group += len(fn_names)
        fn_names += [names[i] for i in uniq.tolist()]
        fn_kind += [int(FunctionKind.PYTHON)] * len(uniq)

    n = len(fn_names)
    group = np.concatenate([k_group, c_group, p_group])
    start = np.concatenate([k_start, c_start, p_start])
    dur = np.concatenate([k_dur, c_dur, p_dur])
    end = start + dur

    # 3. Duration statistics.
    st = group_duration_stats(group, dur, n)

    # 4. Collective sizes and bandwidths (bytes/ns == GB/s).
    nbytes_mean = np.zeros(n)
    algbw = np.zeros(n)
    busbw = np.zeros(n)
    if c_start.size:
        nb = np.bincount(c_group, weights=c["nbytes"], minlength=n)
        gsize = np.bincount(c_group, weights=c["group_size"], minlength=n)
        with np.errstate(invalid="ignore", divide="ignore"):
            nbytes_mean = np.where(st.calls > 0, nb / np.maximum(st.calls, 1), 0.0)
            algbw = np.where(st.mean > 0, nbytes_mean / st.mean, 0.0)
        first_c = int(c_group.min())
        calls_l, gsize_l, algbw_l = st.calls.tolist(), gsize.tolist(), algbw.tolist()
        for j, (op_id, _pg, _e) in enumerate(c_rows):
            g = first_c + j
            members = int(round(gsize_l[g] / max(calls_l[g], 1)))
            busbw[g] = algbw_l[g] * bus_bandwidth_factor(names[op_id], members)

    # 5. Link throughput during each function's executions, every family at once.
    link: dict[str, np.ndarray] = {}
    s = ev.samples
    t, metric, value = s.get("t_ns", _empty()), s.get("metric_id", _empty()), s.get("value", np.zeros(0))
    family = table.family[metric]
    order = np.lexsort((t, family))  # by family, then time; stable like the per-family sorts it replaces
    first = int(family[order].searchsorted(0))
    order = order[first:]
    family, t, value = family[order], t[order], value[order]
    bounds = family.searchsorted(np.arange(len(LINK_FAMILIES) + 1)).tolist()
    # Mean while the link moves data (waiting inside a collective shows ~0 and would make every
    # waiter look slow); fluctuation over every sample, so on/off stalls of congestion count.
    active = np.zeros(value.size, dtype=bool)
    for a, b in itertools.pairwise(bounds):
        if b > a:
            active[a:b] = value[a:b] >= ACTIVE_SHARE * np.maximum.reduce(value[a:b])
    ls = link_stats(t, value, bounds, active, start, end, group, n)
    for f, name in enumerate(LINK_FAMILIES):
        link[f"{name}_mean_bps"] = ls.active_mean[f]
        link[f"{name}_cv"] = ls.cv[f]
        link[f"{name}_peak_bps"] = ls.peak[f]

    patterns: dict[str, Any] = {
        "iteration_start_ns": ev.start_ns,
        "iteration_ns": duration,
        "function": fn_names,
        "kind": fn_kind,
        "calls": st.calls,
        "total_ns": st.total,
        "mean_ns": st.mean,
        "p50_ns": st.p50,
        "p99_ns": st.p99,
        "max_ns": st.max,
        "cv": st.cv,
        "share": st.total / duration,
        "nbytes": nbytes_mean.astype(np.int64),
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
        **link,
    }
    return iteration, patterns


def _collective_keys(
    op: npt.NDArray[np.integer], pg: npt.NDArray[np.integer], exp: npt.NDArray[np.int64], n_names: int
) -> tuple[list[tuple[int, int, int]], npt.NDArray[np.int64]]:
    """Distinct (op, process group, size exponent) rows in sorted order, and each call's row.

    One int64 key per call (exponents are below 64, ids below ``n_names``), so one 1-D ``np.unique``."""
    if n_names < 2**27:
        keys = ((op.astype(np.int64) * n_names + pg) * 64 + exp).tolist()
        uniq = sorted(set(keys))
        row = {key: i for i, key in enumerate(uniq)}
        inv = np.array([row[key] for key in keys], dtype=np.int64)
        return [(key // 64 // n_names, key // 64 % n_names, key % 64) for key in uniq], inv
    rows = np.stack([op.astype(np.int64), pg.astype(np.int64), exp], axis=1)
    uniq_rows, inv = np.unique(rows, axis=0, return_inverse=True)
    return [tuple(r) for r in uniq_rows.tolist()], inv.reshape(-1).astype(np.int64)
