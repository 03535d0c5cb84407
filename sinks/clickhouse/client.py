"""ClickHouse connections, schema migration and error classification.

chDB (in-process ClickHouse) is the embedded default; an ``http(s)://`` URL reaches a server with the same
code. One process can open only one chDB path, so jobs and tests are isolated by *database*, never by path.
The database name is validated as an identifier and is the only text ever formatted into SQL.
"""

from __future__ import annotations

import logging
import os
import threading
from importlib import resources
from urllib.parse import urlsplit

import clickhouse_connect
from clickhouse_connect.driver import Client
from clickhouse_connect.driver import exceptions as ch_errors

from fleetscope.sinks.store_config import StoreConfig, check_database

logger = logging.getLogger(__name__)

# ClickHouse error codes worth a retry: overload, timeouts, network, a replica or keeper hiccup.
_TRANSIENT_CODES = frozenset({3, 32, 159, 202, 203, 209, 210, 236, 241, 242, 252, 319, 394, 425, 999, 1000})

# One chDB engine per process: clients are cached per (path, database) so repeated connect() calls reuse
# handles, and a second path fails with a clear message instead of chDB's.
_CHDB_CLIENTS: dict[tuple[str, str], Client] = {}
_CHDB_LOCK = threading.Lock()


def connect(config: StoreConfig, *, create_database: bool = True) -> Client:
    """A client whose default database is ``config.database`` (created when missing, unless
    ``create_database`` is False: a read-only login may not create it).

    chDB clients are shared by the whole process: do not close them (the engine lives until exit)."""
    path = config.local_path
    if path is None:
        parts = urlsplit(config.url)
        secure = parts.scheme == "https"
        client = clickhouse_connect.get_client(
            host=parts.hostname or "localhost",
            port=parts.port or (8443 if secure else 8123),
            username=parts.username or config.username,
            password=config.password,
            secure=secure,
        )
        if create_database:
            ensure_database(client, config.database)
        client.database = config.database
        return client
    with _CHDB_LOCK:
        key = (path, config.database)
        if key in _CHDB_CLIENTS:
            return _CHDB_CLIENTS[key]
        open_paths = {p for p, _ in _CHDB_CLIENTS}
        if open_paths and path not in open_paths:
            raise ValueError(
                f"this process already has chDB open at {open_paths.pop()!r}; one process can open only one "
                f"chDB path ({path!r} requested): isolate by database name instead"
            )
        if path != ":memory:":
            os.makedirs(path, exist_ok=True)
        client = clickhouse_connect.get_client(interface="chdb", path=None if path == ":memory:" else path)
        ensure_database(client, config.database)
        client.database = config.database
        _CHDB_CLIENTS[key] = client
        logger.info("opened chDB at %s (database %s)", path, config.database)
        return client


def is_chdb(client: Client) -> bool:
    """Whether ``client`` is one of this process's chDB handles (shared: never closed)."""
    with _CHDB_LOCK:
        return any(client is c for c in _CHDB_CLIENTS.values())


def ensure_database(client: Client, database: str) -> None:
    client.command("CREATE DATABASE IF NOT EXISTS {db:Identifier}", parameters={"db": check_database(database)},
                   use_database=False)  # fmt: skip


def bound(client: Client, database: str) -> Client:
    """The client, or a sibling on the same chDB engine, whose default database is ``database``."""
    if client.database == database:
        return client
    path = getattr(client, "path", None)
    with _CHDB_LOCK:
        on_chdb = any(path == p for p, _ in _CHDB_CLIENTS)
    if on_chdb:
        url = "chdb://memory" if path == ":memory:" else f"chdb://{path}"
        return connect(StoreConfig(url=url, database=database))
    raise ValueError(f"client's default database is {client.database!r}, not {database!r}: connect() with it")


def ddl_statements(database: str) -> list[str]:
    """Every statement of ``sql/*.sql`` in file order, with the database substituted."""
    quoted = f"`{check_database(database)}`"
    folder = resources.files("fleetscope.sinks.clickhouse").joinpath("sql")
    statements: list[str] = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        text = entry.read_text(encoding="utf-8").replace("{database}", quoted)
        body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))
        statements.extend(s.strip() for s in body.split(";") if s.strip())
    return statements


def migrate(client: Client, database: str) -> None:
    """Create the database, tables and views; idempotent, so every process runs it on start."""
    ensure_database(client, database)
    for statement in ddl_statements(database):
        client.command(statement, use_database=False)
    logger.info("schema of database %s is up to date", database)


def is_transient(exc: BaseException) -> bool:
    """True for errors a retry may fix (network, timeouts, overload); False for bad SQL or bad data."""
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    if isinstance(exc, ch_errors.ClickHouseError):
        code = getattr(exc, "code", None)
        if code is None:
            return isinstance(exc, ch_errors.OperationalError)
        return code in _TRANSIENT_CODES
    return False


def rejects_records(exc: BaseException) -> bool:
    """Errors caused by the records themselves, not by the store or the SQL."""
    return isinstance(exc, ValueError | TypeError | OverflowError | ch_errors.DataError)


def store_unavailable(exc: BaseException) -> bool:
    """A store that is not there yet (network, server starting, chDB directory still locked by a process
    that is exiting), as opposed to a configuration or schema error that no wait cures."""
    if is_transient(exc) or isinstance(exc, ch_errors.OperationalError):
        return True
    text = str(exc)
    return isinstance(exc, ch_errors.ProgrammingError | RuntimeError) and (
        "Cannot lock file" in text or "Error initializing EmbeddedServer" in text
    )
