"""The publisher's bounded spool: messages the broker has not taken yet, oldest first, on disk or in memory.

Why: a training process must neither block nor lose data while the broker is away. The publisher moves what
librdkafka could not deliver here and replays it, in order, once the broker is back. The spool is bounded: when
full, the oldest messages go first (counted, and logged at most every ``DROP_LOG_INTERVAL_S``), because a live
analysis needs recent data more than old data.

Records get consecutive ids. ``read`` hands out records from a read cursor; ``commit(n)`` says every record
below id ``n`` is delivered; ``rewind`` sends the read cursor back to the oldest uncommitted record (after a
failed replay). One thread uses a spool: nothing here locks.

On disk (``DiskSpool``): append-only segment files named by their first record id, each record
``[body length u32][crc32 u32][topic length u16][key length i32][events u32][topic][key][value]``, and a
``cursor`` file holding the first uncommitted id. Records are flushed to the OS, not fsynced: a process that
dies loses nothing, a machine that dies may lose the tail, which the CRC detects. A replay after a restart
may repeat records committed after the last cursor write; the per-producer sequence numbers in every batch
header make those duplicates detectable downstream.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import time
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

logger = logging.getLogger(__name__)

DROP_LOG_INTERVAL_S = 10.0
_FRAME = struct.Struct(">II")  # body length, crc32 of the body
_BODY = struct.Struct(">HiI")  # topic length, key length (-1: no key), events
_SUFFIX = ".seg"
_CURSOR_WRITE_INTERVAL_S = 1.0


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
        return _FRAME.size + _BODY.size + len(self.topic) + len(self.key or b"") + len(self.value)


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


class _DropCounted:
    """What both spools report of the data they had to drop."""

    _drops: DropLog

    @property
    def dropped(self) -> int:
        return self._drops.dropped

    @property
    def dropped_events(self) -> int:
        return self._drops.dropped_events


class MemorySpool(_DropCounted):
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


@dataclass
class _Segment:
    path: Path
    first: int
    size: int
    events: array[int]  # per record: what a drop of the segment costs in events

    @property
    def end(self) -> int:
        return self.first + len(self.events)


class DiskSpool(_DropCounted):
    """Append-only segment files in ``directory`` (exclusively locked); survives a process restart."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int, segment_bytes: int = 0) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = min(segment_bytes or max(min(max_bytes // 8, 64 << 20), 1), max_bytes)
        self._drops = DropLog(f"spool {self.dir}", max_bytes)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock: BinaryIO | None = open(self.dir / "lock", "ab")  # noqa: SIM115 (held while open)
        except OSError as exc:
            raise SpoolError(f"cannot use spool directory {self.dir}: {exc}") from exc
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self._lock.close()
            raise SpoolError(f"spool directory {self.dir} is in use by another process") from exc
        self._segments = [s for s in map(self._scan, sorted(self.dir.glob(f"*{_SUFFIX}"))) if s is not None]
        self._segments.sort(key=lambda s: s.first)
        self._active: tuple[_Segment, BinaryIO] | None = None  # the segment appended to, and its file
        cursor = self._read_cursor()
        self._tail = self._segments[-1].end if self._segments else cursor  # ids never repeat across runs
        self._head = min(cursor, self._tail)
        self._read = self._head
        self._reader: tuple[int, int] | None = None  # (next id, file offset) within the segment holding it
        self._cursor_at = 0.0
        self._drop_committed_segments()
        if self.records:
            logger.info("spool %s holds %d messages from an earlier run", self.dir, self.records)

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def head(self) -> int:
        first = next((s.first for s in self._segments if s.end > self._head), self._tail)
        return max(first, self._head)

    @property
    def records(self) -> int:
        return self._count_from(self._head)

    @property
    def bytes(self) -> int:
        return sum(s.size for s in self._segments)

    @property
    def unread(self) -> int:
        return self._count_from(max(self._read, self._head))

    def _count_from(self, start: int) -> int:
        return sum(s.end - max(s.first, start) for s in self._segments if s.end > start)

    # -- writing -------------------------------------------------------------------------------------------
    def append(self, record: SpoolRecord) -> None:
        topic = record.topic.encode()
        key = record.key
        body = b"".join(
            (_BODY.pack(len(topic), -1 if key is None else len(key), record.events), topic, key or b"", record.value)
        )
        size = _FRAME.size + len(body)
        if size > self.max_bytes:
            self._drops.add(1, record.events)
            return
        if self._active is None or (self._active[0].size and self._active[0].size + size > self.segment_bytes):
            self._roll()
        segment, writer = self._active or self._roll()
        while self.bytes + size > self.max_bytes and self._segments[0] is not segment:
            self._drop_oldest()
        writer.write(_FRAME.pack(len(body), zlib.crc32(body)))
        writer.write(body)
        segment.size += size
        segment.events.append(record.events)
        self._tail += 1

    def flush(self) -> None:
        """Hand appended records to the OS (a later read and a process crash see them)."""
        if self._active is not None:
            self._active[1].flush()

    def _roll(self) -> tuple[_Segment, BinaryIO]:
        self._close_writer()
        path = self.dir / f"{self._tail:020d}{_SUFFIX}"
        segment = _Segment(path, self._tail, 0, array("I"))
        self._segments.append(segment)
        self._active = (segment, open(path, "ab"))  # noqa: SIM115 (open while it is the active segment)
        return self._active

    def _drop_oldest(self) -> None:
        segment = self._segments.pop(0)
        lost = segment.events[max(self._head - segment.first, 0) :]
        self._drops.add(len(lost), sum(lost))
        self._head = max(self._head, segment.end)
        self._unlink(segment)

    # -- reading -------------------------------------------------------------------------------------------
    def read(self, max_records: int) -> list[tuple[int, SpoolRecord]]:
        self.flush()
        out: list[tuple[int, SpoolRecord]] = []
        while len(out) < max_records:
            start = max(self._read, self._head)
            segment = next((s for s in self._segments if s.end > start), None)
            if segment is None:
                break
            start = max(start, segment.first)  # a segment cut at open leaves a gap in the ids
            offset = self._reader[1] if self._reader and self._reader[0] == start else self._offset_of(segment, start)
            want = min(max_records - len(out), segment.end - start)
            got = 0
            with open(segment.path, "rb") as f:
                f.seek(offset)
                while got < want and (record := _read_record(f)) is not None:
                    out.append((start + got, record))
                    got += 1
                offset = f.tell()
            self._read = start + got
            self._reader = (self._read, offset) if self._read < segment.end else None
            if got < want:  # changed under our feet after the scan at open
                logger.error("spool segment %s is damaged at record %d; dropping its rest", segment.path, self._read)
                lost = segment.events[self._read - segment.first :]
                self._drops.add(len(lost), sum(lost))
                del segment.events[self._read - segment.first :]
                self._reader = None
                if self._active is not None and self._active[0] is segment:
                    self._close_writer()  # appends go on in a new segment, after the gap
        return out

    def rewind(self) -> None:
        self._read = self._head
        self._reader = None

    def commit(self, upto_id: int) -> None:
        upto = min(upto_id, self._tail)
        if upto <= self._head:
            return
        self._head = upto
        self._drop_committed_segments()
        if time.monotonic() - self._cursor_at >= _CURSOR_WRITE_INTERVAL_S:
            self._write_cursor()

    def close(self) -> None:
        self._close_writer()
        if self._lock is None:
            return
        self._write_cursor()
        fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)
        self._lock.close()
        self._lock = None

    # -- helpers -------------------------------------------------------------------------------------------
    def _drop_committed_segments(self) -> None:
        while self._segments and self._segments[0].end <= self._head:
            if self._active is not None and self._active[0] is self._segments[0]:
                self._close_writer()
            self._unlink(self._segments.pop(0))

    def _close_writer(self) -> None:
        if self._active is not None:
            self._active[1].close()
            self._active = None

    def _unlink(self, segment: _Segment) -> None:
        try:
            segment.path.unlink()
        except FileNotFoundError:
            pass

    def _offset_of(self, segment: _Segment, record_id: int) -> int:
        offset = 0
        with open(segment.path, "rb") as f:
            for _ in range(record_id - segment.first):
                frame = f.read(_FRAME.size)
                length, _crc = _FRAME.unpack(frame)
                offset += _FRAME.size + length
                f.seek(offset)
        return offset

    def _scan(self, path: Path) -> _Segment | None:
        """Index a segment left by an earlier run; cut a torn or damaged tail (a crash while writing)."""
        try:
            first = int(path.name.removesuffix(_SUFFIX))
        except ValueError:
            return None
        events = array("I")
        with open(path, "rb") as f:
            good = 0
            while (record := _read_record(f)) is not None:
                events.append(record.events)
                good = f.tell()
            size = f.seek(0, os.SEEK_END)
        if good < size:
            logger.warning("spool segment %s: cut %d damaged trailing bytes", path, size - good)
            os.truncate(path, good)
        if not events:
            path.unlink()
            return None
        return _Segment(path, first, good, events)

    def _read_cursor(self) -> int:
        try:
            return int((self.dir / "cursor").read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _write_cursor(self) -> None:
        tmp = self.dir / "cursor.tmp"
        try:
            tmp.write_text(str(self._head))
            tmp.replace(self.dir / "cursor")
        except OSError as exc:
            logger.warning("cannot write the spool cursor in %s: %s", self.dir, exc)
            return
        self._cursor_at = time.monotonic()


def _read_record(f: BinaryIO) -> SpoolRecord | None:
    frame = f.read(_FRAME.size)
    if len(frame) < _FRAME.size:
        return None
    length, crc = _FRAME.unpack(frame)
    if length > os.fstat(f.fileno()).st_size - f.tell():  # a damaged length: never read (or allocate) past the end
        return None
    body = f.read(length)
    if len(body) < length or zlib.crc32(body) != crc or length < _BODY.size:
        return None
    topic_len, key_len, events = _BODY.unpack_from(body)
    start = _BODY.size
    topic = body[start : start + topic_len].decode()
    start += topic_len
    key = None if key_len < 0 else body[start : start + key_len]
    start += max(key_len, 0)
    return SpoolRecord(topic, key, body[start:], events)
