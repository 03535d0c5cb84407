"""One rank's iteration as the sequence of its synchronisation points: what the replay works on.

Each collective or p2p call the rank made in the iteration, in the order it entered them, with its identity
(its function in the pattern record: op, process group, size class; its sequence number in that group) and
when the rank entered and left it. Calls that overlap (an async collective issued while the previous one
still runs, as DDP's buckets during the backward pass) keep their true enter and leave: the gap between the
previous call's leave and the next enter is then negative. ``compute_ns`` is the GPU compute (kernels of the
compute and memory classes) between one call's enter and the next one's, so that the calls partition the
iteration's compute whether or not it overlapped a call; ``None`` where the rank's kernels are unknown
(gloo, CPU jobs), whose work between calls is all host work.

On the wire (pattern record, ``patterns.v4``) times are whole microseconds after the iteration's start, each
enter written as its gap from the previous leave, functions and sequence numbers as differences from the
previous (call; call of the same function), and the compute less the gap (the work between two calls is
mostly compute): a call costs a few bytes. ``timeline_of`` gives them back in nanoseconds relative to the
iteration's start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas.records import PATTERN_TIMELINE_FIELDS
from fleetscope.streams.analysis.stats import clip

I64 = npt.NDArray[np.int64]

TIMELINE_FIELDS = PATTERN_TIMELINE_FIELDS
"""The pattern record's timeline fields (arrays of one entry per call, ``sync_compute_less_gap_us`` possibly empty,
and the scalar ``sync_tail_compute_us``)."""
US = 1000
"""Nanoseconds per wire unit: a microsecond is finer than any call's transfer the replay tells apart."""


@dataclass(frozen=True, slots=True)
class RankTimeline:
    """One rank's synchronisation points in one iteration, in the order it entered them."""

    function: I64
    """Index of each call's function in the record's ``function`` list."""
    seq: I64
    """Each call's sequence number in its process group (p2p: in its pair), the same on every member."""
    enter_ns: I64
    """When the rank entered each call, after the iteration's start."""
    leave_ns: I64
    """When the rank left each call, after the iteration's start."""
    compute_ns: I64 | None
    """GPU compute since the previous call's enter (the first: the iteration's start) up to this call's
    enter; None: kernels unknown."""
    iteration_ns: int
    tail_compute_ns: int | None = None
    """GPU compute from the last call's enter to the iteration's end; None: kernels unknown."""

    def __len__(self) -> int:
        return int(self.function.size)


def timeline_of(record: Mapping[str, Any]) -> RankTimeline | None:
    """The timeline a pattern record carries; None for records without one (older producers, no calls).

    A timeline no windower writes (fields of unequal lengths, a function outside the record's list, a
    negative duration or compute) raises ``ValueError`` with the one reason, so its message is refused
    whole rather than replayed wrong."""
    function = record.get("sync_function")
    if function is None or len(function) == 0:
        return None
    n = len(function)
    compute = record.get("sync_compute_less_gap_us")
    compute = () if compute is None else compute
    known = len(compute) > 0
    lengths = {name: len(record.get(name, ())) for name in TIMELINE_FIELDS[1:4]}
    if known:
        lengths["sync_compute_less_gap_us"] = len(compute)
    for name, length in lengths.items():
        if length != n:
            raise ValueError(f"timeline of {n} calls has {length} entries in {name}")
    fn = np.cumsum(np.asarray(function, dtype=np.int64))
    gap = np.asarray(record["sync_gap_us"], dtype=np.int64)
    dur = np.asarray(record["sync_dur_us"], dtype=np.int64)
    compute_us = np.asarray(compute, dtype=np.int64) + gap if known else gap[:0]
    tail = int(record.get("sync_tail_compute_us", -1))
    if int(fn.min()) < 0 or int(fn.max()) >= len(record["function"]):
        raise ValueError(f"timeline calls a function outside the record's {len(record['function'])}")
    if int(dur.min()) < 0 or (known and int(compute_us.min()) < 0):
        raise ValueError("timeline has a negative duration or compute")
    leave_us = np.cumsum(gap + dur)
    return RankTimeline(
        function=fn,
        seq=_undo_seq_deltas(fn, np.asarray(record["sync_seq"], dtype=np.int64)),
        enter_ns=(leave_us - dur) * US,
        leave_ns=leave_us * US,
        compute_ns=compute_us * US if known else None,
        iteration_ns=int(record.get("iteration_ns", 0)),
        tail_compute_ns=tail * US if known and tail >= 0 else None,
    )


