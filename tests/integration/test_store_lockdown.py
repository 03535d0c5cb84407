"""The read-only lockdown on the real chDB engine, served (read token) and direct (``run_sql``): no file
outside the store's tables (the token file first), and every read query bounded in time, memory and
result size by ``StoreConfig.read_*``, which neither a URL setting nor a query's SETTINGS lifts."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import clickhouse_connect
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from fleetscope.endpoint import store_tokens
from fleetscope.sinks import StoreConfig, connect, migrate, run_sql
from fleetscope.sinks.clickhouse.server import StoreServer

pytestmark = pytest.mark.integration

BOUNDED = {"read_max_execution_time_s": 1.0, "read_max_memory_bytes": 64 << 20, "read_max_result_rows": 5000}


@pytest.fixture(scope="module")
def served(chdb_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StoreServer, str, Path]]:
    database = f"lock_{uuid.uuid4().hex[:10]}"
    config = StoreConfig(url=f"chdb://{chdb_path}", database=database, **BOUNDED)  # type: ignore[arg-type]
    migrate(connect(config), database)
    data_dir = tmp_path_factory.mktemp("lock-data")
    server = StoreServer(str(chdb_path), store_tokens(data_dir), database=database, config=config).start()
    yield server, database, data_dir
    server.stop()


def _reader(server: StoreServer, database: str, data_dir: Path) -> clickhouse_connect.driver.Client:
    token = store_tokens(data_dir).read
    return clickhouse_connect.get_client(host="127.0.0.1", port=server.port, password=token, database=database)


def test_the_read_token_cannot_read_the_token_file(served: tuple[StoreServer, str, Path]) -> None:
    server, database, data_dir = served
    reader = _reader(server, database, data_dir)
    tokens_file = data_dir / "store-tokens.json"
    for query in (
        f"SELECT file('{tokens_file}')",
        f"SELECT lower(FILE('{tokens_file}'))",
        "SELECT file('/etc/passwd')",
    ):
        with pytest.raises(DatabaseError, match="READONLY") as info:
            reader.query(query)
        assert store_tokens(data_dir).write not in str(info.value)
    assert reader.query("SELECT lower('OK')").result_rows == [("ok",)]


def test_run_sql_direct_refuses_file_functions(chdb_path: Path) -> None:
    database = f"lockd_{uuid.uuid4().hex[:10]}"
    client = connect(StoreConfig(url=f"chdb://{chdb_path}", database=database))
    with pytest.raises(PermissionError, match="file"):
        run_sql(client, database, "SELECT file('/etc/passwd')")
    assert run_sql(client, database, "SELECT countIf(number > 1) FROM numbers(4)") == (
        ["countIf(greater(number, 1))"],
        [(2,)],
    )


def test_a_runaway_read_query_is_stopped_by_the_bounds(served: tuple[StoreServer, str, Path]) -> None:
    server, database, data_dir = served
    reader = _reader(server, database, data_dir)
    t0 = time.monotonic()
    with pytest.raises(DatabaseError, match="TIMEOUT_EXCEEDED"):
        reader.query("SELECT count() FROM numbers_mt(1000000000000) WHERE sipHash64(number) = 0")
    assert time.monotonic() - t0 < 5
    with pytest.raises(DatabaseError, match="MEMORY_LIMIT_EXCEEDED"):
        reader.query("SELECT length(groupArray(number)) FROM numbers(100000000)")
    with pytest.raises(DatabaseError, match="TOO_MANY_ROWS_OR_BYTES"):
        reader.query("SELECT number FROM numbers(10000)")
    with pytest.raises(DatabaseError, match="READONLY"):
        reader.query("SELECT 1 SETTINGS max_execution_time = 0")


def test_run_sql_direct_is_bounded_by_the_configuration(chdb_path: Path) -> None:
    database = f"lockb_{uuid.uuid4().hex[:10]}"
    config = StoreConfig(url=f"chdb://{chdb_path}", database=database, **BOUNDED)  # type: ignore[arg-type]
    client = connect(config)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="TIMEOUT_EXCEEDED"):
        run_sql(client, database, "SELECT count() FROM numbers_mt(1000000000000) WHERE sipHash64(number) = 0",
                config=config)  # fmt: skip
    assert time.monotonic() - t0 < 5
    with pytest.raises(Exception, match="TOO_MANY_ROWS_OR_BYTES"):
        run_sql(client, database, "SELECT number FROM numbers(10000)", config=config)
