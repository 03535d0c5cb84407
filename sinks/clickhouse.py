"""ClickHouse storage: connection, migrations, batched column-oriented writes and the CLI's queries.

chDB (in-process ClickHouse) is the embedded default; an ``http(s)://`` URL reaches a server with the same
code. One process can open only one chDB path, so jobs and tests are isolated by *database*, never by path.
Table names are fixed; the database name is validated as an identifier and is the only text ever
formatted into SQL. User values travel as server-side parameters.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar
from urllib.parse import urlsplit

import clickhouse_connect
import numpy as np
import numpy.typing as npt
from clickhouse_connect.driver import Client
from clickhouse_connect.driver import exceptions as ch_errors
from clickhouse_connect.driver import options as ch_options

from fleetscope.schemas import CATALOG, FunctionKind
from fleetscope.sinks.store_config import ClickHouseConfig, check_database

logger = logging.getLogger(__name__)

ITERATIONS = "iterations"
FUNCTION_PATTERNS = "function_patterns"
FINDING_UPDATES = "finding_updates"
FINDINGS = "findings"
"""The view with the current state of each finding."""
TABLES = (ITERATIONS, FUNCTION_PATTERNS, FINDING_UPDATES)

NATURAL_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    ITERATIONS: (("job", "String"), ("rank", "Int32"), ("iteration", "Int64")),
    FUNCTION_PATTERNS: (("job", "String"), ("rank", "Int32"), ("iteration", "Int64")),
    FINDING_UPDATES: (("job", "String"), ("finding_id", "String"), ("version", "Int64")),
}
"""Per table, the record fields (and ClickHouse types) naming one source message's rows: one iteration,
one PatternBatch, one finding state change. A record whose key is stored already is a replay."""
_KEY_CHUNK = 5_000

_AVRO_DTYPES: dict[str, type[np.generic] | type[object]] = {
    "int": np.int32,
    "long": np.int64,
    "double": np.float64,
    "float": np.float64,
    "boolean": np.bool_,
    "string": object,
}
# ClickHouse error codes worth a retry: overload, timeouts, network, a replica or keeper hiccup.
_TRANSIENT_CODES = frozenset({3, 32, 159, 202, 203, 209, 210, 236, 241, 242, 252, 319, 394, 425, 999, 1000})


# One chDB engine per process: clients are cached per (path, database) so repeated connect() calls reuse
# handles, and a second path fails with a clear message instead of chDB's.
_CHDB_CLIENTS: dict[tuple[str, str], Client] = {}
_CHDB_LOCK = threading.Lock()


def connect(config: ClickHouseConfig) -> Client:
    """A client whose default database is ``config.database`` (created when missing).

    chDB clients are shared by the whole process: do not close them (the engine lives until exit)."""
    path = config.chdb_path
    if path is None:
        parts = urlsplit(config.url)
        secure = parts.scheme == "https"
        client = clickhouse_connect.get_client(
            host=parts.hostname or "localhost",
            port=parts.port or (8443 if secure else 8123),
            username=parts.username or config.username,
            password=config.password,
            secure=secure,
        )
        _ensure_database(client, config.database)
        client.database = config.database
        return client
    with _CHDB_LOCK:
        key = (path, config.database)
        if key in _CHDB_CLIENTS:
            return _CHDB_CLIENTS[key]
        open_paths = {p for p, _ in _CHDB_CLIENTS}
        if open_paths and path not in open_paths:
            raise ValueError(
                f"this process already has chDB open at {open_paths.pop()!r}; one process can open only one "
                f"chDB path ({path!r} requested): isolate by database name instead"
            )
        if path != ":memory:":
            os.makedirs(path, exist_ok=True)
        client = clickhouse_connect.get_client(interface="chdb", path=None if path == ":memory:" else path)
        _ensure_database(client, config.database)
        client.database = config.database
        _CHDB_CLIENTS[key] = client
        logger.info("opened chDB at %s (database %s)", path, config.database)
        return client


def _ensure_database(client: Client, database: str) -> None:
    client.command(f"CREATE DATABASE IF NOT EXISTS `{check_database(database)}`", use_database=False)


def _bound(client: Client, database: str) -> Client:
    """The client, or a sibling on the same chDB engine, whose default database is ``database``."""
    if client.database == database:
        return client
    path = getattr(client, "path", None)
    with _CHDB_LOCK:
        is_chdb = any(path == p for p, _ in _CHDB_CLIENTS)
    if is_chdb:
        url = "chdb://memory" if path == ":memory:" else f"chdb://{path}"
        return connect(ClickHouseConfig(url=url, database=database))
    raise ValueError(f"client's default database is {client.database!r}, not {database!r}: connect() with it")


def ddl_statements(database: str) -> list[str]:
    """Every statement of ``sql/*.sql`` in file order, with the database substituted."""
    quoted = f"`{check_database(database)}`"
    folder = resources.files("fleetscope.sinks").joinpath("sql")
    statements: list[str] = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        text = entry.read_text(encoding="utf-8").replace("{database}", quoted)
        body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
        statements.extend(s.strip() for s in body.split(";") if s.strip())
    return statements


def migrate(client: Client, database: str) -> None:
    """Create the database, tables and views; idempotent, so every process runs it on start."""
    _ensure_database(client, database)
    for statement in ddl_statements(database):
        client.command(statement, use_database=False)
    logger.info("schema of database %s is up to date", database)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """Bounded retries with jittered exponential backoff for transient ClickHouse errors."""

    max_attempts: int = 5
    initial_backoff_ms: int = 100
    max_backoff_ms: int = 5_000

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.initial_backoff_ms < 0 or self.max_backoff_ms < self.initial_backoff_ms:
            raise ValueError(f"invalid RetryPolicy: {self}")

    def delay_s(self, attempt: int) -> float:
        """Equal jitter: half the capped exponential step, plus a random share of the other half."""
        step = min(self.max_backoff_ms, self.initial_backoff_ms * 2**attempt) / 1000.0
        return float(step / 2 + random.uniform(0, step / 2))


def is_transient(exc: BaseException) -> bool:
    """True for errors a retry may fix (network, timeouts, overload); False for bad SQL or bad data."""
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    if isinstance(exc, ch_errors.ClickHouseError):
        code = getattr(exc, "code", None)
        if code is None:
            return isinstance(exc, ch_errors.OperationalError)
        return code in _TRANSIENT_CODES
    return False


_T = TypeVar("_T")


def _avro_fields(subject: str) -> list[tuple[str, Any]]:
    return [(f["name"], f["type"]) for f in CATALOG.latest(subject).parsed["fields"]]


def _avro_defaults(*subjects: str) -> dict[str, Any]:
    """Defaults of fields added by later schema versions: records built before them (or by hand) lack them."""
    return {f["name"]: f["default"] for s in subjects for f in CATALOG.latest(s).parsed["fields"] if "default" in f}


def _column(values: list[Any], avro_type: Any) -> npt.NDArray[Any] | list[Any]:
    dtype = _AVRO_DTYPES.get(avro_type) if isinstance(avro_type, str) else None
    if dtype is None or dtype is object:
        return values
    return np.asarray(values, dtype=dtype)


class ClickHouseWriter:
    """Writes decoded Avro records (dicts) into the tables, column-oriented, retrying transient errors.

    Insert columns come from the Avro schemas, so the record contract is defined once; a new schema
    field without a matching column fails loudly."""

    def __init__(self, client: Client, database: str, *, retry: RetryPolicy | None = None) -> None:
        self._client = client
        self._database = check_database(database)
        self._retry = retry or RetryPolicy()
        self._iteration_fields = _avro_fields("iterations")
        self._finding_fields = _avro_fields("findings")
        pattern_fields = _avro_fields("patterns")
        self._pattern_scalars = [(n, t) for n, t in pattern_fields if not _is_array(t)]
        self._pattern_arrays = [(n, t["items"]) for n, t in pattern_fields if _is_array(t)]
        self._defaults = _avro_defaults("iterations", "findings", "patterns")
        self._kind_names = np.full(max(FunctionKind) + 1, "unknown", dtype=object)
        for kind in FunctionKind:
            self._kind_names[kind.value] = kind.name.lower()
        # clickhouse-connect imports pandas on the first insert (0.2-0.4 CPU s): pay it here, not while
        # the first rows, and the first findings, wait.
        _ = ch_options.pd

    @property
    def database(self) -> str:
        return self._database

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
            columns[name] = np.concatenate([np.asarray(_entries(r, name), dtype=dtype) for r in records])
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
        query = (
            f"SELECT DISTINCT {', '.join(names)} FROM `{self._database}`.{table} "
            f"WHERE ({', '.join(names)}) IN {{keys:Array(Tuple({', '.join(t for _, t in key_spec)}))}}"
        )
        seen: set[tuple[Any, ...]] = set()
        for i in range(0, len(distinct), _KEY_CHUNK):
            chunk = distinct[i : i + _KEY_CHUNK]

            def call(chunk: list[tuple[Any, ...]] = chunk) -> list[Any]:
                return list(self._client.query(query, parameters={"keys": chunk}).result_rows)

            rows = with_retries(call, self._retry, what=f"key lookup in {self._database}.{table}")
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

        with_retries(call, self._retry, what=f"insert into {self._database}.{table}")


def with_retries(call: Callable[[], _T], policy: RetryPolicy, *, what: str) -> _T:
    """Run ``call``, retrying transient errors up to ``policy.max_attempts``; permanent ones raise at once."""
    attempt = 0
    while True:
        try:
            return call()
        except Exception as exc:
            attempt += 1
            if not is_transient(exc) or attempt >= policy.max_attempts:
                raise
            delay = policy.delay_s(attempt - 1)
            logger.warning(
                "%s failed (attempt %d/%d), retrying in %.2fs: %s",
                what,
                attempt,
                policy.max_attempts,
                delay,
                exc,
            )
            time.sleep(delay)


def _is_array(avro_type: Any) -> bool:
    return isinstance(avro_type, dict) and avro_type.get("type") == "array"


@functools.cache
def _pattern_array_names() -> tuple[str, ...]:
    return tuple(name for name, avro_type in _avro_fields("patterns") if _is_array(avro_type))


def pattern_rows(record: Mapping[str, Any]) -> int:
    """Rows a PatternBatch explodes into; ValueError when its column arrays differ in length."""
    n = len(record["function"])
    for name in _pattern_array_names():
        if len(_entries(record, name)) != n:
            raise ValueError(f"pattern column {name!r} has {len(record[name])} entries, function has {n}")
    return n


@functools.cache
def _optional_arrays() -> frozenset[str]:
    """Pattern arrays added later with default ``[]``: a record from an older producer has none."""
    return frozenset(n for n, v in _avro_defaults("patterns").items() if v == [] and n in _pattern_array_names())


def _entries(record: Mapping[str, Any], name: str) -> Any:
    """A pattern column; an optional one the record lacks (absent or empty) is zeros."""
    values = record.get(name)
    if name in _optional_arrays() and not (values is not None and len(values)):
        return np.zeros(len(record["function"]), dtype=np.int64)
    return record[name]


_FINDING_COLUMNS = (
    "job",
    "finding_id",
    "status",
    "version",
    "rank",
    "ranks",
    "host",
    "category",
    "function",
    "metric",
    "value",
    "peer_median",
    "score",
    "iteration_first",
    "iteration_last",
    "est_loss_ns",
    "evidence",
    "first_seen_ns",
    "last_seen_ns",
    "subject",
    "reason",
    "local_rank",
    "gpu_uuid",
    "pci_bus_id",
)


def current_findings(client: Client, database: str, job: str | None = None) -> list[dict[str, Any]]:
    """Current state of every finding (open and closed), biggest estimated loss first; JSON-ready."""
    where = "WHERE job = {job:String}" if job is not None else ""
    query = (
        f"SELECT {', '.join(_FINDING_COLUMNS)} FROM `{check_database(database)}`.{FINDINGS} {where} "
        "ORDER BY est_loss_ns DESC, job, finding_id"
    )
    result = client.query(query, parameters={"job": job} if job is not None else None)
    out: list[dict[str, Any]] = []
    for row in result.result_rows:
        item = dict(zip(_FINDING_COLUMNS, row, strict=True))
        item["ranks"] = list(item["ranks"])
        try:
            evidence = json.loads(item["evidence"]) if item["evidence"] else {}
        except ValueError:
            evidence = {"raw": item["evidence"]}
        item["evidence"] = evidence if isinstance(evidence, dict) else {"value": evidence}
        out.append(item)
    return out


def table_counts(client: Client, database: str) -> dict[str, int]:
    """Rows per table (before background deduplication) and distinct findings in the view."""
    db = check_database(database)
    parts = " UNION ALL ".join(f"SELECT '{t}' AS name, count() AS n FROM `{db}`.{t}" for t in (*TABLES, FINDINGS))
    rows = client.query(parts).result_rows
    return {str(name): int(n) for name, n in rows}
