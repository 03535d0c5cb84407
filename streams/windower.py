"""The windower stage: raw event batches in, iteration and pattern records and stall records out.

``WindowerStage`` is the stage without Kafka (decode, validate, window, summarize; what fails becomes a
dead-letter reason, never an exception): the worker and ``offline`` both run it. ``WindowerAgent`` is its
Faust side: it feeds the stage a batch of messages, sends what comes out (a take's pattern records of a job
as one message, ``schemas.pattern_batch``), and holds each message's ack until replaying it could change
nothing (``recovery``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Collection, Iterable, Sequence

import faust
from faust.types import Message

from fleetscope.schemas import EventBatch, IntakeLimits, Topics, encode
from fleetscope.schemas.pattern_batch import batch_pattern_messages
from fleetscope.schemas.topics import job_key, rank_key
from fleetscope.streams.analysis.stalls import StallRecord
from fleetscope.streams.analysis.windowing import ClosedIteration, RankWindower, WindowerConfig, summarize_closed
from fleetscope.streams.counters import StageCounters
from fleetscope.streams.deadletter import DeadLetters
from fleetscope.streams.intake import IntakeResult, intake, intake_batch
from fleetscope.streams.rebalance import Gate, InputClock, ack, take_over
from fleetscope.streams.recovery import RankId, WindowerRecovery

_DEFAULT_LIMITS = IntakeLimits()


class WindowerStage:
    """Every rank's windower; messages in, closed iterations and stall records out (no I/O)."""

    def __init__(self, config: WindowerConfig | None = None, limits: IntakeLimits = _DEFAULT_LIMITS) -> None:
        self.config = config
        self.limits = limits
        self.windowers: dict[RankId, RankWindower] = {}

    def take(self, message: bytes | None, now_ns: int, wall_ns: int) -> IntakeResult:
        """One raw message (see ``intake``): ``now_ns`` the processing clock, ``wall_ns`` the wall clock."""
        return intake(message, self.windowers, now_ns, self.config, wall_ns=wall_ns, limits=self.limits)

    def take_batch(self, batch: EventBatch, now_ns: int, wall_ns: int) -> IntakeResult:
        """One batch decoded already (trace files): validated and windowed like a message."""
        return intake_batch(batch, self.windowers, now_ns, self.config, wall_ns=wall_ns, limits=self.limits)

    def poll(self, now_ns: int) -> list[ClosedIteration]:
        """Steps that processing time allowed to close (stream discovery, idle ranks)."""
        closed: list[ClosedIteration] = []
        for w in self.windowers.values():
            closed += w.poll(now_ns)
        return closed

    def idle(self, at_ns: int) -> set[RankId]:
        """Ranks without a batch for their ``idle_close_ms``."""
        return {k for k, w in self.windowers.items() if at_ns - w.last_arrival_ns >= w.config.idle_close_ms * 1_000_000}

    def close_rank(self, key: RankId) -> tuple[list[ClosedIteration], RankWindower | None]:
        """The rank's input is complete: close its open steps and forget it (returns its windower too)."""
        w = self.windowers.pop(key, None)
        return (w.flush(), w) if w is not None else ([], None)

    def drop(self, keys: Iterable[RankId]) -> None:
        for key in keys:
            self.windowers.pop(key, None)

    @property
    def incomplete(self) -> int:
        return sum(w.counters.incomplete for w in self.windowers.values())


def stall_records(windowers: Iterable[RankWindower]) -> list[StallRecord]:
    """The stall/resume reports the windowers produced since they were last asked."""
    return [rec for w in windowers for rec in w.take_stalls()]


def summarized(closed: list[ClosedIteration]) -> tuple[list[ClosedIteration], int]:
    """Compute the closed iterations' records; return those that have them and how many failed (logged)."""
    failed = summarize_closed(closed)
    return [c for c in closed if c.error is None], len(failed)


