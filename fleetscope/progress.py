"""One status line on stderr while long work runs (redrawn on a terminal, throttled lines otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, stream: TextIO | None = None, enabled: bool = True, every_s: float = 2.0) -> None:
        self.stream = stream or sys.stderr
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
        if self.tty:
            pad = max(self._width - len(text), 0)
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + text + " " * max(self._width - len(text), 0) + "\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._width = 0
