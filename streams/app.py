"""The Faust app: every topic and agent of the stream stages, declared in one place.

raw topics (key job/rank) -> windower -> fleetscope.iterations (job/rank), fleetscope.patterns (job)
fleetscope.patterns + fleetscope.heartbeats (job) -> differential -> fleetscope.findings (job)

A worker runs the stages listed in ``StreamAppConfig.stages`` (both by default; one each lets them be
sized apart). Agents stay thin: take a batch of events, decode, call the pure functions of ``analysis``, send.
State lives per partition owner (windower per rank, differential per job). The agents ack their
messages themselves, only once what they contributed is delivered or written to a state topic, so a
worker killed at any moment resumes with the same state (see ``recovery``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import faust
from faust.types import Message

from fleetscope import telemetry
from fleetscope.schemas import (
    IntakeLimits,
    SchemaError,
    Topics,
    decode,
    encode,
)
from fleetscope.schemas.topics import job_key, rank_key
from fleetscope.streams import STAGES
from fleetscope.streams.analysis.differential import JobDifferential
from fleetscope.streams.analysis.windowing import ClosedIteration, RankWindower, summarize_closed
from fleetscope.streams.intake import intake
from fleetscope.streams.job_state import DifferentialRecovery
from fleetscope.streams.profiling import ProfilePolicy, ProfileRequestConfig
from fleetscope.streams.recovery import (
    Gate,
    InputClock,
    RankId,
    StateLog,
    WindowerRecovery,
    ack,
    take_over,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StreamAppConfig:
    """What the Faust worker needs; built from the program's ``Config`` by the CLI."""

    bootstrap_servers: str
    topic_prefix: str = "fleetscope"
    app_id: str = "fleetscope-streams"
    stages: tuple[str, ...] = STAGES
    partitions: int = 4
    raw_partitions: int = 4
    session_timeout_ms: int = 6000
    data_dir: str = ".fleetscope"
    web_port: int = 6066
    take_max_events: int = 256
    take_within_ms: int = 200
    job_idle_ms: int = 2000
    job_end_ms: int = 120_000
    profiling: ProfileRequestConfig = field(default_factory=ProfileRequestConfig)
    windower: Any = None
    differential: Any = None
    limits: IntakeLimits = field(default_factory=IntakeLimits)
    broker_credentials: Any = None
    """Faust credentials (SASL/TLS) from ``KafkaSettings.faust_credentials``; None: PLAINTEXT."""


@dataclass
class StageCounters:
    raw_batches: int = 0
    raw_events: int = 0
    dead_letters: int = 0
    iterations: int = 0
    lost_iterations: int = 0
    """Closed iterations whose statistics failed (each logged): nothing is sent for them."""
    incomplete_iterations: int = 0
    """Steps closed before all their streams arrived (too many open while one was quiet), current ranks."""
    pattern_records: int = 0
    findings: int = 0
    per_reason: dict[str, int] = field(default_factory=dict)
    profile_requests_suppressed: int = 0
    held_messages: int = 0
    state_writes: int = 0
    states_restored: int = 0
    replayed_skipped: int = 0
    consumer_lag: int = -1
    """Messages between the committed offsets and the partition ends, every 10 s (-1 until known). On Tansu
    the end offset is the last batch's base offset + 1, so the figure there is a lower bound."""


def consumer_lag(end_offsets: Mapping[Any, int] | None, committed_offsets: Mapping[Any, int | None] | None) -> int:
    """Sum over partitions of end offset minus committed offset; -1 when no partition has both yet."""
    committed = dict(committed_offsets or {})
    ends = dict(end_offsets or {})
    lags = [max(0, int(end) - int(done)) for tp, end in ends.items() if (done := committed.get(tp)) is not None]
    return sum(lags) if lags else -1


