"""The windower's crash recovery: raw messages held per rank, and each rank's last emitted iteration."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable

from faust.types import Message

from fleetscope.schemas.topics import rank_key
from fleetscope.streams.analysis.windowing import ClosedIteration
from fleetscope.streams.recovery.holds import Holds
from fleetscope.streams.recovery.statelog import StateLog

RankId = tuple[str, int]


class WindowerRecovery:
    """Raw messages held per rank, and the last iteration each rank emitted (restored after a crash)."""

    def __init__(self, log: StateLog) -> None:
        self.log = log
        self.holds: Holds[RankId] = Holds()
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
            for value in records.values():
                state = json.loads(value)
                key = (str(state["job"]), int(state["rank"]))
                self.emitted[key] = (int(state["step"]), int(state["end_ns"]))
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
            value = json.dumps({"job": job, "rank": rank, "step": step, "end_ns": end_ns}).encode()
            await self.log.write(partition, rank_key(job, rank), value)
        return list(latest)

    def release(self, keys: Iterable[RankId]) -> list[Message]:
        """Messages of ``keys`` whose every event lies before the rank's last emitted iteration's end."""
        out: list[Message] = []
        for key in keys:
            last = self.emitted.get(key)
            if last is not None:
                out += self.holds.release(key, last[1])
        return out

    def release_idle(self, keys: Iterable[RankId]) -> list[Message]:
        """Everything held for ranks that went idle: their steps were flushed, what is left is in no step."""
        return [m for key in keys for m in self.holds.release_all(key)]

    def jobs_in_progress(self) -> set[str]:
        """Jobs with raw messages still held: some of their iterations are not emitted yet."""
        return {job for job, _ in self.holds.owners()}

    def revoke(self, partitions: Collection[int]) -> list[RankId]:
        """Forget the ranks of revoked partitions; return them (the caller drops their windowers)."""
        keys = [k for k, p in self._partition.items() if p in partitions]
        self.holds.forget(keys)
        for key in keys:
            self.emitted.pop(key, None)
            del self._partition[key]
        self._loaded -= set(partitions)
        return keys
