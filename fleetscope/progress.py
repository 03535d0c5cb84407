"""One status line on stderr while long work runs (redrawn on a terminal, throttled lines otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from fleetscope.redaction import printable


class Progress:
    def __init__(self, stream: TextIO | None = None, enabled: bool = True, every_s: float = 2.0) -> None:
        self.stream = stream or sys.stderr
        self._raw: TextIO = getattr(self.stream, "raw", self.stream)
        """Where the redraw's carriage return goes: past ``TerminalText``, which would show it as text."""
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.every_s = every_s if not self.tty else 0.1
        self._last = 0.0
        self._width = 0

    def update(self, text: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        text = printable(text)  # a file's name cannot move the cursor: only the redraw's own "\r" does
        if self.tty:
            pad = max(self._width - len(text), 0)
            self._raw.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self._raw.write(text + "\n")
        self._raw.flush()

    def done(self, text: str) -> None:
        if not self.enabled:
            return
        text = printable(text)
        if self.tty:
            self._raw.write("\r" + text + " " * max(self._width - len(text), 0) + "\n")
        else:
            self._raw.write(text + "\n")
        self._raw.flush()
        self._width = 0
