"""The reads the commands make of the ClickHouse store: current findings, row counts, the report's figures,
a run's steps for ``diff``, and a job's removal.

Every statement is a literal: values are the driver's server-side parameters (``{job:String}``), the
database and table names ``{name:Identifier}`` parameters bound from the project's own fixed lists."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from clickhouse_connect.driver import Client

from fleetscope.sinks.clickhouse.tables import FINDING_COLUMNS, FINDINGS, FUNCTION_PATTERNS, ITERATIONS, TABLES
from fleetscope.sinks.store import FunctionMean, IterationBucket, IterationSpan, RankBandwidth
from fleetscope.sinks.store_config import check_database

_FINDINGS_OF_JOB = (
    "SELECT * FROM {db:Identifier}.{view:Identifier} WHERE job = {job:String} "
    "ORDER BY est_loss_ns DESC, job, finding_id"
)
_ALL_FINDINGS = "SELECT * FROM {db:Identifier}.{view:Identifier} ORDER BY est_loss_ns DESC, job, finding_id"


def _at(database: str, table: str) -> dict[str, str]:
    """The ``{db:Identifier}.{table:Identifier}`` parameters of one of the store's own tables."""
    return {"db": check_database(database), "table": table}


def current_findings(client: Client, database: str, job: str | None = None) -> list[dict[str, Any]]:
    """Current state of every finding (open and closed), biggest estimated loss first; JSON-ready."""
    params: dict[str, Any] = {"db": check_database(database), "view": FINDINGS}
    if job is not None:
        params["job"] = job
    result = client.query(_FINDINGS_OF_JOB if job is not None else _ALL_FINDINGS, parameters=params)
    names = list(result.column_names)
    out: list[dict[str, Any]] = []
    for row in result.result_rows:
        stored = dict(zip(names, row, strict=True))
        item = {name: stored[name] for name in FINDING_COLUMNS}
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
    query = "SELECT count() FROM {db:Identifier}.{table:Identifier}"
    return {table: int(client.query(query, parameters=_at(database, table)).result_rows[0][0])
            for table in (*TABLES, FINDINGS)}  # fmt: skip


def forget_job(client: Client, database: str, job: str) -> None:
    """Delete every row of ``job`` from the tables (lightweight deletes; the view follows)."""
    for table in TABLES:
        client.command("DELETE FROM {db:Identifier}.{table:Identifier} WHERE job = {job:String}",
                       parameters={**_at(database, table), "job": job})  # fmt: skip


def function_means(client: Client, database: str, job: str) -> list[FunctionMean]:
    """``Store.function_means``: per function and rank, the mean of the pattern rows' means and their total."""
    query = (
        "SELECT function, any(kind_name), rank, avg(mean_ns), sum(total_ns) FROM {db:Identifier}.{table:Identifier} "
        "WHERE job = {job:String} GROUP BY function, rank"
    )
    rows = client.query(query, parameters={**_at(database, FUNCTION_PATTERNS), "job": job}).result_rows
    return [FunctionMean(str(f), str(k), int(r), float(m), float(t)) for f, k, r, m, t in rows]


def iteration_span(client: Client, database: str, job: str) -> IterationSpan:
    """``Store.iteration_span``: min and max iteration, distinct (rank, iteration) pairs, earliest start."""
    query = (
        "SELECT min(iteration), max(iteration), uniqExact((rank, iteration)), min(start_at) "
        "FROM {db:Identifier}.{table:Identifier} WHERE job = {job:String}"
    )
    (lo, hi, n, started), *_ = client.query(query, parameters={**_at(database, ITERATIONS), "job": job}).result_rows
    return IterationSpan(int(lo or 0), int(hi or 0), int(n or 0), started if isinstance(started, datetime) else None)


def iteration_buckets(client: Client, database: str, job: str, step: int) -> list[IterationBucket]:
    """``Store.iteration_buckets``: per rank and bucket of ``step`` iterations, host and mean times in ms."""
    query = (
        "SELECT rank, any(host), intDiv(iteration, {step:UInt32}) * {step:UInt32} AS it, "
        "avg(duration_ns) / 1e6, avg(compute_ns) / 1e6 FROM {db:Identifier}.{table:Identifier} "
        "WHERE job = {job:String} GROUP BY rank, it ORDER BY rank, it"
    )
    params = {**_at(database, ITERATIONS), "job": job, "step": step}
    rows = client.query(query, parameters=params).result_rows
    return [IterationBucket(int(r), str(h), int(it), float(d), float(c)) for r, h, it, d, c in rows]


