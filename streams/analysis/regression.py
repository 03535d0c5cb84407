"""PerfTracker's degradation trigger for one job: when to open a profiling window on every rank.

Pure function, numpy in, verdict out; no Faust, Kafka or ClickHouse.

Algorithm (PerfTracker, method notes §1.2):
1. Slowdown: with at least ``window`` iterations seen, the mean of the last ``window`` (N = 50) iteration
   durations exceeds ``threshold`` (1.05) times the recent best. The recent best is the shortest iteration
   among the last ``best_window`` ones (``baseline="iteration"``, the paper's rule), or the lowest
   ``window``-iteration rolling mean there (``baseline="window_mean"``, robust to one unusually short
   iteration, which with ordinary jitter makes the literal rule fire on a healthy job).
2. Stall: the time since the last received event is at least ``stall_factor`` (5) times the mean
   iteration (mean of the last ``window``), once ``min_stall_iterations`` iterations give that mean.

Assumptions: durations are in completion order, one value per iteration of the job (e.g. the job's
slowest rank per step); times are ns on one clock. A job slow from its first iteration never triggers
condition 1 (no better past): such jobs need an on-demand request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, kw_only=True)
class TriggerConfig:
    window: int = 50
    threshold: float = 1.05
    best_window: int = 1000
    baseline: Literal["iteration", "window_mean"] = "iteration"
    stall_factor: float = 5.0
    min_stall_iterations: int = 5

    def __post_init__(self) -> None:
        p: list[str] = []
        if self.window < 1:
            p.append(f"window must be >= 1, got {self.window}")
        if self.best_window < self.window:
            p.append(f"best_window must be >= window ({self.window}), got {self.best_window}")
        if not self.threshold > 1.0:
            p.append(f"threshold must be > 1, got {self.threshold}")
        if self.baseline not in ("iteration", "window_mean"):
            p.append(f"baseline must be iteration or window_mean, got {self.baseline!r}")
        if not self.stall_factor > 0:
            p.append(f"stall_factor must be > 0, got {self.stall_factor}")
        if self.min_stall_iterations < 1:
            p.append(f"min_stall_iterations must be >= 1, got {self.min_stall_iterations}")
        if p:
            raise ValueError("invalid trigger config: " + "; ".join(p))


@dataclass(frozen=True, slots=True)
class TriggerVerdict:
    slow: bool
    stalled: bool
    recent_mean_ns: float
    """Mean of the last ``window`` iterations (NaN with no iteration)."""
    best_ns: float
    """The recent best the mean is compared with (NaN before ``window`` iterations)."""
    ratio: float
    """recent_mean / best (NaN when not evaluated)."""
    idle_ns: int
    """now - last event."""

    @property
    def triggered(self) -> bool:
        return self.slow or self.stalled

    @property
    def reason(self) -> str:
        return "slow" if self.slow else "stalled" if self.stalled else ""


def check_trigger(
    durations_ns: npt.ArrayLike,
    last_event_ns: int,
    now_ns: int,
    config: TriggerConfig | None = None,
) -> TriggerVerdict:
    """Evaluate both conditions on the job's iteration durations so far (oldest first)."""
    cfg = config or TriggerConfig()
    d = np.asarray(durations_ns, dtype=np.float64)[-cfg.best_window :]
    idle = int(now_ns - last_event_ns)
    recent = d[-cfg.window :]
    mean = float(recent.mean()) if recent.size else float("nan")

    best = ratio = float("nan")
    slow = False
    if d.size >= cfg.window:
        if cfg.baseline == "iteration":
            best = float(d.min())
        else:
            csum = np.concatenate([[0.0], np.cumsum(d)])
            best = float(((csum[cfg.window :] - csum[: -cfg.window]) / cfg.window).min())
        ratio = mean / best if best > 0 else float("inf")
        slow = bool(mean > cfg.threshold * best)

    stalled = bool(recent.size >= cfg.min_stall_iterations and idle >= cfg.stall_factor * mean)
    return TriggerVerdict(
        slow=slow, stalled=stalled, recent_mean_ns=mean, best_ns=best, ratio=ratio, idle_ns=idle
    )
