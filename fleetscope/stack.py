"""The embedded stack: broker, topics, ClickHouse sink and stream worker on one machine.

Start downstream first (broker -> topics -> sink -> worker), stop upstream first
(worker drains -> sink flushes and commits -> broker), each within a deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleetscope.broker import BrokerError, TansuBroker, ensure_topics, free_port, preferred_port, stop_process
from fleetscope.config import Config, split_secrets
from fleetscope.endpoint import Endpoint, ensure_unlocked, remove_endpoint, store_tokens, write_endpoint
from fleetscope.lifetime import child_env
from fleetscope.schemas import Topics
from fleetscope.sinks import Sink, SinkConfig, Store, open_store
from fleetscope.sinks.store import ServedStore, adapter
from fleetscope.wiring import findings_key
from fleetscope.wiring import stream_app_config as stream_app_config  # the CLI and tests find it here

log = logging.getLogger(__name__)


SINK_GROUP_PREFIX = "fleetscope-sink-"
PROFILE_DIR_ENV = "FLEETSCOPE_WORKER_PROFILE_DIR"
"""Set, each stream worker runs under cProfile and writes ``<dir>/<name>.prof`` when it stops (benches only)."""


def private_dir(path: str | Path) -> Path:
    """The data folder, created 0700 when it is not there (its parents as the umask says): it holds the
    store, the logs and the tokens. A folder that exists keeps its mode (it may be one the user chose for
    more than fleetscope), with a warning when others may read it. The files inside are private through
    the umask of the commands that write them (``fleetscope.cli.PRIVATE_UMASK``)."""
    folder = Path(path)
    if not folder.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # another process made it first
            pass
        else:
            folder.chmod(0o700)  # mkdir's mode is cut by the umask; this one is exact
    elif (mode := folder.stat().st_mode & 0o777) & 0o077:
        log.warning("data folder %s is open to other users (mode %o): chmod 700 it", folder, mode)
    return folder


def sink_group(config: Config) -> str:
    """One consumer group per store: sinks writing the same store share the partitions; a sink writing
    elsewhere (another folder, another server or database) reads every record into its own store instead
    of taking partitions from this one."""
    ch = config.store
    where = f"{ch.local_path or ch.url}|{ch.database}"
    return SINK_GROUP_PREFIX + hashlib.sha256(where.encode()).hexdigest()[:12]


def other_store_sinks(config: Config, timeout_s: float = 5.0) -> list[str]:
    """Sink groups of other stores with members on the broker (each of them gets every record too)."""
    from confluent_kafka import ConsumerGroupState
    from confluent_kafka.admin import AdminClient

    from fleetscope.broker import quiet_client

    k = config.kafka
    admin = AdminClient(quiet_client({"bootstrap.servers": k.bootstrap_servers, **k.client_settings()}))
    result = admin.list_consumer_groups(request_timeout=timeout_s).result(timeout=timeout_s)
    mine = sink_group(config)
    return sorted(
        g.group_id
        for g in result.valid
        if g.group_id.startswith(SINK_GROUP_PREFIX)
        and g.group_id != mine
        and g.state not in (ConsumerGroupState.EMPTY, ConsumerGroupState.DEAD)  # Tansu reports UNKNOWN
    )


def sink_config(config: Config) -> SinkConfig:
    k = config.kafka
    return SinkConfig(
        group_id=sink_group(config),
        bootstrap_servers=k.bootstrap_servers,
        topic_prefix=k.topic_prefix,
        session_timeout_ms=k.session_timeout_ms,
        flush_rows=config.store.flush_rows,
        flush_interval_ms=config.store.flush_interval_ms,
        extra=k.client_settings(),
        findings_key=findings_key(config),
    )


_PROFILED_MAIN = """import cProfile, runpy, sys, time
out = sys.argv.pop(1)
profile = cProfile.Profile(time.process_time)
profile.enable()
try:
    runpy.run_module("fleetscope", run_name="__main__", alter_sys=True)
finally:
    profile.disable()
    profile.dump_stats(out)
"""
"""``python -m fleetscope`` under cProfile on the process's CPU clock (``-m cProfile`` has the wall's, which
counts the worker's waits and the time a loaded machine leaves it unscheduled), dumped however it exits."""


def worker_command(config_path: Path, web_port: int, name: str, profile_dir: str | None = None) -> list[str]:
    """``fleetscope worker``'s command line; with ``profile_dir`` under cProfile, which writes
    ``<profile_dir>/<name>.prof`` when the worker stops (a bench's profile of the whole worker)."""
    main = ["-c", _PROFILED_MAIN, str(Path(profile_dir) / f"{name}.prof")] if profile_dir else ["-m", "fleetscope"]
    return [
        sys.executable,
        *main,
        *("worker", "--config", str(config_path), "--web-port", str(web_port), "--log-level", "INFO"),
    ]


