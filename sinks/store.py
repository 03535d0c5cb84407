"""The store seam: what the sink, ``findings``, ``sql``, ``report``, ``diff`` and ``up`` need from a store,
and the one place a store is opened.

``RecordWriter`` is the write side the sink drives (idempotent on each record's natural key, so a replay adds
no row); ``Store`` adds every read the commands make and ``close``. ``StoreAdapter`` is what a store's package
provides (``ADAPTER``): its opener, what is worth waiting for, the lock of a local store, its served interface
and the wording of its errors. The adapter is found by the URL's scheme in ``store_config.STORE_KINDS`` and
imported only when first used, so importing this module (or the configuration) loads no driver.
"""

from __future__ import annotations

import hmac
import importlib
import logging
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, Protocol, cast, overload

from fleetscope.sinks.retry import backoff_s
from fleetscope.sinks.store_config import STORE_KINDS, StoreConfig, StoreServerBounds

logger = logging.getLogger(__name__)

Records = Sequence[Mapping[str, Any]]


class FunctionMean(NamedTuple):
    """One rank's figures of one function over a job: its mean duration per call and its total time."""

    function: str
    kind: str
    rank: int
    mean_ns: float
    total_ns: float


class IterationSpan(NamedTuple):
    """A job's stored iterations: first and last number, distinct (rank, iteration) pairs, earliest start."""

    first: int
    last: int
    rank_iterations: int
    started: datetime | None


class IterationBucket(NamedTuple):
    """One rank's mean iteration and compute time over the iterations ``iteration..iteration+step-1``."""

    rank: int
    host: str
    iteration: int
    duration_ms: float
    compute_ms: float


class RankBandwidth(NamedTuple):
    """One rank's mean collective bus bandwidth and NVLink throughput (GB/s; NaN where nothing was measured)."""

    rank: int
    busbw_gbps: float
    link_gbps: float


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
    """A store the commands read and the sink writes. Every read a command makes is a method here, so that
    no command speaks the store's dialect; only ``query`` takes a user's text (``fleetscope sql``)."""

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
        is False (a refused non-read statement that does not parse raises the store's syntax error)."""
        ...

    def counts(self) -> dict[str, int]:
        """Rows per table and distinct findings."""
        ...

    def function_means(self, job: str) -> list[FunctionMean]:
        """``report``'s heatmap: per function and rank of ``job``, the mean of its per-iteration means and
        its total time, over every stored pattern row."""
        ...

    def iteration_span(self, job: str) -> IterationSpan:
        """``report``'s frame: first and last iteration, distinct (rank, iteration) pairs and the earliest
        start of ``job``'s iterations (zeros and None when it has none)."""
        ...

    def iteration_buckets(self, job: str, step: int) -> list[IterationBucket]:
        """``report``'s time lines: per rank and bucket of ``step`` iterations (numbered by its first, a
        multiple of ``step``), the rank's host and its mean iteration and compute time, by rank and bucket."""
        ...

    def collective_bandwidth(self, job: str) -> list[RankBandwidth]:
        """``report``'s bars: per rank, the mean over its collective pattern rows of the bus bandwidth (the
        finite, positive ones) and of the NVLink throughput (the finite ones)."""
        ...

    def job_activity(self, job: str) -> tuple[int, int]:
        """(iteration rows of ``job``, the latest end of one in ns since the epoch; 0, 0 when none)."""
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


@dataclass(frozen=True)
class Tokens:
    """The two secrets of a served store: ``read`` may query, ``write`` may also modify."""

    read: str
    write: str

    def access(self, presented: str) -> str | None:
        """ "write", "read" or None; constant-time comparisons."""
        if presented and hmac.compare_digest(presented.encode(), self.write.encode()):
            return "write"
        if presented and hmac.compare_digest(presented.encode(), self.read.encode()):
            return "read"
        return None


class ServedStore(Protocol):
    """A local store served to other processes (``up``), until ``stop``."""

    @property
    def url(self) -> str: ...

    def stop(self) -> None: ...


class Refusal(NamedTuple):
    """A store's error as a person reads it: the store's own message and, where one is known, the fix."""

    message: str
    fix: str | None


class StoreAdapter(Protocol):
    """What a store's package provides as ``ADAPTER`` (registered by URL scheme in ``STORE_KINDS``)."""

    def open(self, config: StoreConfig, *, prepare: bool) -> Store:
        """Connect and, with ``prepare``, create the database, tables and views idempotently."""
        ...

    def unavailable(self, exc: BaseException) -> bool:
        """The store is not there yet (starting, network, still locked by an exiting process): worth a wait."""
        ...

    def held_elsewhere(self, config: StoreConfig) -> bool:
        """Another process holds the local store ``config`` names (False for a server)."""
        ...

    def serve(self, config: StoreConfig, tokens: Tokens, *, port: int, bounds: StoreServerBounds) -> ServedStore:
        """Serve the local store over its HTTP interface on loopback (``port`` 0: any free one), started."""
        ...

    def refusal(self, exc: BaseException) -> Refusal | None:
        """``exc`` worded, when it is the store's own error; else None."""
        ...


def adapter(config: StoreConfig) -> StoreAdapter:
    """The adapter of the store kind ``config.url`` names, imported on first use."""
    return cast(StoreAdapter, importlib.import_module(config.kind.adapter).ADAPTER)


@overload
def open_store(config: StoreConfig, *, stop: None = None, prepare: bool = True) -> Store: ...


@overload
def open_store(config: StoreConfig, *, stop: threading.Event, prepare: bool = True) -> Store | None: ...


def open_store(config: StoreConfig, *, stop: threading.Event | None = None, prepare: bool = True) -> Store | None:
    """Connect to the store ``config`` names and, with ``prepare``, create its database, tables and views
    (idempotent: every process runs it on start).

    With ``stop``, a store that is not there yet (a server starting, a local store still locked by a
    process that is exiting) is waited for with backoff until it answers (the store) or ``stop`` is set
    (None); without, the first error raises. Other errors always raise at once: they are configuration
    errors no wait cures."""
    kind = adapter(config)
    failures = 0
    while stop is None or not stop.is_set():
        try:
            return kind.open(config, prepare=prepare)
        except Exception as exc:
            if stop is None or not kind.unavailable(exc):
                raise
            failures += 1
            delay = backoff_s(failures)
            logger.warning("store %s unavailable (%d in a row), retrying in %.1fs: %s", config.url, failures, delay,
                           " ".join(str(exc).split())[:300])  # fmt: skip
            stop.wait(delay)
    return None


def refusal(exc: BaseException) -> Refusal | None:
    """``exc`` worded by the adapter it came from: each adapter already loaded is asked (an adapter that is
    not loaded raised nothing), so that wording an error never loads a driver."""
    for module in dict.fromkeys(kind.adapter for kind in STORE_KINDS.values()):
        loaded = sys.modules.get(module)
        if loaded is not None and (worded := cast(StoreAdapter, loaded.ADAPTER).refusal(exc)) is not None:
            return worded
    return None
