"""User SQL (``fleetscope sql``, the report, Grafana panels): one read-only lockdown, enforced by ClickHouse.

A read-only query runs on a session that is read-only as a whole: on chDB a connection of its own whose
settings were set by ``lockdown_settings`` before any user text arrived (a client's own settings only from
``READ_CLIENT_SETTINGS``, then the bounds of ``StoreConfig.read_*``, then no Python or introspection,
then ``readonly=1``, which freezes them all); on a server the same settings sent with every request. Before
running, the engine's own parser renders the text as one statement (``formatQuerySingleLine`` refuses
multi-statements) and its AST (``EXPLAIN AST``) names every function: a table function must be one of
``IN_STORE_TABLE_FUNCTIONS`` and every other function one the engine files under a category of pure
computation (``SAFE_FUNCTION_CATEGORIES``, read from ``system.functions`` itself) or one of
``PURE_OTHER_FUNCTIONS``. An allowlist, because chDB (clickhouse-local) does not confine the scalar
``file()`` to ``user_files_path`` nor check grants for it: a function the engine adds later is refused
until someone files it as pure. The regular expressions below only give a friendlier error first.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import clickhouse_connect
from clickhouse_connect.driver import Client

from fleetscope.sinks.clickhouse.client import bound as _bound
from fleetscope.sinks.store_config import StoreConfig, check_database

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

READ_CLIENT_SETTINGS = frozenset(
    {
        "output_format_json_quote_64bit_integers", "output_format_json_quote_64bit_floats",
        "output_format_json_quote_denormals", "output_format_json_quote_decimals",
        "output_format_json_named_tuples_as_objects", "output_format_json_array_of_rows",
        "output_format_json_validate_utf8", "output_format_json_escape_forward_slashes",
        "output_format_decimal_trailing_zeros", "output_format_arrow_string_as_string",
        "output_format_arrow_low_cardinality_as_dictionary", "output_format_native_encode_types_in_binary_format",
        "output_format_pretty_max_rows", "output_format_pretty_color", "output_format_write_statistics",
        "output_format_csv_crlf_end_of_line", "format_csv_delimiter", "date_time_output_format",
        "session_timezone", "extremes", "join_use_nulls", "max_block_size",
    }
)  # fmt: skip
"""Settings a read-only client may pass (Grafana and clickhouse-connect send some of these): how results are
written, nothing that names a file, a path, a host or a limit. An allowlist: every other setting a read
client sends is dropped before the lockdown, since several read files (``format_template_resultset``,
``format_schema``) or lift bounds."""

SAFE_FUNCTION_CATEGORIES = frozenset(
    {
        "Aggregate Functions", "Arithmetic", "Arrays", "Bit", "Bitmap", "Comparison", "Conditional",
        "Dates and Times", "Distance", "Encoding", "Encryption", "Financial", "Geo", "Geo Polygon", "Hash",
        "IP Address", "JSON", "Logical", "Map", "Mathematical", "Null", "NumericIndexedVector", "QBit",
        "Random Number", "Rounding", "String", "String Replacement", "String Search", "String Splitting",
        "Time Series", "Time Window", "Tuple", "Type Conversion", "URL", "UUID",
    }
)  # fmt: skip
"""Categories of ``system.functions`` whose functions compute on their arguments only. Left out: Other
(``file``, ``hostName``, ``getServerSetting``...), Dictionary (a dictionary may be a file or a URL), AI
(network), Machine Learning (model files), Introspection, Embedded Dictionary, Internal."""

PURE_OTHER_FUNCTIONS = frozenset(
    {
        "bar", "blocksize", "bytesize", "countdigits", "currentdatabase", "finalizeaggregation",
        "formatquery", "formatquerysingleline", "formatreadabledecimalsize", "formatreadablequantity",
        "formatreadablesize", "formatreadabletimedelta", "identity", "ignore", "initializeaggregation",
        "isconstant", "isdecimaloverflow", "materialize", "neighbor", "parsereadablesize", "parsetimedelta",
        "rownumberinallblocks", "rownumberinblock", "runningaccumulate", "runningdifference",
        "runningdifferencestartingwithfirstvalue", "throwif", "totypename", "tocolumntypename", "transform",
        "version", "visiblewidth",
    }
)  # fmt: skip
"""Functions of the Other category (lower case) that read nothing but their arguments, the query or the
engine's version: what the report, Grafana and ``run_sql``'s own checks (``formatQuerySingleLine``) use."""

AST_CONSTRUCTS = frozenset({"lambda", "exists", "grouping", "untuple", "_cast"})
"""``Function`` nodes of ``EXPLAIN AST`` that are syntax, not entries of ``system.functions`` (``_CAST``: a
query parameter, substituted)."""

FUNCTION_CATALOG_QUERY = (
    "SELECT name, is_aggregate, case_insensitive, alias_to, categories FROM system.functions "
    "UNION ALL SELECT name, 2, 0, '', '' FROM system.aggregate_function_combinators"
)
"""The engine's own list of its functions and aggregate combinators (is_aggregate 2), for ``FunctionCatalog``."""


