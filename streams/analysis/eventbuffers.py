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
    return sum(int(buf[TIME_COLUMN[kind]].size) for kind, buf in buffers.items())


def gpu_work_end(bufs: tuple[Cols | None, ...], start: int, end: int) -> int:
    """When the GPU work launched in [start, end) ends (at least ``end``)."""
    gpu_end = end
    for buf in bufs:
        if buf is None:
            continue
        sel = (buf["assign_ns"] >= start) & (buf["assign_ns"] < end)
        if sel.any():
            gpu_end = max(gpu_end, int(np.maximum.reduce(buf["start_ns"][sel] + buf["dur_ns"][sel])))
    return gpu_end


def take_step(buffers: dict[EventKind, Cols], start: int, end: int, gpu_end: int) -> dict[EventKind, Cols]:
    """Take the step [start, end) out of ``buffers`` (replaced by what later steps still need) and return its
    events per kind. Hardware samples run on to ``gpu_end``, the end of the step's GPU work."""
    parts: dict[EventKind, Cols] = {}
    for kind, buf in buffers.items():
        t = buf[TIME_COLUMN[kind]]
        samples = kind is EventKind.SAMPLES
        if t.size < 2 or bool((t[1:] >= t[:-1]).all()):  # in time order, as sent: slices, not masks
            first = int(t.searchsorted(start, side="left"))
            stop = int(t.searchsorted(gpu_end if samples else end, side="right" if samples else "left"))
            kept = int(t.searchsorted(end, side="left"))
            parts[kind] = {k: v[first:stop] for k, v in buf.items()}
            # copies, so the closed step's events do not stay referenced by what is kept
            buffers[kind] = {k: v[kept:].copy() for k, v in buf.items()} if kept else buf
            continue
        inside = (t >= start) & ((t <= gpu_end) if samples else (t < end))
        keep = t >= end
        parts[kind] = {k: v[inside] for k, v in buf.items()}
        buffers[kind] = {k: v[keep] for k, v in buf.items()}
    return parts
