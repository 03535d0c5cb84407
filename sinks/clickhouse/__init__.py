"""The ClickHouse store: chDB in-process (``chdb://<path>``, ``chdb://memory``) or a server (``http(s)://``).

In: decoded Avro records of the ``iterations``, ``patterns`` and ``findings`` subjects. Out: rows in the
``iterations``, ``function_patterns`` and ``finding_updates`` tables and the ``findings`` view (current state
per finding). ``client`` connects and migrates (DDL in ``sql/*.sql``, run on every start), ``writer`` writes
batches idempotently, ``queries`` and ``user_sql`` read, ``store`` puts them behind the ``Store`` seam,
``adapter`` (``ADAPTER``) is the store kind the seam opens by URL, ``server`` and ``http_framing`` serve a
chDB store over ClickHouse's HTTP interface (``up``), ``messages`` words ClickHouse's errors.
Importing this package loads the driver; the configuration (``fleetscope.sinks.store_config``) does not.
"""

from fleetscope.sinks.clickhouse.adapter import ADAPTER
from fleetscope.sinks.clickhouse.client import (
    bound,
    connect,
    ddl_statements,
    is_transient,
    migrate,
    rejects_records,
    store_unavailable,
)
from fleetscope.sinks.clickhouse.queries import current_findings, forget_job, table_counts
from fleetscope.sinks.clickhouse.store import ClickHouseStore, open_clickhouse
from fleetscope.sinks.clickhouse.tables import (
    FINDING_COLUMNS,
    FINDING_UPDATES,
    FINDINGS,
    FUNCTION_PATTERNS,
    ITERATIONS,
    NATURAL_KEYS,
    TABLES,
)
from fleetscope.sinks.clickhouse.user_sql import readonly_session, readonly_settings, run_sql
from fleetscope.sinks.clickhouse.writer import ClickHouseWriter

__all__ = [
    "ADAPTER",
    "FINDINGS",
    "FINDING_COLUMNS",
    "FINDING_UPDATES",
    "FUNCTION_PATTERNS",
    "ITERATIONS",
    "NATURAL_KEYS",
    "TABLES",
    "ClickHouseStore",
    "ClickHouseWriter",
    "bound",
    "connect",
    "current_findings",
    "ddl_statements",
    "forget_job",
    "is_transient",
    "migrate",
    "open_clickhouse",
    "readonly_session",
    "readonly_settings",
    "rejects_records",
    "run_sql",
    "store_unavailable",
    "table_counts",
]
