"""Why a stage refuses a message: one short line, the dead-letter topic's ``reason`` header."""

from __future__ import annotations

MAX_REASON_CHARS = 500
"""A reason is cut to this length: a header, not a log."""


def reason(prefix: str, exc: BaseException | str) -> str:
    """``prefix: text`` on one line (the exception's text, or its type where it has none), cut to size."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{prefix}: {text}"[:MAX_REASON_CHARS]