def _call_windows_us(record: Mapping[str, Any]) -> tuple[npt.NDArray[np.float64], int] | None:
    """Each call's window of GPU compute in whole µs (its gap plus the compute less the gap, as
    ``timeline_of`` decodes them) and the tail's, from the wire fields alone; None where the rank's kernels
    are unknown or it has no timeline."""
    less_gap = record.get("sync_compute_less_gap_us")
    tail = int(record.get("sync_tail_compute_us", -1))
    if less_gap is None or len(less_gap) == 0 or tail < 0:
        return None
    return np.asarray(less_gap, dtype=np.float64) + np.asarray(record["sync_gap_us"], dtype=np.float64), tail


def compute_total_ns(record: Mapping[str, Any]) -> float:
    """The rank's GPU compute in its whole iteration, as its timeline partitions it (every call's window and
    the tail); NaN where its kernels are unknown or it has no timeline. Compute that ran while the rank
    waited in a call counts too: the work between its calls does not show it."""
    read = _call_windows_us(record)
    return float("nan") if read is None else float((read[0].sum() + read[1]) * US)


def compute_windows_ns(record: Mapping[str, Any]) -> npt.NDArray[np.float64] | None:
    """The rank's GPU compute in each call's window (from the previous call's enter to its own), then in its
    tail (from its last call's enter to the iteration's end); None where its kernels are unknown or it has
    no timeline."""
    read = _call_windows_us(record)
    return None if read is None else np.append(read[0], float(read[1])) * US


def _undo_seq_deltas(function: I64, deltas: I64) -> I64:
    order = np.argsort(function, kind="stable")
    sums = np.cumsum(deltas[order])
    first = np.ones(order.size, dtype=bool)
    first[1:] = function[order][1:] != function[order][:-1]
    base = np.maximum.accumulate(np.where(first, np.arange(order.size), 0))
    out = np.empty_like(deltas)
    out[order] = sums - sums[base] + deltas[order][base]
    return out


@dataclass(frozen=True, slots=True)
class TimelineBatch:
    """The wire fields of the timelines of a batch of iterations, every call of them in entry order."""

    bounds: list[int]
    """Iteration ``i``'s calls are ``bounds[i]:bounds[i + 1]``."""
    function: I64
    """Each call's function, an index into its iteration's own function list (before any capping)."""
    seq: I64
    function_delta: I64
    seq_delta: I64
    gap_us: I64
    dur_us: I64
    compute_less_gap_us: I64
    tail_compute_us: list[int]
    """Per iteration; -1 where kernels are unknown or there is no call."""
    known: list[bool]
    """Per iteration: whether its kernels (so its compute) are known."""

    def record(self, i: int, function_map: I64 | None = None) -> dict[str, Any]:
        """Iteration ``i``'s timeline fields of its pattern record; ``function_map`` takes its functions to
        the rows its record keeps (capped: many to its last row)."""
        lo, hi = self.bounds[i], self.bounds[i + 1]
        fn_delta, seq_delta = self.function_delta[lo:hi], self.seq_delta[lo:hi]
        if function_map is not None:
            fn = function_map[self.function[lo:hi]]
            one = np.zeros(fn.size, dtype=np.int64)
            fn_delta, seq_delta = _less_previous(fn, one == np.arange(fn.size)), seq_deltas(one, fn, self.seq[lo:hi])
        known = self.known[i] and hi > lo
        return {
            "sync_function": fn_delta,
            "sync_seq": seq_delta,
            "sync_gap_us": self.gap_us[lo:hi],
            "sync_dur_us": self.dur_us[lo:hi],
            "sync_compute_less_gap_us": self.compute_less_gap_us[lo:hi] if known else self.gap_us[:0],
            "sync_tail_compute_us": self.tail_compute_us[i] if known else -1,
        }


def _less_previous(x: I64, first: npt.NDArray[np.bool_]) -> I64:
    """Each call's value less the previous call's of its iteration (its ``first``: less 0); along the last
    axis, so rows of several values at once."""
    prev = np.empty_like(x)
    prev[..., 1:] = x[..., :-1]
    prev[..., first] = 0
    out: I64 = x - prev
    return out


