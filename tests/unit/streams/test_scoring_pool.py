"""A job's iterations scored by a pool of processes (``streams.scoring``): a message the pool cannot decode
comes back with its reason, the job's state covers only the iterations tracked, and a killed process costs
nothing. That the pool finds exactly what scoring in the worker finds, on four layouts (``JOBS``), is tested
with the scorers across workers, on the same jobs, in tests/integration/test_striped_scoring.py."""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import encode
from fleetscope.streams.analysis.differential import DifferentialConfig
from fleetscope.streams.differential import DifferentialStage
from fleetscope.streams.offline import OfflinePipeline
from fleetscope.streams.scoring import ScoringPool

JOBS = {
    "gpu+host, flat": dict(ranks=16, faults=("slow_gpu:6:1.4", "host_slow:11:1.5")),
    "link+pcie, tp2 pp2": dict(ranks=16, tp=2, pp=2, faults=("slow_link:9:1.3", "pcie_downgrade:12:1.5")),
    "stage + stall, pp4": dict(ranks=16, pp=4, faults=("stage_imbalance:2:1.3", "dataloader_stall:5:1.5")),
    "healthy, dp2 tp2 pp2": dict(ranks=8, tp=2, pp=2, faults=()),
}


@pytest.fixture(scope="module")
def pool() -> Iterator[ScoringPool]:
    scoring = ScoringPool(3, DifferentialConfig())
    yield scoring
    scoring.close()


def messages(name: str, iterations: int = 24) -> list[bytes]:
    spec = JOBS[name]
    cfg = SimulatorConfig(
        job="pool", iterations=iterations, seed=11, **{**spec, "faults": tuple(map(parse_fault, spec["faults"]))}
    )
    pipeline = OfflinePipeline(keep_patterns=True).add_all(simulate(cfg))
    pipeline.finish()
    return [encode("patterns", p) for p in pipeline.patterns]


def run(stage: DifferentialStage, batch: list[bytes]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(batch):
        taken = stage.take(message, None, source=i)
        assert taken.reason is None
        out += taken.findings + stage.collect()
    out += stage.flush("pool")
    return [{k: v for k, v in u.items() if k != "emitted_ns"} for u in out]


def test_a_message_the_pool_cannot_decode_comes_back_with_its_reason_and_its_iteration_is_scored(
    pool: ScoringPool,
) -> None:
    batch = messages("gpu+host, flat", iterations=6)
    damaged = len(batch) // 2
    batch[damaged] = batch[damaged][:-40]  # its head whole, its arrays cut
    stage = DifferentialStage(pool=pool)
    run(stage, batch)
    assert [(t.source, t.reason is not None and t.reason.startswith("schema:")) for t in stage.rejected] == [
        (damaged, True)
    ]
    jd = stage.jobs["pool"]
    assert jd.scored_upto == 5 and jd.iterations_scored == 6


def test_the_jobs_state_covers_the_iterations_tracked_not_those_still_being_scored(pool: ScoringPool) -> None:
    batch = messages("gpu+host, flat", iterations=8)
    stage = DifferentialStage(pool=pool)
    half = len(batch) // 2
    for i, message in enumerate(batch[:half]):
        stage.take(message, None, source=i)
    stage.collect(wait={"pool"})  # those tracked
    for i, message in enumerate(batch[half : half + len(batch) // 4], start=half):
        stage.take(message, None, source=i)  # those with the pool: not collected
    jd = stage.jobs["pool"]
    tracked, in_flight = jd.scored_upto, stage.scoring["pool"][0].iteration
    assert 0 <= tracked < in_flight
    saved = pickle.dumps(jd)  # what a state record holds now; the worker dies
    restarted = DifferentialStage(pool=pool)
    restarted.jobs["pool"] = pickle.loads(saved)
    assert restarted.jobs["pool"].scored_upto == tracked
    # the replay brings every message not covered: those of the iteration that was with the pool are taken again
    replayed = run(restarted, batch)
    assert restarted.jobs["pool"].late_records == sum(1 for m in batch if _iteration(m) <= tracked)
    full = run(DifferentialStage(), batch)
    assert [u for u in replayed if u["iteration_last"] > tracked] == [u for u in full if u["iteration_last"] > tracked]


def _iteration(message: bytes) -> int:
    from fleetscope.schemas.codec import decode_head

    head = decode_head(message)[1]
    assert head is not None
    return int(head["iteration"])


def test_a_pool_takes_no_scorer_of_its_own(pool: ScoringPool) -> None:
    with pytest.raises(ValueError, match="configured scorer"):
        DifferentialStage(scorer=lambda x, abs_scale_floor=0.0: None, pool=pool)  # type: ignore[arg-type, return-value]


def test_a_scoring_process_killed_mid_run_costs_nothing_its_pools_iterations_are_scored_again() -> None:
    """A process of the pool dies (the kernel's OOM killer, an operator): the pool is broken, every iteration
    it had fails; the stage sends them again to a fresh pool, and the job's findings are unchanged."""
    batch = messages("gpu+host, flat")
    alone = run(DifferentialStage(), batch)
    pool = ScoringPool(2, DifferentialConfig())
    try:
        stage = DifferentialStage(pool=pool)
        out: list[dict[str, Any]] = []
        killed = False
        for i, message in enumerate(batch):
            out += stage.take(message, None, source=i).findings
            if not killed and len(stage.in_flight()) >= 3:
                stage.in_flight()[-1].exception(timeout=60)  # the pool has started its processes
                os.kill(next(iter(pool._executor._processes)), signal.SIGKILL)  # noqa: SLF001
                killed = True
            elif killed:
                out += stage.collect()
        out += stage.flush("pool")
        assert killed and pool.restarts >= 1
        assert [{k: v for k, v in u.items() if k != "emitted_ns"} for u in out] == alone
    finally:
        pool.close()
