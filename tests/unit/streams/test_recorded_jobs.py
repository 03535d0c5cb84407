"""Real 4-rank PyTorch jobs (gloo on 2 shared cores, beside the stack), replayed from what their windowers
published (tests/data/real_jobs, ``recorded_jobs``): real arrivals, not the simulator's.

Three healthy ones each gave a false straggler before the arrival rule asked for the margin against each
peer: 4 ranks on 2 cores pair up per core, and the pair on the busier core arrives late together for a
dozen iterations (iterations 90, 190 and 212). The fourth (none-e519c9, recorded with each step's run-queue
wait) gave a false ``job_regression`` at iteration 21 on its steps' time: the broker, worker and store took
their share of the 2 cores, and its steps less that wait show no step. The faulty ones (from step 30) must
be named within 10 iterations, and no other rank: the 3x-forward rank aa8c5d was named at iteration 41
before the summed lead (``noise._leads``); slowdown-2f5da0, every rank's forward 4 times over, is the
job's own regression, wait included. The ``fsdp`` ones shard the model with FSDP2, the ``dtensor`` ones split
it with DTensor's tensor parallelism: FSDP2's all-gathers and reduce-scatters, and DTensor's all-reduce, are
the collectives the ranks meet at (before the hook timed them, such jobs had none). The ``hsdp`` ones shard
it in pairs, replicated over the pairs: every group a pair, each with collectives of several sizes, and the
wait at whichever comes first (the 3x-forward rank was named by nothing while pairs were read per collective).
The ``varying`` ones accumulate gradients over micro-batches of random lengths: a different rank is last
each step. In none-varying8bd1aa (CPU burners beside it, 60 % of its steps waiting for a CPU), rank 2 is
behind each peer in 11 of 12 steps around step 127 for want of a CPU: no straggler (``_late_throughout``).
In none-pipe2fa0f8, the real-job test's pipeline by hand (dp2 x pp2), rank 1 is late in its data pair by
12.5 ms around step 209, 8 ms of them waiting for a CPU while its core mate ran: no straggler (no one-pair
straggler where run-queue waits are measured)."""

from __future__ import annotations

from typing import Any

import pytest
from recorded_jobs import FAULTS, Recording, missed_bar, recordings

from fleetscope.streams.differential import DifferentialStage


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


def test_the_recordings_are_there() -> None:
    assert {r.fault for r in recordings()} == {"none", *FAULTS}, "tests/data/real_jobs lost a recording"
    for layout in ("fsdp", "hsdp", "dtensor", "varying"):
        assert {r.fault for r in recordings() if f"-{layout}" in r.path.name} == {"none", *FAULTS}, layout
