"""Vectorised statistics used by the windower and the differential stage (numpy in, numpy out)."""

from __future__ import annotations

import itertools
import types
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


_QUANTILES = np.array([[0.5], [0.99]])


def group_duration_stats(group: npt.NDArray[np.integer], dur: I64, n_groups: int) -> GroupStats:
    """Calls, total, mean, p50, p99 (linear interpolation), max and CV of ``dur`` per group.

    1. Sort by (group, duration) once; 2. group boundaries from bincount offsets;
    3. percentiles by indexing the sorted durations at interpolated ranks, the maximum at the last.
    """
    group = np.asarray(group, dtype=np.int64)
    dur = np.asarray(dur, dtype=np.int64)
    calls = np.bincount(group, minlength=n_groups).astype(np.int64, copy=False)
    total = np.bincount(group, weights=dur, minlength=n_groups)
    sq = np.bincount(group, weights=dur.astype(np.float64) ** 2, minlength=n_groups)
    sorted_int = _sorted_by_group(group, dur, calls)
    last = calls.cumsum() - 1
    ok = calls > 0
    calls_1 = np.maximum(calls, 1)  # empty groups divide by 1 and are masked after: no warnings to silence
    mean = total / calls_1
    var = np.maximum(sq / calls_1 - mean**2, 0.0)
    positive = mean > 0
    cv = np.where(positive, np.sqrt(var) / np.where(positive, mean, 1.0), 0.0)
    # p50 and p99 at once: the group's offset + q (calls - 1), interpolated between its two neighbours;
    # empty groups read the NaN after the sorted durations. The fraction is taken within the group, so
    # a group's percentiles do not depend on its offset (summaries of one or many iterations agree).
    span = np.maximum(calls - 1, 0)
    rank = _QUANTILES * span
    whole = np.floor(rank)
    frac = rank - whole
    lo = np.where(ok, (last - span) + whole.astype(np.int64), dur.size)
    hi = np.where(ok, np.minimum(lo + 1, last), dur.size)
    sorted_dur = np.concatenate((sorted_int.astype(np.float64), [np.nan]))
    pct = sorted_dur[lo] * (1 - frac) + sorted_dur[hi] * frac
    return GroupStats(
        calls=calls,
        total=total.astype(np.int64),
        mean=np.where(ok, mean, np.nan),
        p50=pct[0],
        p99=pct[1],
        max=np.where(ok, np.maximum(sorted_int[np.maximum(last, 0)], 0) if dur.size else 0, 0),
        cv=cv,
    )


def _sorted_by_group(group: npt.NDArray[np.integer], dur: I64, calls: I64) -> I64:
    """``dur[np.lexsort((dur, group))]``: one sort of a (group, duration) int64 key when it fits (a
    lexsort of unordered keys costs ~15x more), else the lexsort."""
    if dur.size == 0:
        return dur
    low, high = int(dur.min()), int(dur.max())
    stride = high - low + 1
    if stride * calls.size >= 2**63:
        return dur[np.lexsort((dur, group))]
    key = group * stride + (dur - low)  # below 2**63; dur - low may wrap, its value does not
    out: I64 = np.sort(key) % stride + low
    return out


def merge_intervals(start: I64, end: I64) -> tuple[I64, I64]:
    """Union of [start, end) intervals as sorted, disjoint segments."""
    if start.size == 0:
        return start.astype(np.int64), end.astype(np.int64)
    order = np.argsort(start, kind="stable")
    s = start[order]
    e = np.maximum.accumulate(end[order])
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    np.greater(s[1:], e[:-1], out=new[1:])
    last = np.empty(s.size, dtype=bool)
    last[:-1] = new[1:]
    last[-1] = True
    return s[new], e[last]


def clip(x: I64, lo: int | I64, hi: int | I64) -> I64:
    """``np.clip`` for int arrays, without its per-call overhead."""
    return np.minimum(np.maximum(x, lo), hi)


