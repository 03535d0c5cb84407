"""The differential stage: pattern records, stall records and heartbeats in (key job), findings out.

``DifferentialStage`` is the stage without Kafka (decode, check the subject, feed the job's
``JobDifferential``; what fails, the analysis included, becomes a dead-letter reason, never an exception):
the worker and ``offline`` both run it. ``DifferentialAgent`` is its Faust side: it feeds the stage a batch
of messages, sends the findings and profile requests, idles and ends jobs, and holds each message's ack
until the job's state record covers it (``recovery``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import faust
from faust.types import Message

from fleetscope.schemas import SchemaError, decode, encode
from fleetscope.schemas.catalog import SchemaEntry
from fleetscope.schemas.codec import decode_head
from fleetscope.schemas.pattern_batch import PATTERN_BATCH, PATTERNS, element_reason
from fleetscope.schemas.signing import MAC_HEADER, findings_mac
from fleetscope.schemas.topics import job_key
from fleetscope.streams import reasons
from fleetscope.streams.analysis.differential import DifferentialConfig, JobDifferential, ScoringCache
from fleetscope.streams.analysis.signals import OutlierScorer
from fleetscope.streams.counters import StageCounters
from fleetscope.streams.deadletter import DeadLetters
from fleetscope.streams.profiling import ProfilePolicy
from fleetscope.streams.rebalance import Gate, InputClock, ack, take_over
from fleetscope.streams.recovery import DifferentialRecovery
from fleetscope.streams.scoring import InlineScoring, IterationScoring, PoolScore

log = logging.getLogger(__name__)

SUBJECTS = (PATTERNS, PATTERN_BATCH, "stall", "heartbeat")
"""What the differential reads: windowers' pattern records (alone or in batches) and stall records, producers'
heartbeats."""
_PAYLOAD, _WRITER, _SOURCE = "_payload", "_writer", "_source"
"""A record placed by its head (``decode_head``): its message, the message's writer schema, and its source."""


@dataclass(frozen=True, slots=True)
class Taken:
    """What one message did: the finding records it produced, or why it goes to the dead-letter topic.

    ``replayed``: a stall record the job's state record applied already (nothing done)."""

    findings: list[dict[str, Any]] = field(default_factory=list)
    job: str = ""
    subject: str = ""
    iteration: int | None = None
    reason: str | None = None
    replayed: bool = False
    source: Any = None
    """The message ``reason`` refuses, where it is not the one taken (``DifferentialStage.rejected``)."""
    records: int = 0
    """Pattern records used: one of a lone record, those of a batch not refused (``iteration``: the highest)."""


@dataclass(slots=True)
class _Scoring:
    """An iteration a scoring process has: what was sent (sent again should the process die), and its messages'
    sources, in the order sent."""

    iteration: int
    future: Future[PoolScore]
    payloads: list[bytes | dict[str, Any]]
    writers: dict[int, SchemaEntry]
    sources: list[Any]


def element_message(source: Message, value: bytes) -> Message:
    """A batch element as a message of its own, for the dead-letter topic: the batch's place (topic,
    partition, offset, key), the element's value. Never acked: the batch's message is."""
    return Message(
        source.topic, source.partition, source.offset, source.timestamp, source.timestamp_type, source.headers,
        source.key, value, None, tp=source.tp,
    )  # fmt: skip


