"""What the stream worker needs, typed: built from the program's ``Config`` by ``fleetscope.wiring``."""

from __future__ import annotations

from dataclasses import dataclass, field

import faust

from fleetscope.schemas import IntakeLimits
from fleetscope.streams import STAGES
from fleetscope.streams.analysis.differential import DifferentialConfig
from fleetscope.streams.analysis.windowing import WindowerConfig
from fleetscope.streams.profiling import ProfileRequestConfig

BrokerCredentials = faust.SASLCredentials | faust.SSLCredentials | None
"""The Faust app's SASL/TLS settings; None: PLAINTEXT."""


@dataclass(frozen=True, kw_only=True)
class StreamAppConfig:
    """The stream worker's settings: where the broker is, which stages run, and each stage's config."""

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
    state_chunk_bytes: int = 512 * 1024
    state_share: float = 0.1
    compression: str = "none"
    """The codec of what the worker sends (Faust's ``producer_compression_type``): none or zstd, the one
    ``wiring`` picks."""
    scoring_processes: int = 0
    score_across_workers: bool = False
    profiling: ProfileRequestConfig = field(default_factory=ProfileRequestConfig)
    windower: WindowerConfig = field(default_factory=WindowerConfig)
    differential: DifferentialConfig = field(default_factory=DifferentialConfig)
    limits: IntakeLimits = field(default_factory=IntakeLimits)
    broker_credentials: BrokerCredentials = None
    """Faust credentials (SASL/TLS) from ``KafkaSettings.faust_credentials``; None: PLAINTEXT."""
    findings_key: bytes = field(default=b"", repr=False)
    """Key the differential signs its findings with (``stack.findings_key``); empty: unsigned."""