def seq_deltas(it: I64, function: I64, seq: I64) -> I64:
    """Each call's sequence number less that of the previous call of the same function in its iteration (the
    first of each: itself): consecutive calls of a group differ by one, a byte on the wire."""
    order = np.lexsort((function, it))  # stable: calls of a function in entry order
    s = seq[order]
    out = s.copy()
    same = (it[order][1:] == it[order][:-1]) & (function[order][1:] == function[order][:-1])
    out[1:][same] -= s[:-1][same]
    deltas = np.empty_like(out)
    deltas[order] = out
    return deltas


def build_timelines(
    it: I64,
    enter_ns: I64,
    leave_ns: I64,
    function: I64,
    seq: I64,
    compute_at_enter_ns: I64,
    compute_ns: I64,
    known: npt.NDArray[np.bool_],
) -> TimelineBatch:
    """Every iteration's timeline from its calls (any order; times after the iteration's start; each call's
    GPU compute from the iteration's start to its enter) and each iteration's GPU compute in all.

    Calls are put in entry order (ties in the order given); times and compute are floored to the
    microsecond after the iteration's start before they are differenced, so that the gaps and the compute
    add up exactly (no rounding error accumulates along the iteration)."""
    m = int(compute_ns.size)
    order = np.lexsort((enter_ns, it))  # stable: ties in the order given
    times = np.array((enter_ns, leave_ns, compute_at_enter_ns, function), dtype=np.int64)[:, order]
    times[:3] //= US
    it, function, seq = it[order], times[3], seq[order]
    first = np.ones(it.size, dtype=bool)
    first[1:] = it[1:] != it[:-1]
    steps = _less_previous(times, first)  # per row: enter, leave, compute, function, less the previous call's
    enter_us, leave_us, compute_us = times[0], times[1], times[2]
    gap = enter_us - leave_us + steps[1]
    counts = np.bincount(it, minlength=m)
    bounds = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    last_compute = np.concatenate((compute_us, [0]))[np.where(counts > 0, bounds[1:] - 1, it.size)]
    tail = np.where(counts > 0, compute_ns // US - last_compute, -1)
    return TimelineBatch(
        bounds=bounds.tolist(),
        function=function,
        seq=seq,
        function_delta=steps[3],
        seq_delta=seq_deltas(it, function, seq),
        gap_us=gap,
        dur_us=leave_us - enter_us,
        compute_less_gap_us=steps[2] - gap,
        tail_compute_us=tail.tolist(),
        known=known.tolist(),
    )


_BEFORE_ALL = np.array([np.iinfo(np.int64).min])
"""The empty segment a union starts with, so that every time has a segment at or before it."""
_NONE_BEFORE = np.zeros(1, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class CoveredTime:
    """A union of intervals as sorted disjoint segments (each iteration's in a time range of its own, where
    ``shift`` takes its times) and the length of those before each: how much of it an iteration had up to
    any time, by one search. The windower's summary keeps its compute kernels' so."""

    start: I64
    end: I64
    before: I64
    lo: I64
    hi: I64
    shift: I64
    """Per iteration: its bounds and what takes its times into its range."""

    @classmethod
    def of(cls, start: I64, end: I64, lo: I64, hi: I64, shift: I64, covered: I64 | None = None) -> CoveredTime:
        """From the segments; an empty one before them all, so every time has a segment at or before it.
        ``covered``: the segments' running length from 0 (one more entry), where the caller has it."""
        if covered is None:
            covered = np.zeros(start.size + 1, dtype=np.int64)
            np.cumsum(end - start, out=covered[1:])
        before = np.concatenate((_NONE_BEFORE, covered[:-1]))
        return cls(np.concatenate((_BEFORE_ALL, start)), np.concatenate((_BEFORE_ALL, end)), before, lo, hi, shift)

    def since_start(self, t: I64, it: npt.NDArray[np.integer]) -> I64:
        """Iteration ``it``'s compute from its start up to ``t`` (clipped to the iteration)."""
        at = self._at(np.concatenate((clip(t, self.lo[it], self.hi[it]) + self.shift[it], self.lo + self.shift)))
        since: I64 = at[: t.size] - at[t.size :][it]
        return since

    def _at(self, t: I64) -> I64:
        j = self.start.searchsorted(t, side="right") - 1
        covered: I64 = self.before[j] + np.minimum(t, self.end[j]) - self.start[j]
        return covered
