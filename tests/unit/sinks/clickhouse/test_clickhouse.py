"""ClickHouse sink against real chDB: schema, writes, the findings view, dedup and the query helpers."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clickhouse_connect.driver import Client
from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError, ProgrammingError

from fleetscope.sinks import (
    ClickHouseWriter,
    RetryPolicy,
    StoreConfig,
    connect,
    current_findings,
    migrate,
    run_sql,
    table_counts,
)
from fleetscope.sinks.clickhouse import ddl_statements

T0 = 1_700_000_000_000_000_000


@pytest.fixture()
def database() -> str:
    return f"t_{uuid.uuid4().hex}"


@pytest.fixture()
def client(chdb_path: Path, database: str) -> Iterator[Client]:
    client = connect(StoreConfig(url=f"chdb://{chdb_path}", database=database))
    migrate(client, database)
    yield client
    client.command(f"DROP DATABASE IF EXISTS `{database}`", use_database=False)


@pytest.fixture()
def writer(client: Client, database: str) -> ClickHouseWriter:
    return ClickHouseWriter(client, database)


def iteration(rank: int, it: int, job: str = "job-a") -> dict[str, Any]:
    start = T0 + it * 1_000_000_000
    return {
        "job": job, "rank": rank, "host": f"node{rank // 8}", "world_size": 16,
        "tp_rank": rank % 2, "pp_rank": 0, "dp_rank": rank // 2, "iteration": it,
        "detected_by": "step_marker", "start_ns": start, "end_ns": start + 900_000_000,
        "duration_ns": 900_000_000, "gpu_busy_ns": 800_000_000, "compute_ns": 600_000_000,
        "collective_ns": 200_000_000, "exposed_collective_ns": 50_000_000, "idle_ns": 100_000_000,
        "max_idle_gap_ns": 7_000_000, "kernels": 1200 + rank, "functions": 3, "profiled": it == 2,
        "local_rank": rank % 8, "gpu_uuid": f"GPU-{rank:04d}", "cpu_wait_ns": -1 if rank == 3 else 1_000 * it,
    }  # fmt: skip


def pattern_batch(rank: int, it: int, functions: list[str], job: str = "job-a") -> dict[str, Any]:
    n = len(functions)
    nan = float("nan")
    return {
        "job": job, "rank": rank, "host": f"node{rank // 8}", "world_size": 16,
        "tp_rank": -1, "pp_rank": -1, "dp_rank": -1, "iteration": it,
        "iteration_start_ns": T0 + it * 1_000_000_000, "iteration_ns": 900_000_000,
        "function": functions, "kind": [i % 4 for i in range(n)], "calls": [i + 1 for i in range(n)],
        "total_ns": [1000 * (i + 1) + rank for i in range(n)], "mean_ns": [10.5 * (i + 1) for i in range(n)],
        "p50_ns": [10.0] * n, "p99_ns": [20.0] * n, "max_ns": [30] * n, "cv": [0.1] * n,
        "share": [0.25] * n, "nbytes": [2**30 if i % 4 == 2 else 0 for i in range(n)],
        "algbw_gbps": [100.0 if i % 4 == 2 else nan for i in range(n)],
        "busbw_gbps": [175.0 if i % 4 == 2 else nan for i in range(n)],
        "nvlink_mean_bps": [nan] * n, "nvlink_cv": [nan] * n, "nvlink_peak_bps": [nan] * n,
        "pcie_mean_bps": [1e9] * n, "pcie_cv": [0.5] * n, "pcie_peak_bps": [2e9] * n,
    }  # fmt: skip


def finding(fid: str, version: int, status: str, job: str = "job-a", loss: int = 1_000) -> dict[str, Any]:
    return {
        "finding_id": fid, "status": status, "version": version, "job": job, "rank": 3, "ranks": [3],
        "host": "node0", "category": "gpu_slow", "function": "sm90_gemm", "metric": "mean_ns",
        "value": 1.5 * version, "peer_median": 1.0, "score": 4.0 + version, "iteration_first": 10,
        "iteration_last": 10 + version, "est_loss_ns": loss * version,
        "evidence": json.dumps({"version": version, "clock_mhz": 1100}), "emitted_ns": T0 + version * 10**9,
    }  # fmt: skip


def count(client: Client, database: str, table: str, final: bool = False) -> int:
    suffix = " FINAL" if final else ""
    return int(client.query(f"SELECT count() FROM `{database}`.{table}{suffix}").result_rows[0][0])


def test_migrate_twice_is_idempotent_and_keeps_data(client: Client, writer: ClickHouseWriter, database: str) -> None:
    writer.write_iterations([iteration(0, 1)])
    migrate(client, database)
    migrate(client, database)
    names = {row[0] for row in client.query(f"SHOW TABLES FROM `{database}`").result_rows}
    assert names == {"iterations", "function_patterns", "finding_updates", "findings", "layouts"}
    assert count(client, database, "iterations") == 1


def test_ddl_substitutes_only_the_validated_database_name() -> None:
    statements = ddl_statements("fleet_1")
    assert len(statements) == 5 + 14  # five tables and views, fourteen added columns
    assert all("`fleet_1`." in s and "{database}" not in s for s in statements)
    with pytest.raises(ValueError, match="identifier"):
        ddl_statements("x; DROP TABLE y")


def test_config_reports_every_error_at_once_and_hides_the_password(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        StoreConfig(url="ftp://x", database="1bad", flush_rows=0, flush_interval_ms=-1)
    message = str(info.value)
    for key in ("url:", "database:", "flush_rows:", "flush_interval_ms:"):
        assert key in message
    with pytest.raises(ValueError, match="password"):
        StoreConfig(url="http://u:secret@host:8123")
    config = StoreConfig(url="chdb://rel/store", password="hunter2")
    assert "hunter2" not in repr(config)
    assert config.local_path is not None and Path(config.local_path).is_absolute()
    assert StoreConfig(url="chdb://memory").local_path == ":memory:"
    assert StoreConfig(url="http://localhost:8123").local_path is None


def test_connect_reuses_clients_and_refuses_a_second_chdb_path(
    client: Client, chdb_path: Path, database: str, tmp_path: Path
) -> None:
    assert connect(StoreConfig(url=f"chdb://{chdb_path}", database=database)) is client
    with pytest.raises(ValueError, match="only one chDB path"):
        connect(StoreConfig(url=f"chdb://{tmp_path / 'other'}", database=database))


def test_iterations_round_trip_every_field(client: Client, writer: ClickHouseWriter, database: str) -> None:
    records = [iteration(rank, it) for rank in range(4) for it in range(3)]
    assert writer.write_iterations(records) == 12
    columns, rows = run_sql(client, database, "SELECT * EXCEPT (start_at, inserted_at) FROM iterations")
    got = sorted((dict(zip(columns, row, strict=True)) for row in rows), key=lambda r: (r["rank"], r["iteration"]))
    assert got == sorted(records, key=lambda r: (r["rank"], r["iteration"]))
    start_at = client.query(f"SELECT toUnixTimestamp64Milli(min(start_at)) FROM `{database}`.iterations")
    assert start_at.result_rows[0][0] == T0 // 1_000_000


def test_patterns_explode_to_one_row_per_function(client: Client, writer: ClickHouseWriter, database: str) -> None:
    batches = [
        pattern_batch(0, 5, ["gemm", "memcpy", "ncclDevKernel_AllReduce", "dataloader.next"]),
        pattern_batch(1, 5, ["gemm", "ncclDevKernel_AllReduce"]),
        pattern_batch(2, 5, []),
    ]
    assert writer.write_patterns(batches) == 6
    assert writer.write_patterns([]) == 0
    _, rows = run_sql(
        client,
        database,
        "SELECT rank, host, iteration, function, kind, kind_name, calls, total_ns, mean_ns, algbw_gbps,"
        " nvlink_mean_bps, nbytes, toUnixTimestamp64Milli(iteration_start) FROM function_patterns"
        " ORDER BY rank, calls",
    )
    assert len(rows) == 6
    first = rows[0]
    assert first[:8] == (0, "node0", 5, "gemm", 0, "compute", 1, 1000)
    assert first[8] == 10.5 and math.isnan(first[9]) and math.isnan(first[10])
    assert first[12] == (T0 + 5 * 10**9) // 1_000_000
    collective = rows[2]
    assert collective[3:6] == ("ncclDevKernel_AllReduce", 2, "collective")
    assert collective[9] == 100.0 and collective[11] == 2**30
    assert [r[5] for r in rows] == ["compute", "memory", "collective", "python", "compute", "memory"]
    assert [r[0] for r in rows] == [0, 0, 0, 0, 1, 1]


def test_pattern_batch_with_ragged_columns_is_rejected(writer: ClickHouseWriter) -> None:
    bad = pattern_batch(0, 1, ["a", "b"])
    bad["cv"] = [0.1]
    with pytest.raises(ValueError, match="'cv'"):
        writer.write_patterns([bad])


def test_findings_view_holds_the_latest_version_of_each_finding(
    client: Client, writer: ClickHouseWriter, database: str
) -> None:
    updates = [
        finding("f1", 1, "open"),
        finding("f1", 2, "update"),
        finding("f2", 1, "open", loss=50_000),
        finding("f3", 1, "open", loss=10),
        finding("f3", 2, "update", loss=10),
        finding("f1", 3, "closed"),
        finding("f1", 1, "open", job="job-b"),
    ]
    assert writer.write_findings(updates) == 7
    assert count(client, database, "finding_updates") == 7
    assert count(client, database, "findings") == 4
    found = current_findings(client, database)
    assert [(f["job"], f["finding_id"]) for f in found] == [
        ("job-a", "f2"), ("job-a", "f1"), ("job-b", "f1"), ("job-a", "f3"),
    ]  # fmt: skip
    f1 = found[1]
    assert f1["status"] == "closed" and f1["version"] == 3
    assert f1["value"] == 4.5 and f1["iteration_last"] == 13 and f1["est_loss_ns"] == 3_000
    assert f1["ranks"] == [3] and f1["evidence"] == {"version": 3, "clock_mhz": 1100}
    assert f1["first_seen_ns"] == T0 + 10**9 and f1["last_seen_ns"] == T0 + 3 * 10**9
    assert {f["finding_id"]: f["status"] for f in found if f["job"] == "job-a"} == {
        "f1": "closed", "f2": "open", "f3": "open",
    }  # fmt: skip
    assert json.dumps(found)  # JSON-ready for the CLI
    only_b = current_findings(client, database, job="job-b")
    assert [(f["job"], f["status"]) for f in only_b] == [("job-b", "open")]
    columns, _ = run_sql(client, database, "SELECT * FROM findings LIMIT 0")
    finding_json = "job rank ranks host category function metric value peer_median score iteration_first"
    finding_json += " iteration_last est_loss_ns evidence finding_id status first_seen last_seen"
    assert set(finding_json.split()) <= set(columns)


def test_replayed_batches_leave_no_duplicates_after_merge(
    client: Client, writer: ClickHouseWriter, database: str
) -> None:
    iterations = [iteration(rank, it) for rank in range(3) for it in range(4)]
    patterns = [pattern_batch(rank, 1, ["gemm", "allreduce"]) for rank in range(3)]
    findings = [finding("f1", 1, "open"), finding("f1", 2, "closed")]
    for _ in range(2):
        writer.write_iterations(iterations)
        writer.write_patterns(patterns)
        writer.write_findings(findings)
    # The writer skips stored keys, so the replay adds no row even before merges (no FINAL needed).
    assert count(client, database, "iterations") == 12
    assert count(client, database, "iterations", final=True) == 12
    for table in ("iterations", "function_patterns", "finding_updates"):
        client.command(f"OPTIMIZE TABLE `{database}`.{table} FINAL")
    assert count(client, database, "iterations") == 12
    assert count(client, database, "function_patterns") == 6
    assert count(client, database, "finding_updates") == 2
    assert count(client, database, "findings") == 1
    assert table_counts(client, database) == {
        "iterations": 12, "function_patterns": 6, "finding_updates": 2, "findings": 1,
    }  # fmt: skip


def test_non_readonly_sql_may_write(client: Client, database: str) -> None:
    assert run_sql(client, database, "CREATE TABLE scratch (a Int32) ENGINE = Memory", readonly=False) == (
        [],
        [],
    )
    run_sql(client, database, "INSERT INTO scratch VALUES (1), (2)", readonly=False)
    assert run_sql(client, database, "SELECT sum(a) FROM scratch")[1] == [(3,)]


class _FlakyClient:
    """Fails the first ``failures`` inserts with ``error``, then succeeds; stores nothing (key lookups
    find no row)."""

    class _NoRows:
        result_rows: list[Any] = []

    def query(self, *_args: Any, **_kwargs: Any) -> _NoRows:
        return self._NoRows()

    def __init__(self, error: Exception, failures: int) -> None:
        self.error = error
        self.failures = failures
        self.calls = 0

    def insert(self, *_args: Any, **_kwargs: Any) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error


FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_ms=1, max_backoff_ms=2)


def test_writer_retries_transient_errors_with_a_bound() -> None:
    flaky = _FlakyClient(OperationalError("connection reset"), failures=2)
    writer = ClickHouseWriter(flaky, "db", retry=FAST_RETRY)  # type: ignore[arg-type]
    assert writer.write_iterations([iteration(0, 0)]) == 1
    assert flaky.calls == 3
    down = _FlakyClient(DatabaseError("Too many parts", code=252), failures=100)
    with pytest.raises(DatabaseError):
        ClickHouseWriter(down, "db", retry=FAST_RETRY).write_iterations([iteration(0, 0)])  # type: ignore[arg-type]
    assert down.calls == 4


def test_writer_does_not_retry_permanent_errors() -> None:
    broken = _FlakyClient(ProgrammingError("Unknown table", code=60), failures=100)
    with pytest.raises(ProgrammingError):
        ClickHouseWriter(broken, "db", retry=FAST_RETRY).write_findings([finding("f", 1, "open")])  # type: ignore[arg-type]
    assert broken.calls == 1


def test_retry_backoff_is_jittered_and_capped() -> None:
    policy = RetryPolicy(initial_backoff_ms=100, max_backoff_ms=1_000)
    delays = [policy.delay_s(attempt) for attempt in range(8) for _ in range(20)]
    assert all(0.05 <= d <= 1.0 for d in delays)
    assert len({round(d, 6) for d in delays}) > 100


def test_connect_to_a_server_url_creates_and_selects_the_database(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, Any] = {}

    class _Server:
        database: str | None = None

        def command(self, sql: str, parameters: dict[str, str] | None = None, use_database: bool = True) -> None:
            calls["command"] = (sql, parameters, use_database)

    def fake_get_client(**kwargs: Any) -> _Server:
        calls["kwargs"] = kwargs
        return _Server()

    monkeypatch.setattr("clickhouse_connect.get_client", fake_get_client)
    config = StoreConfig(url="https://ch.example:9443", database="fleet", username="ro", password="pw")
    client = connect(config)
    assert calls["kwargs"] == {
        "host": "ch.example",
        "port": 9443,
        "username": "ro",
        "password": "pw",
        "secure": True,
    }
    assert calls["command"] == ("CREATE DATABASE IF NOT EXISTS {db:Identifier}", {"db": "fleet"}, False)
    assert client.database == "fleet"


def test_layouts_view_has_one_row_per_rank_with_the_jobs_sizes(
    client: Client, writer: ClickHouseWriter, database: str
) -> None:
    """Coordinates as the producers derived them (dp4 x pp2 here); a job without a layout gets -1 / 1."""
    rows = []
    for rank in range(8):
        for it in (1, 2):
            rec = iteration(rank, it) | {"world_size": 8, "tp_rank": 0, "pp_rank": rank // 4, "dp_rank": rank % 4}
            rows.append(rec)
    rows.append(iteration(0, 1, job="job-b") | {"tp_rank": -1, "pp_rank": -1, "dp_rank": -1})
    writer.write_iterations(rows)
    columns, result = run_sql(client, database, "SELECT * FROM layouts ORDER BY job, rank")
    got = [dict(zip(columns, row, strict=True)) for row in result]
    assert len(got) == 9
    six = got[6]
    assert (six["host"], six["world_size"], six["stage"], six["dp_rank"]) == ("node0", 8, 1, 2)
    assert (six["tp_size"], six["pp_size"], six["dp_size"]) == (1, 2, 4)
    assert (six["first_iteration"], six["last_iteration"]) == (1, 2)
    other = got[8]
    assert (other["job"], other["pp_rank"], other["pp_size"], other["dp_size"]) == ("job-b", -1, 1, 1)
    query = (
        "SELECT l.stage, count() FROM iterations i JOIN layouts l ON i.job = l.job AND i.rank = l.rank "
        "WHERE i.job = 'job-a' GROUP BY l.stage ORDER BY l.stage"
    )
    _, joined = run_sql(client, database, query)
    assert [tuple(r) for r in joined] == [(1 - 1, 8), (1, 8)]
