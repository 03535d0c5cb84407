"""What the CLI prints when a command fails: at most three lines, the cause first, then the fix.

Tracebacks are for ``--debug``; a store's error shows the store's own message as its adapter words it
(``sinks.store.refusal``), a Kafka error the broker it could not reach.
"""

from __future__ import annotations

from fleetscope.config import ConfigError

MAX_LINES = 3
_MAX_CHARS = 300


class BrokerUnreachable(RuntimeError):
    """No broker answered at the configured address."""

    def __init__(self, servers: str, detail: str = "") -> None:
        self.servers = servers
        super().__init__(f"no Kafka broker answers at {servers}" + (f" ({detail})" if detail else ""))


class StoreLocked(RuntimeError):
    """Another process has the local store open (a local store admits one process at a time)."""


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 3] + "..."


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
    from fleetscope.sinks.store import refusal

    text = str(exc)
    refused = refusal(exc)
    if refused is not None:
        lines = [f"{who}: the store refused: {_clip(refused.message)}"]
        if refused.fix is not None:
            lines.append(f"  {refused.fix}")
        return lines, 1
    if isinstance(exc, PermissionError):
        return [f"{who}: {_clip(text)}", "  add --write to modify the store"], 1
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    if isinstance(exc, ValueError | RuntimeError | TimeoutError | OSError):
        return [f"{who}: {_clip(first)}", "  (--debug shows the traceback)"], 1
    return [f"{who}: unexpected {type(exc).__name__}: {_clip(first)}", "  (--debug shows the traceback)"], 1
