"""Batched, column-oriented, idempotent writes of decoded Avro records into the ClickHouse tables.

Insert columns come from the Avro schemas (``fleetscope.sinks.records``), so the record contract is defined
once; user values travel as server-side parameters and table names are fixed.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from clickhouse_connect.driver import Client
from clickhouse_connect.driver import options as ch_options

from fleetscope.schemas import FunctionKind
from fleetscope.sinks.clickhouse.client import is_transient, rejects_records
from fleetscope.sinks.clickhouse.tables import FINDING_UPDATES, FUNCTION_PATTERNS, ITERATIONS, NATURAL_KEYS
from fleetscope.sinks.records import avro_defaults, avro_fields, is_array, pattern_entries, pattern_rows
from fleetscope.sinks.retry import RetryPolicy, with_retries
from fleetscope.sinks.store_config import check_database

logger = logging.getLogger(__name__)

_KEY_CHUNK = 5_000

_AVRO_DTYPES: dict[str, type[np.generic] | type[object]] = {
    "int": np.int32,
    "long": np.int64,
    "double": np.float64,
    "float": np.float64,
    "boolean": np.bool_,
    "string": object,
}


def _column(values: list[Any], avro_type: Any) -> npt.NDArray[Any] | list[Any]:
    dtype = _AVRO_DTYPES.get(avro_type) if isinstance(avro_type, str) else None
    if dtype is None or dtype is object:
        return values
    return np.asarray(values, dtype=dtype)


def _joined(entries: list[Any], dtype: Any, total: int) -> npt.NDArray[Any]:
    """The records' entries of one pattern column as one array of ``total`` values. Lists (fastavro's, for
    records under ``codec.COLUMNS_FROM_BYTES``) are read in one pass, not made an array each: a record of 18
    functions has ~30 columns, so that was one ``np.asarray`` call per column and record."""
    if dtype is not object and all(type(e) is list for e in entries):
        return np.fromiter(itertools.chain.from_iterable(entries), dtype=dtype, count=total)
    return np.concatenate([np.asarray(e, dtype=dtype) for e in entries])


class ClickHouseWriter:
    """Writes decoded Avro records (dicts) into the tables, column-oriented, retrying transient errors.

    Insert columns come from the Avro schemas, so the record contract is defined once; a new schema
    field without a matching column fails loudly."""

    def __init__(self, client: Client, database: str, *, retry: RetryPolicy | None = None) -> None:
        self._client = client
        self._database = check_database(database)
        self._retry = retry or RetryPolicy()
        self._iteration_fields = avro_fields("iterations")
        self._finding_fields = avro_fields("findings")
        pattern_fields = avro_fields("patterns")
        self._pattern_scalars = [(n, t) for n, t in pattern_fields if not is_array(t)]
        self._pattern_arrays = [(n, t["items"]) for n, t in pattern_fields if is_array(t)]
        self._defaults = avro_defaults("iterations", "findings", "patterns")
        self._kind_names = np.full(max(FunctionKind) + 1, "unknown", dtype=object)
        for kind in FunctionKind:
            self._kind_names[kind.value] = kind.name.lower()
        # clickhouse-connect imports pandas on the first insert (0.2-0.4 CPU s): pay it here, not while
        # the first rows, and the first findings, wait.
        _ = ch_options.pd

    @property
    def database(self) -> str:
        return self._database

    def is_transient(self, exc: BaseException) -> bool:
        return is_transient(exc)

    def rejects_records(self, exc: BaseException) -> bool:
        return rejects_records(exc)

    def write_iterations(self, records: Sequence[Mapping[str, Any]]) -> int:
        """One row per IterationRecord not stored yet."""
        return self._insert_records(ITERATIONS, self._iteration_fields, self.unseen(ITERATIONS, records))

    def write_findings(self, records: Sequence[Mapping[str, Any]]) -> int:
        """One row per Finding state change not stored yet; ``findings`` (the view) reduces them to the
        current state."""
        return self._insert_records(FINDING_UPDATES, self._finding_fields, self.unseen(FINDING_UPDATES, records))

    def write_patterns(self, records: Sequence[Mapping[str, Any]]) -> int:
        """Explode PatternBatches not stored yet (one entry per function) into rows, column-wise."""
        records = self.unseen(FUNCTION_PATTERNS, records)
        if not records:
            return 0
        counts = np.fromiter((pattern_rows(r) for r in records), dtype=np.int64, count=len(records))
        total = int(counts.sum())
        if total == 0:
            return 0
        columns: dict[str, npt.NDArray[Any]] = {}
        for name, avro_type in self._pattern_scalars:
            dtype = _AVRO_DTYPES.get(avro_type, object) if isinstance(avro_type, str) else object
            default = self._defaults.get(name)
            columns[name] = np.repeat(np.array([r.get(name, default) for r in records], dtype=dtype), counts)
        for name, item_type in self._pattern_arrays:
            dtype = _AVRO_DTYPES.get(item_type, object) if isinstance(item_type, str) else object
            columns[name] = _joined([pattern_entries(r, name) for r in records], dtype, total)
        kind = columns["kind"]
        if kind.min() < 0 or kind.max() > 255:
            raise ValueError("pattern kind outside 0..255")
        known = kind < len(self._kind_names)
        columns["kind"] = kind.astype(np.uint8)
        columns["kind_name"] = np.where(known, self._kind_names[np.where(known, kind, 0)], "unknown")
        # Strings go as lists (clickhouse-connect encodes them value by value anyway); numbers stay numpy.
        data = [col.tolist() if col.dtype == object else col for col in columns.values()]
        self._insert(FUNCTION_PATTERNS, list(columns), data)
        return total

    def unseen(self, table: str, records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """The records whose natural key (``NATURAL_KEYS``) is neither stored nor earlier in ``records``.

        Why at insert time: a sink replaying a topic (crash, rebalance, new group) must not add rows
        that ``count()`` sees before background merges; ClickHouse's own insert deduplication (block hash
        or ``insert_deduplication_token``) only catches a replay cut into exactly the same batches,
        which consumer batching does not guarantee. One sink owns a key's partition, so check-then-insert
        does not race; the Replacing engines still absorb anything that slips through."""
        if not records:
            return []
        key_spec = NATURAL_KEYS[table]
        names = [name for name, _ in key_spec]
        keys = [tuple(r[name] for name in names) for r in records]
        distinct = list(dict.fromkeys(keys))
        # The key's columns and types come from NATURAL_KEYS, the tables' fixed list, and the database is
        # an identifier (check_database): the driver binds the keys, not a column list nor a parameter's type.
        query = (
            f"SELECT DISTINCT {', '.join(names)} FROM `{self._database}`.{table} "  # noqa: S608 - fixed names
            f"WHERE ({', '.join(names)}) IN {{keys:Array(Tuple({', '.join(t for _, t in key_spec)}))}}"
        )
        seen: set[tuple[Any, ...]] = set()
        for i in range(0, len(distinct), _KEY_CHUNK):
            chunk = distinct[i : i + _KEY_CHUNK]

            def call(chunk: list[tuple[Any, ...]] = chunk) -> list[Any]:
                return list(self._client.query(query, parameters={"keys": chunk}).result_rows)

            rows = with_retries(
                call, self._retry, retryable=is_transient, what=f"key lookup in {self._database}.{table}"
            )
            seen.update(tuple(row) for row in rows)
        fresh: list[Mapping[str, Any]] = []
        for key, record in zip(keys, records, strict=True):
            if key not in seen:
                seen.add(key)
                fresh.append(record)
        if len(fresh) < len(records):
            logger.debug("%s: %d replayed records skipped", table, len(records) - len(fresh))
        return fresh

    def _insert_records(self, table: str, fields: list[tuple[str, Any]], records: Sequence[Mapping[str, Any]]) -> int:
        if not records:
            return 0
        names = [name for name, _ in fields]
        defaults = self._defaults
        data = [_column([r.get(name, defaults.get(name)) for r in records], avro_type) for name, avro_type in fields]
        self._insert(table, names, data)
        return len(records)

    def _insert(self, table: str, names: list[str], data: list[Any]) -> None:
        def call() -> None:
            self._client.insert(table, data, column_names=names, database=self._database, column_oriented=True)

        with_retries(call, self._retry, retryable=is_transient, what=f"insert into {self._database}.{table}")
