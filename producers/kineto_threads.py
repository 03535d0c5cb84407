"""A trace's host threads: each span's nesting depth within its thread, and the time each thread worked
outside its own host spans, which self time needs on traces with several threads.

Why: the parser keeps only annotations, comms ops, step markers and blocking calls of a trace's CPU ops
(the bulk of a trace is the rest). The backward runs on the autograd engine's thread while
``## backward ##`` on the main thread waits for it; without that thread's work the annotation's whole
duration, waiting included, reads as its self time. So the parser also sends, per thread, the stretches
its dropped CPU ops cover and none of its own host spans does, as rows of depth ``THREAD_BUSY_DEPTH``:
``streams.analysis.hostspans`` takes them out of the spans of other threads they fall in, the one rule
the live path feeds with the outermost ops it sends as host spans.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]

THREAD_BUSY_NAME = "[thread busy]"
"""The name of a ``THREAD_BUSY_DEPTH`` row (no function: the depth says so, the name reads in a dump)."""


def depths(start: I64, dur: I64, thread: I64) -> npt.NDArray[np.int32]:
    """Nesting depth of each host span within its thread (0 = outermost)."""
    depth = np.zeros(start.size, dtype=np.int32)
    order = np.lexsort((-dur, start, thread))
    stack: list[int] = []
    current = None
    for i in order.tolist():
        if thread[i] != current:
            current, stack = thread[i], []
        s = int(start[i])
        while stack and stack[-1] <= s:
            stack.pop()
        depth[i] = len(stack)
        stack.append(s + int(dur[i]))
    return depth


def busy_outside_spans(
    busy_start: I64, busy_end: I64, busy_thread: I64, span_start: I64, span_end: I64, span_thread: I64
) -> tuple[I64, I64, I64]:
    """Per thread (small ints from 0), the disjoint stretches that its CPU ops ``[busy_start, busy_end)``
    cover (nested or not) and none of its host spans does; returned as (start, end, thread), by thread
    then time.

    One sweep per thread: over the sorted boundaries of both sets, an elementary segment is busy where
    more ops than have ended started at or before it (likewise for spans); runs of busy, span-free
    segments are the stretches. A span-free thread's stretches are the union of its ops.
    """
    out: list[tuple[I64, I64, I64]] = []
    for t in np.flatnonzero(np.bincount(busy_thread)).tolist() if busy_thread.size else ():
        mine = busy_thread == t
        bs, be = np.sort(busy_start[mine]), np.sort(busy_end[mine])
        own = span_thread == t
        ss, se = np.sort(span_start[own]), np.sort(span_end[own])
        points = np.sort(np.concatenate([bs, be, ss, se]))  # repeated points: empty segments, harmless
        left = points[:-1]
        busy = bs.searchsorted(left, side="right") > be.searchsorted(left, side="right")
        free = ss.searchsorted(left, side="right") == se.searchsorted(left, side="right")
        edge = np.diff(np.concatenate([[0], (busy & free).astype(np.int8), [0]]))
        start, end = points[np.flatnonzero(edge == 1)], points[np.flatnonzero(edge == -1)]
        out.append((start, end, np.full(start.size, t, dtype=np.int64)))
    if not out:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    start, end, thread = (np.concatenate(c).astype(np.int64) for c in zip(*out, strict=True))
    return start, end, thread
