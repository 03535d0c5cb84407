"""Real 4-rank PyTorch jobs (gloo on 2 shared cores, beside the stack), replayed from what their windowers
published (tests/data/real_jobs, ``recorded_jobs``): real arrivals, not the simulator's.

Each layout has a healthy job (300 steps, a manual profiling window past step 120) and four faulty ones (from
step 30): a slow data loader (rank 2), GC after each step (rank 3), a 3x forward (rank 1) and every rank's
forward 4 times over (the job's own regression). A faulty rank must be named within 10 iterations and no other
rank; a healthy job gets nothing. The ``fsdp`` ones shard the model with FSDP2, the ``hsdp`` ones shard it in
pairs replicated over the pairs, the ``dtensor`` ones split it with DTensor's tensor parallelism, the
``varying`` ones accumulate gradients over micro-batches of random lengths (a different rank is last each
step), ``pipe`` is the real-job test's pipeline by hand (dp2 x pp2); the others DDP. Most were recorded at a
load average of 15-22 on the 2 cores; a second healthy DDP job (none-d545b4) beside two bursty CPU burners
(``record --load bursty``), 57 % of its steps' time waiting for a CPU.

The pattern records carry each rank's call timeline (patterns.v4), from which the what-if replays the
iteration. How far the replayed iteration is from the measured one is held
too: per iteration it swings both ways where a rank's work after its last call (GC, above all) is paid by its
peers in the next iteration, so the bars are on the median and on the mean with its sign.

"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from recorded_jobs import FAULTS, Recording, missed_bar, recordings, replay_errors

from fleetscope.streams.differential import DifferentialStage

MEDIAN_REPLAY_ERROR = 0.10
"""The median iteration's |replayed - measured| / measured a recording must keep (measured: 0.2-7.8 %)."""
MEAN_REPLAY_ERROR = 0.05
"""The same, signed and averaged over the job's iterations (measured: -3.2 to +3.9 %)."""


def _opened(recording: Recording) -> list[dict[str, Any]]:
    """Every finding the differential opens on the recording, fed as the worker reads it (offline: an
    iteration waits for all its ranks)."""
    stage = DifferentialStage()
    updates: list[dict[str, Any]] = []
    for message in recording.messages():
        taken = stage.take(message, None)
        assert taken.reason is None, taken.reason
        updates += taken.findings
    for job in list(stage.jobs):
        updates += stage.flush(job)
    return [u for u in updates if u["status"] == "open"]


@pytest.mark.parametrize("recording", recordings(), ids=lambda r: r.path.name.removesuffix(".bin.gz"))
def test_a_recorded_real_job_gets_exactly_its_faults_finding(recording: Recording) -> None:
    opened = _opened(recording)
    shown = [(u["category"], u["rank"], u["function"], u["iteration_last"]) for u in opened]
    assert recording.faulty == FAULTS.get(recording.fault, (-1,))[0], recording
    assert missed_bar(recording.fault, opened) is None, (missed_bar(recording.fault, opened), shown)
    errors = replay_errors(recording.messages())
    assert errors and None not in errors, "an iteration without every rank's timeline"
    size = np.abs(np.array(errors, dtype=np.float64))
    assert np.median(size) <= MEDIAN_REPLAY_ERROR and abs(np.mean(errors)) <= MEAN_REPLAY_ERROR, (
        np.median(size),
        np.mean(errors),
    )


def test_the_recordings_are_there() -> None:
    assert {r.fault for r in recordings()} == {"none", *FAULTS}, "tests/data/real_jobs lost a recording"
    for layout in ("fsdp", "hsdp", "dtensor", "varying"):
        assert {r.fault for r in recordings() if f"-{layout}" in r.path.name} == {"none", *FAULTS}, layout
    assert any(r.fault == "none" and "-pipe" in r.path.name for r in recordings()), "the pipeline's"
