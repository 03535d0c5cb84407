"""A stream worker killed (SIGKILL) mid-run and restarted stores exactly what an uninterrupted run stores:
state comes back from the state topics, and what was in memory is re-read from uncommitted offsets."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetscope.config import Config
from fleetscope.producers import simulate
from fleetscope.stack import StreamWorkerProcess
from fleetscope.streams.offline import OfflinePipeline
from fleetscope.streams.recovery import JobState, dump_job_state
from tests.integration.worker_runs import (
    MOVING_JOB,
    QUICK_HANDOVER,
    Outcome,
    Publishing,
    Step,
    join,
    kill,
    run_config,
    run_pipeline,
)

pytestmark = pytest.mark.integration


def _a_third_stored(_publishing: Publishing, rows: int) -> bool:
    """The worker holds state worth losing: a third of the job's iterations are stored."""
    return rows >= MOVING_JOB.expected_rows // 3


def _killed_and_restarted(config: Config, one_worker_run: Outcome) -> Outcome:
    """``MOVING_JOB`` through one worker, SIGKILLed once a third is stored and restarted: it must store
    exactly what the uninterrupted run stored."""
    worker = StreamWorkerProcess(config)
    killed = run_pipeline(config, MOVING_JOB, [worker], [Step(kill, [worker]), Step(join, [worker])], _a_third_stored)
    assert 0 < killed.acted_at_rows < MOVING_JOB.expected_rows, "the worker must die mid-run"
    assert killed.counts == one_worker_run.counts
    assert killed.updates == one_worker_run.updates
    assert killed.findings == one_worker_run.findings
    return killed


def test_a_worker_killed_mid_run_and_restarted_stores_exactly_what_a_clean_run_stores(
    tmp_path: Path, chdb_path: Path, broker: str, one_worker_run: Outcome
) -> None:
    config = run_config(tmp_path, broker, f"chdb://{chdb_path}", **QUICK_HANDOVER)
    killed = _killed_and_restarted(config, one_worker_run)
    print(
        f"\nrestart (kill to ready) {killed.act_s:.1f} s at {killed.acted_at_rows}/{MOVING_JOB.expected_rows} rows; "
        f"sink consumed {killed.sink_messages} messages vs {one_worker_run.sink_messages} "
        f"({killed.sink_messages - one_worker_run.sink_messages} re-emitted, dropped by natural key); "
        f"counts {killed.counts}"
    )


def test_a_worker_scoring_in_processes_with_its_state_in_chunks_killed_mid_run_stores_what_a_clean_run_stores(
    tmp_path: Path, chdb_path: Path, broker: str, one_worker_run: Outcome
) -> None:
    """With ``streams.scoring_processes`` the job's iterations are decoded and scored by a pool beside the
    worker and tracked in order; its state records cover only iterations tracked, so the iterations the
    pool had when the worker died are replayed, and the run stores what the one-process run stores.

    In the same run, a large job's differential state (megabytes at a thousand ranks: more than a Kafka
    message may hold) goes in chunks; here the job is small and the chunks are too (1 KiB), so each of its
    state records is dozens of chunks, and the restarted worker restores the job from them. (One run for
    both: they were two runs of 30-40 s.)"""
    pipeline = OfflinePipeline().add_all(simulate(MOVING_JOB.sim))
    pipeline.finish()
    state = dump_job_state(JobState(job=pipeline.differential.jobs["moving-job"], progress_offset=-1, flushed=False))
    assert len(state) > 8 * 1024  # chunked: the test tests something
    settings = {"streams.scoring_processes": 2, "streams.state_chunk_bytes": 1024}
    _killed_and_restarted(
        run_config(tmp_path, broker, f"chdb://{chdb_path}", **QUICK_HANDOVER, **settings), one_worker_run
    )
