"""``DiskSpool``: the publisher's spool on disk, surviving a restart of the process.

Append-only segment files named by their first record id, each record
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
import time
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fleetscope.producers.publisher.spool import BODY, FRAME, DropCounted, DropLog, SpoolError, SpoolRecord

logger = logging.getLogger("fleetscope.producers.publisher.spool")

_SUFFIX = ".seg"
_CURSOR_WRITE_INTERVAL_S = 1.0


@dataclass
class _Segment:
    path: Path
    first: int
    size: int
    events: array[int]  # per record: what a drop of the segment costs in events

    @property
    def end(self) -> int:
        return self.first + len(self.events)


class DiskSpool(DropCounted):
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
            (BODY.pack(len(topic), -1 if key is None else len(key), record.events), topic, key or b"", record.value)
        )
        size = FRAME.size + len(body)
        if size > self.max_bytes:
            self._drops.add(1, record.events)
            return
        if self._active is None or (self._active[0].size and self._active[0].size + size > self.segment_bytes):
            self._roll()
        segment, writer = self._active or self._roll()
        while self.bytes + size > self.max_bytes and self._segments[0] is not segment:
            self._drop_oldest()
        writer.write(FRAME.pack(len(body), zlib.crc32(body)))
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
                frame = f.read(FRAME.size)
                length, _crc = FRAME.unpack(frame)
                offset += FRAME.size + length
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
    frame = f.read(FRAME.size)
    if len(frame) < FRAME.size:
        return None
    length, crc = FRAME.unpack(frame)
    if length > os.fstat(f.fileno()).st_size - f.tell():  # a damaged length: never read (or allocate) past the end
        return None
    body = f.read(length)
    if len(body) < length or zlib.crc32(body) != crc or length < BODY.size:
        return None
    topic_len, key_len, events = BODY.unpack_from(body)
    start = BODY.size
    topic = body[start : start + topic_len].decode()
    start += topic_len
    key = None if key_len < 0 else body[start : start + key_len]
    start += max(key_len, 0)
    return SpoolRecord(topic, key, body[start:], events)
