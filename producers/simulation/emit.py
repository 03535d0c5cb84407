"""Turn one simulated iteration into each rank's event batches (the producers' wire shape).

Why separate: the physics works on (ranks x events) matrices; this is the only per-rank loop, so it does
as little as possible per rank (row views, shared read-only id columns, one header per batch).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.producers.simulation.engine import PYTHON_NAMES, Timeline
from fleetscope.producers.simulation.faults import host_name
from fleetscope.producers.simulation.groups import derived_layout
from fleetscope.producers.simulation.program import Layout
from fleetscope.producers.simulation.samples import METRICS, Samples, grid_ns
from fleetscope.schemas import BatchHeader, EventBatch, EventKind, step_marker_name
from fleetscope.schemas.records import OPTIONAL_COLUMNS

MAX_BATCH_EVENTS = 4096
COMPUTE_STREAM = 7
ALL_STREAMS = tuple(kind.value for kind in EventKind)
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def gpu_uuid(job: str, rank: int) -> str:
    """A stable, UUID-shaped id for a simulated GPU."""
    h = hashlib.sha256(f"{job}/{rank}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _frozen(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    a.flags.writeable = False
    return a


class Emitter:
    """Per-rank identity, name dictionaries and producer sequence numbers; builds the batches."""

    def __init__(self, lay: Layout, host_offset_ns: I64) -> None:
        cfg = lay.cfg
        self.lay, self.cfg = lay, cfg
        self.offset = cfg.start_ns + host_offset_ns[lay.host]  # (R,) int64
        self.seq = [0] * lay.ranks
        layout = derived_layout(
            cfg, described=cfg.named_groups
        )  # coordinates from the published process groups, as for a real job
        self.identity: list[dict[str, Any]] = [
            {
                "job": cfg.job,
                "rank": r,
                "world_size": cfg.ranks,
                "producer_id": f"sim-{cfg.job}-{r}",
                "local_rank": r % cfg.gpus_per_host,
                "host": host_name(int(lay.host[r])),
                "gpu_uuid": gpu_uuid(cfg.job, r),
                **layout.role(r).header_fields(),
                "streams": ALL_STREAMS,
            }
            for r in range(lay.ranks)
        ]
        self.collective_names = [lay.collective_names(r) for r in range(lay.ranks)]
        k = lay.k_ids.size
        self.k_ids = _frozen(lay.k_ids.copy())
        self.k_stream = _frozen(np.full(k, COMPUTE_STREAM, dtype=np.int32))
        m = lay.m
        ids = [0, 1, *[2] * m, *[3] * m, 5, 4, 6]  # marker, names in PYTHON_NAMES order (see Timeline)
        self.py_ids = _frozen(np.array(ids, dtype=np.int32))
        self.py_depth = _frozen(np.array([0] + [1] * (len(ids) - 1), dtype=np.int32))
        self.metric_ids = _frozen(np.tile(np.arange(len(METRICS), dtype=np.int32), 512))

    def _metric_ids(self, samples: int) -> npt.NDArray[np.int32]:
        need = samples * len(METRICS)
        if self.metric_ids.size < need:
            self.metric_ids = _frozen(np.tile(np.arange(len(METRICS), dtype=np.int32), 2 * samples))
        return self.metric_ids[:need]

    def _ts(self, x: F64) -> I64:
        """True-time floats (R, n) -> each rank's clock in int ns; non-finite values become 0."""
        return np.rint(np.where(np.isfinite(x), x, 0.0)).astype(np.int64) + self.offset[:, None]

    def iteration(self, tl: Timeline, smp: Samples) -> Iterator[EventBatch]:
        """Every rank's kernels, collectives, python and throughput batches of one iteration, rank by rank."""
        lay = self.lay
        complete = bool(np.isfinite(tl.step_end).all())
        k_fin = np.isfinite(tl.k_end)
        ks, ke, kl = self._ts(tl.k_start), self._ts(tl.k_end), self._ts(tl.k_launch)
        kd = ke - ks
        c_ok = lay.c_valid[lay.pp_rank] & np.isfinite(tl.c_end)
        order = np.argsort(np.where(c_ok, tl.c_launch, np.inf), axis=1, kind="stable")
        c_n = c_ok.sum(axis=1)
        cs = np.take_along_axis(self._ts(tl.c_start), order, 1)
        ce = np.take_along_axis(self._ts(tl.c_end), order, 1)
        cd, cl = ce - cs, np.take_along_axis(self._ts(tl.c_launch), order, 1)
        c_cols = {
            "name_id": lay.c_name[order],
            "op_id": lay.c_op[order],
            "pg_id": lay.c_pg[order],
            "seq": (tl.step * lay.c_seq_mult + lay.c_seq_base)[order],
            "group_size": lay.c_size[order],
            "nbytes": lay.c_bytes[order],
        }
        p_ok = np.isfinite(tl.py_end)
        ps, pe = self._ts(tl.py_start), self._ts(tl.py_end)
        py_names = [step_marker_name(tl.step), *PYTHON_NAMES]
        t_grid = grid_ns(smp)
        for r in range(lay.ranks):
            kr = slice(None) if complete else k_fin[r]
            yield from self._emit(
                r,
                EventKind.KERNELS,
                lay.kernel_names,
                {
                    "start_ns": ks[r, kr],
                    "dur_ns": kd[r, kr],
                    "name_id": self.k_ids[kr],
                    "stream": self.k_stream[kr],
                    "launch_ns": kl[r, kr],
                },
                ke[r, kr],
            )
            n = c_n[r]
            cols = {k: v[r, :n] for k, v in c_cols.items()}
            cols |= {"start_ns": cs[r, :n], "dur_ns": cd[r, :n], "launch_ns": cl[r, :n]}
            yield from self._emit(r, EventKind.COLLECTIVES, self.collective_names[r], cols, ce[r, :n])
            pr = p_ok[r]
            yield from self._emit(
                r,
                EventKind.HOST,
                py_names,
                {
                    "start_ns": ps[r, pr],
                    "dur_ns": pe[r, pr] - ps[r, pr],
                    "name_id": self.py_ids[pr],
                    "depth": self.py_depth[pr],
                },
                pe[r, pr],
            )
            lo, hi = smp.lo[r], smp.hi[r]
            t_ns = np.repeat(t_grid[lo:hi] + self.offset[r], len(METRICS))
            yield from self._emit(
                r,
                EventKind.SAMPLES,
                list(METRICS),
                {
                    "t_ns": t_ns,
                    "metric_id": self._metric_ids(hi - lo),
                    "value": smp.values[r, lo:hi].reshape(-1),
                },
                t_ns,
            )

    def _emit(
        self, r: int, kind: EventKind, names: list[str], cols: dict[str, npt.NDArray[Any]], ends: I64
    ) -> Iterator[EventBatch]:
        """The kind's batches, split at MAX_BATCH_EVENTS; an empty kind sends nothing."""
        size = len(next(iter(cols.values())))
        for lo in range(0, size, MAX_BATCH_EVENTS):
            sl = slice(lo, lo + MAX_BATCH_EVENTS)
            header = BatchHeader(**self.identity[r], seq=self.seq[r], sent_ns=int(ends[sl].max()))
            self.seq[r] += 1
            chunk = cols if size <= MAX_BATCH_EVENTS else {k: v[sl] for k, v in cols.items()}
            yield EventBatch(kind=kind, header=header, names=names, columns=chunk)


