"""A second kind of store, in memory: the ``Store`` seam implemented over Python dicts, registered for the
``memory-double://`` scheme by ``register`` (``store_config.STORE_KINDS``'s one line, made by the test).

A test double of the seam, not of ClickHouse: it keeps the records the sink hands it (deduplicated on their
natural keys, as the seam requires), answers every read the commands make, and refuses user SQL. It proves
that ``findings``, ``report`` and the sink need nothing of the store but the seam. Importable from every test
as ``memory_store``."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import pytest

from fleetscope.schemas import FunctionKind
from fleetscope.sinks.records import avro_defaults, avro_fields, pattern_entries, pattern_rows
from fleetscope.sinks.store import (
    FunctionMean,
    IterationBucket,
    IterationSpan,
    RankBandwidth,
    Records,
    Refusal,
    ServedStore,
    Store,
    Tokens,
)
from fleetscope.sinks.store_config import STORE_KINDS, StoreConfig, StoreKind, StoreServerBounds

SCHEME = "memory-double"
_KIND_NAMES = {kind.value: kind.name.lower() for kind in FunctionKind}
_DEFAULTS = avro_defaults("findings")
_FINDING_FIELDS = [name for name, _ in avro_fields("findings") if name != "emitted_ns"]
"""A finding's current state: its latest update's fields, with first and last seen in place of emitted."""


class MemoryStore:
    """Every stored record in dicts keyed by its natural key; reads computed from them."""

    def __init__(self, config: StoreConfig) -> None:
        self._url = config.url
        self._database = config.database
        self.iterations: dict[tuple[str, int, int], dict[str, Any]] = {}
        self.patterns: dict[tuple[str, int, int], dict[str, Any]] = {}
        self.finding_updates: dict[tuple[str, str, int], dict[str, Any]] = {}

    @property
    def database(self) -> str:
        return self._database

    @property
    def url(self) -> str:
        return self._url

    def write_iterations(self, records: Records) -> int:
        return _put(self.iterations, records, ("job", "rank", "iteration"))

    def write_patterns(self, records: Records) -> int:
        fresh = [r for r in records if (r["job"], r["rank"], r["iteration"]) not in self.patterns]
        rows = sum(pattern_rows(r) for r in fresh)
        _put(self.patterns, fresh, ("job", "rank", "iteration"))
        return rows

    def write_findings(self, records: Records) -> int:
        return _put(self.finding_updates, records, ("job", "finding_id", "version"))

    def is_transient(self, exc: BaseException) -> bool:
        return False

    def rejects_records(self, exc: BaseException) -> bool:
        return isinstance(exc, ValueError | TypeError | KeyError)

    def _rows(self, job: str) -> Iterator[dict[str, Any]]:
        """The job's pattern rows, one per function of each stored PatternBatch."""
        for record in self.patterns.values():
            if record["job"] != job:
                continue
            columns = {name: pattern_entries(record, name) for name in ("function", "kind", "mean_ns", "total_ns",
                                                                         "busbw_gbps", "nvlink_mean_bps")}  # fmt: skip
            for i in range(len(record["function"])):
                yield {"rank": int(record["rank"])} | {name: values[i] for name, values in columns.items()}

    def findings(self, job: str | None = None) -> list[dict[str, Any]]:
        by_finding: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
        for update in self.finding_updates.values():
            if job is None or update["job"] == job:
                by_finding[(update["job"], update["finding_id"])].append(update)
        out = []
        for updates in by_finding.values():
            latest = max(updates, key=lambda u: u["version"])
            item = {name: latest.get(name, _DEFAULTS.get(name)) for name in _FINDING_FIELDS}
            item["status"] = "closed" if latest["status"] == "closed" else "open"
            item["ranks"] = list(latest["ranks"])
            item["evidence"] = json.loads(latest["evidence"]) if latest["evidence"] else {}
            item["first_seen_ns"] = min(u["emitted_ns"] for u in updates)
            item["last_seen_ns"] = max(u["emitted_ns"] for u in updates)
            out.append(item)
        return sorted(out, key=lambda f: (-f["est_loss_ns"], f["job"], f["finding_id"]))

    def query(
        self, sql: str, params: Mapping[str, Any] | None = None, *, readonly: bool = True
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        raise RuntimeError("the memory store runs no SQL")

    def counts(self) -> dict[str, int]:
        rows = sum(pattern_rows(r) for r in self.patterns.values())
        distinct = len({(u["job"], u["finding_id"]) for u in self.finding_updates.values()})
        return {"iterations": len(self.iterations), "function_patterns": rows,
                "finding_updates": len(self.finding_updates), "findings": distinct}  # fmt: skip

    def function_means(self, job: str) -> list[FunctionMean]:
        groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for row in self._rows(job):
            groups[(str(row["function"]), row["rank"])].append(row)
        return [FunctionMean(function, _KIND_NAMES.get(int(rows[0]["kind"]), "unknown"), rank,
                             sum(float(r["mean_ns"]) for r in rows) / len(rows),
                             sum(float(r["total_ns"]) for r in rows))
                for (function, rank), rows in groups.items()]  # fmt: skip

    def iteration_span(self, job: str) -> IterationSpan:
        mine = [r for r in self.iterations.values() if r["job"] == job]
        if not mine:
            return IterationSpan(0, 0, 0, None)
        start_ns = min(int(r["start_ns"]) for r in mine)
        return IterationSpan(min(r["iteration"] for r in mine), max(r["iteration"] for r in mine), len(mine),
                             datetime.fromtimestamp(start_ns / 1e9, UTC))  # fmt: skip

    def iteration_buckets(self, job: str, step: int) -> list[IterationBucket]:
        groups: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
        for r in self.iterations.values():
            if r["job"] == job:
                groups[(int(r["rank"]), int(r["iteration"]) // step * step)].append(r)
        return [IterationBucket(rank, str(rows[0]["host"]), it,
                                sum(r["duration_ns"] for r in rows) / len(rows) / 1e6,
                                sum(r["compute_ns"] for r in rows) / len(rows) / 1e6)
                for (rank, it), rows in sorted(groups.items())]  # fmt: skip

    def collective_bandwidth(self, job: str) -> list[RankBandwidth]:
        groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for row in self._rows(job):
            if _KIND_NAMES.get(int(row["kind"])) == "collective":
                groups[row["rank"]].append(row)

        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else math.nan

        return [RankBandwidth(rank, mean([float(r["busbw_gbps"]) for r in rows
                                          if math.isfinite(r["busbw_gbps"]) and r["busbw_gbps"] > 0]),
                              mean([float(r["nvlink_mean_bps"]) for r in rows
                                    if math.isfinite(r["nvlink_mean_bps"])]) / 1e9)
                for rank, rows in groups.items()]  # fmt: skip

    def job_activity(self, job: str) -> tuple[int, int]:
        ends = [int(r["end_ns"]) for r in self.iterations.values() if r["job"] == job]
        return len(ends), max(ends, default=0)

    def run_iterations(self, job: str) -> list[tuple[int, int, int, int, float]]:
        groups: dict[tuple[int, int, int], list[float]] = defaultdict(list)
        for r in self.patterns.values():
            if r["job"] == job and not r.get("profiled", False):
                groups[(int(r["pp_rank"]), int(r["tp_rank"]), int(r["iteration"]))].append(float(r["iteration_ns"]))
        return [(pp, tp, it, len(ns), sum(ns) / len(ns)) for (pp, tp, it), ns in sorted(groups.items())]

    def function_moments(
        self, job: str, first_iteration: int, last_iteration: int
    ) -> list[tuple[int, int, str, str, int, float, float, float]]:
        raise NotImplementedError("the memory store serves no run-to-run diff")

    def forget_job(self, job: str) -> None:
        for table in (self.iterations, self.patterns, self.finding_updates):
            for key in [k for k in table if k[0] == job]:
                del table[key]

    def close(self) -> None:
        pass


def _put(table: dict[Any, dict[str, Any]], records: Records, key: tuple[str, ...]) -> int:
    added = 0
    for record in records:
        natural = tuple(record[name] for name in key)
        if natural not in table:
            table[natural] = dict(record)
            added += 1
    return added


class MemoryAdapter:
    """The ``StoreAdapter`` of ``memory-double://NAME``: one store per URL, kept for the process."""

    def __init__(self) -> None:
        self.stores: dict[str, MemoryStore] = {}

    def open(self, config: StoreConfig, *, prepare: bool) -> Store:
        return self.stores.setdefault(config.url, MemoryStore(config))

    def unavailable(self, exc: BaseException) -> bool:
        return False

    def held_elsewhere(self, config: StoreConfig) -> bool:
        return False

    def serve(self, config: StoreConfig, tokens: Tokens, *, port: int, bounds: StoreServerBounds) -> ServedStore:
        raise ValueError("the memory store is not served")

    def refusal(self, exc: BaseException) -> Refusal | None:
        return None


ADAPTER = MemoryAdapter()


def register(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second store's one registration, for the test that calls it."""
    monkeypatch.setitem(STORE_KINDS, SCHEME, StoreKind(adapter=__name__, local=False))
