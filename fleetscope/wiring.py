"""From the program's ``Config`` to each stream component's own config, typed: the one place that maps them.

Components never read ``Config`` themselves: each takes its own frozen dataclass, built here, so a
component can be run (tests, the offline path) without the rest of the program's settings.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from fleetscope.config import Config
from fleetscope.schemas.signing import MIN_KEY_BYTES
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
        windower=s.windower,
        differential=s.differential,
        profiling=s.profiling,
        limits=config.limits,
        broker_credentials=k.faust_credentials(),
        findings_key=findings_key(config),
    )
