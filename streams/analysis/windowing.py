"""Cut one rank's event streams into iterations (pure state machine, no I/O).

Iterations come from step markers (``ProfilerStep#N`` spans). GPU work belongs to the step in
which it was *launched*, so a step closes only when every stream this rank produces has moved past
it (per-stream watermarks), or when the rank has been idle for a while, or when too many steps
wait while a stream they wait for has gone quiet (a backlog, e.g. a restart re-reading, delivers the light
streams far ahead of the kernels: that is not a reason to close steps without them; a bounded number of
steps more is the memory guard, and such a close is counted as incomplete and logged). The four streams
travel on separate topics and are consumed independently, so every stream
declared in the batch header (``streams``) is waited for; when a producer declares nothing, a
stream not seen yet is waited for during ``stream_discovery_ms`` after the rank's first batch.
Events that arrive for an already closed step are counted as late and dropped. Without markers, steps are
inferred from the host sequence (data loader, optimizer) or the collectives' period; steps inferred from
collectives also wait for the host stream, where there is one, to pass them: a rank's collectives can run
ahead of its first step marker (a pipeline stage's receives, early in its first step), and the marker
replaces what they would have cut.
"""

from __future__ import annotations

import logging
from dataclasses import MISSING, dataclass, field, fields
from functools import lru_cache
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import BatchHeader, EventBatch, EventKind, parse_step_marker
from fleetscope.schemas.vocabulary import (
    OTHER_FUNCTIONS,
    host_phase,
    is_cpu_wait,
    is_profiling_window,
    is_step_marker_name,
)
from fleetscope.streams.analysis.closed_iterations import ClosedIteration, summarize_closed
from fleetscope.streams.analysis.eventbuffers import (
    TIME_COLUMN,
    Cols,
    gpu_work_end,
    held_events,
    kept_columns,
    take_step,
)
from fleetscope.streams.analysis.iterations import CollectivePeriodDetector, HostSequenceDetector, Span
from fleetscope.streams.analysis.patterns import IterationEvents, NameTable
from fleetscope.streams.analysis.stalls import StallRecord, stall_record
from fleetscope.streams.settings import WindowerConfig

log = logging.getLogger(__name__)

__all__ = ["ClosedIteration", "RankWindower", "WindowerConfig", "identity", "summarize_closed"]

_MAX_HELD_EVENTS = 2_000_000
"""Events a rank may hold in open steps past ``max_open_steps`` (about 80 MB) while a lagging stream arrives."""
_MAX_WINDOWS = 16
"""Profiler windows a rank remembers (the latest): enough to mark the steps still open and judge stalls."""
_WINDOW, _WAIT = 1, 2
"""Kinds of a producer's own host spans, no host functions: a profiler window, a step's run-queue wait."""


def _own_span_kind(name: str) -> int:
    return _WINDOW if is_profiling_window(name) else _WAIT if is_cpu_wait(name) else 0


@dataclass(slots=True)
class WindowerCounters:
    batches: int = 0
    events: int = 0
    late_events: int = 0
    iterations: int = 0
    incomplete: int = 0
    """Steps closed before every stream they waited for reached them (too many open steps)."""


@lru_cache(maxsize=64)
def _declared(streams: tuple[str, ...]) -> frozenset[EventKind]:
    return frozenset(k for k in EventKind if k.value in streams)


def identity(header: BatchHeader) -> dict[str, Any]:
    return {
        "job": header.job,
        "rank": header.rank,
        "host": header.host,
        "world_size": header.world_size,
        "tp_rank": header.tp_rank,
        "pp_rank": header.pp_rank,
        "dp_rank": header.dp_rank,
        "local_rank": header.local_rank,
        "gpu_uuid": header.gpu_uuid,
    }


