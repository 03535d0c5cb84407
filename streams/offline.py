"""The stream stages in-process, without Kafka: the same windower and differential code.

Used by ``fleetscope analyze`` (trace files), the quality bench and tests. Memory stays bounded
by the windowers' open steps plus one iteration's patterns per job that is still waiting for ranks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from fleetscope.schemas import EventBatch
from fleetscope.streams.analysis.differential import DifferentialConfig, JobDifferential
from fleetscope.streams.analysis.outliers import OutlierScorer
from fleetscope.streams.analysis.windowing import ClosedIteration, RankWindower, WindowerConfig, summarize_closed


@dataclass
class OfflineResult:
    iterations: list[dict[str, Any]] = field(default_factory=list)
    finding_updates: list[dict[str, Any]] = field(default_factory=list)
    late_events: int = 0

    @property
    def findings(self) -> list[dict[str, Any]]:
        """Latest state of each finding, by estimated loss (largest first)."""
        latest: dict[str, dict[str, Any]] = {}
        for rec in self.finding_updates:
            latest[rec["finding_id"]] = rec
        return sorted(latest.values(), key=lambda f: -f["est_loss_ns"])


class OfflinePipeline:
    """Feed raw batches in any order per rank; ``finish()`` closes everything and returns results."""

    def __init__(
        self,
        windower: WindowerConfig | None = None,
        differential: DifferentialConfig | None = None,
        scorer: OutlierScorer | None = None,
        keep_patterns: bool = False,
    ) -> None:
        # Offline input is complete and read in order: no backlog, so no processing-time silence to wait for.
        self.windower_config = replace(windower or WindowerConfig(), stall_silence_ms=0)
        self.differential_config = differential or DifferentialConfig()
        self.scorer = scorer
        self.keep_patterns = keep_patterns
        self.patterns: list[dict[str, Any]] = []
        self.result = OfflineResult()
        self._windowers: dict[tuple[str, int], RankWindower] = {}
        self._jobs: dict[str, JobDifferential] = {}

    def add(self, batch: EventBatch, now_ns: int = 0) -> None:
        key = (batch.header.job, batch.header.rank)
        w = self._windowers.get(key)
        if w is None:
            w = self._windowers[key] = RankWindower(self.windower_config)
        self._take(w.add(batch, now_ns))
        self._take_progress(w)

    def add_all(self, batches: Iterable[EventBatch]) -> OfflinePipeline:
        for batch in batches:
            self.add(batch)
        return self

    def close_rank(self, job: str, rank: int) -> None:
        """The rank's input is complete (e.g. its trace file ended): close its open steps now."""
        w = self._windowers.pop((job, rank), None)
        if w is not None:
            self._take(w.flush())
            self._take_progress(w)
            self.result.late_events += w.counters.late_events

    def finish(self) -> OfflineResult:
        for job, rank in list(self._windowers):
            self.close_rank(job, rank)
        for jd in self._jobs.values():
            self.result.finding_updates += jd.flush()
        return self.result

    def _job(self, job: str) -> JobDifferential:
        jd = self._jobs.get(job)
        if jd is None:
            jd = self._jobs[job] = JobDifferential(job, self.differential_config, self.scorer)
        return jd

    def _take_progress(self, w: RankWindower) -> None:
        for rec in w.take_progress():
            self.result.finding_updates += self._job(rec["job"]).add_progress(rec)

    def _take(self, closed: list[ClosedIteration]) -> None:
        summarize_closed(closed)
        for c in closed:
            if c.error is not None:  # logged where it failed
                continue
            self.result.iterations.append(c.iteration)
            if self.keep_patterns:
                self.patterns.append(c.patterns)
            self.result.finding_updates += self._job(c.patterns["job"]).add(c.patterns)
