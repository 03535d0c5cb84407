"""Sinks: the pipeline's derived records into a store, and alerts out of the findings topic.

In: Avro records from the ``<prefix>.iterations``, ``<prefix>.patterns`` and ``<prefix>.findings`` topics
(decoded with ``fleetscope.schemas.decode``). Out: the records in a ``Store`` (``store.py``: the seam;
``open_store`` the one start-up sequence), undecodable messages on ``<prefix>.deadletter``, alerts.

The store is ClickHouse (``clickhouse/``): chDB in-process by default (``chdb://<path>``; one path per
process, so isolate by database) or a server (``http(s)://host:port``). ``sink.py`` knows only the seam.
"""

from typing import Any

from fleetscope.schemas.lazy import load_export

_EXPORTS = {
    "FINDINGS": "clickhouse",
    "FINDING_UPDATES": "clickhouse",
    "FUNCTION_PATTERNS": "clickhouse",
    "ITERATIONS": "clickhouse",
    "ClickHouseStore": "clickhouse",
    "ClickHouseWriter": "clickhouse",
    "connect": "clickhouse",
    "current_findings": "clickhouse",
    "migrate": "clickhouse",
    "run_sql": "clickhouse",
    "readonly_session": "clickhouse",
    "readonly_settings": "clickhouse",
    "table_counts": "clickhouse",
    "StoreConfig": "store_config",
    "RecordWriter": "store",
    "Store": "store",
    "open_store": "store",
    "RetryPolicy": "retry",
    "Sink": "sink",
    "SinkConfig": "sink_clients",
}
"""Public name -> submodule. Imported on first use, so ``fleetscope.sinks.store_config`` (read by every
process that loads the configuration) does not pull in the ClickHouse driver."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    return load_export(__name__, _EXPORTS, name)
