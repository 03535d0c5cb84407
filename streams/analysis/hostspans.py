"""Host (Python) spans: how much of a span is the rank's own work.

A CPU annotation's duration includes whatever runs inside it and the time it blocks on the GPU or on
its peers; comparing durations would make the ranks that wait look host-slow. Self time is what is
left once nested spans and blocking calls are taken out, and the time its thread waited for a CPU where
the producer measured it (``SPAN_CPU_WAIT_DEPTH`` rows): on a shared host a rank descheduled inside a
span did no more work, so the time it waited for a CPU is no host slowness.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import SPAN_CPU_WAIT_DEPTH, THREAD_BUSY_DEPTH

Cols = dict[str, npt.NDArray[Any]]
I64 = npt.NDArray[np.int64]


def with_depth(python: Cols) -> Cols:
    """Host spans with their nesting depth (0 for every span where the source sent none)."""
    if not python or "depth" in python:
        return python
    return {**python, "depth": np.zeros(python["start_ns"].size, dtype=np.int32)}


def host_self_ns(
    it: I64,
    start: I64,
    dur: I64,
    depth: npt.NDArray[np.integer],
    sync: npt.NDArray[np.bool_],
    name: npt.NDArray[np.integer] | None = None,
) -> I64:
    """Each host span's self time: its duration minus its direct children's (depth + 1, inside it, same
    iteration) and minus its run-queue wait (a ``SPAN_CPU_WAIT_DEPTH`` row of its ``name`` id and start,
    which holds its own wait only: nested spans' waits are theirs), and 0 for a blocking call
    (``is_sync_call``), whose time is waiting for the GPU or peers.

    So an annotation that only waits (``## backward ##`` around ``cudaStreamSynchronize``, or while another
    thread does the work: ``_other_threads_inside``) has no self time. Rows of depth ``THREAD_BUSY_DEPTH``
    (a thread's work outside its own spans, from a trace parser) only count in that rule; theirs is 0.

    The parent of a child is the last span one level up that starts no later than it (spans of one thread
    nest); starts are ranked once so that one sorted key (iteration, depth, start rank) finds every parent
    with one ``searchsorted``.
    """
    n = start.size
    own = dur.astype(np.int64, copy=True)
    if n == 0:
        return own
    d = depth.astype(np.int64)
    floor = int(d.min())
    # A span at the shallowest depth has no parent (a torch hook's outermost spans are at depth 1, its step
    # marker taken out): the parents' search, only where some span may have one.
    child = np.flatnonzero(d > max(floor, 0))
    if child.size:
        order = np.lexsort((d, start))  # a parent that starts with its child ranks first
        srank = np.empty(n, dtype=np.int64)
        srank[order] = np.arange(n)
        levels = int(d.max()) + 2
        key = (it.astype(np.int64) * levels + d) * n + srank
        by_key = np.argsort(key, kind="stable")
        sorted_key = key[by_key]
        want_group = it[child].astype(np.int64) * levels + d[child] - 1
        pos = sorted_key.searchsorted(want_group * n + srank[child], side="right") - 1
        ok = pos >= 0
        ok[ok] = sorted_key[pos[ok]] // n == want_group[ok]
        parent = by_key[np.where(ok, pos, 0)]
        end = start + dur
        inside = ok & (start[child] < end[parent])
        overlap = np.minimum(end[child], end[parent]) - start[child]
        own -= np.bincount(parent[inside], weights=overlap[inside], minlength=n).astype(np.int64)
    if floor <= 0:  # no outermost span (depth 0 or a thread's busy stretch) nor wait row: nothing inside
        own -= _other_threads_inside(it, start, dur, d)
    if name is not None and floor <= SPAN_CPU_WAIT_DEPTH:
        own -= _own_waits(it, name, start, dur, d)
    own[sync | (d < 0)] = 0
    return np.maximum(own, 0)


def _own_waits(it: I64, name: npt.NDArray[np.integer], start: I64, dur: I64, depth: I64) -> I64:
    """Per span, the length of the ``SPAN_CPU_WAIT_DEPTH`` row of the same iteration, name and start (0 where
    none): rows and spans sorted together by that key, each row just after its span."""
    wait = np.zeros(start.size, dtype=np.int64)
    rows = np.flatnonzero(depth == SPAN_CPU_WAIT_DEPTH)
    if rows.size == 0:
        return wait
    spans = np.flatnonzero(depth >= 0)
    both = np.concatenate([spans, rows])
    is_row = np.concatenate([np.zeros(spans.size, dtype=bool), np.ones(rows.size, dtype=bool)])
    order = np.lexsort((is_row, start[both], name[both], it[both]))
    row_at = np.flatnonzero(is_row[order][1:]) + 1
    span, row = both[order][row_at - 1], both[order][row_at]
    ok = ~is_row[order][row_at - 1] & (it[span] == it[row]) & (name[span] == name[row]) & (start[span] == start[row])
    np.add.at(wait, span[ok], dur[row[ok]])
    return wait


def _other_threads_inside(it: I64, start: I64, dur: I64, depth: I64) -> I64:
    """Per span, the time of outermost spans (depth 0, and a thread's work outside its spans: depth
    ``THREAD_BUSY_DEPTH``) of its iteration that start and end inside it: a thread's spans of one depth never
    overlap, so these are other threads' work (``## backward ##`` on the main thread while the autograd
    engine's thread runs the backward): its own thread only waited meanwhile.

    Times are ranked once, so that one sorted key (iteration, start rank) of the outermost spans and a prefix
    sum of their durations give each span's total with two ``searchsorted``; where the last one that starts
    inside ends outside, only its part inside counts."""
    outer = np.flatnonzero((depth == 0) | (depth == THREAD_BUSY_DEPTH))
    if outer.size == 0:
        return np.zeros(start.size, dtype=np.int64)
    n = start.size + 1
    times = np.sort(start)
    end = start + dur
    iteration = it.astype(np.int64) * n
    o_key = iteration[outer] + times.searchsorted(start[outer], side="left")
    order = np.argsort(o_key, kind="stable")
    o_key, o_end = o_key[order], end[outer][order]
    cum = np.concatenate([[0], np.cumsum(dur[outer][order])])
    lo = o_key.searchsorted(iteration + times.searchsorted(start, side="left"), side="left")
    hi = o_key.searchsorted(iteration + times.searchsorted(end, side="left"), side="left")
    inside = cum[hi] - cum[lo]
    inside -= np.where(hi > lo, np.maximum(o_end[np.maximum(hi - 1, 0)] - end, 0), 0)
    inside[outer] -= dur[outer]  # an outermost span starts inside itself
    out: I64 = np.maximum(inside, 0).astype(np.int64)
    return out
