"""The Faust app: every topic, state table, agent and timer of the stream stages, declared in one place.

raw topics (key job/rank) -> windower -> <prefix>.iterations (job/rank), <prefix>.patterns, <prefix>.stalls (job)
<prefix>.patterns + <prefix>.stalls + <prefix>.heartbeats (job) -> differential -> <prefix>.findings (job)

A worker runs the stages listed in ``StreamAppConfig.stages`` (both by default; one each lets them be
sized apart). What each stage does is in ``windower`` and ``differential`` (a stage class the offline path
runs too, and its thin agent); how they survive a crash in ``recovery``; rebalances in ``rebalance``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import faust

from fleetscope import telemetry
from fleetscope.schemas import SchemaError, Topics
from fleetscope.streams.appconfig import StreamAppConfig
from fleetscope.streams.counters import StageCounters, consumer_lag
from fleetscope.streams.deadletter import DeadLetters
from fleetscope.streams.differential import DifferentialAgent, DifferentialStage
from fleetscope.streams.profiling import ProfilePolicy
from fleetscope.streams.rebalance import Gate, InputClock
from fleetscope.streams.recovery import DifferentialRecovery, StateLog, WindowerRecovery
from fleetscope.streams.scoring import ScoringPool
from fleetscope.streams.striped_scoring import (
    KafkaScoring,
    StripeScorer,
    default_partition,
    frame_headers,
    frame_refused,
)
from fleetscope.streams.windower import WindowerAgent, WindowerStage

__all__ = ["StageCounters", "StreamAppConfig", "consumer_lag", "create_app", "run_worker"]

log = logging.getLogger(__name__)

PRODUCER_BATCH_BYTES = 524_288
"""A partition's records in one producer batch, before compression (Faust's default, 16 KiB, is less than one
pattern record: each went alone, compressed and stored as its own batch). Half the consumers' 1 MiB fetch."""