def create_app(cfg: StreamAppConfig) -> faust.App:
    topics = Topics(prefix=cfg.topic_prefix)
    session_s = cfg.session_timeout_ms / 1000
    app = faust.App(
        cfg.app_id,
        broker=f"kafka://{cfg.bootstrap_servers}",
        broker_credentials=cfg.broker_credentials,
        store="memory://",
        datadir=f"{cfg.data_dir}/faust",
        topic_partitions=cfg.partitions,
        topic_replication_factor=1,
        broker_session_timeout=session_s,
        broker_heartbeat_interval=max(session_s / 10, 0.1),
        broker_rebalance_timeout=max(session_s, 2.0),
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        producer_max_request_size=max(1_048_576, cfg.limits.max_message_bytes + 65_536),  # dead letters fit
        web_enabled=False,
        web_port=cfg.web_port,
        web_bind="127.0.0.1",
        stream_wait_empty=False,  # held messages are acked only once covered; a rebalance must not wait for them
    )

    def raw(*names: str) -> faust.TopicT:
        return app.topic(*names, key_serializer="raw", value_serializer="raw")

    raw_events = raw(*topics.raw_all)
    differential_in = raw(topics.patterns, topics.heartbeats)
    """The differential's input: pattern and stall records, and producers' heartbeats (both keyed by job)."""
    differential_topics = {topics.patterns, topics.heartbeats}
    progress_out = raw(topics.patterns)
    findings_out = raw(topics.findings)
    deadletter = raw(topics.deadletter)
    control = raw(topics.control)

    counters = StageCounters()
    profiles = ProfilePolicy(cfg.profiling)
    windowers: dict[RankId, RankWindower] = {}
    job_seen: dict[str, int] = {}
    job_input: dict[str, int] = {}
    """Input-clock time of each job's last pattern, stall report or heartbeat: its end closes its findings."""
    within_s = cfg.take_within_ms / 1000
    gate = Gate()
    state_name = f"{cfg.topic_prefix}.{cfg.app_id}"
    wrec = WindowerRecovery(StateLog(app, f"{state_name}.windower-state", cfg.raw_partitions, cfg.bootstrap_servers))
    drec = DifferentialRecovery(
        StateLog(app, f"{state_name}.differential-state", cfg.partitions, cfg.bootstrap_servers), cfg.differential
    )
    jobs: dict[str, JobDifferential] = drec.jobs
    windower_lock, differential_lock = asyncio.Lock(), asyncio.Lock()
    """Emission, state record and release run in close order: a record never covers an undelivered output."""
    clock = InputClock()
    """The idle rules' clock (see ``InputClock``)."""

    async def on_revoked(_sender: object, revoked: set[faust.types.TP], **_kw: object) -> None:
        gate.epoch += 1
        gate.paused = True
        clock.rebalancing(True)  # partitions move: their ranks are late, not silent
        for key in wrec.revoke({tp.partition for tp in revoked if tp.topic in raw_events.topics}):
            windowers.pop(key, None)
        for job in drec.revoke({tp.partition for tp in revoked if tp.topic in differential_topics}):
            job_seen.pop(job, None)
            job_input.pop(job, None)

    async def on_assigned(_sender: object, _assigned: set[faust.types.TP], **_kw: object) -> None:
        gate.paused = False
        clock.rebalancing(False)

    # Faust awaits coroutine receivers; its stubs only describe plain callables.
    app.on_partitions_revoked.connect(on_revoked)  # type: ignore[arg-type]
    app.on_partitions_assigned.connect(on_assigned)  # type: ignore[arg-type]

    async def dead(event: faust.EventT, reason: str) -> None:
        counters.dead_letters += 1
        short = reason.split(":", 1)[0]
        counters.per_reason[short] = counters.per_reason.get(short, 0) + 1
        msg = event.message
        headers = {
            "reason": reason.encode(),
            "topic": str(msg.topic).encode(),
            "partition": str(msg.partition).encode(),
            "offset": str(msg.offset).encode(),
        }
        value = event.value
        if value is not None and len(value) > cfg.limits.max_message_bytes:  # the raw topic keeps it whole
            headers["truncated_from_bytes"] = str(len(value)).encode()
            value = value[: cfg.limits.max_message_bytes]
        await deadletter.send(key=event.key, value=value, headers=headers)

    async def emit_closed(closed: list[ClosedIteration], epoch: int, touched: Iterable[RankId]) -> list[Message]:
        """Send the iterations not emitted before, wait for their delivery, record them, and return the
        messages of these and the ``touched`` ranks that replay no longer needs. Caller holds ``windower_lock``."""
        fresh = wrec.fresh(closed)
        counters.replayed_skipped += len(closed) - len(fresh)
        failed = summarize_closed(fresh)
        counters.lost_iterations += len(failed)
        sent: list[Awaitable[Any]] = []
        send = app.producer.send  # straight to the Kafka producer: Faust's channel layer costs more than encoding
        for c in fresh:
            if c.error is not None:  # recorded as emitted below all the same: its raw messages can be acked
                continue
            it, pat = c.iteration, c.patterns
            key = rank_key(it["job"], it["rank"])
            sent.append(await send(topics.iterations, key, encode("iterations", it), None, None, None))
            sent.append(await send(topics.patterns, job_key(pat["job"]), encode("patterns", pat), None, None, None))
            counters.iterations += 1
        await asyncio.gather(*sent)
        if epoch != gate.epoch:
            return []
        return wrec.release({*touched, *await wrec.record(fresh)})

    async def emit_progress(touched: list[RankWindower]) -> None:
        for w in touched:
            for rec in w.take_progress():
                await progress_out.send(key=job_key(rec["job"]), value=encode("progress", rec))

    async def emit_findings(records: list[dict[str, Any]]) -> None:
        """Send finding records and wait for their delivery (a job's state record must not overtake them)."""
        sent: list[Awaitable[Any]] = []
        for rec in records:
            sent.append(await findings_out.send(key=job_key(rec["job"]), value=encode("findings", rec)))
            counters.findings += 1
            request = profiles.request(rec, time.monotonic_ns())
            if request is not None:
                sent.append(await control.send(key=job_key(rec["job"]), value=encode("control", request)))
        await asyncio.gather(*sent)

    async def windower_batch(batch: Sequence[faust.EventT]) -> None:
        events = take_over(batch, app, gate)
        epoch = gate.epoch
        if not events:
            return
        await wrec.load({e.message.partition for e in events})
        if epoch != gate.epoch:
            return
        now, wall = clock.now_ns(), time.time_ns()
        closed: list[ClosedIteration] = []
        touched: dict[RankId, RankWindower] = {}
        rejected: list[tuple[faust.EventT, str]] = []
        for event in events:
            result = intake(event.value, windowers, now, cfg.windower, wall_ns=wall, limits=cfg.limits)
            if result.key is not None:
                wrec.place(result.key, event.message.partition)
            if result.reason is not None:
                rejected.append((event, result.reason))
                continue
            if result.key is not None and result.windower is not None:
                touched[result.key] = result.windower
                wrec.holds.hold(result.key, result.horizon_ns, event.message)
            counters.raw_batches += 1
            counters.raw_events += result.events
            closed += result.closed
        async with windower_lock:
            released = await emit_closed(closed, epoch, touched)
        await emit_progress(list(touched.values()))
        for event, reason in rejected:
            await dead(event, reason)
        if epoch == gate.epoch:  # whatever was sent above is flushed before Faust commits these acks
            ack([*released, *(event.message for event, _ in rejected)], app)

    async def differential_batch(batch: Sequence[faust.EventT]) -> None:
        events = take_over(batch, app, gate)
        epoch = gate.epoch
        if not events:
            return
        for job in await drec.load({e.message.partition for e in events}):
            job_seen[job] = clock.now_ns()  # restored before its idle flush: flush it when idle again
        if epoch != gate.epoch:
            return
        rejected: list[tuple[faust.EventT, str]] = []
        # Scoring happens under the lock too: a job's state record must not include iterations whose
        # findings are still on their way (the timer's flush writes records while this batch waits).
        async with differential_lock:
            if epoch != gate.epoch:  # revoked while this batch waited: the replay brings it again
                return
            out: list[dict[str, Any]] = []
            touched: set[str] = set()
            for event in events:
                msg = event.message
                try:
                    subject, record = decode(event.value)
                except SchemaError as exc:
                    rejected.append((event, f"schema: {exc}"))
                    continue
                if subject not in ("patterns", "progress", "heartbeat"):
                    rejected.append((event, f"subject: expected patterns, progress or heartbeat, got {subject}"))
                    continue
                job = record["job"]
                jd = drec.job(job, msg.partition)
                job_input[job] = clock.now_ns()
                if subject == "heartbeat":  # the latest per rank is all a diagnosis needs: replay adds nothing
                    out += jd.add_heartbeat(record)
                    drec.skipped(job, msg)
                    touched.add(job)  # released by its checkpoint
                    continue
                job_seen[job] = clock.now_ns()
                touched.add(job)
                if subject == "progress":
                    if drec.replayed_progress(job, msg.offset):
                        counters.replayed_skipped += 1
                        drec.skipped(job, msg)
                        continue
                    out += jd.add_progress(record)
                    drec.took(job, msg, None)
                    continue
                counters.pattern_records += 1
                out += jd.add(record, clock.now_ns())
                drec.took(job, msg, int(record["iteration"]))
            await emit_findings(out)
            released = await drec.checkpoint(touched) if epoch == gate.epoch else []
        for event, reason in rejected:
            await dead(event, reason)
        if epoch == gate.epoch:
            ack([*released, *(event.message for event, _ in rejected)], app)

    async def windower(stream: faust.StreamT) -> None:
        async for batch in stream.take_events(cfg.take_max_events, within=within_s):  # type: ignore[attr-defined]
            with clock.busy():
                await windower_batch(batch)

    async def differential(stream: faust.StreamT) -> None:
        async for batch in stream.take_events(cfg.take_max_events, within=within_s):  # type: ignore[attr-defined]
            with clock.busy():
                await differential_batch(batch)

    if "windower" in cfg.stages:
        app.agent(raw_events, name="windower")(windower)
    if "differential" in cfg.stages:
        app.agent(differential_in, name="differential")(differential)

    @app.timer(interval=0.25)
    async def close_idle() -> None:
        if gate.paused:
            return
        now, epoch = clock.now_ns(), gate.epoch

        def idle(at_ns: int) -> set[RankId]:
            return {k for k, w in windowers.items() if at_ns - w.last_arrival_ns >= w.config.idle_close_ms * 1_000_000}

        closed: list[ClosedIteration] = []
        for w in windowers.values():
            closed += w.poll(now)
        flushed = idle(now)
        async with windower_lock:
            released = await emit_closed(closed, epoch, ())
            # Still idle after the awaits: nothing arrived since their flush was emitted.
            released += wrec.release_idle(flushed & idle(clock.now_ns()))
        await emit_progress(list(windowers.values()))
        if epoch == gate.epoch:
            ack(released, app)
        now, idle_ns = clock.now_ns(), cfg.job_idle_ms * 1_000_000
        for job in wrec.jobs_in_progress() & job_seen.keys():
            job_seen[job] = now  # its last iterations are still being cut here: not idle, whatever the timers
        for job, seen in list(job_seen.items()):
            jd = jobs.get(job)
            if now - seen < idle_ns or jd is None or epoch != gate.epoch:
                continue
            del job_seen[job]
            async with differential_lock:
                if epoch != gate.epoch:
                    return
                out = jd.flush()
                drec.flushed(job)
                await emit_findings(out)
                released = await drec.checkpoint([job]) if epoch == gate.epoch else []
            if epoch == gate.epoch:
                ack(released, app)

    @app.timer(interval=1.0)
    async def end_jobs() -> None:
        """Close the findings of jobs that ended: no input for ``job_end_ms`` on the input clock (which
        stands still while a backlog is worked off, so a lagging partition is not an ended job)."""
        if gate.paused:
            return
        now, epoch = clock.now_ns(), gate.epoch
        for job, seen in list(job_input.items()):
            jd = jobs.get(job)
            if now - seen < cfg.job_end_ms * 1_000_000 or jd is None or epoch != gate.epoch:
                continue
            del job_input[job]
            if not jd.open_findings():
                continue
            async with differential_lock:
                if epoch != gate.epoch:
                    return
                await emit_findings(jd.end())
                profiles.forget(job)
                released = await drec.checkpoint([job]) if epoch == gate.epoch else []
            if epoch == gate.epoch:
                ack(released, app)

    @app.timer(interval=10.0)
    async def report() -> None:
        counters.held_messages = len(wrec.holds) + len(drec.holds)
        counters.profile_requests_suppressed = profiles.suppressed
        counters.state_writes = wrec.log.writes + drec.log.writes
        counters.incomplete_iterations = sum(w.counters.incomplete for w in windowers.values())
        counters.states_restored = wrec.restored + drec.restored
        counters.consumer_lag = consumer_lag(app.monitor.tp_end_offsets, app.monitor.tp_committed_offsets)
        log.info("stream stages: %s", counters)

    app.fleetscope_counters = counters  # type: ignore[attr-defined]
    telemetry.register_source("stream", counters, dataclasses.asdict)
    return app


def run_worker(cfg: StreamAppConfig, loglevel: str = "WARNING", logfile: str | None = None) -> None:
    """Run the stream worker until SIGTERM/SIGINT (blocking)."""
    app = create_app(cfg)
    worker = faust.Worker(app, loglevel=loglevel, logfile=logfile, quiet=True)
    if not sys.stdout.isatty():
        worker.spinner = None  # its cursor escape codes would land in logs and pipes
    worker.execute_from_commandline()
