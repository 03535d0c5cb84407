"""Job-level checks: a job compared with its own history (regression) and with progress (hang).

Nothing stands out among peers when every rank slows down alike or when the whole job stops, so
these checks do not use peers. Regression follows PerfTracker: the recent iteration time against
the recent best; a rolling median keeps one-off pauses (checkpoints) from counting. Hang: every
rank has stopped progressing for ``stall_factor`` mean iterations while its clock (hardware samples,
or processing time) moves on; the rank that stopped first is the culprit. Each rank's stall is
measured on its own clock, so clock skew between hosts does not matter.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetscope.streams.analysis.outliers import RankSignal


@dataclass(frozen=True, kw_only=True)
class JobLevelConfig:
    recent_iterations: int = 8
    history_iterations: int = 50
    regression_threshold: float = 0.05
    stall_factor: float = 5.0

    def __post_init__(self) -> None:
        if self.recent_iterations < 1 or self.history_iterations < self.recent_iterations:
            raise ValueError("need 1 <= recent_iterations <= history_iterations")
        if self.regression_threshold <= 0 or self.stall_factor <= 1:
            raise ValueError("regression_threshold must be > 0 and stall_factor > 1")


class RegressionCheck:
    """Rolling median of the job's iteration time against its best over the recent history."""

    def __init__(self, config: JobLevelConfig) -> None:
        self.config = config
        self._durations: deque[float] = deque(maxlen=config.recent_iterations)
        self._rolling: deque[float] = deque(maxlen=config.history_iterations)

    def observe(self, iteration_ns: float) -> RankSignal | None:
        cfg = self.config
        self._durations.append(iteration_ns)
        if len(self._durations) < cfg.recent_iterations:
            return None
        current = float(np.median(self._durations))
        self._rolling.append(current)
        best = min(self._rolling)
        if len(self._rolling) < cfg.recent_iterations or current <= (1 + cfg.regression_threshold) * best:
            return None
        return RankSignal(
            rank=-1, host="", category="job_regression", function="iteration", metric="iteration_ns",
            value=current, peer_median=best, score=(current / best - 1) / cfg.regression_threshold,
            loss_ns=current - best, subject="job",
            evidence={"recent_median_ns": current, "recent_best_ns": best,
                      "slowdown": round(current / best - 1, 4), "window_iterations": cfg.recent_iterations},
        )  # fmt: skip


def stall_record(
    job: str,
    rank: int,
    host: str,
    world_size: int,
    last_step: int,
    last_progress_ns: int,
    clock_ns: int,
    mean_iteration_ns: float,
    stalled: bool,
) -> dict[str, Any]:
    """The windower's report that a rank stopped (or resumed) progressing."""
    return {
        "job": job, "rank": rank, "host": host, "world_size": world_size, "last_step": last_step,
        "last_progress_ns": last_progress_ns, "clock_ns": clock_ns,
        "stalled_ns": max(clock_ns - last_progress_ns, 0), "mean_iteration_ns": float(mean_iteration_ns),
        "stalled": stalled,
    }  # fmt: skip


class HangCheck:
    """A hang is every rank stalled at once; blame the one that stopped first (longest stall)."""

    def __init__(self) -> None:
        self._stalls: dict[int, dict[str, Any]] = {}
        self.reported = False

    def observe(self, record: dict[str, Any]) -> RankSignal | None:
        rank = int(record["rank"])
        if record["stalled"]:
            self._stalls[rank] = record
        else:
            self._stalls.pop(rank, None)
            self.reported = False
        if self.reported or len(self._stalls) < int(record["world_size"]):
            return None
        self.reported = True
        ages = {r: int(s["stalled_ns"]) for r, s in self._stalls.items()}
        culprit = max(ages, key=lambda r: ages[r])
        rec = self._stalls[culprit]
        others = [a for r, a in ages.items() if r != culprit] or [0]
        top = sorted(ages.items(), key=lambda kv: -kv[1])[:5]
        return RankSignal(
            rank=culprit, host=rec["host"], category="hang", function="progress", metric="stalled_ns",
            value=float(ages[culprit]), peer_median=float(np.median(others)),
            score=float(ages[culprit] / max(rec["mean_iteration_ns"], 1.0)),
            loss_ns=float(ages[culprit]), subject=f"rank:{culprit}",
            evidence={"last_step": rec["last_step"], "stalled_ns_by_rank": {str(r): a for r, a in top},
                      "stopped_first_by_ns": float(ages[culprit] - max(others))},
        )  # fmt: skip
