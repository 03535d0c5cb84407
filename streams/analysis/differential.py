"""The differential stage for one job: gather each iteration's patterns from all ranks, score, track."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fleetscope.streams.analysis.findings import FindingTracker, LifecycleConfig
from fleetscope.streams.analysis.outliers import OutlierScorer, ScoringConfig, peer_groups, score_peer_group


@dataclass(frozen=True, kw_only=True)
class DifferentialConfig:
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    missing_rank_wait_iterations: int = 3
    """An iteration still missing ranks is scored anyway once this many later iterations are complete."""


class JobDifferential:
    """Collects pattern records per iteration and scores each iteration once, in order."""

    def __init__(
        self, job: str, config: DifferentialConfig | None = None, scorer: OutlierScorer | None = None
    ):
        self.job = job
        self.config = config or DifferentialConfig()
        self.scorer = scorer
        self.tracker = FindingTracker(job, self.config.lifecycle)
        self._pending: dict[int, dict[int, dict[str, Any]]] = {}
        self._world_size = 0
        self._scored_upto = -(2**62)
        self.iterations_scored = 0
        self.late_records = 0

    def add(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one rank's pattern record; return finding records ready to emit."""
        it = int(record["iteration"])
        if it <= self._scored_upto:
            self.late_records += 1
            return []
        self._world_size = max(self._world_size, int(record["world_size"]))
        self._pending.setdefault(it, {})[int(record["rank"])] = record
        return self._score_ready()

    def flush(self) -> list[dict[str, Any]]:
        """Score every pending iteration with the ranks it has, then report open findings' state."""
        out: list[dict[str, Any]] = []
        for it in sorted(self._pending):
            out += self._score(it)
        return out + self.tracker.flush()

    def _complete(self, it: int) -> bool:
        return len(self._pending[it]) >= self._world_size

    def _score_ready(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        wait = self.config.missing_rank_wait_iterations
        while self._pending:
            first = min(self._pending)
            if not self._complete(first):
                later_complete = sum(1 for it in self._pending if it > first and self._complete(it))
                if later_complete < wait:
                    break
            out += self._score(first)
        return out

    def _score(self, it: int) -> list[dict[str, Any]]:
        records = list(self._pending.pop(it).values())
        self._scored_upto = it
        self.iterations_scored += 1
        signals = []
        for group in peer_groups(records):
            signals += score_peer_group(group, self.config.scoring, self.scorer)
        return self.tracker.observe(it, signals)
