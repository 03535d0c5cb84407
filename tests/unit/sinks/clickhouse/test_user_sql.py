"""Read-only user SQL against real chDB: a corpus of bypass attempts is refused by the engine, and the store
(tables, row counts, files around it) is unchanged afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from clickhouse_connect.driver import Client
from clickhouse_connect.driver.exceptions import DatabaseError

from fleetscope.sinks import (
    ClickHouseWriter,
    StoreConfig,
    connect,
    current_findings,
    migrate,
    readonly_session,
    readonly_settings,
    run_sql,
)
from fleetscope.sinks.clickhouse.user_sql import IN_STORE_TABLE_FUNCTIONS, check_read_query, table_functions
from tests.unit.sinks.clickhouse.test_clickhouse import iteration, pattern_batch

_S3 = "http://127.0.0.1:1/bucket-name/x.csv"
TABLE_FUNCTION_CALLS: dict[str, str] = {
    "file": "file('/etc/hostname', 'LineAsString')",
    "fileCluster": "fileCluster('default', '/etc/hostname', 'LineAsString')",
    "filesystem": "filesystem('/etc')",
    "url": "url('http://127.0.0.1:1/x', 'LineAsString')",
    "urlCluster": "urlCluster('default', 'http://127.0.0.1:1/x')",
    "s3": f"s3('{_S3}', 'CSV')",
    "s3Cluster": f"s3Cluster('default', '{_S3}')",
    "gcs": f"gcs('{_S3}', 'CSV')",
    "cosn": f"cosn('{_S3}', 'CSV')",
    "oss": f"oss('{_S3}', 'CSV')",
    "remote": "remote('127.0.0.1', system.one)",
    "remoteSecure": "remoteSecure('127.0.0.1:1', system.one)",
    "cluster": "cluster('default', system.one)",
    "clusterAllReplicas": "clusterAllReplicas('default', system.one)",
    "executable": "executable('ls', 'TSV', 'a String', (SELECT 1))",
    "hdfs": "hdfs('hdfs://127.0.0.1:1/x', 'CSV', 'a Int32')",
    "hdfsCluster": "hdfsCluster('default', 'hdfs://127.0.0.1:1/x', 'CSV', 'a Int32')",
    "mysql": "mysql('127.0.0.1:1', 'd', 't', 'u', 'p')",
    "postgresql": "postgresql('127.0.0.1:1', 'd', 't', 'u', 'p')",
    "mongodb": "mongodb('127.0.0.1:1', 'd', 'c', 'u', 'p', 'a Int32')",
    "redis": "redis('127.0.0.1:1', 'k', 'k String')",
    "sqlite": "sqlite('/tmp/x.db', 't')",
    "jdbc": "jdbc('x', 'y', 'z')",
    "odbc": "odbc('x', 'y', 'z')",
    "input": "input('a Int32')",
    "python": "Python('T0')",
    "arrowstream": "arrowstream('x')",
    "azureBlobStorage": "azureBlobStorage('http://127.0.0.1:1/acc', 'c', 'b', 'CSV')",
    "azureBlobStorageCluster": "azureBlobStorageCluster('default', 'http://127.0.0.1:1/acc', 'c', 'b')",
    "iceberg": f"iceberg('{_S3}')",
    "icebergS3": f"icebergS3('{_S3}')",
    "icebergLocal": "icebergLocal('/tmp/x')",
    "deltaLake": f"deltaLake('{_S3}')",
    "deltaLakeLocal": "deltaLakeLocal('/tmp/x')",
    "hudi": f"hudi('{_S3}')",
    "paimon": f"paimon('{_S3}')",
    "paimonLocal": "paimonLocal('/tmp/x')",
    "bigquery": "bigquery('p', 'd', 't')",
    "ytsaurus": "ytsaurus('http://127.0.0.1:1', '//t', 'token', 'a Int32')",
    "eval": "eval('x')",
    "format": "format(CSV, '1')",
    "dictionary": "dictionary('x')",
    "loop": "loop(numbers(1))",
    "viewExplain": "viewExplain('EXPLAIN', '', (SELECT 1))",
    "fuzzJSON": "fuzzJSON('{\"a\":1}')",
    "fuzzQuery": "fuzzQuery('SELECT 1')",
    "mergeTreeIndex": "mergeTreeIndex(currentDatabase(), 'iterations')",
}
"""One call per table function outside ``IN_STORE_TABLE_FUNCTIONS`` (the coverage test keeps it complete:
the families below share their first member's code path)."""
_FAMILIES = ("iceberg", "deltalake", "paimon", "hudi", "azureblobstorage", "timeseries", "prometheus", "mergetree")
_FAMILIES += ("generate", "viewifpermitted", "sqlstandardvalues")

BYPASSES = [
    "SELECT 1 # '\n; DROP TABLE iterations; SELECT 2 -- '",
    "SELECT 1 -- '\n; DROP TABLE iterations",
    "SELECT 1 /* '; */ ; DROP TABLE iterations",
    "SELECT 1 /* nested /* */ ; TRUNCATE TABLE iterations",
    "SELECT 'a\\'; DROP TABLE iterations; SELECT \\'' AS x; DROP TABLE iterations",
    'SELECT "a;" ; DROP TABLE iterations',
    "SELECT `x;` FROM (SELECT 1 AS `x;`); ALTER TABLE function_patterns DELETE WHERE 1",
    "SELECT 1; INSERT INTO iterations (job) VALUES ('x')",
    "SELECT 1;\nDROP DATABASE {db}",
    "SET readonly = 0",
    "SELECT 1 SETTINGS readonly = 0",
    "SELECT 1 SETTINGS readonly = 2",
    "SELECT 1 SETTINGS allow_python_table_function = 1",
    "WITH 1 AS x SELECT x FROM iterations SETTINGS readonly = 0",
    "SELECT 1 FORMAT Null SETTINGS allow_ddl = 1",
    "INSERT INTO FUNCTION file('written.csv', 'CSV', 'a Int32') VALUES (1)",
    "SELECT 1 INTO OUTFILE 'written.csv'",
    "SELECT 1 INTO OUTFILE 'written.csv' TRUNCATE FORMAT CSV",
    "SELECT 1 /* x */ INTO /* y */ OUTFILE 'written.csv' APPEND",
    "(SELECT 1) INTO OUTFILE 'written.csv'",
    "DESCRIBE TABLE file('/etc/hostname', 'CSVWithNames')",
    "DESCRIBE url('http://127.0.0.1:1/x', 'CSVWithNames')",
    "EXPLAIN SELECT * FROM file('/etc/hostname', 'LineAsString')",
    "SELECT count() FROM iterations WHERE job IN (SELECT * FROM file('/etc/hostname', 'LineAsString'))",
    "DROP TABLE iterations",
    "  -- sneaky\n TRUNCATE TABLE iterations",
    "# sneaky\nALTER TABLE iterations DELETE WHERE 1",
    "OPTIMIZE TABLE iterations FINAL",
    "KILL QUERY WHERE 1",
    "SYSTEM DROP MARK CACHE",
    "CREATE TEMPORARY TABLE scratch (a Int32)",
    "USE system",
    "SELECT addressToSymbol(toUInt64(0))",
    *(f"SELECT * FROM {call}" for call in TABLE_FUNCTION_CALLS.values()),
]


@pytest.fixture()
def database() -> str:
    return f"t_{uuid.uuid4().hex}"


@pytest.fixture()
def client(chdb_path: Path, database: str) -> Iterator[Client]:
    client = connect(StoreConfig(url=f"chdb://{chdb_path}", database=database))
    migrate(client, database)
    writer = ClickHouseWriter(client, database)
    writer.write_iterations([iteration(r, 0) for r in range(4)])
    writer.write_patterns([pattern_batch(0, 0, ["fwd", "bwd"])])
    yield client
    client.command(f"DROP DATABASE IF EXISTS `{database}`", use_database=False)


def store_state(client: Client, database: str) -> tuple[list[str], list[int]]:
    tables = sorted(str(r[0]) for r in client.query(f"SHOW TABLES FROM `{database}`").result_rows)
    counts = [int(client.query(f"SELECT count() FROM `{database}`.`{t}`").result_rows[0][0]) for t in tables]
    return tables, counts


@pytest.mark.parametrize("statement", BYPASSES)
def test_bypass_attempts_are_refused_and_the_store_is_unchanged(
    client: Client, database: str, statement: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    before = store_state(client, database)
    with pytest.raises((PermissionError, ValueError, DatabaseError)):
        run_sql(client, database, statement.replace("{db}", f"`{database}`"))
    assert store_state(client, database) == before
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("statement", BYPASSES)
def test_the_engine_refuses_each_bypass_without_the_friendly_check(
    client: Client, database: str, statement: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The raw text goes straight to the engine: its parser (one statement, its AST) or the read-only
    session refuses it, never the regular expressions that run first in ``run_sql``."""
    monkeypatch.chdir(tmp_path)
    session, settings = readonly_session(client, database)
    before = store_state(client, database)
    with pytest.raises((PermissionError, ValueError, DatabaseError)):
        canonical = check_read_query(session, statement.replace("{db}", f"`{database}`"), None, settings)
        session.query(canonical, settings=settings)
    assert store_state(client, database) == before
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "statement",
    [
        "SELECT 1; DROP TABLE iterations",
        "SELECT 1 # '\n; DROP TABLE iterations; SELECT 2 -- '",
        "SET readonly = 0",
        "SELECT 1 SETTINGS readonly = 0",
        "INSERT INTO FUNCTION file('written.csv', 'CSV', 'a Int32') VALUES (1)",
        *(f"SELECT * FROM {TABLE_FUNCTION_CALLS[name]}" for name in ("file", "url", "s3", "remote", "executable")),
        *(f"SELECT * FROM {TABLE_FUNCTION_CALLS[name]}" for name in ("mysql", "postgresql", "hdfs", "python")),
    ],
)
def test_the_readonly_session_itself_refuses_writes_settings_and_outside_reads(
    client: Client, database: str, statement: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No parser at all: the session's own settings (readonly=1, no Python()) refuse every statement of a
    multi-statement text, a query's SETTINGS, and table functions reaching outside the store."""
    monkeypatch.chdir(tmp_path)
    session, _ = readonly_session(client, database)
    before = store_state(client, database)
    with pytest.raises(DatabaseError) as failure:
        session.command(statement)
    assert failure.value.code in (164, 446), failure.value  # READONLY, FUNCTION_NOT_ALLOWED
    assert store_state(client, database) == before
    assert list(tmp_path.iterdir()) == []


def test_every_table_function_of_the_engine_is_in_store_or_in_the_corpus(client: Client, database: str) -> None:
    names = {str(r[0]) for r in client.query("SELECT name FROM system.table_functions").result_rows}
    covered = {n.lower() for n in TABLE_FUNCTION_CALLS} | IN_STORE_TABLE_FUNCTIONS
    missing = sorted(n for n in names if n.lower() not in covered and not n.lower().startswith(_FAMILIES))
    assert missing == []


def test_the_readonly_session_does_not_leak_onto_writers(client: Client, database: str) -> None:
    session, settings = readonly_session(client, database)
    assert settings is None
    assert session.command("SELECT getSetting('readonly')") == 1
    assert str(session.command("SELECT getSetting('allow_python_table_function')")).lower() in ("0", "false")
    assert readonly_session(client, database)[0] is session  # one handle per store and database
    writer = ClickHouseWriter(client, database)
    assert writer.write_iterations([iteration(9, 1)]) == 1
    run_sql(client, database, "CREATE TABLE scratch (a Int32) ENGINE = Memory", readonly=False)
    run_sql(client, database, "INSERT INTO scratch VALUES (1), (2)", readonly=False)
    assert run_sql(client, database, "SELECT sum(a) FROM scratch")[1] == [(3,)]
    assert client.command("SELECT getSetting('readonly')") == 0


@pytest.mark.parametrize(
    ("statement", "expected"),
    [
        ("SELECT count() FROM iterations", [(4,)]),
        ("-- a comment\nSELECT count() FROM iterations /* x */ ;", [(4,)]),
        ("# hash comment\nSELECT ';' AS s; -- trailing\n;", [(";",)]),
        ("(SELECT 1)", [(1,)]),
        ("WITH 2 AS x SELECT x * x", [(4,)]),
        ("SELECT sum(number) FROM numbers(4)", [(6,)]),
        ("SELECT count() FROM merge(currentDatabase(), '^iterations$')", [(4,)]),
        ("EXISTS TABLE iterations", [(1,)]),
    ],
)
def test_read_statements_run_and_give_their_rows(
    client: Client, database: str, statement: str, expected: list[tuple[object, ...]]
) -> None:
    assert run_sql(client, database, statement)[1] == expected


def test_show_describe_and_explain_run_against_the_configured_database(client: Client, database: str) -> None:
    for statement in ("SHOW TABLES", "DESCRIBE TABLE iterations", "EXPLAIN SELECT 1", "SHOW CREATE TABLE iterations"):
        columns, rows = run_sql(client, database, statement)
        assert columns and rows
    other = f"t_{uuid.uuid4().hex}"
    migrate(client, other)
    try:
        assert run_sql(client, other, "SELECT count() FROM iterations")[1] == [(0,)]
        assert run_sql(client, database, "SELECT count() FROM iterations")[1] == [(4,)]
    finally:
        client.command(f"DROP DATABASE `{other}`", use_database=False)


def test_parameters_are_bound_server_side(client: Client, database: str) -> None:
    ClickHouseWriter(client, database).write_iterations([iteration(0, 0, job="o'brien")])
    query = "SELECT count() FROM iterations WHERE job = {job:String}"
    assert run_sql(client, database, query, {"job": "o'brien"})[1] == [(1,)]
    assert run_sql(client, database, query, {"job": "x' OR 1=1 --"})[1] == [(0,)]
    with pytest.raises(DatabaseError):
        run_sql(client, database, query)  # an unbound {job:String} is an error, never empty text
    assert current_findings(client, database, job="x' OR '1'='1") == []


@pytest.mark.parametrize("statement", ["SELECT 1; DROP TABLE iterations", "SELECT ';'; SELECT 2 -- x"])
def test_write_mode_runs_one_statement_at_a_time(client: Client, database: str, statement: str) -> None:
    before = store_state(client, database)
    with pytest.raises(ValueError, match="one SQL statement"):
        run_sql(client, database, statement, readonly=False)
    assert store_state(client, database) == before


def test_table_functions_are_read_from_the_engines_ast() -> None:
    ast = [
        "SelectWithUnionQuery (children 1)",
        " ExpressionList (children 1)",
        "  SelectQuery (children 2)",
        "   TablesInSelectQuery (children 2)",
        "    TablesInSelectQueryElement (children 1)",
        "     TableExpression (children 1)",
        "      Function Python (alias p) (children 1)",
        "       ExpressionList (children 1)",
        "        Function file (children 1)",
        "    TablesInSelectQueryElement (children 1)",
        "     TableExpression (children 1)",
        "      TableIdentifier t",
        "   Function in (children 1)",
    ]
    assert table_functions(ast) == ["python"]


def test_server_requests_carry_readonly_settings() -> None:
    """A server session is made read-only by the settings each request carries (HTTP applies them to the
    one statement a request may hold); callers get a copy they may extend."""
    settings = readonly_settings()
    assert settings == {"readonly": "1"}
    settings["max_execution_time"] = "5"
    assert readonly_settings() == {"readonly": "1"}


def test_the_function_catalog_allows_pure_categories_aliases_and_combinators_only() -> None:
    from fleetscope.sinks.clickhouse.user_sql import FunctionCatalog

    rows = [
        ("sum", 1, 1, "", "Aggregate Functions"),
        ("plus", 0, 0, "", "Arithmetic"),
        ("file", 0, 0, "", "Other"),
        ("fileAlias", 0, 0, "file", ""),
        ("add", 0, 0, "plus", ""),
        ("dictGet", 0, 0, "", "Dictionary"),
        ("version", 0, 0, "", "Other"),
        ("If", 2, 0, "", ""),
        ("OrNull", 2, 0, "", ""),
    ]
    catalog = FunctionCatalog.from_rows(rows)
    assert [n for n in ("SUM", "plus", "add", "version", "sumIfOrNull", "lambda") if not catalog.permits(n)] == []
    assert [n for n in ("file", "FILE", "fileAlias", "dictGet", "fileIf", "If", "unknown") if catalog.permits(n)] == []


def test_the_lockdown_drops_unlisted_client_settings_and_freezes_last() -> None:
    from fleetscope.sinks import StoreConfig
    from fleetscope.sinks.clickhouse.user_sql import lockdown_settings

    config = StoreConfig(read_max_execution_time_s=2.5, read_max_result_rows=7)
    client = {"format_template_resultset": "/etc/passwd", "readonly": "0", "max_execution_time": "0",
              "output_format_json_quote_64bit_integers": "0"}  # fmt: skip
    steps = lockdown_settings(config, client)
    assert steps[0] == ("output_format_json_quote_64bit_integers", "0")
    assert steps[-1] == ("readonly", "1")
    assert dict(steps)["max_execution_time"] == "2.5" and dict(steps)["max_result_rows"] == "7"
    assert "format_template_resultset" not in dict(steps) and dict(steps)["readonly"] == "1"


@pytest.mark.parametrize("field", ["read_max_execution_time_s", "read_max_memory_bytes", "read_max_result_rows"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf")])
def test_read_bounds_must_be_finite_and_positive(field: str, value: float) -> None:
    from fleetscope.sinks import StoreConfig

    with pytest.raises(ValueError, match=field):
        StoreConfig(**{field: value})  # type: ignore[arg-type]