class StreamWorkerProcess:
    """``fleetscope worker`` in a child process, with its own log file."""

    def __init__(self, config: Config, name: str = "worker") -> None:
        self.config = config
        self.name = name
        self.data_dir = Path(config.data_dir)
        self.log_path = self.data_dir / f"{name}.log"
        self.config_path = self.data_dir / f"{name}-config.json"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout_s: float = 60.0) -> None:
        """Start the worker and wait for it to be ready; after a ``kill()`` this is the restart."""
        private_dir(self.data_dir)
        settings, secrets = split_secrets(self.config)
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(settings, f)
        self.log_path.touch()
        log_from = self.log_path.stat().st_size
        cmd = worker_command(self.config_path, free_port(), self.name, os.environ.get(PROFILE_DIR_ENV))
        self._proc = subprocess.Popen(  # noqa: S603 - our own module, no shell
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log_path, "ab"),
            env=child_env({**os.environ, **secrets}),  # it stops when this process ends, however  # noqa: SIM115
        )
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

    @property
    def pid(self) -> int | None:
        """The running worker's process id (None when stopped)."""
        return self._proc.pid if self.alive() and self._proc is not None else None

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
        self.store: Store | None = None
        self.store_server: ServedStore | None = None

    def start(self) -> Config:
        data_dir = private_dir(self.config.data_dir)
        ensure_unlocked(self.config)
        try:
            if not self.config.kafka.bootstrap_servers:
                port = preferred_port(self.config.embedded.broker_port)
                self.broker = TansuBroker(port=port, log_path=data_dir / "broker.log")
                try:
                    servers = self.broker.start()
                except BrokerError:  # another process took the port since it was found free
                    log.warning("embedded broker could not listen on %d; taking a free port", port)
                    self.broker = TansuBroker(port=free_port(), log_path=data_dir / "broker.log")
                    servers = self.broker.start()
                self.config = self.config.replace(kafka=replace(self.config.kafka, bootstrap_servers=servers))
            k = self.config.kafka
            ensure_topics(k.admin_settings(), Topics(prefix=k.topic_prefix), k.raw_partitions, k.derived_partitions)
            self.store = open_store(self.config.store)
            self._serve_store()
            self.sink = Sink(sink_config(self.config), self.store)
            self.sink.start()
            if self.with_worker:
                self.worker = StreamWorkerProcess(self.config)
                self.worker.start()
        except BaseException:
            # Any failure, Ctrl-C while the worker starts included: `with` runs no __exit__ for a failed
            # __enter__, so what started must stop here (a broker left behind holds its port for good).
            self.stop()
            raise
        return self.config

    @property
    def client(self) -> Any:
        """The ClickHouse adapter's client, for the benches' and tests' own SQL (None before start)."""
        return getattr(self.store, "client", None)

    def _serve_store(self) -> None:
        """Serve the local store to other processes and tell them where, through the data directory."""
        ch = self.config.store
        if not self.config.embedded.serve_store or ch.on_disk is None:
            return
        tokens = store_tokens(self.config.data_dir)
        port = preferred_port(self.config.embedded.store_port)
        bounds = self.config.embedded.store_server
        try:
            self.store_server = adapter(ch).serve(ch, tokens, port=port, bounds=bounds)
        except OSError:  # another process took the port since it was found free
            self.store_server = adapter(ch).serve(ch, tokens, port=0, bounds=bounds)
        endpoint = Endpoint(
            pid=os.getpid(),
            bootstrap_servers=self.config.kafka.bootstrap_servers,
            store_url=self.store_server.url,
            database=ch.database,
            read_token=tokens.read,
            write_token=tokens.write,
        )
        write_endpoint(self.config.data_dir, endpoint)

    def stop(self) -> None:
        """Stop worker, sink, store server, broker, in that order; one that fails to stop does not keep the
        later ones running (the broker stops whatever happened before), and its error is raised after."""
        with contextlib.ExitStack() as stops:  # callbacks run last-in first-out, each despite the others
            if self.broker is not None:
                stops.callback(self.broker.stop)
            if self.store_server is not None:
                stops.callback(self.store_server.stop)
                stops.callback(remove_endpoint, self.config.data_dir)
            if self.sink is not None:
                stops.callback(self.sink.stop)
            if self.worker is not None:
                stops.callback(self.worker.stop)
            self.worker = self.sink = self.store_server = self.broker = None

    def __enter__(self) -> EmbeddedStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
