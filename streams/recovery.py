"""Crash recovery of the stream stages: acks held until replay is harmless, state records for the rest.

Why: Faust acks a source message (and commits it soon after) as soon as an agent has seen it, but the
windower keeps a rank's events in memory until their iteration closes, and the differential keeps a
job's history (persistence windows, rolling medians, open findings) for as long as the job runs. A
worker killed in between would resume after offsets whose contribution was never emitted.

1. Each stage takes the acks of its messages over and acks a message only when replaying it could
   change nothing: the windower once the rank's emitted iterations end after every event of the
   message, the differential once the message's iteration is scored. Faust commits only the
   contiguous run of acked offsets, so the committed offset never passes a message that in-memory
   state still needs.
2. What replay cannot rebuild in bounded time goes to a state topic, one record per rank or job
   (latest wins, compacted, partition = the source partition): the windower's last emitted
   iteration, the differential's job state without the pattern records still waiting for ranks.
   A record is written after the outputs it covers were delivered and before the messages it covers
   are acked, and Faust flushes its producer before it commits offsets. So the newest record after a
   crash is never older than the committed offsets imply, and every output it covers exists.
3. After a restart or a rebalance a stage reads its partition's state records before it touches the
   partition's first message, re-reads from the committed offsets and skips what the records cover.
   Re-emitted outputs repeat the first ones' natural keys, and the sink stores each key once.

This module holds the shared machinery and the windower's side; ``job_state`` the differential's.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import logging
import time
import uuid
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import faust
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth
from faust.types import EventT, Message

from fleetscope.schemas.topics import rank_key
from fleetscope.streams.analysis.windowing import ClosedIteration

log = logging.getLogger(__name__)

RankId = tuple[str, int]
K = TypeVar("K")

EARLIEST = -(2**63)
"""Horizon of a message that nothing later depends on: released by the next release call."""
_FENCE_KEY = b"\x00fence"


class RecoveryError(RuntimeError):
    """A stage could not read its state records; it must not run without them."""


@dataclass
class Gate:
    """Which in-memory state is current. ``epoch`` moves when partitions are revoked (their state is
    dropped): a batch that started in another epoch must neither record state nor ack. ``paused`` lasts
    from the revocation to the new assignment, whose seek to the committed offsets redelivers everything."""

    epoch: int = 0
    paused: bool = False


class InputClock:
    """Processing time that runs only while every agent of the worker waits for input.

    The idle rules (a rank's steps close after ``idle_close_ms`` without a batch, a job is flushed after
    ``job_idle_ms``) stand for "no more data is coming". Under a backlog (a restart re-reading its
    uncommitted offsets, a worker that fell behind) a rank's next batch can wait in the consumer longer
    than that, and wall time would close its steps with events missing; a job's next pattern record waits
    for the windower. This clock stands still while any agent works, so only real silence counts; and
    while this worker's partitions are being reassigned (a worker joined, left or died): until the new
    owners have restored their state and caught up, the ranks of moved partitions are late, not silent."""

    def __init__(self) -> None:
        self._banked = 0
        self._busy = 0
        self._since = time.monotonic_ns()
        self._rebalancing = False

    def now_ns(self) -> int:
        return self._banked + (time.monotonic_ns() - self._since if self._busy == 0 else 0)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Stop the clock while an agent works on a batch."""
        self.working()
        try:
            yield
        finally:
            self.waiting()

    def rebalancing(self, on: bool) -> None:
        """Stop the clock from a revocation to the next assignment (idempotent: Faust may signal twice)."""
        if on and not self._rebalancing:
            self.working()
        elif not on and self._rebalancing:
            self.waiting()
        self._rebalancing = on

    def working(self) -> None:
        if self._busy == 0:
            self._banked += time.monotonic_ns() - self._since
        self._busy += 1

    def waiting(self) -> None:
        self._busy -= 1
        if self._busy == 0:
            self._since = time.monotonic_ns()


def take_over(events: Iterable[EventT], app: faust.App, gate: Gate) -> list[EventT]:
    """Keep Faust from acking ``events`` when the batch ends (the stage acks them) and return the ones it
    should process: none while paused, and none fetched before the last rebalance (they come again)."""
    events = list(events)
    for event in events:
        event.message.incref()
    if gate.paused:
        return []
    generation = app.consumer_generation_id
    return [e for e in events if e.message.generation_id == generation]