class DifferentialStage:
    """Every job's differential; messages in, finding records out (no I/O but the scoring pool's).

    A pattern message is placed by its head, and each complete iteration is handed to the ``pool``
    (``streams.scoring``): its processes, or the worker itself (``InlineScoring``, a pool of none, the
    default). ``collect`` tracks the scores that are back, in each job's iteration order, and ``flush`` and
    ``end`` wait for the job's: one path, whoever scores."""

    def __init__(
        self,
        config: DifferentialConfig | None = None,
        scorer: OutlierScorer | None = None,
        pool: IterationScoring | None = None,
    ) -> None:
        if pool is not None and scorer is not None:
            raise ValueError("a scoring pool scores with the configured scorer: pass no scorer with it")
        self.config = config or DifferentialConfig()
        self.jobs: dict[str, JobDifferential] = {}
        self.pool: IterationScoring = pool or InlineScoring(self.config, scorer, self._scoring_cache)
        self.scoring: dict[str, deque[_Scoring]] = {}
        """Per job, the iterations handed to the pool and not yet tracked, oldest first."""
        self.rejected: list[Taken] = []
        """Messages the pool could not use (``Taken.source``): for the dead-letter topic."""

    def job(self, name: str) -> JobDifferential:
        jd = self.jobs.get(name)
        if jd is None:
            jd = self.jobs[name] = JobDifferential(name, self.config)
        return jd

    def _scoring_cache(self, job: str) -> ScoringCache:
        return self.job(job).scoring_cache

    def take(
        self,
        message: bytes | None,
        now_ns: int | None,
        replayed: Callable[[str, int], bool] | None = None,
        offset: int = -1,
        source: Message | None = None,
    ) -> Taken:
        """Decode one message and apply it (``apply``); ``offset`` is the message's, for ``replayed``;
        ``source``: what names the message to the caller, should the pool refuse it later (``rejected``)."""
        try:
            writer, head = decode_head(message or b"")
            if head is not None:  # the rest is decoded where the iteration is scored
                record = {**head, _PAYLOAD: message, _WRITER: writer, _SOURCE: source}
                return self.apply(writer.subject, record, now_ns, replayed, offset)
            subject, record = decode(message or b"")
        except SchemaError as exc:
            return Taken(reason=f"schema: {exc}")
        if subject == PATTERN_BATCH:
            return self._take_batch(record, now_ns, source)
        if subject not in SUBJECTS:
            return Taken(reason=f"subject: expected patterns, pattern_batch, stall or heartbeat, got {subject}")
        return self.apply(subject, record, now_ns, replayed, offset)

    def _take_batch(self, batch: dict[str, Any], now_ns: int | None, source: Message | None) -> Taken:
        """Each element of a pattern batch taken as a lone pattern message is; an element refused goes to
        ``rejected`` alone (its own message: ``element_message``) and the others are used. A batch none of whose
        elements is usable is refused whole, with the first element's reason, and names no job (nothing of it
        reached one: no job's state to hold it, or to keep for a name anyone may write)."""
        job, findings, refused, used = str(batch["job"]), [], [], []
        for element in batch["records"]:
            own = element_message(source, element) if source is not None else None
            taken = self._take_element(batch, element, now_ns, own)
            if taken.reason is not None:
                refused.append(Taken([], job, PATTERNS, taken.iteration, taken.reason, source=own))
                continue
            findings += taken.findings
            used.append(int(taken.iteration or 0))
        if not used:
            first = f": {refused[0].reason}" if refused else ""
            return Taken(subject=PATTERNS, reason=f"value: no usable record in a pattern batch{first}")  # no job's
        self.rejected += refused
        return Taken(findings, job, PATTERNS, iteration=max(used), records=len(used))

    def _take_element(self, batch: dict[str, Any], element: bytes, now_ns: int | None, own: Message | None) -> Taken:
        """One element of ``batch`` placed by its head and applied (a reason instead where it is refused);
        ``own``: its message, should the scoring refuse it later."""
        try:
            writer, head = decode_head(element)
            if head is None:
                subject, record = decode(element)
                if subject != PATTERNS:
                    return Taken(reason=f"subject: a pattern batch holds a {subject} record")
            else:
                record = {**head, _PAYLOAD: element, _WRITER: writer, _SOURCE: own}
        except SchemaError as exc:
            return Taken(reason=f"schema: {exc}")
        reason = element_reason(batch, record["job"], record["iteration"])
        return Taken(reason=reason) if reason is not None else self.apply(PATTERNS, record, now_ns)

    def apply(
        self,
        subject: str,
        record: dict[str, Any],
        now_ns: int | None,
        replayed: Callable[[str, int], bool] | None = None,
        offset: int = -1,
    ) -> Taken:
        """Feed one decoded record to its job. ``now_ns``: the worker's input clock (None offline: an iteration
        waits for all its ranks); ``replayed(job, offset)``: whether a stall record was applied already."""
        job = str(record["job"])
        jd = self.job(job)
        try:
            if subject == "heartbeat":
                return Taken(jd.add_heartbeat(record), job, subject)
            if subject == "stall":
                if replayed is not None and replayed(job, offset):
                    return Taken([], job, subject, replayed=True)
                tracked = self.collect(wait={job})  # a stall record is rare: after the iterations before it
                return Taken(tracked + jd.add_stall(record), job, subject)
            for it, records in jd.gather(record, now_ns):
                self._send(job, it, records)
            return Taken(self.collect(), job, subject, iteration=int(record["iteration"]), records=1)
        except Exception as exc:  # an analysis bug must cost one message, not the stream
            log.warning("the differential of job %r rejected a %s record: %r", job, subject, exc)
            return Taken([], job, subject, reason=reasons.reason("differential", exc))

    def flush(self, job: str) -> list[dict[str, Any]]:
        """Score what the idle job has pending (``JobDifferential.flush``); an analysis failure is logged."""
        self.send_pending(job)
        return self.collect(wait={job}) + self._guarded(job, "flush", self.jobs[job].flush)

    def end(self, job: str) -> list[dict[str, Any]]:
        """Close the ended job's findings (``JobDifferential.end``); an analysis failure is logged."""
        self.send_pending(job)
        return self.collect(wait={job}) + self._guarded(job, "end", self.jobs[job].end)

    def send_pending(self, job: str) -> None:
        """Hand the pool the job's pending iterations, with the ranks they have (a flush, the job's end)."""
        jd = self.jobs.get(job)
        if jd is not None:
            for it, records in jd.take_pending():
                self._send(job, it, records)

    def in_flight(self, jobs: Collection[str] | None = None) -> list[Future[PoolScore]]:
        """The pool's futures of ``jobs`` (None: every job's), oldest first per job."""
        return [s.future for job, q in self.scoring.items() if jobs is None or job in jobs for s in q]

    def collect(self, wait: Collection[str] = ()) -> list[dict[str, Any]]:
        """Track the scores the pool has returned, each job's in iteration order (those of ``wait``'s jobs all,
        waiting for them); return the finding records. Messages the pool refused go to ``rejected``."""
        out: list[dict[str, Any]] = []
        for job, queue in list(self.scoring.items()):
            while queue and (job in wait or queue[0].future.done()):
                out += self._track(job, queue.popleft())
            if not queue:
                del self.scoring[job]
        return out

    def forget(self, jobs: Collection[str]) -> None:
        """Drop the pool's iterations of jobs this worker no longer owns (their messages replay elsewhere)."""
        for job in jobs:
            for scoring in self.scoring.pop(job, ()):
                scoring.future.cancel()

    def _send(self, job: str, it: int, records: list[dict[str, Any]]) -> None:
        payloads = [r[_PAYLOAD] if _PAYLOAD in r else r for r in records]
        writers = {r[_WRITER].schema_id: r[_WRITER] for r in records if _WRITER in r}
        sources = [r.get(_SOURCE) for r in records]
        future = self.pool.submit(job, payloads, writers)
        self.scoring.setdefault(job, deque()).append(_Scoring(it, future, payloads, writers, sources))

    def _track(self, job: str, scoring: _Scoring) -> list[dict[str, Any]]:
        jd = self.jobs[job]
        try:
            try:
                result = scoring.future.result()
            except BrokenProcessPool:  # a process died (killed, out of memory): its pool's iterations again
                result = self.pool.submit(job, scoring.payloads, scoring.writers).result()
        except Exception as exc:  # the pool failed twice: the iteration is lost, logged
            log.error("the scoring pool lost iteration %d of job %r: %r", scoring.iteration, job, exc)
            jd.skip(scoring.iteration)
            return []
        for at, reason in result.rejected:
            self.rejected.append(Taken([], job, "patterns", scoring.iteration, reason, source=scoring.sources[at]))
        if result.score is None:
            jd.skip(scoring.iteration)
            return []
        try:
            return jd.apply(scoring.iteration, result.score)
        except Exception as exc:  # an analysis bug must cost one iteration, not the stream
            log.warning("the differential of job %r failed to track iteration %d: %r", job, scoring.iteration, exc)
            refused = reasons.reason("differential", exc)
            self.rejected.append(Taken([], job, "patterns", scoring.iteration, refused, source=scoring.sources[-1]))
            return []

    @staticmethod
    def _guarded(job: str, what: str, step: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """A timer's step: no message to dead-letter, but a failure must not stop the worker's timers."""
        try:
            return step()
        except Exception:
            log.exception("the differential of job %r failed to %s", job, what)
            return []


class DifferentialAgent:
    """The differential's Faust agent and timers: findings sent, acks held until a state record covers them."""

    def __init__(
        self,
        app: faust.App,
        stage: DifferentialStage,
        recovery: DifferentialRecovery,
        *,
        findings: faust.TopicT,
        control: faust.TopicT,
        profiles: ProfilePolicy,
        counters: StageCounters,
        dead: DeadLetters,
        gate: Gate,
        clock: InputClock,
        job_idle_ms: int,
        job_end_ms: int,
        findings_key: bytes = b"",
    ) -> None:
        self.app, self.stage, self.recovery = app, stage, recovery
        self.findings_key = findings_key
        """Signs each finding message (``schemas.signing``): the sink and the alert follower trust no other."""
        self.findings, self.control, self.profiles = findings, control, profiles
        self.counters, self.dead, self.gate, self.clock = counters, dead, gate, clock
        self.job_idle_ns, self.job_end_ns = job_idle_ms * 1_000_000, job_end_ms * 1_000_000
        self.seen: dict[str, int] = {}
        """Input-clock time of each job's last pattern record or stall record: idle jobs are flushed."""
        self.input: dict[str, int] = {}
        """Input-clock time of each job's last pattern, stall record or heartbeat: its end closes its findings."""
        self.loading = asyncio.Lock()
        """Restoring partitions' jobs (on assignment and at a batch) happens once per partition."""
        self.adopting: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()
        """Scoring, emission and state record run under it: a job's record never includes iterations whose
        findings are still on their way (a timer's flush writes records while a batch waits)."""

    async def run(self, stream: faust.StreamT, max_events: int, within_s: float) -> None:
        async for batch in stream.take_events(max_events, within=within_s):  # type: ignore[attr-defined]
            with self.clock.busy():
                await self.batch(batch)

    async def batch(self, batch: Sequence[faust.EventT]) -> None:
        events = take_over(batch, self.app, self.gate)
        epoch = self.gate.epoch
        if not events:
            return
        for job in await self._load({e.message.partition for e in events}):
            self.seen[job] = self.clock.now_ns()  # restored before its idle flush: flush it when idle again
        if epoch != self.gate.epoch:
            return
        rejected: list[tuple[faust.EventT, str]] = []
        async with self.lock:
            if epoch != self.gate.epoch:  # revoked while this batch waited: the replay brings it again
                return
            out: list[dict[str, Any]] = []
            touched: set[str] = set()
            for event in events:
                msg = event.message
                taken = self.stage.take(
                    event.value, self.clock.now_ns(), self.recovery.replayed_stall, msg.offset, source=msg
                )
                if taken.job:
                    self.recovery.place(taken.job, msg.partition)
                    self.input[taken.job] = self.clock.now_ns()
                if taken.reason is not None:
                    rejected.append((event, taken.reason))
                    continue
                job = taken.job
                touched.add(job)  # a heartbeat's message is released by the job's next checkpoint
                out += taken.findings
                if taken.subject == "heartbeat":  # the latest per rank is all a diagnosis needs: replay adds nothing
                    self.recovery.skipped(job, msg)
                    continue
                self.seen[job] = self.clock.now_ns()
                if taken.replayed:
                    self.counters.replayed_skipped += 1
                    self.recovery.skipped(job, msg)
                elif taken.subject == "stall":
                    self.recovery.took(job, msg, None)
                else:  # a batch is held until its last iteration is scored: then all of it is
                    self.counters.pattern_records += taken.records
                    self.recovery.took(job, msg, taken.iteration)
            await self._backpressure()
            touched |= self.stage.scoring.keys()
            out += self.stage.collect()
            await self.emit(out)
            released = await self.recovery.checkpoint(touched) if epoch == self.gate.epoch else []
        for event, reason in rejected:
            await self.dead.send(event.message, reason)
        await self._dead_letter_refused()
        if epoch == self.gate.epoch:
            ack([*released, *(event.message for event, _ in rejected)], self.app)

    async def _backpressure(self) -> None:
        """Wait for the pool's oldest iterations while it has more than two per process: the input waits."""
        futures = self.stage.in_flight()
        excess = len(futures) - 2 * self.stage.pool.processes
        if excess > 0:
            await asyncio.wait([asyncio.wrap_future(f) for f in futures[:excess]])

    async def _scores_of(self, job: str) -> None:
        """Send the pool the job's pending iterations and wait for all its iterations there (before a flush)."""
        self.stage.send_pending(job)
        futures = self.stage.in_flight({job})
        if futures:
            await asyncio.wait([asyncio.wrap_future(f) for f in futures])

    async def _dead_letter_refused(self) -> None:
        """Messages the pool could not decode (held by their jobs like the others: acked once covered)."""
        refused, self.stage.rejected = self.stage.rejected, []
        for taken in refused:
            await self.dead.send(taken.source, taken.reason or "")

    async def collect_scores(self) -> None:
        """Track the scores the pool has returned since the last batch (the input may have stopped)."""
        if not self.stage.scoring or self.gate.paused:
            return
        epoch = self.gate.epoch
        async with self.lock:
            if epoch != self.gate.epoch:
                return
            jobs = set(self.stage.scoring)
            await self.emit(self.stage.collect())
            released = await self.recovery.checkpoint(jobs) if epoch == self.gate.epoch else []
        await self._dead_letter_refused()
        if epoch == self.gate.epoch:
            ack(released, self.app)

    def adopt(self, partitions: Collection[int]) -> None:
        """Restore the jobs of assigned partitions now rather than at their next message: a job whose last
        records were acked before its partition moved gets its idle flush from the new owner all the same."""
        self.adopting = asyncio.ensure_future(self._adopt(partitions, self.gate.epoch))

    async def _adopt(self, partitions: Collection[int], epoch: int) -> None:
        try:
            unflushed = await self._load(partitions)
        except Exception as exc:  # the next batch of those partitions loads them again
            log.warning("could not restore the jobs of partitions %s on assignment: %r", sorted(partitions), exc)
            return
        if epoch != self.gate.epoch:  # they moved again meanwhile: forget them; their next owner restores them
            self.revoke(partitions)
            return
        for job in unflushed:
            self.seen[job] = self.input[job] = self.clock.now_ns()

    async def _load(self, partitions: Collection[int]) -> list[str]:
        async with self.loading:
            return await self.recovery.load(partitions)

    async def flush_idle(self, in_progress: set[str]) -> None:
        """Score what idle jobs have pending; ``in_progress``: jobs whose iterations are still being cut."""
        if self.gate.paused:
            return
        now, epoch = self.clock.now_ns(), self.gate.epoch
        for job in in_progress & self.seen.keys():
            self.seen[job] = now  # its last iterations are still being cut here: not idle, whatever the timers
        for job, seen in list(self.seen.items()):
            jd = self.stage.jobs.get(job)
            if now - seen < self.job_idle_ns or jd is None or epoch != self.gate.epoch:
                continue
            del self.seen[job]
            async with self.lock:
                if epoch != self.gate.epoch:
                    return
                await self._scores_of(job)
                out = self.stage.flush(job)
                self.recovery.flushed(job)
                await self.emit(out)
                released = await self.recovery.checkpoint([job]) if epoch == self.gate.epoch else []
            if epoch == self.gate.epoch:
                ack(released, self.app)

    async def end_jobs(self) -> None:
        """Close the findings of jobs that ended: no input for ``job_end_ms`` on the input clock (which
        stands still while a backlog is worked off, so a lagging partition is not an ended job)."""
        if self.gate.paused:
            return
        now, epoch = self.clock.now_ns(), self.gate.epoch
        for job, seen in list(self.input.items()):
            jd = self.stage.jobs.get(job)
            if now - seen < self.job_end_ns or jd is None or epoch != self.gate.epoch:
                continue
            del self.input[job]
            if not jd.open_findings():
                continue
            async with self.lock:
                if epoch != self.gate.epoch:
                    return
                await self._scores_of(job)
                await self.emit(self.stage.end(job))
                self.profiles.forget(job)
                released = await self.recovery.checkpoint([job]) if epoch == self.gate.epoch else []
            if epoch == self.gate.epoch:
                ack(released, self.app)

    async def emit(self, records: list[dict[str, Any]]) -> None:
        """Send finding records and wait for their delivery (a job's state record must not overtake them)."""
        sent: list[Awaitable[object]] = []
        for rec in records:
            log.info(
                "finding %s %s v%d, iterations %d-%d",
                rec["finding_id"], rec["status"], rec["version"], rec["iteration_first"], rec["iteration_last"],
            )  # fmt: skip
            key, value = job_key(rec["job"]), encode("findings", rec)
            sent.append(await self.findings.send(key=key, value=value, headers=self.signed(key, value)))
            self.counters.findings += 1
            request = self.profiles.request(rec, time.monotonic_ns())
            if request is not None:
                sent.append(await self.control.send(key=job_key(rec["job"]), value=encode("control", request)))
        await asyncio.gather(*sent)

    def signed(self, key: bytes, value: bytes) -> list[tuple[str, bytes]]:
        """The headers of a finding message: its signature, when the worker has a key."""
        if not self.findings_key:
            return []
        return [(MAC_HEADER, findings_mac(self.findings_key, self.findings.get_topic_name(), key, value))]

    def revoke(self, partitions: Collection[int]) -> None:
        """Forget the jobs of revoked partitions (their next owner restores them)."""
        jobs = self.recovery.revoke(partitions)
        self.stage.forget(jobs)
        for job in jobs:
            self.seen.pop(job, None)
            self.input.pop(job, None)
