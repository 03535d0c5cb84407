"""Plausibility rules for a decoded raw batch (pure, no I/O).

Decoding proves a message has the right shape; these rules reject batches whose values would poison
the windower or the store (a rank outside the job, a negative duration, a timestamp decades away).
The first broken rule is returned as a one-line reason, prefixed ``header:`` or ``value:`` for the
dead-letter topic. Wall-clock bounds apply only to batches on the ``realtime`` clock.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import EventBatch

MIN_TIMESTAMP_NS = 946_684_800 * 10**9
"""2000-01-01T00:00:00Z: anything earlier is an uninitialised or relative clock."""
MAX_FUTURE_NS = 86_400 * 10**9
"""How far past the checker's wall clock an event may end (clock skew, not a broken clock)."""

_TIME_COLUMNS = ("start_ns", "launch_ns", "t_ns")


def check_batch(batch: EventBatch, now_ns: int) -> str | None:
    """Why ``batch`` must be dead-lettered, or None when it is plausible; ``now_ns`` is wall-clock time."""
    h = batch.header
    if not h.job:
        return "header: empty job"
    if h.world_size < 1:
        return f"header: world size {h.world_size} < 1"
    if not 0 <= h.rank < h.world_size:
        return f"header: rank {h.rank} outside world size {h.world_size}"
    if h.seq < 0:
        return f"header: seq {h.seq} < 0"
    dur = batch.columns.get("dur_ns")
    if dur is not None and dur.size and int(dur.min()) < 0:
        return f"value: negative duration {int(dur.min())} ns in {batch.kind.value}"
    if h.clock != "realtime":
        return None
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
