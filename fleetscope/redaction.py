"""What text may leave the process for a terminal or a log: control characters shown, never obeyed, and
secrets reduced to where they lead.

Two rules, each defined once and pure (no I/O):

- ``printable``: every character a terminal would act on rather than show (C0 and C1 controls, DEL, hence
  every escape sequence, format characters such as bidirectional overrides, line and paragraph separators)
  is written as its Python escape (``\\x1b``). A kernel name is data: it cannot retitle, clear or rewrite
  the operator's terminal, nor forge a log line.
- ``redact``: an http(s) URL keeps its scheme, host and port and loses its user, path, query and fragment
  (a Slack-style webhook's secret is its path; a ``password=`` often rides in the query); ``password=``,
  ``token=``, ``secret=`` and ``api_key=`` values, ``Authorization``/``X-ClickHouse-Key`` header values, and the
  secrets this process was told of (``register_secret``) become ``…``.

``install()`` applies both to every log record the process creates, whatever logger, handler or library
(librdkafka's logger, Faust, aiokafka) it comes from: a record factory runs before any handler, and after
the level check, so a record that is not emitted costs nothing. This module imports nothing from fleetscope.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from collections.abc import Callable
from functools import lru_cache

HIDDEN = "…"
"""What a secret is replaced by."""

_URL = re.compile(r"\b(https?://)(?:[^\s/?#@'\"<>]*@)?([^\s/?#'\"<>]+)([/?#][^\s'\"<>]*)?", re.IGNORECASE)
_KEY_VALUE = re.compile(
    r"\b([\w.-]*(?:password|passwd|pwd|token|secret|api[_-]?key)\s*[=:]\s*['\"]?)[^\s&;,'\"]+",
    re.IGNORECASE,
)
_HEADER = re.compile(
    r"\b((?:proxy-)?authorization|x-clickhouse-key)(['\"]?\s*[:=]\s*['\"]?)(?:(basic|bearer|token)\s+)?[^\s'\",}]+",
    re.IGNORECASE,
)
MIN_SECRET_CHARS = 6
"""Registered secrets shorter than this are not searched for: they would hide ordinary words."""

_secrets: frozenset[str] = frozenset()
_secrets_lock = threading.Lock()


@lru_cache(maxsize=4096)
def _shown(ch: str) -> str:
    """A character as a terminal must receive it: itself when it is printable (or a space), else its escape."""
    if ch.isprintable() or unicodedata.category(ch) == "Zs":
        return ch
    return ch.encode("unicode_escape").decode("ascii")


def printable(text: str, keep: str = "") -> str:
    """``text`` with every character that is not printable written as its escape (``\\x1b[2J`` shows as
    the text ``\\x1b[2J``), except those in ``keep`` (a log keeps the newlines of a traceback)."""
    if text.isprintable():
        return text
    return "".join(ch if ch in keep else _shown(ch) for ch in text)


def register_secret(value: str) -> None:
    """Hide ``value`` (a token, a password) wherever ``redact`` finds it, from now on in this process."""
    global _secrets
    if len(value) >= MIN_SECRET_CHARS:
        with _secrets_lock:
            _secrets = _secrets | {value}


def _url(match: re.Match[str]) -> str:
    scheme, host, rest = match.group(1), match.group(2), match.group(3)
    return f"{scheme}{host}" + (f"/{HIDDEN}" if rest and rest != "/" else rest or "")


def redact(text: str) -> str:
    """``text`` with URLs reduced to ``scheme://host:port/…`` and every secret it shows replaced by ``…``."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, HIDDEN)
    if "://" in text:
        text = _URL.sub(_url, text)
    text = _HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}{m.group(3) + ' ' if m.group(3) else ''}{HIDDEN}", text)
    return _KEY_VALUE.sub(lambda m: m.group(1) + HIDDEN, text)


def safe_log_text(text: str, keep: str = "\t") -> str:
    """What a log may show of ``text``: secrets redacted, controls escaped but those in ``keep``. A message
    keeps no newline (one record, one line: a name cannot forge the next), a traceback keeps its own."""
    return printable(redact(text), keep=keep)


_installed: list[Callable[..., logging.LogRecord]] = []


def install() -> None:
    """Make every log record of this process carry ``safe_log_text`` of its message and traceback
    (idempotent). The message is formatted once, here, so its arguments cannot bring a secret back."""
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            record.msg, record.args = safe_log_text(record.getMessage()), ()
        except Exception:  # a record whose arguments do not format: logging reports it where it emits
            return record
        if record.exc_info and not record.exc_text:
            record.exc_text = safe_log_text(logging.Formatter().formatException(record.exc_info), keep="\n\t")
        if record.stack_info:
            record.stack_info = safe_log_text(record.stack_info, keep="\n\t")
        return record

    _installed.append(previous)
    logging.setLogRecordFactory(factory)


def uninstall() -> None:
    """Restore the record factory ``install`` replaced (for tests)."""
    if _installed:
        logging.setLogRecordFactory(_installed.pop())