def ack(messages: Iterable[Message], app: faust.App) -> None:
    for message in messages:
        message.ack(app.consumer)


class StateLog:
    """One stage's state records: latest value per key in a compacted topic partitioned like its source."""

    def __init__(
        self, app: faust.App, name: str, partitions: int, bootstrap_servers: str, read_timeout_s: float = 30.0
    ) -> None:
        self.name = name
        self.topic = app.topic(
            name,
            partitions=partitions,
            compacting=True,
            internal=True,
            key_serializer="raw",
            value_serializer="raw",
        )
        self.bootstrap_servers = bootstrap_servers
        self.security = dict(credentials_to_aiokafka_auth(app.conf.broker_credentials))
        """The app's own SASL/TLS settings, as aiokafka arguments: the reader talks to the same brokers."""
        self.read_timeout_s = read_timeout_s
        self.writes = 0
        self._declared = False

    async def write(self, partition: int, key: bytes, value: bytes) -> None:
        """Queue a record in the producer; Faust delivers it before it commits any later ack."""
        await self.topic.send(key=key, value=value, partition=partition)
        self.writes += 1

    def consumer(self) -> AIOKafkaConsumer:
        """The reader's consumer (not started; needs a running event loop), secured like the app."""
        return AIOKafkaConsumer(bootstrap_servers=self.bootstrap_servers, enable_auto_commit=False, **self.security)

    async def read(self, partitions: Collection[int]) -> dict[int, dict[bytes, bytes]]:
        """The latest record of every key in ``partitions``, read up to a fence written now.

        A fence, not the high watermark: Tansu reports the base offset of the last batch as the end."""
        if not self._declared:
            await self.topic.maybe_declare()
            self._declared = True
        token = uuid.uuid4().bytes
        for p in partitions:
            delivered = await self.topic.send(key=_FENCE_KEY, value=token, partition=p)
            await delivered
        out: dict[int, dict[bytes, bytes]] = {p: {} for p in partitions}
        consumer = self.consumer()
        await consumer.start()
        try:
            tps = [TopicPartition(self.name, p) for p in partitions]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            waiting = set(partitions)
            deadline = time.monotonic() + self.read_timeout_s
            while waiting:
                if time.monotonic() > deadline:
                    raise RecoveryError(
                        f"{self.name}: no fence in partitions {sorted(waiting)} after {self.read_timeout_s} s"
                    )
                for tp, records in (await consumer.getmany(*tps, timeout_ms=500)).items():
                    for rec in records:
                        if rec.key == _FENCE_KEY:
                            if rec.value == token:
                                waiting.discard(tp.partition)
                        elif tp.partition in waiting and rec.key is not None and rec.value is not None:
                            out[tp.partition][rec.key] = rec.value
        finally:
            await consumer.stop()
        return out


class Holds(Generic[K]):
    """Messages kept un-acked per owner (a rank, a job), each with the horizon past which it is harmless."""

    def __init__(self) -> None:
        self._held: dict[K, list[tuple[int, int, Message]]] = {}
        self._order = itertools.count()

    def hold(self, owner: K, horizon: int, message: Message) -> None:
        heapq.heappush(self._held.setdefault(owner, []), (horizon, next(self._order), message))

    def release(self, owner: K, below: int) -> list[Message]:
        """Pop the owner's messages whose horizon is below ``below``."""
        heap = self._held.get(owner)
        out: list[Message] = []
        while heap and heap[0][0] < below:
            out.append(heapq.heappop(heap)[2])
        if heap is not None and not heap:
            del self._held[owner]
        return out

    def release_all(self, owner: K) -> list[Message]:
        return [m for _, _, m in self._held.pop(owner, [])]

    def forget(self, owners: Iterable[K]) -> None:
        """Drop the owners' messages without acking them (their partitions were revoked)."""
        for owner in owners:
            self._held.pop(owner, None)

    def owners(self) -> list[K]:
        return list(self._held)

    def __len__(self) -> int:
        return sum(len(h) for h in self._held.values())


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
        for (job, rank), (step, end_ns) in latest.items():
            value = json.dumps({"job": job, "rank": rank, "step": step, "end_ns": end_ns}).encode()
            await self.log.write(self._partition[(job, rank)], rank_key(job, rank), value)
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
