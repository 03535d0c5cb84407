"""Opening the store at start, with the backoff a failing flush gets mid-run: a sink started before its
ClickHouse (or while a previous sink still holds the chDB directory) waits for it instead of exiting."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from clickhouse_connect.driver import Client
from clickhouse_connect.driver import exceptions as ch_errors

from fleetscope.sinks.clickhouse import connect, is_transient, migrate
from fleetscope.sinks.store_config import ClickHouseConfig

logger = logging.getLogger(__name__)

MAX_PAUSE_S = 30.0
"""Longest wait between two attempts; the sink's flush backoff uses the same cap."""


def backoff_s(failures: int) -> float:
    """Wait after ``failures`` failures in a row: 0.5 s doubling up to ``MAX_PAUSE_S``."""
    return float(min(MAX_PAUSE_S, 0.5 * 2 ** max(0, failures - 1)))


def store_unavailable(exc: BaseException) -> bool:
    """A store that is not there yet (network, server starting, chDB directory still locked by a process
    that is exiting), as opposed to a configuration or schema error that no wait cures."""
    if is_transient(exc) or isinstance(exc, ch_errors.OperationalError):
        return True
    text = str(exc)
    return isinstance(exc, ch_errors.ProgrammingError | RuntimeError) and (
        "Cannot lock file" in text or "Error initializing EmbeddedServer" in text
    )


def open_store(
    config: ClickHouseConfig, stop: threading.Event, *, attempt: Callable[[ClickHouseConfig], Client] | None = None
) -> Client | None:
    """``connect`` and ``migrate``, retried with backoff while the store is unavailable; None once ``stop``
    is set. Other errors raise at once: they are start-up configuration errors."""
    failures = 0
    while not stop.is_set():
        try:
            if attempt is not None:
                return attempt(config)
            client = connect(config)
            migrate(client, config.database)
            return client
        except Exception as exc:
            if not store_unavailable(exc):
                raise
            failures += 1
            delay = backoff_s(failures)
            logger.warning("store %s unavailable (%d in a row), retrying in %.1fs: %s", config.url, failures, delay,
                           " ".join(str(exc).split())[:300])  # fmt: skip
            stop.wait(delay)
    return None
