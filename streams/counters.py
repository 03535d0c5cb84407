"""The stream worker's counters (exported as metrics by ``telemetry``) and its consumer lag."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar


@dataclass
class StageCounters:
    raw_batches: int = 0
    raw_events: int = 0
    dead_letters: int = 0
    iterations: int = 0
    lost_iterations: int = 0
    """Closed iterations whose statistics failed (each logged): nothing is sent for them."""
    incomplete_iterations: int = 0
    """Steps closed before all their streams arrived (too many open while one was quiet), current ranks."""
    pattern_records: int = 0
    iterations_scored_in_pool: int = 0
    """Iterations sent to the scoring processes (``streams.scoring_processes``)."""
    findings: int = 0
    per_reason: dict[str, int] = field(default_factory=dict)
    profile_requests_suppressed: int = 0
    held_messages: int = 0
    state_writes: int = 0
    states_restored: int = 0
    replayed_skipped: int = 0
    consumer_lag: int = -1
    """Messages between the committed offsets and the partition ends, every 10 s (-1 until known). On Tansu
    the end offset is the last batch's base offset + 1, so the figure there is a lower bound."""

    def dead_letter(self, reason: str) -> None:
        """Count one dead-lettered message under its reason's prefix (``schema``, ``value``, ...)."""
        self.dead_letters += 1
        short = reason.split(":", 1)[0]
        self.per_reason[short] = self.per_reason.get(short, 0) + 1


P = TypeVar("P")
"""A partition, however the client names it."""


def consumer_lag(end_offsets: Mapping[P, int] | None, committed_offsets: Mapping[P, int | None] | None) -> int:
    """Sum over partitions of end offset minus committed offset; -1 when no partition has both yet."""
    committed = dict(committed_offsets or {})
    ends = dict(end_offsets or {})
    lags = [max(0, int(end) - int(done)) for tp, end in ends.items() if (done := committed.get(tp)) is not None]
    return sum(lags) if lags else -1