def collective_bandwidth(client: Client, database: str, job: str) -> list[RankBandwidth]:
    """``Store.collective_bandwidth``: per rank, mean bus bandwidth and NVLink throughput of its collectives."""
    query = (
        "SELECT rank, avgIf(busbw_gbps, isFinite(busbw_gbps) AND busbw_gbps > 0), "
        "avgIf(nvlink_mean_bps, isFinite(nvlink_mean_bps)) / 1e9 FROM {db:Identifier}.{table:Identifier} "
        "WHERE job = {job:String} AND kind_name = 'collective' GROUP BY rank"
    )
    rows = client.query(query, parameters={**_at(database, FUNCTION_PATTERNS), "job": job}).result_rows
    return [RankBandwidth(int(r), float(b), float(lk)) for r, b, lk in rows]


def job_activity(client: Client, database: str, job: str) -> tuple[int, int]:
    """``Store.job_activity``: iteration rows of ``job`` and the latest end among them (ns)."""
    query = "SELECT count(), max(end_ns) FROM {db:Identifier}.{table:Identifier} WHERE job = {job:String}"
    (count, last_ns), *_ = client.query(query, parameters={**_at(database, ITERATIONS), "job": job}).result_rows
    return int(count), int(last_ns or 0)


def run_iterations(client: Client, database: str, job: str) -> list[tuple[int, int, int, int, float]]:
    """``Store.run_iterations``: (pp_rank, tp_rank, iteration, ranks, mean iteration ns) per role and
    iteration, from the pattern rows (one per rank and iteration counted, replays included once; a rank's
    iteration under a profiler window is left out, as the diff compares unprofiled work only)."""
    query = (
        "SELECT r_pp, r_tp, r_it, count(), avg(r_ns) FROM ("
        " SELECT pp_rank AS r_pp, tp_rank AS r_tp, iteration AS r_it, rank AS r_rank, any(iteration_ns) AS r_ns"
        " FROM {db:Identifier}.{table:Identifier} WHERE job = {job:String} AND NOT profiled"
        " GROUP BY r_pp, r_tp, r_it, r_rank"
        ") GROUP BY r_pp, r_tp, r_it ORDER BY r_pp, r_tp, r_it"
    )
    rows = client.query(query, parameters={**_at(database, FUNCTION_PATTERNS), "job": job}).result_rows
    return [(int(pp), int(tp), int(it), int(n), float(ns)) for pp, tp, it, n, ns in rows]


def function_moments(
    client: Client, database: str, job: str, first_iteration: int, last_iteration: int
) -> list[tuple[int, int, str, str, int, float, float, float]]:
    """``Store.function_moments``: per role and function over the iterations ``first..last``, (pp_rank,
    tp_rank, function, kind name, iterations present, sum and sum of squares of the per-rank time per
    iteration, per-rank calls summed). Per iteration, the role's total over its ranks is divided by the
    role's ranks that iteration (those with any pattern row), so one rank of the role is what is measured."""
    query = (
        "SELECT m_pp, m_tp, m_fn, any(m_kind), count(), sum(m_v), sum(m_v * m_v), sum(m_c) FROM ("
        " SELECT p_pp AS m_pp, p_tp AS m_tp, p_fn AS m_fn, any(p_kind) AS m_kind,"
        "  sum(p_total) / any(p_ranks) AS m_v, sum(p_calls) / any(p_ranks) AS m_c FROM ("
        "   SELECT pp_rank AS p_pp, tp_rank AS p_tp, iteration AS p_it, function AS p_fn, kind_name AS p_kind,"
        "    total_ns AS p_total, calls AS p_calls,"
        "    uniqExact(rank) OVER (PARTITION BY pp_rank, tp_rank, iteration) AS p_ranks"
        "   FROM {db:Identifier}.{table:Identifier} FINAL WHERE job = {job:String} AND NOT profiled"
        "    AND iteration BETWEEN {first:Int64} AND {last:Int64}"
        "  ) GROUP BY m_pp, m_tp, m_fn, p_it"
        ") GROUP BY m_pp, m_tp, m_fn ORDER BY m_pp, m_tp, m_fn"
    )
    params = {**_at(database, FUNCTION_PATTERNS), "job": job, "first": first_iteration, "last": last_iteration}
    rows = client.query(query, parameters=params).result_rows
    return [(int(pp), int(tp), str(fn), str(kind), int(n), float(s1), float(s2), float(c))
            for pp, tp, fn, kind, n, s1, s2, c in rows]  # fmt: skip