def coalesce(
    batches: Iterable[EventBatch], interval_ns: int, max_events: int = MAX_BATCH_EVENTS
) -> Iterator[EventBatch]:
    """Regroup one-iteration batches as the real producers ship them: one message per rank and kind for
    each ``interval_ns`` of event time (their flush interval), at most ``max_events`` events.

    Why: the ``Recorder`` and the NVML sampler flush every 500 ms, so their messages span several
    iterations; per-rank producer sequence numbers are renumbered in the new emission order."""
    pending: dict[tuple[str, int, EventKind], list[EventBatch]] = {}
    sizes: dict[tuple[str, int, EventKind], int] = {}
    seq: dict[tuple[str, int], int] = {}

    def ship(group: list[EventBatch]) -> EventBatch:
        h = group[0].header
        n = seq.get((h.job, h.rank), 0)
        seq[(h.job, h.rank)] = n + 1
        return _merged(group, n)

    for b in batches:
        key = (b.header.job, b.header.rank, b.kind)
        group = pending.get(key)
        if group and (sizes[key] + len(b) > max_events or b.header.sent_ns - group[0].header.sent_ns >= interval_ns):
            yield ship(pending.pop(key))
            group = None
        if group is None:
            pending[key], sizes[key] = [b], len(b)
        else:
            group.append(b)
            sizes[key] += len(b)
    for group in pending.values():
        yield ship(group)


def _merged(group: list[EventBatch], seq: int) -> EventBatch:
    """One batch holding the group's events in order, with one string dictionary for all of them."""
    first = group[0]
    header = dataclasses.replace(first.header, seq=seq, sent_ns=max(b.header.sent_ns for b in group))
    if len(group) == 1:
        return EventBatch(kind=first.kind, header=header, names=first.names, columns=first.columns)
    index: dict[str, int] = {}
    parts: dict[str, list[npt.NDArray[Any]]] = {name: [] for name in first.columns}
    for b in group:
        remap = np.fromiter((index.setdefault(s, len(index)) for s in b.names), np.int32, len(b.names))
        for name, col in b.columns.items():
            parts[name].append(remap[col] if name.endswith("_id") else col)
    columns = {
        name: np.concatenate(cols)
        for name, cols in parts.items()
        if name not in OPTIONAL_COLUMNS or all(c.size == len(b) for c, b in zip(cols, group, strict=True))
    }
    return EventBatch(kind=first.kind, header=header, names=list(index), columns=columns)
