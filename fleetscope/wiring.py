"""From the program's ``Config`` to each component's own config, typed: the one place that maps them.

Components never read ``Config`` themselves: each takes its own frozen dataclass, built here, so a
component can be run (tests, the offline path) without the rest of the program's settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

from fleetscope.config import Config
from fleetscope.producers.control import ControlListenerConfig
from fleetscope.producers.publisher.config import PublisherConfig
from fleetscope.schemas.signing import MIN_KEY_BYTES

if TYPE_CHECKING:  # faust is imported only where a worker runs: a training rank builds its publisher here
    from fleetscope.streams.appconfig import StreamAppConfig

FINDINGS_KEY_FILE = "findings.key"


def findings_key(config: Config) -> bytes:
    """The key findings are signed with (``schemas.signing``): the differential's worker and the findings'
    readers (sink, alert follower) must hold the same one. ``kafka.findings_key`` where configured (a
    deployment's secret, handed on to child processes in their environment, never written to a file);
    otherwise the data directory's own, made on first use (0600): the processes of one machine share it."""
    if config.kafka.findings_key:
        return config.kafka.findings_key.encode()
    path = Path(config.data_dir) / FINDINGS_KEY_FILE
    with contextlib.suppress(FileNotFoundError):
        return _read_key(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    try:
        os.link(tmp, path)  # whole or absent, and the first process to make one wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    key = path.read_bytes().strip()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{path}: a findings key of {len(key)} bytes (at least {MIN_KEY_BYTES})")
    return key


WORKER_COMPRESSION = "zstd"
"""What the worker compresses its records with while ``kafka.compression`` is not none: aiokafka, which sends
them, runs lz4 and gzip at level 9 (0.48 and 3.5 ms for 47 KB of pattern records, where Faust's own cost is
0.21 ms a message), zstd at level 3 (0.08 ms, and 5.2x where lz4 gives 4.6x)."""


def worker_compression(config: Config) -> str:
    """The worker's codec: none where ``kafka.compression`` is none, else ``WORKER_COMPRESSION``."""
    return "none" if config.kafka.compression == "none" else WORKER_COMPRESSION


def stream_app_config(config: Config, web_port: int = 6066) -> StreamAppConfig:
    """The stream worker's settings (``fleetscope worker``, the embedded stack)."""
    from fleetscope.streams.appconfig import StreamAppConfig

    k, s = config.kafka, config.streams
    return StreamAppConfig(
        bootstrap_servers=k.bootstrap_servers,
        topic_prefix=k.topic_prefix,
        app_id=s.app_id,
        stages=s.stages,
        partitions=k.derived_partitions,
        raw_partitions=k.raw_partitions,
        session_timeout_ms=k.session_timeout_ms,
        data_dir=config.data_dir,
        web_port=web_port,
        take_max_events=s.take_max_events,
        take_within_ms=s.take_within_ms,
        job_idle_ms=s.job_idle_ms,
        job_end_ms=s.job_end_ms,
        state_chunk_bytes=s.state_chunk_bytes,
        state_share=s.state_share,
        compression=worker_compression(config),
        scoring_processes=s.scoring_processes,
        score_across_workers=s.score_across_workers,
        windower=s.windower,
        differential=s.differential,
        profiling=s.profiling,
        limits=config.limits,
        broker_credentials=k.faust_credentials(),
        findings_key=findings_key(config),
    )


BULK_QUEUE_MESSAGES = 1_000_000
"""The client queue of a publisher that sends a whole job at once (``demo``, ``simulate``, ``replay``)."""


def publisher_config(
    config: Config, *, client_id: str = "fleetscope-producer", queue_max_messages: int | None = None
) -> PublisherConfig:
    """A producing process's publisher (torch hook, agent, replay, demo): the ``kafka`` and ``producer``
    sections; the spool directory, when on disk, is ``<spool_dir or data_dir/spool>/<client_id>``: one per
    producing process."""
    k, prod = config.kafka, config.producer
    spool_dir = ""
    if prod.spool_on_disk:
        spool_dir = f"{(prod.spool_dir or f'{config.data_dir}/spool').rstrip('/')}/{client_id}"
    built = PublisherConfig(
        bootstrap_servers=k.bootstrap_servers,
        topic_prefix=k.topic_prefix,
        compression=k.compression,
        client_id=client_id,
        delivery_timeout_ms=prod.delivery_timeout_ms,
        spool_dir=spool_dir,
        spool_max_bytes=prod.spool_max_bytes,
        retry_backoff_max_ms=prod.retry_backoff_max_ms,
        max_message_bytes=config.limits.max_message_bytes,
        extra=k.client_settings(),
    )
    return built if queue_max_messages is None else dataclasses.replace(built, queue_max_messages=queue_max_messages)


def bulk_publisher_config(config: Config) -> PublisherConfig:
    """The publisher of a whole recorded or simulated job at once (``demo``, ``simulate``, ``replay``, the
    inspector's dumps): its queue holds ``BULK_QUEUE_MESSAGES``."""
    return publisher_config(config, queue_max_messages=BULK_QUEUE_MESSAGES)


def control_listener_config(config: Config) -> ControlListenerConfig:
    """A rank's or agent's follower of the control topic (profile requests): the ``kafka`` section."""
    k = config.kafka
    if not k.bootstrap_servers:
        raise ValueError("no Kafka broker configured (kafka.bootstrap_servers / --bootstrap)")
    return ControlListenerConfig(
        bootstrap_servers=k.bootstrap_servers, topic_prefix=k.topic_prefix, extra=k.client_settings()
    )
