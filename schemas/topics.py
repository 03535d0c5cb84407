"""Topic names, keys and partitioning: the one place that knows them."""

from __future__ import annotations

from dataclasses import dataclass

from fleetscope.schemas.records import EventKind


@dataclass(frozen=True, kw_only=True)
class Topics:
    """Every topic of the pipeline. Raw topics are keyed ``job/rank`` and co-partitioned."""

    prefix: str = "fleetscope"

    def raw(self, kind: EventKind) -> str:
        return f"{self.prefix}.{kind.value}"

    @property
    def raw_all(self) -> tuple[str, ...]:
        return tuple(self.raw(k) for k in EventKind)

    @property
    def iterations(self) -> str:
        return f"{self.prefix}.iterations"

    @property
    def patterns(self) -> str:
        return f"{self.prefix}.patterns"

    @property
    def stalls(self) -> str:
        """Windowers' rank stall/resume reports, key ``job``: partitioned like ``patterns`` (the job's differential)."""
        return f"{self.prefix}.stalls"

    @property
    def findings(self) -> str:
        return f"{self.prefix}.findings"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}.deadletter"

    @property
    def control(self) -> str:
        return f"{self.prefix}.control"

    @property
    def heartbeats(self) -> str:
        """Producers' heartbeats, key ``job``: partitioned like ``patterns`` so the job's differential reads them."""
        return f"{self.prefix}.heartbeats"

    @property
    def score_requests(self) -> str:
        """A job's iterations for scoring (``streams.score_across_workers``), partitioned by iteration stripe."""
        return f"{self.prefix}.score-requests"

    @property
    def scores(self) -> str:
        """The scores of ``score_requests``, key ``job``, sent to the job's patterns partition (its head)."""
        return f"{self.prefix}.scores"

    @property
    def derived_all(self) -> tuple[str, ...]:
        """Topics keyed by job or derived from raw events: created with the derived partition count."""
        return (
            self.iterations,
            self.patterns,
            self.stalls,
            self.findings,
            self.deadletter,
            self.control,
            self.heartbeats,
            self.score_requests,
            self.scores,
        )


def rank_key(job: str, rank: int) -> bytes:
    """Key of raw, iteration and pattern messages: a rank's streams meet in one partition."""
    return f"{job}/{rank}".encode()


def job_key(job: str) -> bytes:
    """Key of findings: one job's findings stay in order."""
    return job.encode()
