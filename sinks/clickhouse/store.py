"""``ClickHouseStore``: the ``Store`` of ``fleetscope.sinks.store`` on chDB or a ClickHouse server."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from clickhouse_connect.driver import Client

from fleetscope.sinks.clickhouse import queries
from fleetscope.sinks.clickhouse.client import connect, is_chdb, is_transient, migrate, rejects_records
from fleetscope.sinks.clickhouse.messages import SYNTAX_PROBE, syntax_error_of
from fleetscope.sinks.clickhouse.user_sql import run_sql
from fleetscope.sinks.clickhouse.writer import ClickHouseWriter
from fleetscope.sinks.store import FunctionMean, IterationBucket, IterationSpan, RankBandwidth, Records
from fleetscope.sinks.store_config import StoreConfig


class ClickHouseStore:
    """One database of a ClickHouse store: the writer the sink drives and the reads of the commands.

    ``client`` stays public for what only ClickHouse speaks (the benches' and tests' own SQL)."""

    def __init__(self, client: Client, config: StoreConfig) -> None:
        self.client = client
        self._database = config.database
        self._url = config.url
        self._config = config

    @property
    def database(self) -> str:
        return self._database

    @property
    def url(self) -> str:
        return self._url

    @functools.cached_property
    def writer(self) -> ClickHouseWriter:
        """Built on the first write: it loads pandas, which a read-only command never needs."""
        return ClickHouseWriter(self.client, self._database)

    def write_iterations(self, records: Records) -> int:
        return self.writer.write_iterations(records)

    def write_patterns(self, records: Records) -> int:
        return self.writer.write_patterns(records)

    def write_findings(self, records: Records) -> int:
        return self.writer.write_findings(records)

    def is_transient(self, exc: BaseException) -> bool:
        return is_transient(exc)

    def rejects_records(self, exc: BaseException) -> bool:
        return rejects_records(exc)

    def findings(self, job: str | None = None) -> list[dict[str, Any]]:
        return queries.current_findings(self.client, self._database, job)

    def query(
        self, sql: str, params: Mapping[str, Any] | None = None, *, readonly: bool = True
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """``run_sql``; a statement refused by its first word is parsed by the engine first (``EXPLAIN
        AST`` runs nothing), so that ``SELEC 1`` is reported as the syntax error it is, not as a write."""
        bound = dict(params) if params else None
        try:
            return run_sql(self.client, self._database, sql, bound, readonly=readonly, config=self._config)
        except PermissionError:
            try:
                run_sql(self.client, self._database, SYNTAX_PROBE + sql, bound, config=self._config)
            except Exception as exc:
                syntax = syntax_error_of(exc)
                if syntax is not None:
                    raise syntax from None
            raise

    def counts(self) -> dict[str, int]:
        return queries.table_counts(self.client, self._database)

    def function_means(self, job: str) -> list[FunctionMean]:
        return queries.function_means(self.client, self._database, job)

    def iteration_span(self, job: str) -> IterationSpan:
        return queries.iteration_span(self.client, self._database, job)

    def iteration_buckets(self, job: str, step: int) -> list[IterationBucket]:
        return queries.iteration_buckets(self.client, self._database, job, step)

    def collective_bandwidth(self, job: str) -> list[RankBandwidth]:
        return queries.collective_bandwidth(self.client, self._database, job)

    def job_activity(self, job: str) -> tuple[int, int]:
        return queries.job_activity(self.client, self._database, job)

    def run_iterations(self, job: str) -> list[tuple[int, int, int, int, float]]:
        return queries.run_iterations(self.client, self._database, job)

    def function_moments(
        self, job: str, first_iteration: int, last_iteration: int
    ) -> list[tuple[int, int, str, str, int, float, float, float]]:
        return queries.function_moments(self.client, self._database, job, first_iteration, last_iteration)

    def forget_job(self, job: str) -> None:
        queries.forget_job(self.client, self._database, job)

    def close(self) -> None:
        """Close a server connection; a chDB handle is the process's engine and stays open until exit."""
        if not is_chdb(self.client):
            self.client.close()


def open_clickhouse(config: StoreConfig, *, prepare: bool = True) -> ClickHouseStore:
    """Connect and, with ``prepare``, migrate the schema; without, touch nothing (a read-only login)."""
    client = connect(config, create_database=prepare)
    if prepare:
        migrate(client, config.database)
    return ClickHouseStore(client, config)
