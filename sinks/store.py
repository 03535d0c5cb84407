"""The store seam: what the sink, ``findings``, ``sql``, ``report`` and ``up`` need from a store, and the
one place a store is opened.

``RecordWriter`` is the write side the sink drives (idempotent on each record's natural key, so a replay adds
no row); ``Store`` adds the reads and ``close``. ``open_store`` is the start-up sequence: connect, create the
schema, and wait with backoff while the store is not there yet. The ClickHouse adapter
(``fleetscope.sinks.clickhouse``) is the implementation, imported only when a store is opened, so importing
this module (or the configuration) loads no driver.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, overload

from fleetscope.sinks.retry import backoff_s
from fleetscope.sinks.store_config import ClickHouseConfig

logger = logging.getLogger(__name__)

Records = Sequence[Mapping[str, Any]]


class RecordWriter(Protocol):
    """Writes decoded records of the three stored subjects; each returns the rows it added (a record whose
    natural key is stored already adds none)."""

    def write_iterations(self, records: Records) -> int: ...

    def write_patterns(self, records: Records) -> int: ...

    def write_findings(self, records: Records) -> int: ...

    def is_transient(self, exc: BaseException) -> bool:
        """A store error a later retry may cure (network, overload), after the writer's own retries."""
        ...

    def rejects_records(self, exc: BaseException) -> bool:
        """An error caused by the records themselves: the sink isolates and dead-letters them."""
        ...


class Store(RecordWriter, Protocol):
    """A store the commands read and the sink writes."""

    @property
    def database(self) -> str: ...

    @property
    def url(self) -> str:
        """Where it lives, as a person would write it (never holds a password)."""
        ...

    def findings(self, job: str | None = None) -> list[dict[str, Any]]:
        """Current state of every finding (of ``job``), biggest estimated loss first; JSON-ready."""
        ...

    def query(
        self, sql: str, params: Mapping[str, Any] | None = None, *, readonly: bool = True
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """(columns, rows) of a user's query; read-only as the store itself enforces unless ``readonly``
        is False."""
        ...

    def counts(self) -> dict[str, int]:
        """Rows per table and distinct findings."""
        ...

    def run_iterations(self, job: str) -> list[tuple[int, int, int, int, float]]:
        """``diff``'s first read of a run: per role and iteration in order, (pp_rank, tp_rank, iteration,
        ranks that reported, their mean iteration time in ns). Rank-iterations recorded under a profiler
        window (``profiled``) are left out of both reads: profiling slows what it watches."""
        ...

    def function_moments(
        self, job: str, first_iteration: int, last_iteration: int
    ) -> list[tuple[int, int, str, str, int, float, float, float]]:
        """``diff``'s second read: per role and function over iterations ``first..last``, (pp_rank, tp_rank,
        function, kind, iterations it ran in, sum and sum of squares over those iterations of the time one
        rank of the role spent in it per iteration, per-rank calls summed). Aggregated where the rows are:
        one row per role and function leaves the store, however many ranks and iterations the job has."""
        ...

    def forget_job(self, job: str) -> None:
        """Delete every stored row of ``job`` (a demo run again under the same name)."""
        ...

    def close(self) -> None: ...


@overload
def open_store(config: ClickHouseConfig, *, stop: None = None, prepare: bool = True) -> Store: ...


@overload
def open_store(config: ClickHouseConfig, *, stop: threading.Event, prepare: bool = True) -> Store | None: ...


def open_store(config: ClickHouseConfig, *, stop: threading.Event | None = None, prepare: bool = True) -> Store | None:
    """Connect to the store ``config`` names and, with ``prepare``, create its database, tables and views
    (idempotent: every process runs it on start).

    With ``stop``, a store that is not there yet (a server starting, a chDB directory still locked by a
    process that is exiting) is waited for with backoff until it answers (the store) or ``stop`` is set
    (None); without, the first error raises. Other errors always raise at once: they are configuration
    errors no wait cures."""
    opener, unavailable = _adapter(config)
    failures = 0
    while stop is None or not stop.is_set():
        try:
            return opener(config, prepare=prepare)
        except Exception as exc:
            if stop is None or not unavailable(exc):
                raise
            failures += 1
            delay = backoff_s(failures)
            logger.warning("store %s unavailable (%d in a row), retrying in %.1fs: %s", config.url, failures, delay,
                           " ".join(str(exc).split())[:300])  # fmt: skip
            stop.wait(delay)
    return None


def _adapter(config: ClickHouseConfig) -> tuple[Callable[..., Store], Callable[[BaseException], bool]]:
    """(opener, is-the-store-just-not-there-yet) of the store kind ``config.url`` names. Every scheme the
    configuration accepts (``chdb://``, ``http(s)://``) is ClickHouse today; the adapter is imported here
    only, on first use, so that the configuration and the sink load no driver."""
    from fleetscope.sinks import clickhouse

    return clickhouse.open_clickhouse, clickhouse.store_unavailable