RESEND_SESSIONS = 3
"""A scoring request unanswered for this many session timeouts is sent again: a dead scorer's partitions
move after one, and their new owner reads what it had not committed."""


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
        producer_compression_type=None if cfg.compression == "none" else cfg.compression,
        producer_max_request_size=max(1_048_576, cfg.limits.max_message_bytes + 65_536),  # dead letters fit
        producer_max_batch_size=PRODUCER_BATCH_BYTES,
        web_enabled=False,
        web_port=cfg.web_port,
        web_bind="127.0.0.1",
        stream_wait_empty=False,  # held messages are acked only once covered; a rebalance must not wait for them
    )

    def raw(*names: str) -> faust.TopicT:
        return app.topic(*names, key_serializer="raw", value_serializer="raw")

    raw_events = raw(*topics.raw_all)
    differential_topics = (topics.patterns, topics.stalls, topics.heartbeats)
    differential_in = raw(*differential_topics)
    state_name = f"{cfg.topic_prefix}.{cfg.app_id}"
    windower_state, differential_state = (
        StateLog(app, f"{state_name}.{stage}-state", n, cfg.bootstrap_servers, chunk_bytes=cfg.state_chunk_bytes)
        for stage, n in (("windower", cfg.raw_partitions), ("differential", cfg.partitions))
    )

    counters, gate, clock = StageCounters(), Gate(), InputClock()
    dead = DeadLetters(raw(topics.deadletter), counters, cfg.limits.max_message_bytes)
    windower_stage = WindowerStage(cfg.windower, cfg.limits)
    windower = WindowerAgent(
        app, windower_stage, WindowerRecovery(windower_state), topics=topics, stalls=raw(topics.stalls),
        counters=counters, dead=dead, gate=gate, clock=clock,
    )  # fmt: skip
    pool: ScoringPool | KafkaScoring | None = None
    striped: KafkaScoring | None = None
    if cfg.scoring_processes and "differential" in cfg.stages:
        pool = ScoringPool(cfg.scoring_processes, cfg.differential)
    elif cfg.score_across_workers and "differential" in cfg.stages:

        def reply_partition(job: str) -> int:
            placed = differential.recovery.partition_of(job)
            return default_partition(job, cfg.partitions) if placed is None else placed

        score_requests, scores = raw(topics.score_requests), raw(topics.scores)

        def send_request(partition: int, key: bytes, value: bytes) -> object:
            headers = frame_headers(cfg.findings_key, topics.score_requests, key, value)
            return score_requests.send_soon(key=key, value=value, partition=partition, headers=headers)

        pool = striped = KafkaScoring(
            send_request,
            stripes=cfg.partitions, part_bytes=cfg.state_chunk_bytes, reply_partition=reply_partition,
            resend_after_s=RESEND_SESSIONS * session_s,
        )  # fmt: skip
    scorer = StripeScorer(cfg.differential, cfg.state_chunk_bytes)
    differential_stage = DifferentialStage(cfg.differential, pool=pool)
    profiles = ProfilePolicy(cfg.profiling)
    differential = DifferentialAgent(
        app, differential_stage, DifferentialRecovery(differential_state, differential_stage.jobs, cfg.state_share),
        findings=raw(topics.findings), control=raw(topics.control), profiles=profiles, counters=counters,
        dead=dead, gate=gate, clock=clock, job_idle_ms=cfg.job_idle_ms, job_end_ms=cfg.job_end_ms,
        findings_key=cfg.findings_key,
    )  # fmt: skip

    async def on_revoked(_sender: object, revoked: set[faust.types.TP], **_kw: object) -> None:
        gate.epoch += 1
        gate.paused = True
        clock.rebalancing(True)  # partitions move: their ranks are late, not silent
        windower.revoke({tp.partition for tp in revoked if tp.topic in raw_events.topics})
        if striped is not None:  # parts of requests half read from moved partitions: their next owner reads them
            scorer.revoke({tp.partition for tp in revoked if tp.topic == topics.score_requests})
        differential.revoke({tp.partition for tp in revoked if tp.topic in differential_topics})

    async def on_assigned(_sender: object, assigned: set[faust.types.TP], **_kw: object) -> None:
        gate.paused = False
        clock.rebalancing(False)
        if "differential" in cfg.stages:
            differential.adopt({tp.partition for tp in assigned if tp.topic in differential_topics})

    # Faust awaits coroutine receivers; its stubs only describe plain callables.
    app.on_partitions_revoked.connect(on_revoked)  # type: ignore[arg-type]
    app.on_partitions_assigned.connect(on_assigned)  # type: ignore[arg-type]

    within_s = cfg.take_within_ms / 1000

    async def windower_agent(stream: faust.StreamT) -> None:
        await windower.run(stream, cfg.take_max_events, within_s)

    async def differential_agent(stream: faust.StreamT) -> None:
        await differential.run(stream, cfg.take_max_events, within_s)

    if "windower" in cfg.stages:
        app.agent(raw_events, name="windower")(windower_agent)
    if "differential" in cfg.stages:
        app.agent(differential_in, name="differential")(differential_agent)

    if striped is not None:

        def refused(topic: str, message: faust.types.Message) -> str | None:
            return frame_refused(cfg.findings_key, topic, message.key, message.value or b"", message.headers)

        async def scorer_agent(stream: faust.StreamT) -> None:
            async for event in stream.events():
                try:
                    why = refused(topics.score_requests, event.message)
                    score = [] if why else scorer.take(event.value or b"", event.message.partition)
                except SchemaError as exc:
                    why, score = f"schema: {exc}", []
                if why:
                    await dead.send(event.message, why)
                for partition, key, value in score:
                    headers = frame_headers(cfg.findings_key, topics.scores, key, value)
                    await scores.send(key=key, value=value, partition=partition, headers=headers)

        async def scores_agent(stream: faust.StreamT) -> None:
            async for event in stream.events():
                try:
                    why = refused(topics.scores, event.message)
                    if not why:
                        striped.receive(event.value or b"")
                except SchemaError as exc:
                    why = f"schema: {exc}"
                if why:
                    await dead.send(event.message, why)

        app.agent(score_requests, name="scorer")(scorer_agent)
        app.agent(scores, name="scores")(scores_agent)

        @app.timer(interval=1.0)
        async def resend_overdue() -> None:
            if not gate.paused:
                striped.resend_overdue()

    if pool is not None:

        async def close_pool(_sender: object, **_kw: object) -> None:
            pool.close()

        app.on_before_shutdown.connect(close_pool)  # type: ignore[arg-type]

    @app.timer(interval=0.25)
    async def close_idle() -> None:
        await windower.close_idle()
        await differential.collect_scores()
        await differential.flush_idle(windower.jobs_in_progress())

    @app.timer(interval=1.0)
    async def end_jobs() -> None:
        await differential.end_jobs()

    @app.timer(interval=10.0)
    async def report() -> None:
        counters.held_messages = len(windower.recovery.unacked) + len(differential.recovery.unacked)
        counters.iterations_scored_in_pool = pool.submitted if pool is not None else 0
        counters.profile_requests_suppressed = profiles.suppressed
        counters.state_writes = windower_state.writes + differential_state.writes
        counters.incomplete_iterations = windower_stage.incomplete
        counters.states_restored = windower.recovery.restored + differential.recovery.restored
        counters.consumer_lag = consumer_lag(app.monitor.tp_end_offsets, app.monitor.tp_committed_offsets)
        log.info("stream stages: %s", counters)
        if striped is not None:
            log.info(
                "scoring across workers: scored=%d requested=%d resent=%d ignored_scores=%d",
                scorer.scored, striped.submitted, striped.resent, striped.duplicates,
            )  # fmt: skip

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
