"""Automatic profile requests: which findings ask a job for a profiler window, and how often.

A window slows the ranks it records, so requests must not feed on what they cause: one request per job
(never one per rank or per finding), at most one per ``min_interval_ms``, only for the configured
categories, and a switch turns them off. Iterations the window records are marked ``profiled`` and kept
out of the comparisons that would take their slowness for a fault (see ``windowing``, ``differential``).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fleetscope.schemas.vocabulary import CATEGORIES


@dataclass(frozen=True, kw_only=True)
class ProfileRequestConfig:
    auto: bool = True
    """Off: findings never ask for windows (``fleetscope profile`` still does)."""
    categories: tuple[str, ...] = ("job_regression", "hang", "straggler")
    """Findings that ask for one when they open: a continuous-mode straggler gets its kernel evidence."""
    min_interval_ms: int = 600_000
    """Per job, the least time between two automatic requests."""
    window_ms: int = 20_000
    start_delay_ms: int = 5_000
    """The window starts this long after the request, the same moment on every rank."""

    def __post_init__(self) -> None:
        errors = [f"categories: {c!r} is not one of {', '.join(CATEGORIES)}" for c in self.categories
                  if c not in CATEGORIES]  # fmt: skip
        if self.min_interval_ms < 0 or self.start_delay_ms < 0:
            errors.append("min_interval_ms and start_delay_ms must be >= 0")
        if self.window_ms <= 0:
            errors.append("window_ms must be > 0")
        if errors:
            raise ValueError("; ".join(errors))


def profile_request(finding: dict[str, object], seconds: float, start_in_s: float = 5.0) -> dict[str, object]:
    """A control record asking the job's ranks for a synchronised profile (see control.v1.avsc)."""
    now = time.time_ns()
    # Named after the finding's state change, so a request re-emitted after a restart is recognised.
    request_id = uuid.uuid5(uuid.NAMESPACE_URL, f"fleetscope:{finding['finding_id']}#{finding['version']}")
    return {
        "request_id": request_id.hex,
        "job": finding["job"],
        "action": "profile",
        "duration_s": float(seconds),
        "start_at_ns": now + int(start_in_s * 1e9),
        "requested_by": "differential",
        "reason": f"{finding['category']} opened: {finding['finding_id']}",
        "issued_ns": now,
    }


class ProfilePolicy:
    """Decides, finding by finding, whether to ask the job for a window now (state: each job's last request)."""

    def __init__(self, config: ProfileRequestConfig | None = None) -> None:
        self.config = config or ProfileRequestConfig()
        self._last_ns: dict[str, int] = {}
        self.suppressed = 0

    def request(self, finding: dict[str, object], now_ns: int) -> dict[str, object] | None:
        """The control record to send for ``finding`` (a finding record), or None."""
        cfg = self.config
        if not cfg.auto or finding["status"] != "open" or finding["category"] not in cfg.categories:
            return None
        job = str(finding["job"])
        last = self._last_ns.get(job)
        if last is not None and now_ns - last < cfg.min_interval_ms * 1_000_000:
            self.suppressed += 1
            return None
        self._last_ns[job] = now_ns
        return profile_request(finding, cfg.window_ms / 1000, cfg.start_delay_ms / 1000)

    def forget(self, job: str) -> None:
        """The job ended: its next window, if it ever comes back, is not held back."""
        self._last_ns.pop(job, None)
