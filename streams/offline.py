"""The stream stages in-process, without Kafka: the same windower and differential code.

Used by ``fleetscope analyze`` (trace files), the quality bench and tests. Memory stays bounded
by the windowers' open steps plus one iteration's patterns per job that is still waiting for ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from fleetscope.schemas import EventBatch, IntakeLimits
from fleetscope.schemas.fields import as_float
from fleetscope.streams.analysis.differential import DifferentialConfig
from fleetscope.streams.analysis.signals import OutlierScorer
from fleetscope.streams.analysis.windowing import ClosedIteration, RankWindower, WindowerConfig
from fleetscope.streams.differential import DifferentialStage
from fleetscope.streams.scoring import ScoringPool
from fleetscope.streams.windower import WindowerStage, stall_records, summarized

log = logging.getLogger(__name__)


@dataclass
class OfflineResult:
    iterations: list[dict[str, object]] = field(default_factory=list)
    finding_updates: list[dict[str, object]] = field(default_factory=list)
    late_events: int = 0
    dead_letters: list[str] = field(default_factory=list)
    """Why each refused batch or record was refused, as the worker's dead-letter topic would say."""

    @property
    def findings(self) -> list[dict[str, object]]:
        """Latest state of each finding, by estimated loss (largest first)."""
        latest: dict[str, dict[str, object]] = {}
        for rec in self.finding_updates:
            latest[str(rec["finding_id"])] = rec
        return sorted(latest.values(), key=lambda f: -as_float(f["est_loss_ns"]))


class OfflinePipeline:
    """Feed raw batches in any order per rank; ``finish()`` closes everything and returns results.

    Runs the worker's own stage classes, so a batch the worker would dead-letter is refused here too
    (its reason lands in ``OfflineResult.dead_letters``)."""

    def __init__(
        self,
        windower: WindowerConfig | None = None,
        differential: DifferentialConfig | None = None,
        scorer: OutlierScorer | None = None,
        keep_patterns: bool = False,
        limits: IntakeLimits | None = None,
        scoring_processes: int = 0,
    ) -> None:
        """``scoring_processes``: iterations scored by a pool of that many processes (``streams.scoring``),
        closed by ``finish``; the findings are the same."""
        # Offline input is complete and read in order: no backlog, so no processing-time silence to wait for.
        self.windower_config = replace(windower or WindowerConfig(), stall_silence_ms=0)
        self.windower = WindowerStage(self.windower_config, limits or IntakeLimits())
        # A trace is recorded after the job's warm-up (a profiler schedule waits and warms up first), so it
        # is judged from its first iteration; only a live stream sees the warm-up itself.
        judged = differential or DifferentialConfig()
        judged = replace(judged, noise=replace(judged.noise, warmup_iterations=0))
        pool = ScoringPool(scoring_processes, judged) if scoring_processes else None
        self.differential = DifferentialStage(judged, scorer, pool)
        self.differential_config = self.differential.config
        self.keep_patterns = keep_patterns
        self.patterns: list[dict[str, object]] = []
        self.result = OfflineResult()

    def add(self, batch: EventBatch, now_ns: int = 0) -> None:
        taken = self.windower.take_batch(batch, now_ns, time.time_ns())
        if taken.reason is not None:
            self._refused(taken.reason, f"a {batch.kind.value} batch of {batch.header.job} rank {batch.header.rank}")
            return
        self._take(taken.closed)
        if taken.windower is not None:
            self._take_stalls(taken.windower)

    def add_all(self, batches: Iterable[EventBatch]) -> OfflinePipeline:
        for batch in batches:
            self.add(batch)
        return self

    def close_rank(self, job: str, rank: int) -> None:
        """The rank's input is complete (e.g. its trace file ended): close its open steps now."""
        closed, w = self.windower.close_rank((job, rank))
        if w is not None:
            self._take(closed)
            self._take_stalls(w)
            self.result.late_events += w.counters.late_events

    def finish(self) -> OfflineResult:
        """Close every rank and flush every job; the pipeline's scoring processes end."""
        try:
            for job, rank in list(self.windower.windowers):
                self.close_rank(job, rank)
            for job in list(self.differential.jobs):
                self.result.finding_updates += self.differential.flush(job)
        finally:
            self.differential.pool.close()
        return self.result

    def _apply(self, subject: str, record: dict[str, object]) -> None:
        taken = self.differential.apply(subject, record, None)
        if taken.reason is not None:
            self._refused(taken.reason, f"a {subject} record of {record['job']}")
        self.result.finding_updates += taken.findings + self.differential.collect()
        refused, self.differential.rejected = self.differential.rejected, []
        for r in refused:
            self._refused(r.reason or "", f"a patterns record of {r.job}, iteration {r.iteration}")

    def _refused(self, reason: str, what: str) -> None:
        """Note what the worker would dead-letter; the first of each kind of reason is logged."""
        short = reason.split(":", 1)[0]
        if not any(r.split(":", 1)[0] == short for r in self.result.dead_letters):
            log.warning("refused %s (the worker would dead-letter it): %s", what, reason)
        self.result.dead_letters.append(reason)

    def _take_stalls(self, w: RankWindower) -> None:
        for rec in stall_records([w]):
            self._apply("stall", dict(rec))

    def _take(self, closed: list[ClosedIteration]) -> None:
        for c in summarized(closed)[0]:  # a failed one is logged where it failed
            self.result.iterations.append(c.iteration)
            if self.keep_patterns:
                self.patterns.append(c.patterns)
            self._apply("patterns", c.patterns)