@dataclass
class RankWindower:
    """Iteration windowing for one rank (job/rank key)."""

    config: WindowerConfig = field(default_factory=WindowerConfig)
    header: BatchHeader | None = None
    counters: WindowerCounters = field(default_factory=WindowerCounters)
    last_arrival_ns: int = 0
    arrival_by_kind: dict[EventKind, int] = field(default_factory=dict)
    """Processing time of each stream's latest batch: a lagging stream still arriving is waited for."""
    first_arrival_ns: int | None = None
    _names: list[str] = field(default_factory=list)
    _name_ids: dict[str, int] = field(default_factory=dict)
    _buffers: dict[EventKind, Cols] = field(default_factory=dict)
    _ordered: dict[EventKind, bool] = field(default_factory=dict)
    """The kinds whose buffer is known to be in time order (``take_step``); forgotten when it is replaced."""
    _watermark: dict[EventKind, int] = field(default_factory=dict)
    _declared_by: dict[str, frozenset[EventKind]] = field(default_factory=dict)
    _steps: dict[int, tuple[int, int]] = field(default_factory=dict)
    _closed_step: int = -(2**62)
    _closed_end_ns: int = -(2**62)
    _last_progress_ns: int = -(2**62)
    _clock_ns: int = -(2**62)
    _durations: list[int] = field(default_factory=list)
    _stalled: bool = False
    _progress_arrival_ns: int = -(2**62)
    """Processing time of the rank's latest kernel, collective or host batch."""
    _progress_span_ns: dict[EventKind, int] = field(default_factory=dict)
    """Per progress stream, the time its latest batch covered. A stream's events arrive up to one batch
    behind the rank's clock (producers flush every 500 ms, samples run ahead): the stall threshold
    allows for the least of these lags, as the freshest stream keeps the rank's progress."""
    _mode: str = ""
    _host_detector: HostSequenceDetector = field(default_factory=HostSequenceDetector)
    _period_detector: CollectivePeriodDetector = field(default_factory=CollectivePeriodDetector)
    _host_phases_seen: bool = False
    _pgs: set[int] = field(default_factory=set)
    _collectives_seen: int = 0
    _stalls: list[StallRecord] = field(default_factory=list)
    _table: NameTable = field(default_factory=NameTable)
    _luts: dict[EventKind, tuple[list[str], npt.NDArray[np.int32]]] = field(default_factory=dict)
    """Per kind, the last batch's name dictionary and its ids in ``_names``: producers resend the same one."""
    _marker_steps: list[int | None] = field(default_factory=list)
    """Step number of each name of ``_names`` that is a step marker."""
    _is_marker: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=bool))
    _own_span: npt.NDArray[np.int8] = field(default_factory=lambda: np.zeros(0, dtype=np.int8))
    """Per name of ``_names``, which of the producer's own spans it is (``_WINDOW``, ``_WAIT``; 0: none)."""
    _windows: list[tuple[int, int]] = field(default_factory=list)
    """The rank's latest profiler windows (start, end): the steps they overlap are ``profiled``, and the
    events a window holds back make no stall."""
    _waits: dict[int, int] = field(default_factory=dict)
    """Run-queue wait spans not yet attributed to a closed step: start -> wait (ns)."""
    _mean_ns: float = 0.0
    _host_seen_ns: int = -(2**62)
    """The end of the latest host event of any kind (step markers and the producer's own spans included): how
    far the host stream has reported, whether or not it advanced the host watermark."""
    _gpu_end_memo: tuple[tuple[int, int], Cols | None, Cols | None, int] | None = None
    """The last ``_gpu_end`` answer and the kernel/collective buffers it read (buffers are replaced, never
    changed in place): the steps' readiness checks ask again after every batch."""

    def add(self, batch: EventBatch, now_ns: int) -> list[ClosedIteration]:
        """Take one batch; return the iterations it allowed to close."""
        self.header = batch.header
        self._declared_by[batch.header.producer_id] = _declared(batch.header.streams)
        self.last_arrival_ns = now_ns
        self.arrival_by_kind[batch.kind] = now_ns
        if self.first_arrival_ns is None:
            self.first_arrival_ns = now_ns
        self.counters.batches += 1
        n = len(batch)
        self.counters.events += n
        if n == 0:
            return []
        latest = self._track_progress(batch, now_ns)
        cols = self._columns(batch, size=n)
        kind = batch.kind
        if kind is EventKind.HOST:
            if self._mode != "step_marker" and cols["start_ns"].size:  # read only until markers come
                seen = int(np.maximum.reduce(cols["start_ns"] + np.maximum(cols["dur_ns"], 0)))
                self._host_seen_ns = max(self._host_seen_ns, seen)
            cols = self._take_step_markers(cols)
            if self._mode != "step_marker":
                self._detect_host_sequence(cols)
        elif kind is EventKind.COLLECTIVES and self._mode in ("", "collective_period"):
            self._detect_collective_period(cols)
        time_col = TIME_COLUMN[kind]
        t = cols[time_col]
        if t.size and int(np.minimum.reduce(t)) < self._closed_end_ns:
            late = t < self._closed_end_ns
            self.counters.late_events += int(np.count_nonzero(late))
            cols = {k: v[~late] for k, v in cols.items()}
            latest = None
        if cols[time_col].size:
            if kind is EventKind.HOST:
                latest = int(np.maximum.reduce(cols["start_ns"] + cols["dur_ns"]))
            elif latest is None or kind is not EventKind.SAMPLES:
                latest = int(np.maximum.reduce(cols[time_col]))
            self._watermark[kind] = max(self._watermark.get(kind, -(2**62)), latest)
            buf = self._buffers.get(kind)
            self._buffers[kind] = cols if buf is None else {k: np.concatenate([buf[k], cols[k]]) for k in cols}
            self._ordered.pop(kind, None)
        return self._close(force=False, now_ns=now_ns)

    @property
    def clock_ns(self) -> int | None:
        """The latest time the rank's events reached (span end, sample time); None before any event."""
        return self._clock_ns if self._clock_ns > -(2**62) else None

    @property
    def mean_iteration_ns(self) -> float:
        """Mean duration of the rank's recent closed iterations (0.0 before the first)."""
        return self._mean_ns

    def take_stalls(self) -> list[StallRecord]:
        """Stall/resume reports produced since the last call (for the job's hang check)."""
        out, self._stalls = self._stalls, []
        return out

    def poll(self, now_ns: int) -> list[ClosedIteration]:
        """Re-check waiting steps as processing time passes (stream discovery, idleness).

        Stalls are judged on event time only: a finished job and a lagging consumer are silent in
        processing time too, while a hung job's hardware samples keep coming.
        """
        if self.is_idle(now_ns):
            return self.flush()
        return self._close(force=False, now_ns=now_ns)

    def flush(self) -> list[ClosedIteration]:
        """Close every step whose span is complete, whatever the watermarks (rank idle or stopping)."""
        if self._mode in ("", "optimizer_sequence"):
            self._add_spans("optimizer_sequence", self._host_detector.finish())
        return self._close(force=True, now_ns=self.last_arrival_ns)

    def is_idle(self, now_ns: int) -> bool:
        return bool(self._steps) and now_ns - self.last_arrival_ns >= self.config.idle_close_ms * 1_000_000

    # -- internals -------------------------------------------------------------------------------

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A state saved by an older version lacks the fields added since: they start at their defaults."""
        missing = {
            f.name: f.default_factory() if f.default_factory is not MISSING else f.default
            for f in fields(self)
            if f.name not in state
        }
        self.__dict__.update(missing, **state)

    def _mean_iteration_ns(self) -> float:
        return self._mean_ns

    def _track_progress(self, batch: EventBatch, now_ns: int) -> int | None:
        """Move the rank's clock on; return the latest sample time of a hardware batch."""
        latest = None
        if batch.kind is EventKind.SAMPLES:
            latest = int(np.maximum.reduce(batch["t_ns"]))
            self._clock_ns = max(self._clock_ns, latest)
        else:
            self._progress_arrival_ns = now_ns
            end = int(np.maximum.reduce(batch["start_ns"] + batch["dur_ns"]))
            self._progress_span_ns[batch.kind] = end - int(np.minimum.reduce(batch["start_ns"]))
            self._last_progress_ns = max(self._last_progress_ns, end)
            self._clock_ns = max(self._clock_ns, end)
        mean = self._mean_iteration_ns()
        if mean:
            self._check_stall(self._clock_ns, mean, now_ns)
        return latest

    def _check_stall(self, clock_ns: int, mean_ns: float, now_ns: int) -> None:
        batch_lag = min(self._progress_span_ns.values(), default=0)
        # A profiler window holds the rank's events back until it closes: up to its end, that is no stall.
        progress = max([self._last_progress_ns, *(we for ws, we in self._windows if ws <= clock_ns)])
        stalled = clock_ns - progress >= self.config.stall_factor * mean_ns + batch_lag
        # The streams are consumed apart: samples read ahead of a lagging kernel or host partition would
        # pass the rank's last progress too. Progress batches still arriving (processing time) are a
        # backlog, not silence; a hung rank's stop arriving.
        stalled = stalled and now_ns - self._progress_arrival_ns >= self.config.stall_silence_ms * 1_000_000
        if stalled == self._stalled or self.header is None:
            return
        self._stalled = stalled
        h = self.header
        self._stalls.append(
            stall_record(h.job, h.rank, h.host, h.world_size, self._closed_step, self._last_progress_ns,
                         clock_ns, mean_ns, stalled)
        )  # fmt: skip

    def _intern(self, name: str) -> int:
        gid = self._name_ids.get(name)
        if gid is None and len(self._names) >= self.config.max_names and parse_step_marker(name) is None:
            name = OTHER_FUNCTIONS  # the table is full: bounded memory, one row of everything past it
            gid = self._name_ids.get(name)
        if gid is None:
            gid = self._name_ids[name] = len(self._names)
            self._names.append(name)
        return gid

    def _columns(self, batch: EventBatch, size: int) -> Cols:
        known = self._luts.get(batch.kind)
        if known is not None and known[0] == batch.names:
            lut = known[1]
        else:
            lut = np.array([self._intern(name) for name in batch.names], dtype=np.int32)
            self._luts[batch.kind] = (list(batch.names), lut)
        return kept_columns(batch, lut, size)

    def _take_step_markers(self, cols: Cols) -> Cols:
        """Take step markers and the producer's own spans out of a host batch (they are no host functions)."""
        ids = cols["name_id"]
        steps = self._marker_steps
        if len(steps) < len(self._names):
            new = [parse_step_marker(n) for n in self._names[len(steps) :]]
            steps += new
            fresh = [is_step_marker_name(n) for n in self._names[len(self._is_marker) :]]  # broken ones too
            self._is_marker = np.concatenate((self._is_marker, np.array(fresh, dtype=bool)))
        if self._own_span.size < len(self._names):
            kinds = [_own_span_kind(n) for n in self._names[self._own_span.size :]]
            self._own_span = np.concatenate((self._own_span, np.array(kinds, dtype=np.int8)))
        own = self._own_span[ids]
        if own.any():
            cols = self._take_own_spans(cols, own)
            ids = cols["name_id"]
        is_marker = self._is_marker[ids]
        if not is_marker.any():
            return cols
        at = np.flatnonzero(is_marker)
        marks = zip(ids[at].tolist(), cols["start_ns"][at].tolist(), cols["dur_ns"][at].tolist(), strict=True)
        for name_id, start, dur in marks:
            step = steps[name_id]
            if step is None:
                continue
            if self._mode != "step_marker":  # explicit markers beat every inferred boundary
                self._mode = "step_marker"
                self._steps.clear()
            if self._closed_step < step:
                self._steps[step] = (start, start + dur)
        return {k: v[~is_marker] for k, v in cols.items()}

    def _take_own_spans(self, cols: Cols, own: npt.NDArray[np.int8]) -> Cols:
        """Take the producer's own spans (``own``: each row's ``_own_span`` kind) out of a host batch: a
        profiler window's marks the steps it overlaps, a step's run-queue wait goes to the step it starts."""
        at = np.flatnonzero(own)
        spans = zip(own[at].tolist(), cols["start_ns"][at].tolist(), cols["dur_ns"][at].tolist(), strict=True)
        for kind, start, dur in spans:
            length = max(dur, 0)
            if kind == _WINDOW:
                self._windows.append((start, start + length))
            elif start >= self._closed_end_ns and len(self._waits) < 16 * self.config.max_open_steps:
                self._waits[start] = self._waits.get(start, 0) + length
        self._windows = sorted(set(self._windows))[-_MAX_WINDOWS:]
        kept = own == 0
        return {k: v[kept] for k, v in cols.items()}

    def _cpu_wait(self, start: int, end: int) -> int:
        """The run-queue wait of the step [start, end) (the wait spans starting in it; -1: none measured),
        and those of earlier steps forgotten."""
        waits = [(t, w) for t, w in self._waits.items() if t < end]
        for t, _ in waits:
            del self._waits[t]
        inside = [w for t, w in waits if t >= start]
        return sum(inside) if inside else -1

    def _profiled(self, start: int, end: int) -> bool:
        """Whether a profiler window overlaps the step [start, end)."""
        return any(ws < end and we > start for ws, we in self._windows)

    def _add_spans(self, mode: str, spans: list[Span]) -> None:
        if not spans or self._mode not in ("", mode):
            return
        self._mode = mode
        for step, start, end in spans:
            if step > self._closed_step:
                self._steps[step] = (start, end)

    def _detect_host_sequence(self, cols: Cols) -> None:
        depth = cols.get("depth")
        if depth is not None and depth.size and int(np.minimum.reduce(depth)) < 0:
            cols = {k: v[depth >= 0] for k, v in cols.items()}  # a thread's busy stretches are no spans
        if not cols["start_ns"].size:
            return
        order = np.argsort(cols["start_ns"], kind="stable")
        names = [self._names[i] for i in cols["name_id"][order]]
        if not self._host_phases_seen:
            self._host_phases_seen = any(host_phase(n) for n in set(names))
        start = cols["start_ns"][order]
        spans = self._host_detector.feed(names, start, start + cols["dur_ns"][order])
        self._add_spans("optimizer_sequence", spans)

    def _detect_collective_period(self, cols: Cols) -> None:
        if self._host_phases_seen or not cols["start_ns"].size:
            return
        order = np.argsort(cols["start_ns"], kind="stable")
        c = {k: v[order] for k, v in cols.items()}
        nbytes = np.maximum(c["nbytes"], 1)
        key = (
            (c["op_id"].astype(np.int64) << 40)
            | (c["pg_id"].astype(np.int64) << 20)
            | np.ceil(np.log2(nbytes)).astype(np.int64)
        )
        self._pgs.update(c["pg_id"].tolist())
        n = c["seq"].size
        # One process group: its sequence numbers align ranks; several: fall back to arrival order.
        seq = c["seq"] if len(self._pgs) == 1 else np.arange(self._collectives_seen, self._collectives_seen + n)
        self._collectives_seen += n
        spans = self._period_detector.feed(key, seq, c["start_ns"], c["start_ns"] + c["dur_ns"])
        self._add_spans("collective_period", spans)

    def _ready(self, start: int, end: int, now_ns: int) -> bool:
        declared = set().union(*self._declared_by.values()) if self._declared_by else set()
        if any(kind not in self._watermark for kind in declared):
            return False
        first = now_ns if self.first_arrival_ns is None else self.first_arrival_ns
        discovering = now_ns - first < self.config.stream_discovery_ms * 1_000_000
        if discovering and not declared and len(self._watermark) < len(EventKind):
            return False
        # Wait for the declared streams (each producer's latest declaration: a profiling window's
        # kernels stop being waited for when it ends), or for every stream seen when none is declared.
        waited = declared or set(self._watermark)
        for kind in (EventKind.KERNELS, EventKind.COLLECTIVES):
            if kind in waited and self._watermark[kind] < end:
                return False
        if self._mode == "collective_period" and -(2**62) < self._host_seen_ns < end:
            return False  # a step marker in host events not in yet replaces boundaries inferred from collectives
        if EventKind.SAMPLES in waited:
            gpu_end = self._gpu_end(start, end)
            if self._watermark[EventKind.SAMPLES] < gpu_end:
                return False
        return True

    def _gpu_end(self, start: int, end: int) -> int:
        bufs = (self._buffers.get(EventKind.KERNELS), self._buffers.get(EventKind.COLLECTIVES))
        memo = self._gpu_end_memo
        if memo is not None and memo[0] == (start, end) and memo[1] is bufs[0] and memo[2] is bufs[1]:
            return memo[3]
        gpu_end = gpu_work_end(self._buffers, start, end, self._ordered)
        self._gpu_end_memo = ((start, end), bufs[0], bufs[1], gpu_end)
        return gpu_end

    def _close(self, force: bool, now_ns: int) -> list[ClosedIteration]:
        closed: list[ClosedIteration] = []
        while self._steps:
            step = min(self._steps)
            start, end = self._steps[step]
            if not (force or self._ready(start, end, now_ns)):
                if not self._too_many_open(now_ns):
                    break
                self.counters.incomplete += 1
                if self.counters.incomplete == 1:
                    log.warning(
                        "closing step %d of %s rank %s before all its streams arrived (%d steps open): counted "
                        "as incomplete", step, *(self.header.job, self.header.rank) if self.header else ("?", "?"),
                        len(self._steps),
                    )  # fmt: skip
            closed.append(self._close_step(step, start, end))
        return closed

    def _too_many_open(self, now_ns: int) -> bool:
        """More than ``max_open_steps`` wait and a stream they wait for is quiet; or 16 times that many, or
        more than ``_MAX_HELD_EVENTS`` events held (the memory bound when the heavy stream is the one ahead)."""
        n = len(self._steps)
        if n <= self.config.max_open_steps:
            return False
        if n > 16 * self.config.max_open_steps:
            return True
        if held_events(self._buffers) > _MAX_HELD_EVENTS:
            return True
        quiet_ns = self.config.idle_close_ms * 1_000_000
        since = self.first_arrival_ns if self.first_arrival_ns is not None else now_ns
        declared = set().union(*self._declared_by.values()) if self._declared_by else set()
        waited = declared or set(self._watermark)
        return any(now_ns - self.arrival_by_kind.get(kind, since) >= quiet_ns for kind in waited)

    def _close_step(self, step: int, start: int, end: int) -> ClosedIteration:
        del self._steps[step]
        parts = take_step(self._buffers, start, end, self._gpu_end(start, end), self._ordered)
        self._closed_step = step
        self._closed_end_ns = end
        events = IterationEvents(
            step=step,
            start_ns=start,
            end_ns=end,
            names=self._names,
            kernels=parts.get(EventKind.KERNELS, {}),
            collectives=parts.get(EventKind.COLLECTIVES, {}),
            python=parts.get(EventKind.HOST, {}),
            samples=parts.get(EventKind.SAMPLES, {}),
            table=self._table,
            max_functions=self.config.max_functions,
            max_function_chars=self.config.max_function_chars,
        )
        self._durations = (self._durations + [max(end - start, 1)])[-20:]
        self._mean_ns = float(np.add.reduce(np.asarray(self._durations), dtype=np.float64) / len(self._durations))
        self.counters.iterations += 1
        who = identity(self.header) if self.header else {}
        who["profiled"] = self._profiled(start, end)
        who["cpu_wait_ns"] = self._cpu_wait(start, end)
        return ClosedIteration.pending(events, who, self._mode or "step_marker")
