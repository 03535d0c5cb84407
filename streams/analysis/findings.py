"""Finding lifecycle: persistence before a finding opens, recovery before it closes.

A finding opens when its subject was flagged in ``persist_iterations`` of the last
``window_iterations`` evaluated iterations (so intermittent faults are caught and one-off glitches
are not), and closes after ``recover_iterations`` clear iterations in a row.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from fleetscope.schemas.categories import JOB_LEVEL
from fleetscope.streams.analysis.outliers import RankSignal
from fleetscope.streams.settings import LifecycleConfig

_JOB_LEVEL = JOB_LEVEL
"""Categories about the job as a whole rather than some of its ranks."""


@dataclass(slots=True)
class _Track:
    flags: deque[int]
    recent: list[tuple[int, RankSignal]] = field(default_factory=list)
    clear_run: int = 0
    finding_id: str = ""
    iteration_first: int = 0
    iteration_last: int = 0
    emitted_iteration: int = 0
    version: int = 0
    loss_sum: float = 0.0
    flagged: int = 0
    best: RankSignal | None = None


class FindingTracker:
    """Turns per-iteration signals of one job into open/update/closed finding records."""

    def __init__(self, job: str, config: LifecycleConfig | None = None) -> None:
        self.job = job
        self.config = config or LifecycleConfig()
        self._tracks: dict[tuple[str, str], _Track] = {}
        self.gpus: dict[int, tuple[int, str]] = {}
        """Rank -> (local rank, GPU UUID), as its records say: a rank finding names the device to drain."""

    def __setstate__(self, state: dict[str, object]) -> None:
        """A tracker saved before ``gpus`` existed restores with none known."""
        self.__dict__.update(state)
        self.__dict__.setdefault("gpus", {})

    def observe(
        self, iteration: int, signals: list[RankSignal], blind: Collection[str] = ()
    ) -> list[dict[str, object]]:
        """Feed one evaluated iteration (in order); return finding records to emit. Categories in ``blind``
        could not be judged in this iteration: their findings are neither flagged nor cleared by it."""
        cfg = self.config
        out: list[dict[str, object]] = []
        flagged = {sig.key(): sig for sig in signals}
        for key, sig in flagged.items():
            tr = self._tracks.get(key)
            if tr is None:
                tr = self._tracks[key] = _Track(flags=deque(maxlen=cfg.window_iterations))
            tr.flags.append(iteration)
            tr.clear_run = 0
            tr.recent = [(i, s) for i, s in tr.recent if i > iteration - cfg.window_iterations] + [(iteration, sig)]
            if tr.finding_id:
                self._accumulate(tr, sig, iteration)
                if iteration - tr.emitted_iteration >= cfg.update_every:
                    out.append(self._record(tr, "update", iteration))
            elif sum(1 for i in tr.flags if i > iteration - cfg.window_iterations) >= cfg.persist_iterations:
                tr.iteration_first = tr.recent[0][0]
                subject = sig.subject or f"rank:{sig.rank}"
                tr.finding_id = f"{self.job}/{sig.category}/{subject}/{tr.iteration_first}"
                tr.loss_sum, tr.flagged, tr.best = 0.0, 0, None
                for i, s in tr.recent:
                    self._accumulate(tr, s, i)
                out.append(self._record(tr, "open", iteration))
        for key, tr in list(self._tracks.items()):
            if key in flagged or key[1] in blind:
                continue
            tr.clear_run += 1
            if tr.finding_id and tr.clear_run >= cfg.recover_iterations:
                out.append(self._record(tr, "closed", iteration))
                del self._tracks[key]
            elif not tr.finding_id and tr.clear_run >= cfg.window_iterations:
                del self._tracks[key]
        return out

    def emit_now(self, sig: RankSignal, iteration: int) -> list[dict[str, object]]:
        """Open (or update) a finding immediately, for conditions that already include persistence."""
        key = sig.key()
        tr = self._tracks.get(key)
        if tr is None:
            tr = self._tracks[key] = _Track(flags=deque([iteration], maxlen=self.config.window_iterations))
        if not tr.finding_id:
            tr.iteration_first = iteration
            tr.finding_id = f"{self.job}/{sig.category}/{sig.subject or f'rank:{sig.rank}'}/{iteration}"
            self._accumulate(tr, sig, iteration)
            return [self._record(tr, "open", iteration)]
        self._accumulate(tr, sig, iteration)
        return [self._record(tr, "update", iteration)]

    def flush(self) -> list[dict[str, object]]:
        """Latest state of every open finding whose last emitted record is stale."""
        return [
            self._record(tr, "update", tr.iteration_last)
            for tr in self._tracks.values()
            if tr.finding_id and tr.emitted_iteration < tr.iteration_last
        ]

    def peers_explain(self, iteration: int) -> bool:
        """Whether a rank, host or stage stands out persistently (open, or flagged as often as a finding needs
        to open) within the window up to ``iteration``: a job-wide slowdown then has a cause among the peers
        (the others wait for it) and is not a regression of the job itself. One-off flags do not count."""
        since = iteration - self.config.window_iterations
        need = self.config.persist_iterations
        return any(
            category not in _JOB_LEVEL and (tr.finding_id or sum(1 for i in tr.flags if i > since) >= need)
            for (_, category), tr in self._tracks.items()
        )

    def close_all(self, reason: str, iteration: int | None = None) -> list[dict[str, object]]:
        """Close every open finding now (``reason``: "job_ended") and forget every track."""
        out = []
        for tr in self._tracks.values():
            if tr.finding_id:
                out.append(self._record(tr, "closed", tr.iteration_last if iteration is None else iteration, reason))
        self._tracks.clear()
        return out

    def is_open(self, key: tuple[str, str]) -> bool:
        """Whether the subject's finding of this category is open (opened, and not closed since)."""
        tr = self._tracks.get(key)
        return tr is not None and bool(tr.finding_id)

    def open_findings(self, category: str | None = None, function: str | None = None) -> int:
        """How many findings are open (of ``category``, and on ``function``, when given)."""
        return sum(
            1
            for (_, cat), tr in self._tracks.items()
            if tr.finding_id
            and category in (None, cat)
            and (function is None or (tr.best is not None and tr.best.function == function))
        )

    @staticmethod
    def _accumulate(tr: _Track, sig: RankSignal, iteration: int) -> None:
        tr.iteration_last = max(tr.iteration_last, iteration)
        tr.loss_sum += sig.loss_ns
        tr.flagged += 1
        if tr.best is None or abs(sig.score) >= abs(tr.best.score):
            tr.best = sig

    def _record(self, tr: _Track, status: str, iteration: int, reason: str = "recovered") -> dict[str, object]:
        sig = tr.best or tr.recent[-1][1]
        tr.version += 1
        tr.emitted_iteration = iteration
        evidence = dict(sig.evidence, flagged_iterations=tr.flagged)
        return {
            "finding_id": tr.finding_id,
            "status": status,
            "version": tr.version,
            "job": self.job,
            "rank": sig.rank,
            "ranks": list(sig.member_ranks()),
            "host": sig.host,
            "category": sig.category,
            "function": sig.function,
            "metric": sig.metric,
            "value": sig.value,
            "peer_median": sig.peer_median,
            "score": sig.score,
            "iteration_first": tr.iteration_first,
            "iteration_last": tr.iteration_last,
            "est_loss_ns": int(tr.loss_sum / max(tr.flagged, 1)),
            "evidence": json.dumps(evidence, sort_keys=True, default=float),
            "emitted_ns": time.time_ns(),
            "subject": sig.subject or f"rank:{sig.rank}",
            "reason": reason if status == "closed" else "",
            **self._gpu(sig.rank),
        }

    def _gpu(self, rank: int) -> dict[str, object]:
        local_rank, uuid = self.gpus.get(rank, (-1, "")) if rank >= 0 else (-1, "")
        return {"local_rank": local_rank, "gpu_uuid": uuid}