def covered_ns(start: I64, end: I64, lo: int, hi: int) -> int:
    """Length of the union of intervals clipped to [lo, hi)."""
    s, e = merge_intervals(clip(start, lo, hi), clip(end, lo, hi))
    return int(np.sum(e - s))


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
    """Join samples (t, value) onto intervals [start, end] and pool them per interval group (``t``
    sorted); an interval with no sample adds nothing. One signal of ``link_stats``."""
    ls = link_stats(t, value, [0, t.size], np.zeros(t.size, dtype=bool), start, end, group, n_groups)
    return SampleStats(count=ls.count[0], mean=ls.mean[0], cv=ls.cv[0], peak=ls.peak[0])


@dataclass(frozen=True, slots=True)
class LinkStats:
    """Per signal (row) and group (column): count, mean, peak and CV of every sample inside the group's
    intervals, and the mean of the active samples among them; NaN where none fell inside."""

    count: I64
    mean: F64
    peak: F64
    cv: F64
    active_mean: F64


def link_stats(
    t: I64,
    value: F64,
    bounds: list[int],
    active: npt.NDArray[np.bool_],
    start: I64,
    end: I64,
    group: npt.NDArray[np.integer],
    n_groups: int,
) -> LinkStats:
    """Join samples onto intervals [start, end] for several signals at once and pool them per group:
    samples ``bounds[i]:bounds[i + 1]`` are signal i, each sorted by time (integer times).

    1. one ``searchsorted`` per signal gives each interval's samples as an index range (times are integers, so
       the samples right of ``end`` are those left of ``end + 1``: one search finds both ends);
    2. one ``reduceat`` over the interleaved range bounds sums every range of every signal for all three sums
       at once (value, square, active value: the rows of one array; its even entries; an empty range reads
       one element and is masked), another takes the peaks; the active samples are counted by a difference
       of running counts;
    3. one ``bincount`` pools the (signal, group) pairs.
    Sums run over each range's own samples, so a sample far from an interval cannot round it away.
    """
    k, m = len(bounds) - 1, start.size
    query = np.empty(2 * m, dtype=np.int64)  # each interval's bounds, interleaved: lo, hi, lo, hi, ...
    query[0::2] = start
    np.add(end, 1, out=query[1::2])
    per_signal = np.empty((k, 2 * m), dtype=np.intp)
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        np.add(t[a:b].searchsorted(query), a, out=per_signal[i])
    ranges = per_signal.reshape(-1)
    lo, hi = ranges[0::2], ranges[1::2]
    # The summed rows (value, square, value where active) as the samples lie, plus a last element, so a
    # range may end at the last sample.
    x = np.zeros((3, t.size + 1))
    x[0, :-1] = value
    np.multiply(value, value, out=x[1, :-1])
    np.copyto(x[2, :-1], value, where=active)
    some = hi > lo
    sums = np.zeros((5, k * m))  # sum, sum of squares, active sum, active count, count
    peak_each = np.full(k * m, -np.inf)  # an empty range's peak: none (fmax below also passes NaN by)
    if ranges.size:
        np.copyto(sums[:3], np.add.reduceat(x, ranges, axis=1)[:, 0::2], where=some)
        v = x[0]
        v[-1] = -np.inf
        np.copyto(peak_each, np.maximum.reduceat(v, ranges)[0::2], where=some)
    on = np.zeros(t.size + 1, dtype=np.int64)  # active samples counted exactly: a difference of counts
    np.cumsum(active, out=on[1:])
    np.subtract(on[hi], on[lo], out=sums[3], casting="unsafe")
    np.subtract(hi, lo, out=sums[4], casting="unsafe")
    size = k * n_groups
    pair = np.asarray(group, dtype=np.int64) + (np.arange(5 * k) * n_groups)[:, None]
    pooled = np.bincount(pair.ravel(), weights=sums.ravel(), minlength=5 * size).reshape(5, size)
    s, ss, s_on, n_on = pooled[0], pooled[1], pooled[2], pooled[3].astype(np.int64)
    count = pooled[4].astype(np.int64)
    peak = np.full(size, -np.inf)
    np.fmax.at(peak, pair[:k].ravel(), peak_each)  # a range whose peak is NaN adds nothing
    some_group = count > 0
    mean = np.where(some_group, s / np.maximum(count, 1), np.nan)
    var = np.maximum(ss / np.maximum(count, 1) - mean**2, 0.0)
    positive = some_group & (mean > 0)
    cv = np.where(positive, np.sqrt(var) / np.where(positive, mean, 1.0), np.nan)
    active_mean = np.where(n_on > 0, s_on / np.maximum(n_on, 1), np.nan)
    shape = (k, n_groups)
    return LinkStats(
        count=count.reshape(shape),
        mean=mean.reshape(shape),
        peak=np.where(some_group, peak, np.nan).reshape(shape),
        cv=cv.reshape(shape),
        active_mean=active_mean.reshape(shape),
    )


