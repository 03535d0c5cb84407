"""ClickHouse storage for the pipeline's derived records.

In: Avro records from the ``<prefix>.iterations``, ``<prefix>.patterns`` and ``<prefix>.findings`` topics
(decoded with ``fleetscope.schemas.decode``), or the same records as dicts handed to ``ClickHouseWriter``.
Out: rows in the ``iterations``, ``function_patterns`` and ``finding_updates`` tables and the ``findings``
view (current state per finding) of one ClickHouse database; undecodable messages on ``<prefix>.deadletter``.

The store is chDB in-process by default (``chdb://<path>``; one path per process, so isolate by database)
or a ClickHouse server (``http(s)://host:port``). DDL lives in ``sql/*.sql`` and runs on every start.
"""

import importlib
from typing import Any

_EXPORTS = {
    "FINDINGS": "clickhouse",
    "FINDING_UPDATES": "clickhouse",
    "FUNCTION_PATTERNS": "clickhouse",
    "ITERATIONS": "clickhouse",
    "ClickHouseWriter": "clickhouse",
    "RetryPolicy": "clickhouse",
    "connect": "clickhouse",
    "current_findings": "clickhouse",
    "migrate": "clickhouse",
    "run_sql": "user_sql",
    "readonly_session": "user_sql",
    "readonly_settings": "user_sql",
    "table_counts": "clickhouse",
    "ClickHouseConfig": "store_config",
    "Sink": "sink",
    "SinkConfig": "sink",
}
"""Public name -> submodule. Imported on first use, so ``fleetscope.sinks.store_config`` (read by every
process that loads the configuration) does not pull in the ClickHouse driver."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