@dataclass(frozen=True)
class FunctionCatalog:
    """Which functions a read-only query may call, as the engine lists them: ``allowed`` (lower-case names
    of pure functions and their aliases), ``aggregates`` and ``combinators`` (``sumIf`` is ``sum`` + ``If``)."""

    allowed: frozenset[str]
    aggregates: frozenset[str]
    combinators: tuple[str, ...]

    @classmethod
    def from_rows(cls, rows: Iterable[Sequence[Any]]) -> FunctionCatalog:
        """From ``FUNCTION_CATALOG_QUERY``'s rows: a function is allowed when its category (or that of the
        function it is an alias of) is in ``SAFE_FUNCTION_CATEGORIES`` or it is in ``PURE_OTHER_FUNCTIONS``."""
        listed = [(str(r[0]), int(r[1]), str(r[3]), str(r[4])) for r in rows]
        category = {name: cat for name, kind, _, cat in listed if kind < 2}
        allowed: set[str] = set(PURE_OTHER_FUNCTIONS) | set(AST_CONSTRUCTS)
        aggregates: set[str] = set()
        for name, kind, alias_to, cat in listed:
            if kind == 2:
                continue
            resolved = category.get(alias_to, cat) if alias_to else cat
            if resolved in SAFE_FUNCTION_CATEGORIES or (alias_to or name).lower() in PURE_OTHER_FUNCTIONS:
                allowed.add(name.lower())
                if kind == 1 or resolved == "Aggregate Functions":
                    aggregates.add(name.lower())
        combinators = tuple(sorted((name.lower() for name, kind, _, _ in listed if kind == 2), key=len, reverse=True))
        return cls(frozenset(allowed), frozenset(aggregates), combinators)

    def permits(self, name: str) -> bool:
        """Whether a read-only query may call ``name``: an allowed function, or an aggregate of them followed
        by combinators (``quantilesExactIfOrNull``)."""
        lowered = name.lower()
        if lowered in self.allowed:
            return True
        stripped = True
        while stripped:
            stripped = False
            for suffix in self.combinators:
                if lowered.endswith(suffix) and len(lowered) > len(suffix):
                    lowered = lowered[: -len(suffix)]
                    stripped = True
                    if lowered in self.aggregates:
                        return True
                    break
        return False


def read_bounds(config: StoreConfig) -> tuple[tuple[str, str], ...]:
    """The engine settings that bound one read-only query (time, memory, result size, threads), from the
    configuration's ``read_*`` fields; a query past one is stopped by the engine with an error (``throw``)."""
    return (
        ("max_execution_time", repr(float(config.read_max_execution_time_s))),
        ("timeout_overflow_mode", "throw"),
        ("max_memory_usage", str(config.read_max_memory_bytes)),
        ("max_result_rows", str(config.read_max_result_rows)),
        ("max_result_bytes", str(config.read_max_result_bytes)),
        ("result_overflow_mode", "throw"),
        ("max_threads", str(config.read_max_threads)),
    )


