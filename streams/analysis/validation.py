"""Plausibility rules for a decoded raw batch (pure, no I/O).

Decoding proves a message has the right shape; these rules reject batches whose values would poison
the windower or the store (a rank outside the job, a negative duration, a timestamp decades away).
The first broken rule is returned as a one-line reason, prefixed ``header:``, ``size:`` or ``value:`` for
the dead-letter topic. Every clock label is checked (``CLOCKS``): one the rules do not know is refused, so
no batch skips the timestamp bounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import CLOCKS, EventBatch, IntakeLimits

MIN_TIMESTAMP_NS = 946_684_800 * 10**9
"""2000-01-01T00:00:00Z: anything earlier is an uninitialised or relative clock."""
MAX_FUTURE_NS = 86_400 * 10**9
"""How far past the checker's wall clock an event may end (clock skew, not a broken clock)."""

_TIME_COLUMNS = ("start_ns", "launch_ns", "t_ns")
_FLOAT_COLUMNS = ("value",)
_DEFAULT_LIMITS = IntakeLimits()


def check_batch(batch: EventBatch, now_ns: int, limits: IntakeLimits = _DEFAULT_LIMITS) -> str | None:
    """Why ``batch`` must be dead-lettered, or None when it is plausible; ``now_ns`` is wall-clock time."""
    h = batch.header
    if not h.job:
        return "header: empty job"
    if h.clock not in CLOCKS:
        return f"header: unknown clock {h.clock[:64]!r} (known: {', '.join(sorted(CLOCKS))})"
    reason = _check_sizes(batch, limits)
    if reason is not None:
        return reason
    if h.world_size < 1:
        return f"header: world size {h.world_size} < 1"
    if not 0 <= h.rank < h.world_size:
        return f"header: rank {h.rank} outside world size {h.world_size}"
    if h.seq < 0:
        return f"header: seq {h.seq} < 0"
    dur = batch.columns.get("dur_ns")
    if dur is not None and dur.size and int(dur.min()) < 0:
        return f"value: negative duration {int(dur.min())} ns in {batch.kind.value}"
    for name in _FLOAT_COLUMNS:
        col = batch.columns.get(name)
        if col is not None and col.size and not bool(np.isfinite(col).all()):
            bad = float(col[~np.isfinite(col)][0])
            return f"value: non-finite {batch.kind.value} {name} {bad!r}"
    latest = now_ns + MAX_FUTURE_NS
    for name in _TIME_COLUMNS:
        col = batch.columns.get(name)
        if col is None or not col.size:
            continue
        low, high = int(col.min()), int(col.max())
        if low < MIN_TIMESTAMP_NS:
            return f"value: {batch.kind.value} {name} {low} is before 2000-01-01"
        if high > latest:
            return f"value: {batch.kind.value} {name} {high} is more than 1 day in the future"
    if dur is not None and dur.size and _ends_after(batch.columns["start_ns"], dur, latest):
        return f"value: a {batch.kind.value} event ends more than 1 day in the future"
    return None


def _ends_after(start: npt.NDArray[Any], dur: npt.NDArray[Any], latest: int) -> bool:
    """``start + dur > latest`` for any event, without int64 overflow (start <= latest holds here)."""
    return bool(np.any(dur > np.int64(latest) - start))


def _check_sizes(batch: EventBatch, limits: IntakeLimits) -> str | None:
    """Bounds on the batch's size and its strings (a 100 kB job id or 2**31 ranks is an attack or a bug)."""
    h = batch.header
    if h.world_size > limits.max_world_size:
        return f"size: world size {h.world_size} > max_world_size {limits.max_world_size}"
    if len(batch) > limits.max_events_per_batch:
        return f"size: {len(batch)} events > max_events_per_batch {limits.max_events_per_batch}"
    labels = {"job": h.job, "host": h.host, "cluster": h.cluster, "producer_id": h.producer_id}
    labels |= {"gpu_uuid": h.gpu_uuid} | {f"streams[{i}]": s for i, s in enumerate(h.streams)}
    for field, text in labels.items():
        if len(text) > limits.max_label_chars:
            return f"size: {field} of {len(text)} chars > max_label_chars {limits.max_label_chars}"
    longest = max(map(len, batch.names), default=0)
    if longest > limits.max_name_chars:
        return f"size: a name of {longest} chars > max_name_chars {limits.max_name_chars}"
    return None


def batch_reach_ns(batch: EventBatch) -> int | None:
    """The latest time a batch's events reach (a span's end, a sample's time); None when it is empty."""
    if len(batch) == 0:
        return None
    if "dur_ns" in batch.columns:
        return int(np.max(batch["start_ns"] + batch["dur_ns"]))
    return int(np.max(batch["t_ns"]))


def check_clock_jump(
    reach_ns: int,
    clock_ns: int | None,
    mean_iteration_ns: float,
    quiet_ns: int,
    peer_clock_ns: int | None,
    limits: IntakeLimits = _DEFAULT_LIMITS,
    wall_ns: int | None = None,
) -> str | None:
    """Why a batch reaching ``reach_ns`` would jump its rank's clock (``clock_ns``, None: no clock yet),
    or None. A rank's clock moves at the pace of its work: a batch may reach past it by at most
    ``clock_jump_iterations`` mean iterations or ``max_clock_jump_ms``, whichever is more, plus the time the
    rank was quiet (``quiet_ns``, input clock: a rank back from silence has moved on). A batch within that
    of the job's furthest peer (``peer_clock_ns``) is in pace too (a backlog of a job-wide pause read fast).
    A batch no further past the checker's wall clock (``wall_ns``) than a rank may run ahead of its own clock
    is in pace as well: events cannot come from the future, and a backlog read after a job-wide pause (every
    rank's clock behind by the pause) is real. A rank quiet for ``clock_step_accept_ms`` takes any jump: a
    real clock step moves all its batches."""
    quiet_ns = max(quiet_ns, 0)  # a clock restored from another process's state may read ahead
    if clock_ns is None or quiet_ns >= limits.clock_step_accept_ms * 1_000_000:
        return None
    ahead = max(limits.clock_jump_iterations * mean_iteration_ns, limits.max_clock_jump_ms * 1e6)
    allowed = ahead + quiet_ns
    jump = reach_ns - clock_ns
    if jump <= allowed or (peer_clock_ns is not None and reach_ns - peer_clock_ns <= allowed):
        return None
    if wall_ns is not None and reach_ns - wall_ns <= ahead:
        return None
    peers = " and its peers'" if peer_clock_ns is not None else ""
    return (
        f"value: events reach {jump / 1e9:.1f} s past the rank's clock{peers} and the wall clock"
        f" (allowed {allowed / 1e9:.1f} s:"
        f" {limits.clock_jump_iterations} iterations of {mean_iteration_ns / 1e6:.0f} ms, at least"
        f" {limits.max_clock_jump_ms / 1e3:g} s, plus {quiet_ns / 1e9:.1f} s quiet): a clock jump, refused until"
        f" the rank is quiet for {limits.clock_step_accept_ms / 1e3:g} s"
    )
