"""What the CLI prints when a command fails: at most three lines, the cause first, then the fix.

Tracebacks are for ``--debug``; a ClickHouse error shows the server's own message (its first sentence,
without the parser's list of expected tokens), a Kafka error the broker it could not reach.
"""

from __future__ import annotations

import re

from fleetscope.config import ConfigError

MAX_LINES = 3
_MAX_CHARS = 300
_CLICKHOUSE = re.compile(
    r"Code: (\d+)\. DB::Exception: (.*?)(?: \(version [^)]*\))?\.?\s*(?:\(for url [^)]*\))?$", re.S
)
_CLICKHOUSE_NAME = re.compile(r"\(([A-Z][A-Z0-9_]+)\)\s*$")
_FIXES = {
    62: "fix the SQL (docs/sql-cookbook.md has worked examples)",
    47: "SHOW TABLES and DESCRIBE <table> list what the store has",
    60: "the tables are iterations, function_patterns, finding_updates and the findings view (SHOW TABLES)",
    81: "the database is set by store.database (default fleetscope)",
    164: "add --write to modify the store",
    516: "the tokens are in <data_dir>/endpoint.json of the running `fleetscope up`",
}


class BrokerUnreachable(RuntimeError):
    """No broker answered at the configured address."""

    def __init__(self, servers: str, detail: str = "") -> None:
        self.servers = servers
        super().__init__(f"no Kafka broker answers at {servers}" + (f" ({detail})" if detail else ""))


class StoreLocked(RuntimeError):
    """Another process has the chDB store open (chDB admits one process per store)."""


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 3] + "..."


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


def syntax_error_of(query: str, explain_error: BaseException, prefix: str) -> RuntimeError | None:
    """The engine's syntax error for ``query``, from the error of ``prefix + query`` (positions shifted back
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


def describe(exc: BaseException, command: str) -> tuple[list[str], int]:
    """(lines to print, exit status) for an exception that ended ``command``."""
    who = f"fleetscope {command}"
    if isinstance(exc, ConfigError):
        lines = [f"{who}: {_clip(exc.errors[0])}"] if exc.errors else [f"{who}: invalid configuration"]
        lines += [f"  also: {_clip(e)}" for e in exc.errors[1:2]]
        if len(exc.errors) > 2:
            lines.append(f"  and {len(exc.errors) - 2} more problems: see the README's configuration block")
        return lines[:MAX_LINES], 2
    if isinstance(exc, BrokerUnreachable):
        fix = "start `fleetscope up` in this folder, or pass --bootstrap HOST:PORT of a running broker"
        return [f"{who}: {_clip(str(exc))}", f"  {fix}"], 1
    if isinstance(exc, StoreLocked):
        return [f"{who}: {_clip(str(exc))}"], 1
    text = str(exc)
    parsed = clickhouse_message(text)
    if parsed is not None:
        code, message = parsed
        lines = [f"{who}: the store refused: {_clip(message)}"]
        if code in _FIXES:
            lines.append(f"  {_FIXES[code]}")
        return lines, 1
    if isinstance(exc, PermissionError):
        return [f"{who}: {_clip(text)}", "  add --write to modify the store"], 1
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if isinstance(exc, ValueError | RuntimeError | TimeoutError | OSError):
        return [f"{who}: {_clip(first)}", "  (--debug shows the traceback)"], 1
    return [f"{who}: unexpected {type(exc).__name__}: {_clip(first)}", "  (--debug shows the traceback)"], 1
