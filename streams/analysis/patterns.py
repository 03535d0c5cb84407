"""Per-iteration summaries of one rank: iteration figures and per-function behaviour patterns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import FunctionKind, bus_bandwidth_factor, classify_kernel
from fleetscope.streams.analysis.stats import (
    covered_ns,
    group_duration_stats,
    merge_intervals,
    samples_within,
)

Cols = dict[str, npt.NDArray[Any]]

LINK_FAMILIES = ("nvlink", "pcie")
THROUGHPUT_SUFFIX = "_bytes_per_s"
ACTIVE_SHARE = 0.05
"""A link sample counts as active (moving data) above this share of the rank's peak in the iteration."""


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
    k, c, p = ev.kernels, ev.collectives, ev.python
    k_start, k_dur = k.get("start_ns", _empty()), k.get("dur_ns", _empty())
    c_start, c_dur = c.get("start_ns", _empty()), c.get("dur_ns", _empty())
    p_start, p_dur = p.get("start_ns", _empty()), p.get("dur_ns", _empty())
    duration = max(ev.end_ns - ev.start_ns, 1)

    # 1. Iteration figures.
    k_kind = np.array([classify_kernel(names[i]) for i in range(len(names))], dtype=np.int8)
    k_ids = k.get("name_id", np.zeros(0, dtype=np.int32))
    is_comm_kernel = k_kind[k_ids] == FunctionKind.COLLECTIVE if k_ids.size else np.zeros(0, bool)
    comp_s, comp_e = k_start[~is_comm_kernel], (k_start + k_dur)[~is_comm_kernel]
    comm_s = np.concatenate([c_start, k_start[is_comm_kernel]])
    comm_e = np.concatenate([c_start + c_dur, (k_start + k_dur)[is_comm_kernel]])
    all_s, all_e = np.concatenate([comp_s, comm_s]), np.concatenate([comp_e, comm_e])
    lo, hi = ev.start_ns, ev.end_ns
    busy = covered_ns(all_s, all_e, lo, hi)
    compute = covered_ns(comp_s, comp_e, lo, hi)
    comm = covered_ns(comm_s, comm_e, lo, hi)
    seg_s, seg_e = merge_intervals(np.clip(all_s, lo, hi), np.clip(all_e, lo, hi))
    edges_s = np.concatenate(([lo], seg_e))
    edges_e = np.concatenate((seg_s, [hi]))
    max_gap = int(np.max(edges_e - edges_s)) if edges_s.size else duration
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
        uniq, inv = np.unique(k_ids, return_inverse=True)
        k_group = inv.astype(np.int64)
        fn_names += [names[i] for i in uniq]
        fn_kind += [int(k_kind[i]) for i in uniq]
    c_group = np.zeros(0, dtype=np.int64)
    c_rows: list[tuple[int, int, int]] = []
    if c_start.size:
        nbytes = c["nbytes"]
        exp = np.where(nbytes > 0, np.ceil(np.log2(np.maximum(nbytes, 1))), 0).astype(np.int64)
        keys = np.stack([c["op_id"].astype(np.int64), c["pg_id"].astype(np.int64), exp], axis=1)
        uniq_rows, inv = np.unique(keys, axis=0, return_inverse=True)
        c_group = inv.reshape(-1).astype(np.int64) + len(fn_names)
        for op_id, pg_id, e in uniq_rows:
            fn_names.append(collective_function_name(names[op_id], names[pg_id], 1 << int(e) if e else 0))
            fn_kind.append(int(FunctionKind.COLLECTIVE))
            c_rows.append((int(op_id), int(pg_id), int(e)))
    p_group = np.zeros(0, dtype=np.int64)
    if p_start.size:
        uniq, inv = np.unique(p["name_id"], return_inverse=True)
        p_group = inv.astype(np.int64) + len(fn_names)
        fn_names += [names[i] for i in uniq]
        fn_kind += [int(FunctionKind.PYTHON)] * len(uniq)

    n = len(fn_names)
    group = np.concatenate([k_group, c_group, p_group])
    start = np.concatenate([k_start, c_start, p_start])
    dur = np.concatenate([k_dur, c_dur, p_dur])

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
        for j, (op_id, _pg, _e) in enumerate(c_rows):
            g = first_c + j
            members = int(round(gsize[g] / max(st.calls[g], 1)))
            busbw[g] = algbw[g] * bus_bandwidth_factor(names[op_id], members)
    nbytes_mean = np.nan_to_num(nbytes_mean)

    # 5. Link throughput during each function's executions.
    link: dict[str, np.ndarray] = {}
    s = ev.samples
    t, metric, value = s.get("t_ns", _empty()), s.get("metric_id", _empty()), s.get("value", np.zeros(0))
    for family in LINK_FAMILIES:
        fam_ids = [
            i for i, nm in enumerate(names) if nm.startswith(family) and nm.endswith(THROUGHPUT_SUFFIX)
        ]
        sel = np.isin(metric, fam_ids) if t.size else np.zeros(0, bool)
        ft, fv = t[sel], value[sel]
        order = np.argsort(ft, kind="stable")
        ft, fv = ft[order], fv[order]
        every = samples_within(ft, fv, start, start + dur, group, n)
        # Mean while the link moves data (waiting inside a collective shows ~0 and would make every
        # waiter look slow); fluctuation over every sample, so on/off stalls of congestion count.
        active = fv >= ACTIVE_SHARE * fv.max() if fv.size else np.zeros(0, bool)
        act = samples_within(ft[active], fv[active], start, start + dur, group, n)
        peak = every.peak
        link[f"{family}_mean_bps"] = act.mean
        link[f"{family}_cv"] = every.cv
        link[f"{family}_peak_bps"] = peak

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
