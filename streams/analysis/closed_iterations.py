"""A rank's finished iteration, handed out before its statistics are computed, and the batch that computes them.

Split from ``windowing`` (which cuts iterations) because the statistics are computed elsewhere: by the
windower agent for every iteration a batch closed, of any ranks, in one numpy pass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from fleetscope.streams.analysis.patterns import IterationEvents, summarize_iterations

log = logging.getLogger(__name__)


class ClosedIteration:
    """A finished iteration of one rank: its iteration record and pattern record, Avro-ready dicts.

    The windower hands iterations out before their statistics are computed, so that ``summarize_closed``
    computes those of many iterations, of any ranks, in one numpy pass; reading ``iteration`` or
    ``patterns`` first computes this one alone. ``job``, ``rank``, ``step`` and ``end_ns`` are known at
    once (replay checks need no statistics)."""

    __slots__ = ("_pending", "_records", "end_ns", "error", "job", "rank", "step")

    def __init__(self, iteration: dict[str, Any], patterns: dict[str, Any]) -> None:
        self.job, self.rank = str(iteration["job"]), int(iteration["rank"])
        self.step, self.end_ns = int(iteration["iteration"]), int(iteration["end_ns"])
        self._records: tuple[dict[str, Any], dict[str, Any]] | None = (iteration, patterns)
        self._pending: tuple[IterationEvents, dict[str, Any], str] | None = None
        self.error: str | None = None
        """Why its statistics could not be computed (a bug met by odd events): it has no records."""

    @classmethod
    def pending(cls, events: IterationEvents, who: dict[str, Any], detected_by: str) -> ClosedIteration:
        closed = cls.__new__(cls)
        closed.job, closed.rank = str(who.get("job", "")), int(who.get("rank", -1))
        closed.step, closed.end_ns = events.step, events.end_ns
        closed._records, closed._pending, closed.error = None, (events, who, detected_by), None
        return closed

    @property
    def iteration(self) -> dict[str, Any]:
        return self._summarized()[0]

    @property
    def patterns(self) -> dict[str, Any]:
        return self._summarized()[1]

    def _summarized(self) -> tuple[dict[str, Any], dict[str, Any]]:
        summarize_closed([self])
        if self._records is None:
            raise RuntimeError(f"iteration {self.step} of {self.job} rank {self.rank}: {self.error}")
        return self._records


def summarize_closed(closed: Iterable[ClosedIteration]) -> list[ClosedIteration]:
    """Compute the records of every iteration of ``closed`` not computed yet, in one batch; return those
    whose statistics failed (each then tried alone, so one odd iteration costs itself, not the batch)."""
    todo = [c for c in closed if c._pending is not None]
    if not todo:
        return []
    try:
        summaries = summarize_iterations([c._pending[0] for c in todo])  # type: ignore[index]
    except Exception as exc:
        if len(todo) == 1:
            log.warning("iteration %d of %s rank %d lost: its statistics failed: %r", todo[0].step,
                        todo[0].job, todo[0].rank, exc)  # fmt: skip
            todo[0]._pending, todo[0].error = None, repr(exc)
            return todo
        return [failed for c in todo for failed in summarize_closed([c])]
    for c, (figures, patterns) in zip(todo, summaries, strict=True):
        events, who, detected_by = c._pending  # type: ignore[misc]
        iteration = {**who, "detected_by": detected_by, **figures, "functions": len(patterns["function"])}
        record = {**who, "iteration": events.step}
        for key, value in patterns.items():
            record[key] = value.tolist() if isinstance(value, np.ndarray) else value
        c._records, c._pending = (iteration, record), None
    return []
