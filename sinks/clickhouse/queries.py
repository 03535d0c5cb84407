"""The reads the commands make of the ClickHouse store: current findings, row counts, a run's steps for
``diff``, and a job's removal."""

from __future__ import annotations

import json
from typing import Any

from clickhouse_connect.driver import Client

from fleetscope.sinks.clickhouse.tables import FINDING_COLUMNS, FINDINGS, FUNCTION_PATTERNS, TABLES
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


def run_iterations(client: Client, database: str, job: str) -> list[tuple[int, int, int, int, float]]:
    """``Store.run_iterations``: (pp_rank, tp_rank, iteration, ranks, mean iteration ns) per role and
    iteration, from the pattern rows (one per rank and iteration counted, replays included once; a rank's
    iteration under a profiler window is left out, as the diff compares unprofiled work only)."""
    db = check_database(database)
    query = (
        "SELECT r_pp, r_tp, r_it, count(), avg(r_ns) FROM ("
        " SELECT pp_rank AS r_pp, tp_rank AS r_tp, iteration AS r_it, rank AS r_rank, any(iteration_ns) AS r_ns"
        f" FROM `{db}`.{FUNCTION_PATTERNS} WHERE job = {{job:String}} AND NOT profiled"
        " GROUP BY r_pp, r_tp, r_it, r_rank"
        ") GROUP BY r_pp, r_tp, r_it ORDER BY r_pp, r_tp, r_it"
    )
    rows = client.query(query, parameters={"job": job}).result_rows
    return [(int(pp), int(tp), int(it), int(n), float(ns)) for pp, tp, it, n, ns in rows]


def function_moments(
    client: Client, database: str, job: str, first_iteration: int, last_iteration: int
) -> list[tuple[int, int, str, str, int, float, float, float]]:
    """``Store.function_moments``: per role and function over the iterations ``first..last``, (pp_rank,
    tp_rank, function, kind name, iterations present, sum and sum of squares of the per-rank time per
    iteration, per-rank calls summed). Per iteration, the role's total over its ranks is divided by the
    role's ranks that iteration (those with any pattern row), so one rank of the role is what is measured."""
    db = check_database(database)
    query = (
        "SELECT m_pp, m_tp, m_fn, any(m_kind), count(), sum(m_v), sum(m_v * m_v), sum(m_c) FROM ("
        " SELECT p_pp AS m_pp, p_tp AS m_tp, p_fn AS m_fn, any(p_kind) AS m_kind,"
        "  sum(p_total) / any(p_ranks) AS m_v, sum(p_calls) / any(p_ranks) AS m_c FROM ("
        "   SELECT pp_rank AS p_pp, tp_rank AS p_tp, iteration AS p_it, function AS p_fn, kind_name AS p_kind,"
        "    total_ns AS p_total, calls AS p_calls,"
        "    uniqExact(rank) OVER (PARTITION BY pp_rank, tp_rank, iteration) AS p_ranks"
        f"   FROM `{db}`.{FUNCTION_PATTERNS} FINAL WHERE job = {{job:String}} AND NOT profiled"
        "    AND iteration BETWEEN {first:Int64} AND {last:Int64}"
        "  ) GROUP BY m_pp, m_tp, m_fn, p_it"
        ") GROUP BY m_pp, m_tp, m_fn ORDER BY m_pp, m_tp, m_fn"
    )
    params = {"job": job, "first": first_iteration, "last": last_iteration}
    rows = client.query(query, parameters=params).result_rows
    return [(int(pp), int(tp), str(fn), str(kind), int(n), float(s1), float(s2), float(c))
            for pp, tp, fn, kind, n, s1, s2, c in rows]  # fmt: skip
