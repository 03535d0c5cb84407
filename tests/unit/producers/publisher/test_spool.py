"""The outage spool: bounded, oldest dropped first and counted, order kept, and on disk it survives a restart."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetscope.producers.publisher import DiskSpool, MemorySpool, SpoolError, SpoolRecord
from fleetscope.producers.publisher.spool import Spool


def rec(i: int, size: int = 100) -> SpoolRecord:
    return SpoolRecord(topic="fleetscope.kernels", key=f"job/{i % 3}".encode(), value=bytes([i % 256]) * size, events=i)


def values(records: list[tuple[int, SpoolRecord]]) -> list[int]:
    return [r.events for _, r in records]


Make = Callable[[int], Spool]


@pytest.fixture(params=["memory", "disk"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Make:
    def build(max_bytes: int) -> Spool:
        if request.param == "memory":
            return MemorySpool(max_bytes)
        return DiskSpool(tmp_path / "spool", max_bytes, segment_bytes=max_bytes // 4)

    return build


def test_records_come_back_in_order_and_commit_forgets_them(make: Make) -> None:
    spool = make(1 << 20)
    for i in range(10):
        spool.append(rec(i))
    assert spool.records == 10 and spool.unread == 10
    first = spool.read(4)
    assert values(first) == [0, 1, 2, 3] and [i for i, _ in first] == [0, 1, 2, 3]
    assert values(spool.read(100)) == list(range(4, 10)) and spool.unread == 0
    spool.commit(4)
    assert spool.records == 6 and spool.head == 4
    spool.rewind()  # a failed replay starts again at the oldest uncommitted record
    assert values(spool.read(100)) == list(range(4, 10))
    spool.commit(10)
    assert spool.records == 0 and spool.read(10) == []
    spool.close()


def test_a_full_spool_drops_the_oldest_counts_them_and_logs_once(make: Make, caplog: pytest.LogCaptureFixture) -> None:
    spool = make(20_000)
    with caplog.at_level(logging.WARNING, logger="fleetscope.producers.publisher.spool"):
        for i in range(1, 101):
            spool.append(rec(i, size=1000))
    assert spool.bytes <= 20_000
    kept = values(spool.read(1000))
    assert kept == list(range(101 - len(kept), 101))  # the newest survive, in order
    assert spool.dropped == 100 - len(kept) > 0
    assert spool.dropped_events == sum(range(1, 101 - len(kept)))
    assert len([r for r in caplog.records if "full" in r.message]) == 1  # then only counted
    spool.close()


def test_a_record_larger_than_the_spool_is_dropped_alone(make: Make) -> None:
    spool = make(65_536)
    spool.append(rec(1))
    spool.append(rec(2, size=70_000))
    spool.append(rec(3))
    assert values(spool.read(10)) == [1, 3] and spool.dropped == 1 and spool.dropped_events == 2
    spool.close()


def test_commit_after_the_head_was_dropped_is_harmless(make: Make) -> None:
    spool = make(20_000)
    for i in range(5):
        spool.append(rec(i, size=1000))
    in_flight = spool.read(5)
    for i in range(5, 60):
        spool.append(rec(i, size=1000))
    assert spool.dropped >= 5 and spool.head > in_flight[-1][0]
    spool.commit(in_flight[-1][0] + 1)  # acknowledged after the full spool had dropped them
    assert spool.records == spool.unread > 0
    assert values(spool.read(1000))[-1] == 59
    spool.close()


def test_the_disk_spool_survives_a_restart_and_resumes_after_the_last_commit(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, 1 << 20, segment_bytes=1000)
    for i in range(20):
        spool.append(rec(i))
    spool.read(8)
    spool.commit(8)
    spool.close()

    again = DiskSpool(tmp_path, 1 << 20, segment_bytes=1000)
    assert again.records == 12 and again.head == 8
    assert values(again.read(100)) == list(range(8, 20))
    again.append(rec(20))
    assert values(again.read(100)) == [20]  # ids go on after the old ones
    again.commit(21)
    again.close()
    assert not list(tmp_path.glob("*.seg"))  # delivered segments are deleted


def test_a_torn_last_record_is_cut_at_open(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    for i in range(3):
        spool.append(rec(i))
    spool.close()
    segment = next(tmp_path.glob("*.seg"))
    segment.write_bytes(segment.read_bytes()[:-30])  # a crash in the middle of a write
    with caplog.at_level(logging.WARNING):
        again = DiskSpool(tmp_path, 1 << 20)
    assert values(again.read(10)) == [0, 1] and "damaged" in caplog.text
    again.close()


def test_one_process_at_a_time_owns_a_spool_directory(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    with pytest.raises(SpoolError, match="in use"):
        DiskSpool(tmp_path, 1 << 20)
    spool.close()
    DiskSpool(tmp_path, 1 << 20).close()


def test_keys_may_be_absent_and_bytes_are_kept_exactly(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    records = [SpoolRecord("t", None, b"", 0), SpoolRecord("t.x", b"", b"\x00\xff" * 10, 7)]
    for r in records:
        spool.append(r)
    assert [r for _, r in spool.read(10)] == records
    spool.close()


def test_what_a_killed_process_spooled_is_there_for_the_next_one(tmp_path: Path) -> None:
    done = DiskSpool(tmp_path, 1 << 20)
    for i in range(5):
        done.append(rec(i))
    done.commit(5)  # an earlier run delivered everything: ids must not start again below its cursor
    done.close()
    script = (
        "import os, sys\n"
        "from fleetscope.producers.publisher import DiskSpool, SpoolRecord\n"
        "s = DiskSpool(sys.argv[1], 1 << 20)\n"
        "for i in range(3):\n"
        "    s.append(SpoolRecord('fleetscope.python', b'job/1', b'v' * 50, 10 + i))\n"
        "s.flush()\n"
        "os._exit(0)  # killed: no close, no cursor write\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=60)
    again = DiskSpool(tmp_path, 1 << 20)
    assert again.records == 3 and values(again.read(10)) == [10, 11, 12]
    again.close()


def test_a_damaged_length_is_not_trusted(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, 1 << 20)
    spool.append(rec(1))
    spool.close()
    segment = next(tmp_path.glob("*.seg"))
    segment.write_bytes(segment.read_bytes() + b"\xff\xff\xff\xf0" + b"junk")  # claims a 4 GB record
    again = DiskSpool(tmp_path, 1 << 20)
    assert values(again.read(10)) == [1]
    again.close()
