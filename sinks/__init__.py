"""ClickHouse storage for the pipeline's derived records.

In: Avro records from the ``<prefix>.iterations``, ``<prefix>.patterns`` and ``<prefix>.findings`` topics
(decoded with ``fleetscope.schemas.decode``), or the same records as dicts handed to ``ClickHouseWriter``.
Out: rows in the ``iterations``, ``function_patterns`` and ``finding_updates`` tables and the ``findings``
view (current state per finding) of one ClickHouse database; undecodable messages on ``<prefix>.deadletter``.

The store is chDB in-process by default (``chdb://<path>``; one path per process, so isolate by database)
or a ClickHouse server (``http(s)://host:port``). DDL lives in ``sql/*.sql`` and runs on every start.
"""

from fleetscope.sinks.clickhouse import (
    FINDING_UPDATES,
    FINDINGS,
    FUNCTION_PATTERNS,
    ITERATIONS,
    ClickHouseConfig,
    ClickHouseWriter,
    RetryPolicy,
    connect,
    current_findings,
    migrate,
    table_counts,
)
from fleetscope.sinks.sink import Sink, SinkConfig
from fleetscope.sinks.user_sql import readonly_session, readonly_settings, run_sql

__all__ = [
    "FINDINGS",
    "FINDING_UPDATES",
    "FUNCTION_PATTERNS",
    "ITERATIONS",
    "ClickHouseConfig",
    "ClickHouseWriter",
    "RetryPolicy",
    "Sink",
    "SinkConfig",
    "connect",
    "current_findings",
    "migrate",
    "readonly_session",
    "readonly_settings",
    "run_sql",
    "table_counts",
]
