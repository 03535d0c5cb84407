"""The store ``fleetscope up`` serves: clickhouse-connect's HTTP client against the real chDB engine, the
tokens, engine-enforced read-only mode, and the CLI going through a running ``up``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import clickhouse_connect
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from fleetscope.sinks import StoreConfig, connect, migrate, run_sql
from fleetscope.sinks.clickhouse.server import StoreServer, Tokens

pytestmark = pytest.mark.integration

TOKENS = Tokens(read="read-secret", write="write-secret")


@pytest.fixture(scope="module")
def served(chdb_path: Path) -> Iterator[tuple[StoreServer, str]]:
    database = f"srv_{uuid.uuid4().hex[:10]}"
    migrate(connect(StoreConfig(url=f"chdb://{chdb_path}", database=database)), database)
    server = StoreServer(str(chdb_path), TOKENS, database=database).start()
    yield server, database
    server.stop()


def client(server: StoreServer, database: str, token: str, **kw: object) -> clickhouse_connect.driver.Client:
    return clickhouse_connect.get_client(
        host="127.0.0.1", port=server.port, username="any", password=token, database=database, **kw
    )


def test_ping_answers_without_a_token(served: tuple[StoreServer, str]) -> None:
    server, _ = served
    with urllib.request.urlopen(f"{server.url}/ping", timeout=5) as r:
        assert r.read() == b"Ok.\n"


@pytest.mark.parametrize("compress", [True, False, "gzip", "zstd"])
def test_the_write_token_inserts_and_the_read_token_reads(served: tuple[StoreServer, str], compress: object) -> None:
    server, database = served
    writer = client(server, database, TOKENS.write, compress=compress)
    reader = client(server, database, TOKENS.read, compress=compress)
    job = f"srv-{uuid.uuid4().hex[:6]}"
    rows = [[job, r, i, 1_700_000_000 * 10**9 + i, 10**6 + r] for r in range(8) for i in range(500)]
    writer.insert("iterations", rows, column_names=["job", "rank", "iteration", "start_ns", "duration_ns"])
    q = "SELECT count(), max(rank), sum(iteration) FROM iterations WHERE job = {job:String}"
    assert reader.query(q, parameters={"job": job}).result_rows == [(4000, 7, 8 * sum(range(500)))]
    df = reader.query_df("SELECT rank, avg(duration_ns) AS d FROM iterations WHERE job = {j:String} GROUP BY rank "
                         "ORDER BY rank", parameters={"j": job})  # fmt: skip
    assert list(df["rank"]) == list(range(8)) and list(df["d"]) == [1e6 + r for r in range(8)]


def test_writes_are_refused_without_the_write_token(served: tuple[StoreServer, str], tmp_path: Path) -> None:
    server, database = served
    reader = client(server, database, TOKENS.read)
    attempts = [
        lambda: reader.command("INSERT INTO iterations (job, rank, iteration) VALUES ('x', 0, 0)"),
        lambda: reader.insert("iterations", [["x", 0, 0]], column_names=["job", "rank", "iteration"]),
        lambda: reader.command("DROP TABLE iterations"),
        lambda: reader.query("SELECT 1 SETTINGS readonly = 0"),
        lambda: reader.command("SET readonly = 0"),
        lambda: reader.query(f"SELECT 1 INTO OUTFILE '{tmp_path / 'leak.txt'}'"),
    ]
    for attempt in attempts:
        with pytest.raises(DatabaseError) as info:
            attempt()
        assert "readonly" in str(info.value).lower() or "READONLY" in str(info.value)
    assert not (tmp_path / "leak.txt").exists()
    assert reader.query("SELECT count() FROM iterations WHERE job = 'x'").result_rows == [(0,)]
    assert reader.query("SELECT count() FROM system.tables WHERE name = 'iterations'").result_rows[0][0] >= 1


def test_the_read_token_reaches_nothing_outside_the_store(served: tuple[StoreServer, str], tmp_path: Path) -> None:
    """readonly=1 alone still lets chDB read files and URLs (schema inference) and the host process (Python()):
    the read token gets run_sql's lockdown and the engine's AST check as well."""
    server, database = served
    reader = client(server, database, TOKENS.read)
    secret = tmp_path / "secret.csv"
    secret.write_text("1,2\n")
    attempts = [
        f"SELECT * FROM file('{secret}', CSV)",
        f"DESCRIBE file('{secret}', CSV)",
        "SELECT * FROM url('http://127.0.0.1:9/x', CSV, 'a Int32')",
        "SELECT * FROM Python(globals())",
        "SELECT 1; DROP TABLE iterations",
        "SELECT 1 # '\n; DROP TABLE iterations; SELECT 2 -- '",
    ]
    for query in attempts:
        with pytest.raises(DatabaseError):
            reader.query(query)
    assert reader.query("SELECT count() FROM system.tables WHERE name = 'iterations'").result_rows[0][0] >= 1


@pytest.mark.parametrize("token", ["", "wrong", TOKENS.read + "x"])
def test_a_bad_token_is_refused(served: tuple[StoreServer, str], token: str) -> None:
    server, database = served
    with pytest.raises(DatabaseError, match="516|AUTHENTICATION_FAILED"):
        client(server, database, token)


def test_server_errors_carry_clickhouse_s_message(served: tuple[StoreServer, str]) -> None:
    server, database = served
    reader = client(server, database, TOKENS.read)
    with pytest.raises(DatabaseError, match=r"Code: 62\. DB::Exception: Syntax error"):
        reader.query("SELEC 1")
    with pytest.raises(DatabaseError, match=r"UNKNOWN_TABLE"):
        reader.query("SELECT * FROM no_such_table")


def test_run_sql_through_the_server_is_read_only(served: tuple[StoreServer, str]) -> None:
    server, database = served
    reader = client(server, database, TOKENS.read)
    columns, rows = run_sql(reader, database, "SELECT {a:Int32} + 1 AS b", {"a": "41"}, readonly=True)
    assert (columns, rows) == (["b"], [(42,)])


def _cli(data_dir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetscope", *args, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE__")},
    )


def test_the_cli_goes_through_a_running_up(tmp_path: Path) -> None:
    """``up`` holds the store; ``simulate`` finds its broker and ``sql``/``findings`` its store through the
    data directory; the endpoint file is private and gone after Ctrl-C."""
    data_dir = tmp_path / "fs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE__")}
    env["FLEETSCOPE__EMBEDDED__BROKER_PORT"] = "0"
    env["FLEETSCOPE__EMBEDDED__STORE_PORT"] = "0"
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        up = subprocess.Popen(
            [sys.executable, "-m", "fleetscope", "up", "--data-dir", str(data_dir)],
            stdout=stdout,
            stderr=stderr,
            env=env,
        )
    try:
        endpoint_file = data_dir / "endpoint.json"
        deadline = time.monotonic() + 90
        while not endpoint_file.exists() or "Ctrl-C" not in out.read_text():
            assert up.poll() is None, err.read_text()
            assert time.monotonic() < deadline, "up did not start"
            time.sleep(0.2)
        assert endpoint_file.stat().st_mode & 0o077 == 0
        endpoint = json.loads(endpoint_file.read_text())
        banner = out.read_text()
        assert f"export FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS={endpoint['bootstrap_servers']}" in banner
        assert "fleetscope run -- torchrun" in banner
        sim = _cli(data_dir, "simulate", "--job", "served", "--ranks", "8", "--iterations", "12")
        assert sim.returncode == 0, sim.stderr
        deadline = time.monotonic() + 90
        count = ""
        while count != "96" and time.monotonic() < deadline:
            res = _cli(data_dir, "sql", "SELECT count() FROM iterations WHERE job = 'served'")
            assert res.returncode == 0, res.stderr
            count = res.stdout.strip()
            time.sleep(1)
        assert count == "96"
        findings = _cli(data_dir, "findings", "--json", "--job", "served")
        assert findings.returncode == 0 and json.loads(findings.stdout) == [], findings.stderr
        report = _cli(data_dir, "report", "--job", "served", "-o", str(tmp_path / "served.html"), "--json")
        assert report.returncode == 0 and json.loads(report.stdout)["ranks"] == 8, report.stderr
        refused = _cli(data_dir, "sql", "DROP TABLE iterations")
        assert refused.returncode != 0
    finally:
        up.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        up.wait(60)
    assert time.monotonic() - t0 < 15, "Ctrl-C stops up within seconds"
    assert not (data_dir / "endpoint.json").exists()
