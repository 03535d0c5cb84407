"""The one retry policy of the sinks: exponential backoff, optionally jittered, bounded in tries and time.

Used by the store writer (a transient insert error), the webhook (a 5xx or a dropped connection), the store's
start-up (a server not up yet) and the sink's paused consumption after a failed flush. Store-neutral: what is
worth a retry is the caller's ``retryable`` predicate.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Backoff of ``initial_backoff_ms`` doubling up to ``max_backoff_ms``; at most ``max_attempts`` tries
    (0: until stopped) and, when ``max_elapsed_ms`` > 0, no new try after that long.

    ``jitter`` (equal jitter: half the step plus a random share of the other half) spreads a fleet's
    retries apart; off, the waits are exact (the start-up and flush pauses a person reads in the log)."""

    max_attempts: int = 5
    initial_backoff_ms: int = 100
    max_backoff_ms: int = 5_000
    max_elapsed_ms: int = 0
    jitter: bool = True

    def __post_init__(self) -> None:
        if (
            self.max_attempts < 0
            or self.initial_backoff_ms < 0
            or self.max_backoff_ms < self.initial_backoff_ms
            or self.max_elapsed_ms < 0
        ):
            raise ValueError(f"invalid RetryPolicy: {self}")

    def delay_s(self, attempt: int) -> float:
        """The wait after the ``attempt``-th failure in a row, counted from 0."""
        step = min(self.max_backoff_ms, self.initial_backoff_ms * 2 ** max(0, attempt)) / 1000.0
        if not self.jitter:
            return float(step)
        return float(step / 2 + random.uniform(0, step / 2))

    def gives_up(self, attempts: int, started_s: float) -> bool:
        """True once ``attempts`` tries (or the elapsed time since ``started_s``, monotonic) use the budget."""
        if self.max_attempts and attempts >= self.max_attempts:
            return True
        return bool(self.max_elapsed_ms) and (time.monotonic() - started_s) * 1000.0 >= self.max_elapsed_ms


STORE_PAUSES = RetryPolicy(max_attempts=0, initial_backoff_ms=500, max_backoff_ms=30_000, jitter=False)
"""Waits while the store (or the broker) is away: at start, after a failed flush, after a refused login."""
MAX_PAUSE_S = STORE_PAUSES.max_backoff_ms / 1000.0
"""Longest of those waits."""


def backoff_s(failures: int) -> float:
    """Wait after ``failures`` failures in a row under ``STORE_PAUSES``: 0.5 s doubling up to ``MAX_PAUSE_S``."""
    return STORE_PAUSES.delay_s(failures - 1)


def with_retries(
    call: Callable[[], _T],
    policy: RetryPolicy,
    *,
    retryable: Callable[[BaseException], bool],
    what: str,
    on_retry: Callable[[int, BaseException], None] | None = None,
    log_level: int = logging.WARNING,
) -> _T:
    """Run ``call``; an error ``retryable`` accepts is retried under ``policy``, any other raises at once,
    and the last one raises when the policy gives up. ``on_retry(attempt, error)`` runs before each wait."""
    started_s = time.monotonic()
    attempt = 0
    while True:
        try:
            return call()
        except Exception as exc:
            attempt += 1
            if not retryable(exc) or policy.gives_up(attempt, started_s):
                raise
            delay = policy.delay_s(attempt - 1)
            if on_retry is not None:
                on_retry(attempt, exc)
            logger.log(log_level, "%s failed (attempt %d/%s), retrying in %.2fs: %s", what, attempt,
                       policy.max_attempts or "unbounded", delay, exc)  # fmt: skip
            time.sleep(delay)
