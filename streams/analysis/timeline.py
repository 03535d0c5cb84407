"""One rank's iteration as the sequence of its synchronisation points: what the replay works on.

Each collective or p2p call the rank made in the iteration, in the order it entered them, with its identity
(its function in the pattern record: op, process group, size class; its sequence number in that group) and
when the rank entered and left it. The work between two calls is the gap between the first's leave and the
next one's enter; of it, ``compute_ns`` is the GPU compute (kernels of the compute and memory classes), when
the rank's kernels are known.

On the wire (pattern record, ``patterns.v4``) times are whole microseconds, each enter a delta from the
previous call's enter, so that a call costs a few bytes; ``timeline_of`` gives them back in nanoseconds
relative to the iteration's start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]

TIMELINE_FIELDS = ("sync_function", "sync_seq", "sync_enter_us", "sync_dur_us", "sync_compute_us")
"""The pattern record's timeline fields (arrays of one entry per call; ``sync_compute_us`` may be empty)."""


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
    """GPU compute in the work before each call (since the previous call's leave); None: kernels unknown."""
    iteration_ns: int

    def __len__(self) -> int:
        return int(self.function.size)


def timeline_of(record: Mapping[str, Any]) -> RankTimeline | None:
    """The timeline a pattern record carries; None for records without one (older producers, no calls)."""
    function = record.get("sync_function")
    if function is None or len(function) == 0:
        return None
    enter_us = np.cumsum(np.asarray(record["sync_enter_us"], dtype=np.int64))
    dur_us = np.asarray(record["sync_dur_us"], dtype=np.int64)
    compute = record.get("sync_compute_us")
    return RankTimeline(
        function=np.asarray(function, dtype=np.int64),
        seq=np.asarray(record["sync_seq"], dtype=np.int64),
        enter_ns=enter_us * 1000,
        leave_ns=(enter_us + dur_us) * 1000,
        compute_ns=np.asarray(compute, dtype=np.int64) * 1000 if compute is not None and len(compute) else None,
        iteration_ns=int(record.get("iteration_ns", 0)),
    )