class WindowerAgent:
    """The windower's Faust agent and idle timer: messages in, records sent, acks held until harmless."""

    def __init__(
        self,
        app: faust.App,
        stage: WindowerStage,
        recovery: WindowerRecovery,
        *,
        topics: Topics,
        stalls: faust.TopicT,
        counters: StageCounters,
        dead: DeadLetters,
        gate: Gate,
        clock: InputClock,
    ) -> None:
        self.app, self.stage, self.recovery, self.topics, self.stalls = app, stage, recovery, topics, stalls
        self.counters, self.dead, self.gate, self.clock = counters, dead, gate, clock
        self.lock = asyncio.Lock()
        """Emission, state record and release run in close order: a record never covers an undelivered output."""

    async def run(self, stream: faust.StreamT, max_events: int, within_s: float) -> None:
        async for batch in stream.take_events(max_events, within=within_s):  # type: ignore[attr-defined]
            with self.clock.busy():
                await self.batch(batch)

    async def batch(self, batch: Sequence[faust.EventT]) -> None:
        events = take_over(batch, self.app, self.gate)
        epoch = self.gate.epoch
        if not events:
            return
        await self.recovery.load({e.message.partition for e in events})
        if epoch != self.gate.epoch:
            return
        now, wall = self.clock.now_ns(), time.time_ns()
        closed: list[ClosedIteration] = []
        touched: dict[RankId, RankWindower] = {}
        rejected: list[tuple[faust.EventT, str]] = []
        for event in events:
            result = self.stage.take(event.value, now, wall)
            if result.key is not None:
                self.recovery.place(result.key, event.message.partition)
            if result.reason is not None:
                rejected.append((event, result.reason))
                continue
            if result.key is not None and result.windower is not None:
                touched[result.key] = result.windower
                self.recovery.unacked.keep(result.key, result.horizon_ns, event.message)
            self.counters.raw_batches += 1
            self.counters.raw_events += result.events
            closed += result.closed
        async with self.lock:
            released = await self.emit(closed, epoch, touched)
        await self.emit_stalls(touched.values())
        for event, reason in rejected:
            await self.dead.send(event.message, reason)
        if epoch == self.gate.epoch:  # whatever was sent above is flushed before Faust commits these acks
            ack([*released, *(event.message for event, _ in rejected)], self.app)

    async def close_idle(self) -> None:
        """Close the steps processing time allowed to close, and release idle ranks' messages."""
        if self.gate.paused:
            return
        now, epoch = self.clock.now_ns(), self.gate.epoch
        closed = self.stage.poll(now)
        flushed = self.stage.idle(now)
        async with self.lock:
            released = await self.emit(closed, epoch, ())
            # Still idle after the awaits: nothing arrived since their flush was emitted.
            released += self.recovery.release_idle(flushed & self.stage.idle(self.clock.now_ns()))
        await self.emit_stalls(list(self.stage.windowers.values()))
        if epoch == self.gate.epoch:
            ack(released, self.app)

    async def emit(self, closed: list[ClosedIteration], epoch: int, touched: Iterable[RankId]) -> list[Message]:
        """Send the iterations not emitted before, wait for their delivery, record them, and return the
        messages of these and the ``touched`` ranks that replay no longer needs. Caller holds ``lock``."""
        fresh = self.recovery.fresh(closed)
        self.counters.replayed_skipped += len(closed) - len(fresh)
        _, lost = summarized(fresh)  # a failed one is recorded as emitted all the same: its messages can be acked
        self.counters.lost_iterations += lost
        sent: list[Awaitable[object]] = []
        send = self.app.producer.send  # straight to the Kafka producer: Faust's channel layer costs more than encoding
        patterns: dict[str, list[tuple[int, bytes]]] = {}
        for c in fresh:
            if c.error is not None:
                continue
            it, pat = c.iteration, c.patterns
            key = rank_key(it["job"], it["rank"])
            sent.append(await send(self.topics.iterations, key, encode("iterations", it), None, None, None))
            patterns.setdefault(str(pat["job"]), []).append((int(pat["iteration"]), encode("patterns", pat)))
            self.counters.iterations += 1
        for job, records in patterns.items():  # one message per job and take, not per rank: each costs ~210 us
            for value in batch_pattern_messages(job, records, self.stage.limits.max_message_bytes):
                sent.append(await send(self.topics.patterns, job_key(job), value, None, None, None))
        await asyncio.gather(*sent)
        if epoch != self.gate.epoch:
            return []
        return self.recovery.release({*touched, *await self.recovery.record(fresh)})

    async def emit_stalls(self, windowers: Iterable[RankWindower]) -> None:
        for rec in stall_records(windowers):
            await self.stalls.send(key=job_key(rec["job"]), value=encode("stall", rec))

    def revoke(self, partitions: Collection[int]) -> None:
        """Forget the ranks of revoked partitions (their next owner restores them)."""
        self.stage.drop(self.recovery.revoke(partitions))

    def jobs_in_progress(self) -> set[str]:
        """Jobs with raw messages still held: some of their iterations are not emitted yet."""
        return self.recovery.jobs_in_progress()
