"""librdkafka's own log lines, routed into ``logging`` (not stderr) and thinned out.

While a broker is away, librdkafka reports every reconnect attempt; one line of each kind per ``interval_s``
says enough, and the publisher's counters carry the rest.
"""

from __future__ import annotations

import logging
import time


class _Repeats(logging.Filter):
    """Lets one line of each kind through per ``interval_s`` (the kind: the text after librdkafka's prefix)."""

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = record.getMessage().rsplit("]: ", 1)[-1][:120]
        now = time.monotonic()
        if now - self._last.get(key, -self.interval_s) < self.interval_s:
            return False
        if len(self._last) > 1000:
            self._last.clear()
        self._last[key] = now
        return True


CLIENT_LOGGER = logging.getLogger("fleetscope.producers.publisher.librdkafka")
CLIENT_LOGGER.addFilter(_Repeats(30.0))
