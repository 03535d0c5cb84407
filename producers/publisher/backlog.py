"""The in-memory backlog: messages accepted while older ones still wait, so that none overtakes them.

``publish`` appends here under the publisher's routing lock; the background thread moves the backlog into the
producer, or into the spool during an outage. Bounded by bytes like the spool: the oldest go first, counted.
"""

from __future__ import annotations

from collections import deque

from fleetscope.producers.publisher.spool import DropLog, SpoolRecord


class Backlog:
    """FIFO of (publisher sequence, record); not thread-safe: the caller holds the routing lock."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: deque[tuple[int, SpoolRecord]] = deque()
        self._drops = DropLog("publisher backlog", max_bytes)

    def __len__(self) -> int:
        return len(self._items)

    def append(self, seq: int, record: SpoolRecord) -> tuple[int, int]:
        """Add at the end; return the (messages, events) dropped from the front to stay within bounds."""
        self._items.append((seq, record))
        self.bytes += record.size
        lost = events = 0
        while self.bytes > self.max_bytes and len(self._items) > 1:
            lost, events = lost + 1, events + self.popleft()[1].events
        self._drops.add(lost, events)
        return lost, events

    def first(self) -> tuple[int, SpoolRecord]:
        return self._items[0]

    def popleft(self) -> tuple[int, SpoolRecord]:
        item = self._items.popleft()
        self.bytes -= item[1].size
        return item

    def take_all(self) -> list[tuple[int, SpoolRecord]]:
        items, self._items, self.bytes = list(self._items), deque(), 0
        return items
