"""Why a stage refuses a message: one short line, the dead-letter topic's ``reason`` header."""

from __future__ import annotations

import re

MAX_REASON_CHARS = 500
"""A reason is cut to this length: a header, not a log."""

_NAME = r"(?:[^<>\s]|<\w+>)+"
_OBJECT_REPR = re.compile(rf"<((?:\w+ )*?{_NAME}?)(?: object)? at 0x[0-9a-fA-F]+>")
"""Python's default ``repr`` of an object (``<_io.BytesIO object at 0x7f...>``, ``<function f at 0x...>``)."""


def _words(match: re.Match[str]) -> str:
    """``a BytesIO`` for ``<_io.BytesIO object at 0x...>``: the last part of the dotted name."""
    return "a " + match.group(1).rsplit(".", 1)[-1]


def reason(prefix: str, exc: BaseException | str) -> str:
    """``prefix: text`` on one line (the exception's text, or its type where it has none), cut to size.

    A reason is words: an object's default ``repr`` in the text (fastavro's ``cannot read double from
    <_io.BytesIO object at 0x7f…>``) becomes its type's name (``from a BytesIO``). Its address says nothing
    to the reader, shows the process's memory layout, and would make each refusal's reason unique."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{prefix}: {_OBJECT_REPR.sub(_words, text)}"[:MAX_REASON_CHARS]
