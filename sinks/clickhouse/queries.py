"""The reads the commands make of the ClickHouse store: current findings, row counts, and a job's removal."""

from __future__ import annotations

import json
from typing import Any

from clickhouse_connect.driver import Client

from fleetscope.sinks.clickhouse.tables import FINDING_COLUMNS, FINDINGS, TABLES
from fleetscope.sinks.store_config import check_database


def current_findings(client: Client, database: str, job: str | None = None) -> list[dict[str, Any]]:
    """Current state of every finding (open and closed), biggest estimated loss first; JSON-ready."""
    where = "WHERE job = {job:String}" if job is not None else ""
    query = (
        f"SELECT {', '.join(FINDING_COLUMNS)} FROM `{check_database(database)}`.{FINDINGS} {where} "
        "ORDER BY est_loss_ns DESC, job, finding_id"
    )
    result = client.query(query, parameters={"job": job} if job is not None else None)
    out: list[dict[str, Any]] = []
    for row in result.result_rows:
        item = dict(zip(FINDING_COLUMNS, row, strict=True))
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


def forget_job(client: Client, database: str, job: str) -> None:
    """Delete every row of ``job`` from the tables (lightweight deletes; the view follows)."""
    db = check_database(database)
    for table in TABLES:
        client.command(f"DELETE FROM `{db}`.{table} WHERE job = {{job:String}}", parameters={"job": job})
