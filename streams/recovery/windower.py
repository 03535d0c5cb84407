"""The windower's crash recovery: raw messages held per rank, and each rank's last emitted iteration."""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Collection, Iterable

from faust.types import Message

from fleetscope.schemas.topics import rank_key
from fleetscope.streams.analysis.windowing import ClosedIteration
from fleetscope.streams.recovery.statelog import StateLog
from fleetscope.streams.recovery.unacked import UnackedMessages

log = logging.getLogger(__name__)

RankId = tuple[str, int]

_EMITTED = struct.Struct(">cqq")
"""A rank's state record: format 1, then the step and end (ns) of its last emitted iteration; the job and
rank are the record's key (``rank_key``). 17 bytes where the JSON record it replaces, still read (it starts
with ``{``), took 76 with its job and rank spelled out: written about once a rank a second."""
_FORMAT = b"\x01"


def dump_emitted(step: int, end_ns: int) -> bytes:
    return _EMITTED.pack(_FORMAT, step, end_ns)


def load_emitted(key: bytes, value: bytes) -> tuple[RankId, tuple[int, int]]:
    """Inverse of ``dump_emitted`` with the record's key: ((job, rank), (step, end_ns)); ``ValueError`` for a
    record of neither format."""
    if value.startswith(b"{"):
        state = json.loads(value)
        return (str(state["job"]), int(state["rank"])), (int(state["step"]), int(state["end_ns"]))
    if len(value) != _EMITTED.size or value[:1] != _FORMAT:
        raise ValueError(f"a windower state record of {len(value)} bytes in format {value[:1]!r}")
    _, step, end_ns = _EMITTED.unpack(value)
    job, _, rank = key.decode().rpartition("/")
    return (job, int(rank)), (step, end_ns)


class WindowerRecovery:
    """Raw messages held per rank, and the last iteration each rank emitted (restored after a crash)."""

    def __init__(self, log: StateLog) -> None:
        self.log = log
        self.unacked: UnackedMessages[RankId] = UnackedMessages()
        self.emitted: dict[RankId, tuple[int, int]] = {}
        """(step, end_ns) of the last emitted iteration of each rank."""
        self.restored = 0
        self._partition: dict[RankId, int] = {}
        self._loaded: set[int] = set()

    async def load(self, partitions: Collection[int]) -> None:
        """Read the state records of partitions not loaded yet (first message after an assignment)."""
        missing = set(partitions) - self._loaded
        if not missing:
            return
        for p, records in (await self.log.read(missing)).items():
            for record_key, value in records.items():
                try:
                    key, emitted = load_emitted(record_key, value)
                except (ValueError, KeyError, TypeError) as exc:
                    log.error("windower state record %r is unreadable (%s); its rank starts afresh", record_key, exc)
                    continue
                self.emitted[key] = emitted
                self._partition[key] = p
                self.restored += 1
        self._loaded |= missing

    def place(self, key: RankId, partition: int) -> None:
        """The rank's source partition (where its state record goes)."""
        self._partition[key] = partition

    def fresh(self, closed: list[ClosedIteration]) -> list[ClosedIteration]:
        """The iterations not emitted before a restart (replay rebuilds older steps, partly)."""
        out = []
        for c in closed:
            last = self.emitted.get((c.job, c.rank))
            if last is None or c.step > last[0]:
                out.append(c)
        return out

    async def record(self, emitted: list[ClosedIteration]) -> list[RankId]:
        """Note delivered iterations and write each rank's latest as its state record; return the ranks."""
        latest: dict[RankId, tuple[int, int]] = {}
        for c in emitted:
            latest[(c.job, c.rank)] = (c.step, c.end_ns)
        self.emitted.update(latest)
        # Partitions looked up before the first write: a rebalance may revoke some while a write awaits (a
        # worker resumed after a stall crashed on a rank revoked mid-loop). A rank already revoked has
        # no partition here; its new owner rebuilds it from the log and replay.
        places = {key: self._partition.get(key) for key in latest}
        for (job, rank), (step, end_ns) in latest.items():
            partition = places[(job, rank)]
            if partition is None:
                continue
            await self.log.write(partition, rank_key(job, rank), dump_emitted(step, end_ns))
        return list(latest)

    def release(self, keys: Iterable[RankId]) -> list[Message]:
        """Messages of ``keys`` whose every event lies before the rank's last emitted iteration's end."""
        out: list[Message] = []
        for key in keys:
            last = self.emitted.get(key)
            if last is not None:
                out += self.unacked.take_harmless(key, last[1])
        return out

    def release_idle(self, keys: Iterable[RankId]) -> list[Message]:
        """Everything held for ranks that went idle: their steps were flushed, what is left is in no step."""
        return [m for key in keys for m in self.unacked.take_all(key)]

    def jobs_in_progress(self) -> set[str]:
        """Jobs with raw messages still held: some of their iterations are not emitted yet."""
        return {job for job, _ in self.unacked.owners()}

    def revoke(self, partitions: Collection[int]) -> list[RankId]:
        """Forget the ranks of revoked partitions; return them (the caller drops their windowers)."""
        keys = [k for k, p in self._partition.items() if p in partitions]
        self.unacked.forget(keys)
        for key in keys:
            self.emitted.pop(key, None)
            del self._partition[key]
        self._loaded -= set(partitions)
        return keys
