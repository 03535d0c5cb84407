"""User SQL (``fleetscope sql``, the report, Grafana panels): read-only enforced by ClickHouse itself.

A read-only query runs on a session that is read-only as a whole: on chDB a connection handle of its own
where ``readonly=1`` (and no Python or introspection functions) was set before any user text arrived, on a
server the ``readonly=1`` setting sent with every request (the HTTP interface also refuses multi-statements
and ``INTO OUTFILE``). Before running, the engine's own parser renders the text as one statement
(``formatQuerySingleLine`` refuses multi-statements) and its AST (``EXPLAIN AST``) names the table
functions; only that canonical text runs. The regular expressions below only give a friendlier error first.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import clickhouse_connect
from clickhouse_connect.driver import Client

from fleetscope.sinks.clickhouse.client import bound as _bound
from fleetscope.sinks.store_config import check_database

READONLY_SETTINGS: dict[str, str] = {"readonly": "1"}
"""Per-request settings that make a server session read-only: writes, DDL, setting changes (so a query's
own ``SETTINGS readonly=0``) and table functions (they need CREATE TEMPORARY TABLE) are refused."""

CHDB_LOCKDOWN: tuple[tuple[str, str], ...] = (
    ("allow_python_table_function", "0"),
    ("allow_introspection_functions", "0"),
    ("readonly", "1"),
)
"""Session settings of chDB's read-only handle, in order: ``Python()`` reads the host process's objects and
readonly=1 does not stop it; ``readonly`` comes last since it freezes every setting."""

IN_STORE_TABLE_FUNCTIONS = frozenset(
    {
        "numbers",
        "numbers_mt",
        "zeros",
        "zeros_mt",
        "values",
        "view",
        "merge",
        "null",
        "primes",
        "generaterandom",
        "generate_series",
        "generateseries",
    }
)
"""Table functions that read nothing outside the store (lower case); every other one needs ``--write``,
which also covers those that ``DESCRIBE`` would open (schema inference reads a file or a URL)."""

_READ_STATEMENT = re.compile(r"^(SELECT|WITH|SHOW|DESCRIBE|DESC|EXPLAIN|EXISTS)\b", re.IGNORECASE)
_LEADING_NOISE = re.compile(r"^(?:\s|(?:--|#)[^\n]*(?:\n|$)|/\*.*?\*/|\()+", re.DOTALL)
_SQL_TOKENS = re.compile(
    r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|`(?:[^`\\]|\\.)*`|(?:--|#)[^\n]*|/\*.*?\*/|;", re.DOTALL
)
_INTO_OUTFILE = re.compile(r"\bINTO\s+OUTFILE\b", re.IGNORECASE)
_AST_LINE = re.compile(r"^( *)(\S+)(?: (\S+))?")

_READONLY_CHDB: dict[tuple[str, str], Client] = {}
_READONLY_LOCK = threading.Lock()


def readonly_settings() -> dict[str, str]:
    """The settings a read-only request to a ClickHouse server carries (a copy: callers may add theirs)."""
    return dict(READONLY_SETTINGS)


def readonly_session(client: Client, database: str) -> tuple[Client, dict[str, str] | None]:
    """A client whose session is read-only as a whole, and the settings each of its queries must carry.

    chDB: a dedicated connection handle on the same engine (cached per path and database), locked down with
    ``SET`` before it is handed out, so every statement of any text run on it is read-only and nothing it
    runs can lift that; no per-query settings. Server: ``client`` itself with ``READONLY_SETTINGS`` on
    every request (HTTP settings reach the one statement a request may hold)."""
    database = check_database(database)
    path = getattr(client, "path", None)
    if not isinstance(path, str):
        return _bound(client, database), readonly_settings()
    _bound(client, database)  # creates the database's writable twin, and checks the path is this process's
    key = (path, database)
    with _READONLY_LOCK:
        session = _READONLY_CHDB.get(key)
        if session is None:
            session = clickhouse_connect.get_client(
                interface="chdb", path=None if path == ":memory:" else path, database=database
            )
            for name, value in CHDB_LOCKDOWN:
                session.command(f"SET {name} = {value}")
            if session.command("SELECT getSetting('readonly')") != 1:
                raise RuntimeError("chDB did not take readonly=1 on the read-only session")
            _READONLY_CHDB[key] = session
    return session, None


def check_read_query(session: Client, query: str, parameters: dict[str, Any] | None, settings: Any) -> str:
    """The engine's canonical one-line text of ``query`` once the engine parsed it as a single read
    statement without ``INTO OUTFILE`` and without table functions reaching outside the store.

    PermissionError for what needs ``--write``; ValueError (from the engine's parser) for several statements
    or bad syntax."""
    try:
        canonical = session.query(
            "SELECT formatQuerySingleLine({q:String})", parameters={"q": query}, settings=settings
        ).result_rows[0][0]
    except Exception as exc:
        if "Multi-statements are not allowed" in str(exc):
            raise ValueError("one SQL statement at a time") from exc
        raise

    def explain_ast(text: str) -> str:
        # raw_query: the driver would take an AST of a query ending in LIMIT 0 for a column-metadata probe.
        return bytes(
            session.raw_query(f"EXPLAIN AST {text}", parameters=parameters, settings=settings, fmt="TSVRaw")
        ).decode()

    return vet_canonical(str(canonical), explain_ast)


def vet_canonical(canonical: str, explain_ast: Callable[[str], str]) -> str:
    """``canonical`` (the engine's one-line rendering of one statement) when a read-only session may run it:
    a read statement, no ``INTO OUTFILE``, no table function reaching outside the store (by the engine's
    ``EXPLAIN AST``, which ``explain_ast`` runs). PermissionError otherwise. Shared by ``run_sql`` and the
    embedded store's HTTP server, so both refuse exactly the same."""
    if not _READ_STATEMENT.match(canonical):
        raise PermissionError(f"read-only SQL accepts {_read_statement_names()} statements only")
    if _INTO_OUTFILE.search(_SQL_TOKENS.sub(" ", canonical)):
        raise PermissionError("read-only SQL cannot write files (INTO OUTFILE)")
    outside = sorted(set(table_functions(explain_ast(canonical).splitlines())) - IN_STORE_TABLE_FUNCTIONS)
    if outside:
        raise PermissionError(f"read-only SQL cannot call table functions reaching outside the store: {outside}")
    return canonical


def table_functions(ast_lines: Any) -> list[str]:
    """Names (lower case) of the table functions in an ``EXPLAIN AST`` dump: ``Function NAME`` nodes whose
    parent is a ``TableExpression``."""
    names: list[str] = []
    parents: list[str] = []
    for line in ast_lines:
        match = _AST_LINE.match(line)
        if not match:
            continue
        depth, node, name = len(match.group(1)), match.group(2), match.group(3)
        del parents[depth:]
        if node == "Function" and name and depth > 0 and len(parents) == depth and parents[-1] == "TableExpression":
            names.append(name.lower())
        parents.append(node)
    return names


def _read_statement_names() -> str:
    return "SELECT, WITH, SHOW, DESCRIBE, EXPLAIN or EXISTS"


def run_sql(
    client: Client,
    database: str,
    query: str,
    parameters: dict[str, Any] | None = None,
    readonly: bool = True,
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run user SQL with ``database`` as the default database; (column names, rows).

    Read-only (the default): checked by the engine (``check_read_query``) and run on a read-only session
    (``readonly_session``), the same on chDB and on a server. ``readonly=False`` runs one statement as given."""
    database = check_database(database)
    query = _single_statement(query)
    is_read = bool(_READ_STATEMENT.match(_LEADING_NOISE.sub("", query)))
    if readonly:
        if not is_read:
            raise PermissionError(f"read-only SQL accepts {_read_statement_names()} statements only")
        if _INTO_OUTFILE.search(_SQL_TOKENS.sub(" ", query)):
            raise PermissionError("read-only SQL cannot write files (INTO OUTFILE)")
        session, settings = readonly_session(client, database)
        canonical = check_read_query(session, query, parameters, settings)
        result = session.query(canonical, parameters=parameters, settings=settings)
        return list(result.column_names), [tuple(row) for row in result.result_rows]
    bound = _bound(client, database)
    if not is_read:
        bound.command(query, parameters=parameters)
        return [], []
    result = bound.query(query, parameters=parameters)
    return list(result.column_names), [tuple(row) for row in result.result_rows]


def _single_statement(query: str) -> str:
    """The query up to its first ``;`` outside literals and comments; ValueError if SQL follows it.

    A friendly first check only: the engine's parser decides for read-only SQL (``check_read_query``)."""
    for match in _SQL_TOKENS.finditer(query):
        if match.group() == ";":
            rest = query[match.end() :]
            rest = _SQL_TOKENS.sub(lambda m: "" if m.group()[:1] in ("-", "/", "#", ";") else m.group(), rest)
            if rest.strip():
                raise ValueError("one SQL statement at a time")
            return query[: match.start()]
    return query
