"""The publisher's bounded spool: messages the broker has not taken yet, oldest first, on disk or in memory.

Why: a training process must neither block nor lose data while the broker is away. The publisher moves what
librdkafka could not deliver here and replays it, in order, once the broker is back. The spool is bounded: when
full, the oldest messages go first (counted, and logged at most every ``DROP_LOG_INTERVAL_S``), because a live
analysis needs recent data more than old data.

Records get consecutive ids. ``read`` hands out records from a read cursor; ``commit(n)`` says every record
below id ``n`` is delivered; ``rewind`` sends the read cursor back to the oldest uncommitted record (after a
failed replay). One thread uses a spool: nothing here locks.

On disk: ``DiskSpool`` (``disk_spool.py``).
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)

DROP_LOG_INTERVAL_S = 10.0
FRAME = struct.Struct(">II")  # body length, crc32 of the body
BODY = struct.Struct(">HiI")  # topic length, key length (-1: no key), events
"""A record's framing on disk; its ``size`` counts it in memory too, so both spools fill alike."""


class SpoolError(RuntimeError):
    """The spool directory cannot be used (locked by another process, not writable)."""


@dataclass(frozen=True, slots=True)
class SpoolRecord:
    """One Kafka message waiting for the broker; ``events`` is how many events its batch holds."""

    topic: str
    key: bytes | None
    value: bytes
    events: int

    @property
    def size(self) -> int:
        return FRAME.size + BODY.size + len(self.topic) + len(self.key or b"") + len(self.value)


class Spool(Protocol):
    max_bytes: int

    @property
    def dropped(self) -> int:
        """Records dropped because the spool was full."""
        ...

    @property
    def dropped_events(self) -> int: ...

    @property
    def head(self) -> int:
        """Id of the oldest record not committed yet."""
        ...

    @property
    def records(self) -> int:
        """Records not committed yet (read or not)."""
        ...

    @property
    def bytes(self) -> int: ...

    @property
    def unread(self) -> int: ...

    def append(self, record: SpoolRecord) -> None: ...

    def read(self, max_records: int) -> list[tuple[int, SpoolRecord]]: ...

    def rewind(self) -> None: ...

    def commit(self, upto_id: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class DropLog:
    """Counts drops of the oldest data; logs the first at once, then at most every ``DROP_LOG_INTERVAL_S``."""

    def __init__(self, where: str, max_bytes: int) -> None:
        self.where = where
        self.max_bytes = max_bytes
        self.dropped = 0
        self.dropped_events = 0
        self._logged_at = -DROP_LOG_INTERVAL_S
        self._unlogged = 0

    def add(self, records: int, events: int) -> None:
        if records <= 0:
            return
        self.dropped += records
        self.dropped_events += events
        self._unlogged += records
        now = time.monotonic()
        if now - self._logged_at >= DROP_LOG_INTERVAL_S:
            logger.warning(
                "%s full (%d bytes): dropped the %d oldest messages (%d dropped in all, %d events)",
                self.where,
                self.max_bytes,
                self._unlogged,
                self.dropped,
                self.dropped_events,
            )
            self._logged_at, self._unlogged = now, 0


class DropCounted:
    """What both spools report of the data they had to drop."""

    _drops: DropLog

    @property
    def dropped(self) -> int:
        return self._drops.dropped

    @property
    def dropped_events(self) -> int:
        return self._drops.dropped_events


class MemorySpool(DropCounted):
    """The spool without a directory: same contract, lost when the process ends."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._records: dict[int, SpoolRecord] = {}
        self._head = 0
        self._tail = 0
        self._read = 0
        self._bytes = 0
        self._drops = DropLog("spool in memory", max_bytes)

    @property
    def head(self) -> int:
        return self._head

    @property
    def records(self) -> int:
        return self._tail - self._head

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def unread(self) -> int:
        return self._tail - max(self._read, self._head)

    def append(self, record: SpoolRecord) -> None:
        if record.size > self.max_bytes:
            self._drops.add(1, record.events)
            return
        records = events = 0
        while self._bytes + record.size > self.max_bytes:
            old = self._records.pop(self._head)
            self._head += 1
            self._bytes -= old.size
            records, events = records + 1, events + old.events
        self._drops.add(records, events)
        self._records[self._tail] = record
        self._tail += 1
        self._bytes += record.size

    def read(self, max_records: int) -> list[tuple[int, SpoolRecord]]:
        start = max(self._read, self._head)
        stop = min(self._tail, start + max_records)
        self._read = stop
        return [(i, self._records[i]) for i in range(start, stop)]

    def rewind(self) -> None:
        self._read = self._head

    def commit(self, upto_id: int) -> None:
        while self._head < min(upto_id, self._tail):
            self._bytes -= self._records.pop(self._head).size
            self._head += 1

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
