"""ClickHouse's error texts as a person reads them: the server's own message (its first sentence, without
the parser's list of expected tokens or the driver's additions) and the fix of the codes people meet."""

from __future__ import annotations

import re

from fleetscope.sinks.store import Refusal

_CLICKHOUSE = re.compile(
    r"Code: (\d+)\. DB::Exception: (.*?)(?: \(version [^)]*\))?\.?\s*(?:\(for url [^)]*\))?$", re.S
)
_CLICKHOUSE_NAME = re.compile(r"\(([A-Z][A-Z0-9_]+)\)\s*$")
FIXES = {
    62: "fix the SQL (docs/sql-cookbook.md has worked examples)",
    47: "SHOW TABLES and DESCRIBE <table> list what the store has",
    60: "the tables are iterations, function_patterns, finding_updates and the findings view (SHOW TABLES)",
    81: "the database is set by store.database (default fleetscope)",
    164: "add --write to modify the store",
    516: "the tokens are in <data_dir>/endpoint.json of the running `fleetscope up`",
}
"""ClickHouse error code -> the fix the CLI prints below the message."""
SYNTAX_PROBE = "EXPLAIN AST "
"""Prefixed to a statement the read-only session refused by its first word: the engine parses it, runs nothing."""


def clickhouse_message(text: str) -> tuple[int, str] | None:
    """(code, the server's message) from a ClickHouse or chDB error text, or None."""
    starts = [m.start() for m in re.finditer(r"Code: \d+\. DB::Exception:", text)]
    if not starts:
        return None
    match = _CLICKHOUSE.match(text[starts[-1] :].strip())
    if match is None:
        return None
    message = match.group(2)
    message = re.split(r"\. Expected one of:|\. Stack trace|\nStack trace", message)[0]
    # the driver's own additions to the user's query
    message = re.sub(r" SETTINGS readonly = '?1'?|\s*FORMAT (?:Native|JSON|TabSeparated)\b", "", message)
    name = _CLICKHOUSE_NAME.search(match.group(2))
    if name and name.group(0) not in message:
        message = f"{message.rstrip('.')} ({name.group(1)})"
    return int(match.group(1)), message


def syntax_error_of(explain_error: BaseException, prefix: str = SYNTAX_PROBE) -> RuntimeError | None:
    """The engine's syntax error for a query, from the error of ``prefix + query`` (positions shifted back
    and the driver's FORMAT clause dropped), or None when the engine parsed it."""
    parsed = clickhouse_message(str(explain_error))
    if parsed is None or parsed[0] != 62:
        return None
    shift = len(prefix)

    def back(m: re.Match[str]) -> str:
        return f"{m.group(1)}{max(1, int(m.group(2)) - shift)}"

    message = re.sub(
        r"(position |col )(\d+)", back, parsed[1].replace("\n FORMAT Native", "").replace(" FORMAT Native", "")
    )
    return RuntimeError(f"Code: 62. DB::Exception: {message}")


def refusal(exc: BaseException) -> Refusal | None:
    """A ClickHouse error worded for the CLI: the server's message and its code's fix; None for others."""
    parsed = clickhouse_message(str(exc))
    if parsed is None:
        return None
    code, message = parsed
    return Refusal(message, FIXES.get(code))