def lockdown_settings(config: StoreConfig, client: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """The one lockdown of a read-only session, as ordered ``SET``s: the client's settings that
    ``READ_CLIENT_SETTINGS`` lists (any other is dropped), then ``read_bounds``, then ``CHDB_LOCKDOWN``
    (``readonly=1`` last: it freezes every setting, so nothing the client sends precedes or lifts it)."""
    chosen = [(k, v) for k, v in (client or {}).items() if k in READ_CLIENT_SETTINGS]
    return [*chosen, *read_bounds(config), *CHDB_LOCKDOWN]


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
_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_AST_LINE = re.compile(r"^( *)(\S+)(?: (\S+))?")

_READONLY_CHDB: dict[tuple[str, str, tuple[tuple[str, str], ...]], Client] = {}
_READONLY_LOCK = threading.Lock()
_CATALOGS: dict[object, FunctionCatalog] = {}


def readonly_settings() -> dict[str, str]:
    """The settings a read-only request to a ClickHouse server carries (a copy: callers may add theirs). The
    bounds are the server's: a ClickHouse server's own profile, the served store's ``read_*`` fields."""
    return dict(READONLY_SETTINGS)


def sql_string(value: str) -> str:
    """``value`` as a ClickHouse string literal (backslashes and quotes escaped)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def set_statement(name: str, value: str) -> str:
    """``SET name = 'value'``: the value a string literal (the engine parses it as the setting's type)."""
    if not _SETTING_NAME.match(name):
        raise ValueError(f"setting name {name!r} is not an identifier")
    return f"SET {name} = {sql_string(value)}"


def readonly_session(
    client: Client, database: str, config: StoreConfig | None = None
) -> tuple[Client, dict[str, str] | None]:
    """A client whose session is read-only as a whole, and the settings each of its queries must carry.

    chDB: a dedicated connection handle on the same engine (cached per path, database and bounds), locked
    down by ``lockdown_settings`` before it is handed out, so every statement of any text run on it is
    read-only and bounded and nothing it runs can lift that; no per-query settings. Server: ``client`` itself
    with ``readonly_settings`` on every request (HTTP settings reach the one statement a request may hold)."""
    database = check_database(database)
    config = config or StoreConfig()
    path = getattr(client, "path", None)
    if not isinstance(path, str):
        return _bound(client, database), readonly_settings()
    _bound(client, database)  # creates the database's writable twin, and checks the path is this process's
    key = (path, database, read_bounds(config))
    with _READONLY_LOCK:
        session = _READONLY_CHDB.get(key)
        if session is None:
            session = clickhouse_connect.get_client(
                interface="chdb", path=None if path == ":memory:" else path, database=database
            )
            for name, value in lockdown_settings(config):
                session.command(set_statement(name, value))
            if session.command("SELECT getSetting('readonly')") != 1:
                raise RuntimeError("chDB did not take readonly=1 on the read-only session")
            _READONLY_CHDB[key] = session
    return session, None


def function_catalog(run: Callable[[str], Iterable[Sequence[Any]]], key: object) -> FunctionCatalog:
    """The engine's ``FunctionCatalog`` (``run`` returns a query's rows), read once per ``key`` (an engine)."""
    with _READONLY_LOCK:
        catalog = _CATALOGS.get(key)
    if catalog is None:
        catalog = FunctionCatalog.from_rows(run(FUNCTION_CATALOG_QUERY))
        with _READONLY_LOCK:
            _CATALOGS[key] = catalog
    return catalog


def check_read_query(session: Client, query: str, parameters: dict[str, Any] | None, settings: Any) -> str:
    """The engine's canonical one-line text of ``query`` once the engine parsed it as a single read
    statement without ``INTO OUTFILE`` and calling only functions the read-only session may call.

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

    key = getattr(session, "path", None) or (getattr(session, "url", None), id(session))
    catalog = function_catalog(lambda sql: session.query(sql, settings=settings).result_rows, key)
    return vet_canonical(str(canonical), explain_ast, catalog)


def vet_canonical(canonical: str, explain_ast: Callable[[str], str], catalog: FunctionCatalog) -> str:
    """``canonical`` (the engine's one-line rendering of one statement) when a read-only session may run it:
    a read statement, no ``INTO OUTFILE``, no table function reaching outside the store and no other
    function outside ``catalog`` (by the engine's ``EXPLAIN AST``, which ``explain_ast`` runs).
    PermissionError otherwise. Shared by ``run_sql`` and the embedded store's HTTP server, so both refuse
    exactly the same."""
    if not _READ_STATEMENT.match(canonical):
        raise PermissionError(f"read-only SQL accepts {_read_statement_names()} statements only")
    if _INTO_OUTFILE.search(_SQL_TOKENS.sub(" ", canonical)):
        raise PermissionError("read-only SQL cannot write files (INTO OUTFILE)")
    lines = explain_ast(canonical).splitlines()
    outside = sorted(set(table_functions(lines)) - IN_STORE_TABLE_FUNCTIONS)
    if outside:
        raise PermissionError(f"read-only SQL cannot call table functions reaching outside the store: {outside}")
    refused = sorted({name for name in functions(lines) if not catalog.permits(name)})
    if refused:
        raise PermissionError(f"read-only SQL calls only functions that compute on their arguments; refused: {refused}")
    return canonical


def _function_calls(ast_lines: Iterable[str]) -> list[tuple[str, bool]]:
    """(name, is a table function) of every ``Function NAME`` node of an ``EXPLAIN AST`` dump: a table function
    is one whose parent is a ``TableExpression``."""
    calls: list[tuple[str, bool]] = []
    parents: list[str] = []
    for line in ast_lines:
        match = _AST_LINE.match(line)
        if not match:
            continue
        depth, node, name = len(match.group(1)), match.group(2), match.group(3)
        del parents[depth:]
        if node == "Function" and name:
            calls.append((name, bool(parents) and len(parents) == depth and parents[-1] == "TableExpression"))
        parents.append(node)
    return calls


def functions(ast_lines: Iterable[str]) -> list[str]:
    """Names of the functions an ``EXPLAIN AST`` dump calls outside table expressions."""
    return [name for name, in_table in _function_calls(ast_lines) if not in_table]


def table_functions(ast_lines: Iterable[str]) -> list[str]:
    """Names (lower case) of the table functions an ``EXPLAIN AST`` dump calls."""
    return [name.lower() for name, in_table in _function_calls(ast_lines) if in_table]


def _read_statement_names() -> str:
    return "SELECT, WITH, SHOW, DESCRIBE, EXPLAIN or EXISTS"


def run_sql(
    client: Client,
    database: str,
    query: str,
    parameters: dict[str, Any] | None = None,
    readonly: bool = True,
    config: StoreConfig | None = None,
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run user SQL with ``database`` as the default database; (column names, rows).

    Read-only (the default): checked by the engine (``check_read_query``) and run on a read-only session
    (``readonly_session``, bounded by ``config``'s ``read_*``), the same on chDB and on a server.
    ``readonly=False`` runs one statement as given."""
    database = check_database(database)
    query = _single_statement(query)
    is_read = bool(_READ_STATEMENT.match(_LEADING_NOISE.sub("", query)))
    if readonly:
        if not is_read:
            raise PermissionError(f"read-only SQL accepts {_read_statement_names()} statements only")
        if _INTO_OUTFILE.search(_SQL_TOKENS.sub(" ", query)):
            raise PermissionError("read-only SQL cannot write files (INTO OUTFILE)")
        session, settings = readonly_session(client, database, config)
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
