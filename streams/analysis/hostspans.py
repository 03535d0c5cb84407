"""Host (Python) spans: how much of a span is the rank's own work.

A CPU annotation's duration includes whatever runs inside it and the time it blocks on the GPU or on
its peers; comparing durations would make the ranks that wait look host-slow. Self time is what is
left once nested spans and blocking calls are taken out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

Cols = dict[str, npt.NDArray[Any]]
I64 = npt.NDArray[np.int64]


def with_depth(python: Cols) -> Cols:
    """Host spans with their nesting depth (0 for every span where the source sent none)."""
    if not python or "depth" in python:
        return python
    return {**python, "depth": np.zeros(python["start_ns"].size, dtype=np.int32)}


def host_self_ns(it: I64, start: I64, dur: I64, depth: npt.NDArray[np.integer], sync: npt.NDArray[np.bool_]) -> I64:
    """Each host span's self time: its duration minus its direct children's (depth + 1, inside it, same
    iteration), and 0 for a blocking call (``is_sync_call``), whose time is waiting for the GPU or peers.

    So an annotation that only waits (``## backward ##`` around ``cudaStreamSynchronize``) has no self
    time. The parent of a child is the last span one level up that starts no later than it (spans of
    one thread nest); starts are ranked once so that one sorted key (iteration, depth, start rank)
    finds every parent with one ``searchsorted``.
    """
    n = start.size
    own = dur.astype(np.int64, copy=True)
    if n == 0:
        return own
    d = depth.astype(np.int64)
    order = np.lexsort((d, start))  # a parent that starts with its child ranks first
    srank = np.empty(n, dtype=np.int64)
    srank[order] = np.arange(n)
    levels = int(d.max()) + 2
    key = (it.astype(np.int64) * levels + d) * n + srank
    by_key = np.argsort(key, kind="stable")
    sorted_key = key[by_key]
    child = np.flatnonzero(d > 0)
    if child.size:
        want_group = it[child].astype(np.int64) * levels + d[child] - 1
        pos = sorted_key.searchsorted(want_group * n + srank[child], side="right") - 1
        ok = pos >= 0
        ok[ok] = sorted_key[pos[ok]] // n == want_group[ok]
        parent = by_key[np.where(ok, pos, 0)]
        end = start + dur
        inside = ok & (start[child] < end[parent])
        overlap = np.minimum(end[child], end[parent]) - start[child]
        own -= np.bincount(parent[inside], weights=overlap[inside], minlength=n).astype(np.int64)
    own[sync] = 0
    return np.maximum(own, 0)
