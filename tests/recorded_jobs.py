"""Real 4-rank PyTorch jobs as their windowers published them: the pattern records of each, byte for byte, in
publication order (``bench/real_jobs.py record`` ran them through the live stack, ``export`` wrote these).

A file is ``<fault>-rank<R>-<id>.bin.gz`` (``<fault>-<id>.bin.gz`` for a healthy job, ``none``, and a fault of
the whole job): gzip of the messages, each a 4-byte big-endian length and the message. Importable from every
test as ``recorded_jobs``."""

from __future__ import annotations

import gzip
import struct
from dataclasses import dataclass
from pathlib import Path

RECORDED = Path(__file__).resolve().parent / "data" / "real_jobs"
FAULT_AT = 30
"""The step from which a faulty rank of the real-job test's job is faulty."""
FAULTS: dict[str, tuple[int, str | None, str | None]] = {
    "dataloader": (2, "host_slow", "dataloader.next"),
    "gc": (3, "host_slow", "gc.collect"),
    "compute": (1, None, None),  # any finding naming the rank (continuous mode: a straggler from arrival)
    "slowdown": (-1, "job_regression", "iteration"),  # every rank's forward 4 times over: the job's own work
}
"""Each fault of the real-job test's job: its rank (-1: every rank, the job) and the finding that must name it
(category and function; None: any), within 10 iterations of ``FAULT_AT``, and no other rank. The live test,
the bench and the recordings' test share it."""
_LENGTH = struct.Struct(">I")


@dataclass(frozen=True)
class Recording:
    path: Path
    fault: str
    faulty: int
    """The faulty rank; -1 for a healthy job or a fault of the whole job."""

    def messages(self) -> list[bytes]:
        data = gzip.decompress(self.path.read_bytes())
        out, at = [], 0
        while at < len(data):
            (n,) = _LENGTH.unpack_from(data, at)
            out.append(data[at + _LENGTH.size : at + _LENGTH.size + n])
            at += _LENGTH.size + n
        return out


def file_name(fault: str, faulty: int, job_id: str) -> str:
    return f"{fault}-{job_id}.bin.gz" if faulty < 0 else f"{fault}-rank{faulty}-{job_id}.bin.gz"


def save(path: Path, messages: list[bytes]) -> None:
    path.write_bytes(gzip.compress(b"".join(_LENGTH.pack(len(m)) + m for m in messages), mtime=0))


def recordings() -> list[Recording]:
    out = []
    for path in sorted(RECORDED.glob("*.bin.gz")):
        fault, *rest = path.name.removesuffix(".bin.gz").split("-")
        faulty = int(rest[0].removeprefix("rank")) if rest[0].startswith("rank") else -1
        out.append(Recording(path, fault, faulty))
    return out
