"""From the program's ``Config`` to each stream component's own config, typed: the one place that maps them.

Components never read ``Config`` themselves: each takes its own frozen dataclass, built here, so a
component can be run (tests, the offline path) without the rest of the program's settings.
"""

from __future__ import annotations

from fleetscope.config import Config
from fleetscope.streams.appconfig import StreamAppConfig


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
        scoring_processes=s.scoring_processes,
        windower=s.windower,
        differential=s.differential,
        profiling=s.profiling,
        limits=config.limits,
        broker_credentials=k.faust_credentials(),
    )
