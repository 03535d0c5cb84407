"""Real 4-rank PyTorch jobs as their windowers published them: the pattern records of each, byte for byte, in
publication order (``bench/real_jobs.py record`` ran them through the live stack, ``export`` wrote these).

A file is ``<fault>-rank<R>-<id>.bin.gz`` (``<fault>-<id>.bin.gz`` for a healthy job, ``none``, and a fault of
the whole job): gzip of the messages, each a 4-byte big-endian length and the message. An id that starts with
a layout is the job laid out so (``record --layout``): ``fsdp``, its model sharded by FSDP2; ``hsdp``, sharded in
pairs and replicated over them (FSDP2 on a 2 x 2 mesh); ``dtensor``, split by DTensor's tensor parallelism;
``varying``, DDP accumulating gradients over micro-batches of random lengths; ``pipe``, the test's pipeline by
hand (dp2 x pp2, its sends and receives timed); the others DDP.
Importable from every test as ``recorded_jobs``."""

from __future__ import annotations

import gzip
import struct
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetscope.schemas import decode
from fleetscope.streams.analysis.replay import replay
from fleetscope.streams.analysis.timeline import timeline_of

RECORDED = Path(__file__).resolve().parent / "data" / "real_jobs"
BEFORE_TIMELINES = RECORDED / "patterns.v2" / "compute-rank1-aa8c5d.bin.gz"
"""A real job recorded before pattern records carried the call timeline (patterns.v2, no ``sync_*`` fields):
kept to hold that older records stay readable; not among ``recordings()``."""
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
the bench and the recordings' test hold a job to it with ``missed_bar``."""
_LENGTH = struct.Struct(">I")


def naming_the_fault(fault: str, updates: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The opened findings that name the fault's rank (the job: -1) by its category and function."""
    faulty, category, function = FAULTS[fault]
    return [
        u
        for u in updates
        if u["status"] == "open" and u["rank"] == faulty and category in (None, u["category"])
        and function in (None, u["function"])
    ]  # fmt: skip


def missed_bar(fault: str, updates: Sequence[Mapping[str, Any]]) -> str | None:
    """Why a job's finding updates miss the real-job bar, None where they meet it: a healthy job (``none``)
    opens nothing; a faulty one is named by its finding (``FAULTS``) within 10 iterations of ``FAULT_AT``,
    and no finding names another rank (a job-wide one, rank -1, names none)."""
    opened = [u for u in updates if u["status"] == "open"]
    if fault not in FAULTS:
        return f"{len(opened)} finding(s) on a healthy job" if opened else None
    named = naming_the_fault(fault, opened)
    if not named:
        return f"no finding names rank {FAULTS[fault][0]} as {FAULTS[fault][1] or 'any'}"
    if not FAULT_AT <= named[0]["iteration_last"] <= FAULT_AT + 10:
        return f"named at iteration {named[0]['iteration_last']}, the fault began at {FAULT_AT}"
    others = {int(r) for u in opened if u["rank"] >= 0 for r in list(u.get("ranks") or []) or [u["rank"]]}
    others -= {FAULTS[fault][0]}
    return f"other ranks named: {sorted(others)}" if others else None


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


def replay_errors(messages: Sequence[bytes]) -> list[float | None]:
    """Per iteration that every rank published, in iteration order: the job's replayed iteration time against
    its measured one, (replayed - measured) / measured (``replay.replay``, from the records' timelines); None
    where a record carries no timeline (the replay has no call of that rank to order by)."""
    by_iteration: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for message in messages:
        kind, record = decode(message)
        if kind == "patterns":
            by_iteration[int(record["iteration"])][int(record["rank"])] = record
    world = max((len(ranks) for ranks in by_iteration.values()), default=0)
    out: list[float | None] = []
    for iteration in sorted(by_iteration):
        ranks = by_iteration[iteration]
        records = [ranks[r] for r in sorted(ranks)]
        if len(records) < world:
            continue
        out.append(None if any(timeline_of(r) is None for r in records) else replay(records).job_error)
    return out
