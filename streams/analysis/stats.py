"""Vectorised statistics used by the windower and the differential stage (numpy in, numpy out)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True, slots=True)
class GroupStats:
    """Duration statistics per group (one entry per group id 0..n_groups-1)."""

    calls: I64
    total: I64
    mean: F64
    p50: F64
    p99: F64
    max: I64
    cv: F64


def group_duration_stats(group: npt.NDArray[np.integer], dur: I64, n_groups: int) -> GroupStats:
    """Calls, total, mean, p50, p99 (linear interpolation), max and CV of ``dur`` per group.

    1. Sort by (group, duration) once; 2. group boundaries from bincount offsets;
    3. percentiles by indexing the sorted durations at interpolated ranks.
    """
    group = np.asarray(group, dtype=np.int64)
    dur = np.asarray(dur, dtype=np.int64)
    calls = np.bincount(group, minlength=n_groups).astype(np.int64)
    total = np.bincount(group, weights=dur, minlength=n_groups)
    sq = np.bincount(group, weights=dur.astype(np.float64) ** 2, minlength=n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / calls
        var = np.maximum(sq / calls - mean**2, 0.0)
        cv = np.where(mean > 0, np.sqrt(var) / mean, 0.0)
    order = np.lexsort((dur, group))
    sorted_dur = dur[order].astype(np.float64)
    offsets = np.concatenate(([0], np.cumsum(calls)[:-1]))

    def percentile(q: float) -> F64:
        pos = offsets + q * np.maximum(calls - 1, 0)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, offsets + np.maximum(calls - 1, 0))
        frac = pos - lo
        out = np.full(n_groups, np.nan)
        ok = calls > 0
        out[ok] = sorted_dur[lo[ok]] * (1 - frac[ok]) + sorted_dur[hi[ok]] * frac[ok]
        return out

    mx = np.zeros(n_groups, dtype=np.int64)
    if dur.size:
        np.maximum.at(mx, group, dur)
    return GroupStats(
        calls=calls,
        total=total.astype(np.int64),
        mean=np.where(calls > 0, mean, np.nan),
        p50=percentile(0.5),
        p99=percentile(0.99),
        max=mx,
        cv=np.nan_to_num(cv),
    )


def merge_intervals(start: I64, end: I64) -> tuple[I64, I64]:
    """Union of [start, end) intervals as sorted, disjoint segments."""
    if start.size == 0:
        return start.astype(np.int64), end.astype(np.int64)
    order = np.argsort(start, kind="stable")
    s = start[order]
    e = np.maximum.accumulate(end[order])
    new = np.ones(s.size, dtype=bool)
    new[1:] = s[1:] > e[:-1]
    seg_start = s[new]
    seg_last = np.flatnonzero(np.append(new[1:], True))
    return seg_start, e[seg_last]


def covered_ns(start: I64, end: I64, lo: int, hi: int) -> int:
    """Length of the union of intervals clipped to [lo, hi)."""
    s, e = merge_intervals(np.clip(start, lo, hi), np.clip(end, lo, hi))
    return int(np.sum(e - s))


class RangeMax:
    """O(1) maximum over any index range [lo, hi) after an O(n log n) sparse-table build."""

    def __init__(self, values: F64) -> None:
        self._levels = [np.asarray(values, dtype=np.float64)]
        width = 1
        while width * 2 <= len(values):
            prev = self._levels[-1]
            self._levels.append(np.maximum(prev[:-width], prev[width:]))
            width *= 2

    def query(self, lo: I64, hi: I64) -> F64:
        """Max over values[lo:hi]; NaN where the range is empty."""
        out = np.full(lo.shape, np.nan)
        n = hi - lo
        ok = n > 0
        if not ok.any():
            return out
        k = np.floor(np.log2(n[ok])).astype(np.int64)
        lo_ok, hi_ok = lo[ok], hi[ok]
        res = np.empty(lo_ok.size)
        for level in np.unique(k):
            sel = k == level
            table = self._levels[level]
            width = 1 << int(level)
            res[sel] = np.maximum(table[lo_ok[sel]], table[hi_ok[sel] - width])
        out[ok] = res
        return out


@dataclass(frozen=True, slots=True)
class SampleStats:
    """Samples of a signal that fall inside each group's intervals, pooled per group."""

    count: I64
    mean: F64
    cv: F64
    peak: F64


def samples_within(
    t: I64, value: F64, start: I64, end: I64, group: npt.NDArray[np.integer], n_groups: int
) -> SampleStats:
    """Join samples (t, value) onto intervals [start, end] and pool them per interval group.

    ``t`` must be sorted. Prefix sums give each interval's sum and sum of squares, a sparse table
    its peak; bincount pools intervals of the same group. An interval with no sample adds nothing.
    """
    group = np.asarray(group, dtype=np.int64)
    lo = np.searchsorted(t, start, side="left")
    hi = np.searchsorted(t, end, side="right")
    cs = np.concatenate(([0.0], np.cumsum(value)))
    css = np.concatenate(([0.0], np.cumsum(value * value)))
    count = np.bincount(group, weights=hi - lo, minlength=n_groups).astype(np.int64)
    s = np.bincount(group, weights=cs[hi] - cs[lo], minlength=n_groups)
    ss = np.bincount(group, weights=css[hi] - css[lo], minlength=n_groups)
    peak_each = RangeMax(value).query(lo, hi) if value.size else np.full(lo.shape, np.nan)
    peak = np.full(n_groups, -np.inf)
    has = ~np.isnan(peak_each)
    np.maximum.at(peak, group[has], peak_each[has])
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, s / count, np.nan)
        var = np.maximum(ss / count - mean**2, 0.0)
        cv = np.where((count > 0) & (mean > 0), np.sqrt(var) / mean, np.nan)
    return SampleStats(count=count, mean=mean, cv=cv, peak=np.where(count > 0, peak, np.nan))


@dataclass(frozen=True, slots=True)
class RobustScores:
    """Peer statistics per column and each row's robust z-score and relative gap."""

    median: F64
    scale: F64
    z: F64
    rel_gap: F64


def robust_scores(
    x: F64, rel_scale_floor: float = 0.01, abs_scale_floor: float = 0.0, min_count: int = 3
) -> RobustScores:
    """Robust z-score of every row against its column's peers: (x - median) / (1.4826 MAD).

    The scale is floored at ``rel_scale_floor`` x |median| so that a near-constant column (MAD ~ 0)
    does not turn a negligible difference into a huge score, and at ``abs_scale_floor`` for
    columns whose median is ~0. NaN entries (function absent on a rank) are ignored in the
    statistics and score NaN, and so does every entry of a column with fewer than ``min_count``
    values (too few peers for a median to mean anything).
    """
    with np.errstate(invalid="ignore"), quiet_nan_warnings():
        med = np.nanmedian(x, axis=0)
        mad = np.nanmedian(np.abs(x - med), axis=0) * MAD_TO_SIGMA
    absmed = np.abs(med)
    scale = np.maximum(np.maximum(mad, rel_scale_floor * absmed), abs_scale_floor)
    scale = np.where(scale > 0, scale, np.inf)
    enough = np.sum(~np.isnan(x), axis=0) >= min_count
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.where(enough, (x - med) / scale, np.nan)
        rel = np.where(absmed > 0, (x - med) / absmed, 0.0)
    return RobustScores(median=med, scale=scale, z=z, rel_gap=rel)


class quiet_nan_warnings:
    """Silence numpy's 'All-NaN slice' warnings: an all-NaN column legitimately has no peers."""

    def __enter__(self) -> None:
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
