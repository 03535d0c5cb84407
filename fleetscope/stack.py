"""The embedded stack: broker, topics, ClickHouse sink and stream worker on one machine.

Start downstream first (broker -> topics -> sink -> worker), stop upstream first
(worker drains -> sink flushes and commits -> broker), each within a deadline.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from fleetscope.broker import BrokerError, TansuBroker, ensure_topics, free_port, stop_process
from fleetscope.config import Config
from fleetscope.schemas import Topics
from fleetscope.sinks import ClickHouseWriter, Sink, SinkConfig, connect, migrate
from fleetscope.streams.app import StreamAppConfig

log = logging.getLogger(__name__)


def sink_config(config: Config) -> SinkConfig:
    k = config.kafka
    return SinkConfig(
        bootstrap_servers=k.bootstrap_servers,
        topic_prefix=k.topic_prefix,
        session_timeout_ms=k.session_timeout_ms,
        flush_rows=config.store.flush_rows,
        flush_interval_ms=config.store.flush_interval_ms,
        extra=k.client_settings(),
    )


def stream_app_config(config: Config, web_port: int = 6066) -> StreamAppConfig:
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
        windower=s.windower,
        differential=s.differential,
        profiling=s.profiling,
    )


class StreamWorkerProcess:
    """``fleetscope worker`` in a child process, with its own log file."""

    def __init__(self, config: Config, name: str = "worker") -> None:
        self.config = config
        self.data_dir = Path(config.data_dir)
        self.log_path = self.data_dir / f"{name}.log"
        self.config_path = self.data_dir / f"{name}-config.json"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout_s: float = 60.0) -> None:
        """Start the worker and wait for it to be ready; after a ``kill()`` this is the restart."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.config.to_dict(), f)
        self.log_path.touch()
        log_from = self.log_path.stat().st_size
        cmd = [
            sys.executable,
            "-m",
            "fleetscope",
            "worker",
            "--config",
            str(self.config_path),
            "--web-port",
            str(free_port()),
            "--log-level",
            "INFO",
        ]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "ab"))  # noqa: SIM115
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"stream worker exited with {self._proc.returncode}; see {self.log_path}")
            with open(self.log_path, "rb") as f:
                f.seek(log_from)
                if b"Worker]: Ready" in f.read():
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"stream worker not ready within {ready_timeout_s} s; see {self.log_path}")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        proc, self._proc = self._proc, None
        stop_process(proc, timeout_s, "stream worker")

    def kill(self) -> None:
        """SIGKILL, as a crash would: no drain, no commit, no producer flush."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


class EmbeddedStack:
    """Everything the pipeline needs on one machine. ``config`` gains the broker address on start."""

    def __init__(self, config: Config, with_worker: bool = True) -> None:
        self.config = config
        self.with_worker = with_worker
        self.broker: TansuBroker | None = None
        self.worker: StreamWorkerProcess | None = None
        self.sink: Sink | None = None
        self.client = None

    def start(self) -> Config:
        data_dir = Path(self.config.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        try:
            if not self.config.kafka.bootstrap_servers:
                self.broker = TansuBroker(log_path=data_dir / "broker.log")
                servers = self.broker.start()
                self.config = self.config.replace(kafka=replace(self.config.kafka, bootstrap_servers=servers))
            k = self.config.kafka
            admin = {"bootstrap.servers": k.bootstrap_servers, **k.client_settings()}
            ensure_topics(admin, Topics(prefix=k.topic_prefix), k.raw_partitions, k.derived_partitions)
            ch = self.config.store
            self.client = connect(ch)
            migrate(self.client, ch.database)
            self.sink = Sink(sink_config(self.config), ClickHouseWriter(self.client, ch.database))
            self.sink.start()
            if self.with_worker:
                self.worker = StreamWorkerProcess(self.config)
                self.worker.start()
        except (BrokerError, RuntimeError, OSError):
            self.stop()
            raise
        return self.config

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
            self.worker = None
        if self.sink is not None:
            self.sink.stop()
            self.sink = None
        if self.broker is not None:
            self.broker.stop()
            self.broker = None

    def __enter__(self) -> EmbeddedStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
