"""The events a rank's windower holds, column by column per kind, and how a closing step takes its share.

Pure functions over ``Cols`` buffers (each column a numpy array, all of one length): kept apart from the
state machine that decides when a step closes (``windowing``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas.records import COLUMNS, ID_COLUMNS, EventBatch, EventKind

Cols = dict[str, npt.NDArray[Any]]

TIME_COLUMN = {
    EventKind.KERNELS: "assign_ns",
    EventKind.COLLECTIVES: "assign_ns",
    EventKind.HOST: "start_ns",
    EventKind.SAMPLES: "t_ns",
}
"""The time each kind's events are filed by: GPU work by launch (``assign_ns``), host spans by start."""
_KEPT = {kind: [(c, c in ID_COLUMNS) for c in COLUMNS[kind] if c != "launch_ns"] for kind in EventKind}
"""Per kind, the batch columns the windower buffers and whether each indexes the name dictionary."""


def kept_columns(batch: EventBatch, lut: npt.NDArray[np.int32], size: int) -> Cols:
    """The batch's buffered columns, name ids mapped through ``lut`` to the rank's own name table; GPU work
    gets ``assign_ns`` (its launch time, or its start when the producer sent no launch times)."""
    columns = batch.columns
    cols: Cols = {name: lut[columns[name]] if is_id else columns[name] for name, is_id in _KEPT[batch.kind]}
    if batch.kind in (EventKind.KERNELS, EventKind.COLLECTIVES):
        launch = columns["launch_ns"]
        cols["assign_ns"] = launch if launch.size == size else columns["start_ns"]
    return cols


def held_events(buffers: dict[EventKind, Cols]) -> int:
    """Events the buffers still hold, all kinds together: what a rank costs in memory."""
    return sum(int(buf[TIME_COLUMN[kind]].size) for kind, buf in buffers.items())


def in_time_order(buffers: dict[EventKind, Cols], kind: EventKind, ordered: dict[EventKind, bool]) -> bool:
    """Whether ``kind``'s buffer is in time order (as producers send it), found once per buffer: ``ordered``
    keeps the kinds found so, and the caller forgets a kind when it replaces its buffer."""
    if ordered.get(kind):
        return True
    t = buffers[kind][TIME_COLUMN[kind]]
    found = ordered[kind] = t.size < 2 or bool((t[1:] >= t[:-1]).all())
    return found


def gpu_work_end(buffers: dict[EventKind, Cols], start: int, end: int, ordered: dict[EventKind, bool]) -> int:
    """When the GPU work launched in [start, end) ends (at least ``end``)."""
    gpu_end = end
    for kind in (EventKind.KERNELS, EventKind.COLLECTIVES):
        buf = buffers.get(kind)
        if buf is None:
            continue
        if in_time_order(buffers, kind, ordered):  # launched in [start, end): one slice
            a, b = buf["assign_ns"].searchsorted([start, end]).tolist()
            if b > a:
                gpu_end = max(gpu_end, int(np.maximum.reduce(buf["start_ns"][a:b] + buf["dur_ns"][a:b])))
            continue
        sel = (buf["assign_ns"] >= start) & (buf["assign_ns"] < end)
        if sel.any():
            gpu_end = max(gpu_end, int(np.maximum.reduce(buf["start_ns"][sel] + buf["dur_ns"][sel])))
    return gpu_end


def take_step(
    buffers: dict[EventKind, Cols], start: int, end: int, gpu_end: int, ordered: dict[EventKind, bool]
) -> dict[EventKind, Cols]:
    """Take the step [start, end) out of ``buffers`` (replaced by what later steps still need) and return its
    events per kind. Hardware samples run on to ``gpu_end``, the end of the step's GPU work.

    A buffer in time order, as producers send it (``ordered``: the kinds whose buffer was found so, kept
    up to date here; a buffer the caller replaces it forgets), gives both parts as slices: what is kept
    stays a view until the kind's next batch replaces the buffer (never more than the buffer held then)."""
    parts: dict[EventKind, Cols] = {}
    for kind, buf in buffers.items():
        t = buf[TIME_COLUMN[kind]]
        samples = kind is EventKind.SAMPLES
        if in_time_order(buffers, kind, ordered):
            # integer times: the samples' stop, right of gpu_end, is left of gpu_end + 1
            first, stop, kept = t.searchsorted([start, gpu_end + 1 if samples else end, end]).tolist()
            parts[kind] = {k: v[first:stop] for k, v in buf.items()}
            buffers[kind] = {k: v[kept:] for k, v in buf.items()} if kept else buf
            continue
        inside = (t >= start) & ((t <= gpu_end) if samples else (t < end))
        keep = t >= end
        parts[kind] = {k: v[inside] for k, v in buf.items()}
        buffers[kind] = {k: v[keep] for k, v in buf.items()}
    return parts