def nan_median(x: npt.NDArray[np.floating], axis: int = 0) -> F64:
    """``np.nanmedian(x, axis)``: the two middle values summed and halved, NaN where a slice has no
    value; one sort instead of numpy's masked arrays (short slices) or per-slice loop (long ones)."""
    values: F64 = np.asarray(x, dtype=np.float64)
    rest = values.shape[:axis] + values.shape[axis + 1 :]
    if values.shape[axis] == 0:
        return np.full(rest, np.nan)
    median, _ = _median_and_count(np.moveaxis(values, axis, 0) if axis else values)
    return median.reshape(rest)


def _median_and_count(x: F64) -> tuple[F64, I64]:
    """Per column of ``x`` (rows first), its NaN-ignoring median and how many values it has. The two middle
    values are picked by index from one sort: it runs per column of every test, so call overhead counts."""
    size = x.shape[0]
    if size == 0:
        return np.full(x.shape[1:], np.nan), np.zeros(x.shape[1:], dtype=np.int64)
    rest = x.shape[1:]
    ordered = np.sort(x.reshape(size, -1), axis=0)  # NaN sorts last
    count: I64 = size - np.add.reduce(np.isnan(ordered), axis=0)
    high = count // 2
    low = high - 1 + (count & 1)
    column = np.arange(ordered.shape[1])
    first = ordered[np.maximum(low, 0), column]
    second = ordered[np.minimum(high, size - 1), column]
    with np.errstate(invalid="ignore"):
        median: F64 = np.where(count > 0, (first + second) / 2, np.nan)
    return median.reshape(rest), count.reshape(rest)


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
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        med, count = _median_and_count(x)
        mad = _median_and_count(np.abs(x - med))[0] * MAD_TO_SIGMA
    return _scores(x, med, mad, rel_scale_floor, abs_scale_floor, min_count, count)


def mean_std_scores(
    x: F64, rel_scale_floor: float = 0.01, abs_scale_floor: float = 0.0, min_count: int = 3
) -> RobustScores:
    """Classical z-score of every row against its column: (x - mean) / standard deviation, with the same
    floors, NaN rules and relative gap as ``robust_scores`` (``median`` holds the mean).

    The row being scored is part of its own mean and deviation, so one outlier among n rows scores at
    most sqrt(n - 1) however far it lies (masking): the robust score's point of comparison."""
    with np.errstate(invalid="ignore"), quiet_nan_warnings():
        mean = np.nanmean(x, axis=0)
        std = np.nanstd(x, axis=0)
    return _scores(x, mean, std, rel_scale_floor, abs_scale_floor, min_count)


def _scores(
    x: F64,
    centre: F64,
    spread: F64,
    rel_scale_floor: float,
    abs_scale_floor: float,
    min_count: int,
    count: I64 | None = None,
) -> RobustScores:
    """z and relative gap of every row from its column's centre, the spread floored as both scorers do.
    ``count``: each column's values, where the centre's computation counted them already."""
    abscentre = np.abs(centre)
    scale = np.maximum(np.maximum(spread, rel_scale_floor * abscentre), abs_scale_floor)
    scale = np.where(scale > 0, scale, np.inf)
    enough = (np.sum(~np.isnan(x), axis=0) if count is None else count) >= min_count
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.where(enough, (x - centre) / scale, np.nan)
        rel = np.where(abscentre > 0, (x - centre) / abscentre, 0.0)
    return RobustScores(median=centre, scale=scale, z=z, rel_gap=rel)


class quiet_nan_warnings:
    """Silence numpy's 'All-NaN slice' warnings: an all-NaN column legitimately has no peers."""

    def __enter__(self) -> None:
        import warnings

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> None:
        self._ctx.__exit__(kind, exc, tb)
