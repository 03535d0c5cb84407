"""The Faust app: every topic and agent of the stream stages, declared in one place.

raw topics (key job/rank) -> windower -> fleetscope.iterations (job/rank), fleetscope.patterns (job)
fleetscope.patterns -> differential -> fleetscope.findings (job)

Agents stay thin: take a batch of events, decode, call the pure functions of ``analysis``, send.
State lives per partition owner (windower per rank, differential per job).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import faust

from fleetscope import telemetry
from fleetscope.schemas import (
    SchemaError,
    Topics,
    decode,
    encode,
)
from fleetscope.schemas.topics import job_key, rank_key
from fleetscope.streams.analysis.differential import JobDifferential
from fleetscope.streams.analysis.windowing import ClosedIteration, RankWindower
from fleetscope.streams.intake import intake

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class StreamAppConfig:
    """What the Faust worker needs; built from the program's ``Config`` by the CLI."""

    bootstrap_servers: str
    topic_prefix: str = "fleetscope"
    app_id: str = "fleetscope-streams"
    partitions: int = 4
    session_timeout_ms: int = 6000
    data_dir: str = ".fleetscope"
    web_port: int = 6066
    take_max_events: int = 256
    take_within_ms: int = 200
    job_idle_ms: int = 2000
    profile_seconds: float = 20.0
    windower: Any = None
    differential: Any = None


@dataclass
class StageCounters:
    raw_batches: int = 0
    raw_events: int = 0
    dead_letters: int = 0
    iterations: int = 0
    pattern_records: int = 0
    findings: int = 0
    per_reason: dict[str, int] = field(default_factory=dict)


PROFILE_ON = frozenset({"job_regression", "hang"})
"""Findings that ask every rank of the job for a profiling window (PerfTracker's trigger)."""


def profile_request(finding: dict[str, Any], seconds: float, start_in_s: float = 5.0) -> dict[str, Any]:
    """A control record asking the job's ranks for a synchronised profile (see control.v1.avsc)."""
    now = time.time_ns()
    return {
        "request_id": uuid.uuid4().hex,
        "job": finding["job"],
        "action": "profile",
        "duration_s": float(seconds),
        "start_at_ns": now + int(start_in_s * 1e9),
        "requested_by": "differential",
        "reason": f"{finding['category']} opened: {finding['finding_id']}",
        "issued_ns": now,
    }


def create_app(cfg: StreamAppConfig) -> faust.App:
    topics = Topics(prefix=cfg.topic_prefix)
    session_s = cfg.session_timeout_ms / 1000
    app = faust.App(
        cfg.app_id,
        broker=f"kafka://{cfg.bootstrap_servers}",
        store="memory://",
        datadir=f"{cfg.data_dir}/faust",
        topic_partitions=cfg.partitions,
        topic_replication_factor=1,
        broker_session_timeout=session_s,
        broker_heartbeat_interval=max(session_s / 10, 0.1),
        broker_rebalance_timeout=max(session_s, 2.0),
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        web_enabled=False,
        web_port=cfg.web_port,
        web_bind="127.0.0.1",
    )

    def raw(*names: str) -> faust.TopicT:
        return app.topic(*names, key_serializer="raw", value_serializer="raw")

    raw_events = raw(*topics.raw_all)
    iterations_out = raw(topics.iterations)
    patterns = raw(topics.patterns)
    findings_out = raw(topics.findings)
    deadletter = raw(topics.deadletter)
    control = raw(topics.control)

    counters = StageCounters()
    windowers: dict[tuple[str, int], RankWindower] = {}
    jobs: dict[str, JobDifferential] = {}
    job_seen: dict[str, int] = {}
    within_s = cfg.take_within_ms / 1000

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
        await deadletter.send(key=event.key, value=event.value, headers=headers)

    async def emit_closed(closed: list[ClosedIteration]) -> None:
        for c in closed:
            it, pat = c.iteration, c.patterns
            await iterations_out.send(key=rank_key(it["job"], it["rank"]), value=encode("iterations", it))
            await patterns.send(key=job_key(pat["job"]), value=encode("patterns", pat))
            counters.iterations += 1

    async def emit_progress(touched: list[RankWindower]) -> None:
        for w in touched:
            for rec in w.take_progress():
                await patterns.send(key=job_key(rec["job"]), value=encode("progress", rec))

    async def emit_findings(records: list[dict[str, Any]]) -> None:
        for rec in records:
            await findings_out.send(key=job_key(rec["job"]), value=encode("findings", rec))
            counters.findings += 1
            if rec["status"] == "open" and rec["category"] in PROFILE_ON:
                request = profile_request(rec, cfg.profile_seconds)
                await control.send(key=job_key(rec["job"]), value=encode("control", request))

    @app.agent(raw_events, name="windower")
    async def windower(stream: faust.StreamT) -> None:
        async for events in stream.take_events(cfg.take_max_events, within=within_s):
            now, wall = time.monotonic_ns(), time.time_ns()
            closed: list[ClosedIteration] = []
            touched: list[RankWindower] = []
            for event in events:
                result = intake(event.value, windowers, now, cfg.windower, wall_ns=wall)
                if result.windower is not None:
                    touched.append(result.windower)
                if result.reason is not None:
                    await dead(event, result.reason)
                    continue
                counters.raw_batches += 1
                counters.raw_events += result.events
                closed += result.closed
            await emit_closed(closed)
            await emit_progress(touched)

    @app.agent(patterns, name="differential")
    async def differential(stream: faust.StreamT) -> None:
        async for events in stream.take_events(cfg.take_max_events, within=within_s):
            out: list[dict[str, Any]] = []
            for event in events:
                try:
                    subject, record = decode(event.value)
                except SchemaError as exc:
                    await dead(event, f"schema: {exc}")
                    continue
                if subject not in ("patterns", "progress"):
                    await dead(event, f"subject: expected patterns or progress, got {subject}")
                    continue
                job = record["job"]
                jd = jobs.get(job)
                if jd is None:
                    jd = jobs[job] = JobDifferential(job, cfg.differential)
                job_seen[job] = time.monotonic_ns()
                if subject == "progress":
                    out += jd.add_progress(record)
                    continue
                counters.pattern_records += 1
                out += jd.add(record)
            await emit_findings(out)

    @app.timer(interval=0.25)
    async def close_idle() -> None:
        now = time.monotonic_ns()
        closed: list[ClosedIteration] = []
        for w in windowers.values():
            closed += w.poll(now)
        await emit_closed(closed)
        await emit_progress(list(windowers.values()))
        idle_ns = cfg.job_idle_ms * 1_000_000
        for job, seen in list(job_seen.items()):
            if now - seen >= idle_ns:
                del job_seen[job]
                await emit_findings(jobs[job].flush())

    @app.timer(interval=10.0)
    async def report() -> None:
        log.info("stream stages: %s", counters)

    app.fleetscope_counters = counters  # type: ignore[attr-defined]
    telemetry.register_source("stream", counters, dataclasses.asdict)
    return app


def run_worker(cfg: StreamAppConfig, loglevel: str = "WARNING", logfile: str | None = None) -> None:
    """Run the stream worker until SIGTERM/SIGINT (blocking)."""
    app = create_app(cfg)
    worker = faust.Worker(app, loglevel=loglevel, logfile=logfile, quiet=True)
    worker.execute_from_commandline()
