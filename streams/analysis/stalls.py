"""A rank's stall record: what the windower reports when a rank stops (or resumes) progressing, and what
the differential's hang check reads. Apart from both, so that neither side imports the other."""

from __future__ import annotations

from typing import TypedDict


class StallRecord(TypedDict):
    """One rank's progress as its windower sees it: ``stalled_ns`` since its last progress, on its own clock."""

    job: str
    rank: int
    host: str
    world_size: int
    last_step: int
    last_progress_ns: int
    clock_ns: int
    stalled_ns: int
    mean_iteration_ns: float
    stalled: bool


def stall_record(
    job: str,
    rank: int,
    host: str,
    world_size: int,
    last_step: int,
    last_progress_ns: int,
    clock_ns: int,
    mean_iteration_ns: float,
    stalled: bool,
) -> StallRecord:
    """The windower's report that a rank stopped (or resumed) progressing."""
    return {
        "job": job, "rank": rank, "host": host, "world_size": world_size, "last_step": last_step,
        "last_progress_ns": last_progress_ns, "clock_ns": clock_ns,
        "stalled_ns": max(clock_ns - last_progress_ns, 0), "mean_iteration_ns": float(mean_iteration_ns),
        "stalled": stalled,
    }  # fmt: skip
