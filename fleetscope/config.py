"""The one configuration object: defaults < file (TOML/JSON) < environment < command line.

Every error is reported at once with its key path; unknown keys are rejected with a suggestion.
Secrets (passwords) never appear in ``repr`` or logs. Every float setting is finite (``finite_float``):
NaN compares false with every threshold, so a NaN threshold would silently pass or silence everything.
The file is read only if it is a regular file, and at most ``MAX_CONFIG_BYTES`` of it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import stat
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleetscope.producers.publisher.config import PublisherConfig
from fleetscope.schemas.limits import IntakeLimits
from fleetscope.sinks.store_config import StoreConfig, StoreServerBounds
from fleetscope.streams import STAGES
from fleetscope.streams.profiling import ProfileRequestConfig
from fleetscope.streams.settings import DifferentialConfig, WindowerConfig

if TYPE_CHECKING:  # faust is imported only where a worker runs (not in training ranks)
    from _typeshed import DataclassInstance

    from fleetscope.streams.appconfig import BrokerCredentials

ENV_PREFIX = "FLEETSCOPE__"
MAX_CONFIG_BYTES = 2**20
"""A configuration file larger than this is refused, not read until memory runs out."""
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
"""The SASL mechanisms both client libraries (librdkafka and aiokafka) speak with a user and password."""


class ConfigError(ValueError):
    """Invalid configuration; ``errors`` lists every problem as 'key.path: message'."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("invalid configuration:\n  " + "\n  ".join(errors))


@dataclass(frozen=True, kw_only=True)
class KafkaSettings:
    """Where the broker is. An empty ``bootstrap_servers`` means: start the embedded Tansu broker."""

    bootstrap_servers: str = ""
    topic_prefix: str = "fleetscope"
    raw_partitions: int = 4
    derived_partitions: int = 4
    session_timeout_ms: int = 6000
    compression: str = "lz4"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password: str = field(default="", repr=False)
    ssl_ca_location: str = ""
    """CA bundle (PEM) that signs the brokers' certificates; empty: the system's trust store."""
    registry_url: str = ""
    """Confluent-compatible schema registry; empty: schema ids come from the embedded catalog."""
    registry_username: str = ""
    registry_password: str = field(default="", repr=False)
    findings_key: str = field(default="", repr=False)
    """Secret the differential signs findings with and the sink and ``alerts`` verify them by (at least 16
    characters; the same on every machine of a deployment). Empty: the data directory's own key."""

    def __post_init__(self) -> None:
        errors = []
        if self.registry_url and not self.registry_url.startswith(("http://", "https://")):
            errors.append(f"registry_url {self.registry_url!r} must start with http:// or https://")
        if self.raw_partitions < 1 or self.derived_partitions < 1:
            errors.append("partitions must be >= 1")
        if self.session_timeout_ms < 1000:
            errors.append("session_timeout_ms must be >= 1000")
        if self.compression not in ("none", "gzip", "snappy", "lz4", "zstd"):
            errors.append(f"compression {self.compression!r} is not one of none, gzip, snappy, lz4, zstd")
        if self.security_protocol not in ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"):
            errors.append(f"security_protocol {self.security_protocol!r} is not a Kafka security protocol")
        if self.sasl_mechanism and self.sasl_mechanism not in SASL_MECHANISMS:
            errors.append(f"sasl_mechanism {self.sasl_mechanism!r} is not one of {', '.join(SASL_MECHANISMS)}")
        if self.security_protocol.startswith("SASL_") and not self.sasl_mechanism:
            errors.append(f"security_protocol {self.security_protocol} needs a sasl_mechanism")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    def client_settings(self) -> dict[str, str]:
        """librdkafka security settings shared by every confluent-kafka client (values never logged)."""
        out = {"security.protocol": self.security_protocol}
        if self.uses_tls and self.ssl_ca_location:
            out["ssl.ca.location"] = self.ssl_ca_location
        if self.sasl_mechanism:
            out |= {
                "sasl.mechanism": self.sasl_mechanism,
                "sasl.username": self.sasl_username,
                "sasl.password": self.sasl_password,
            }
        return out

    def admin_settings(self) -> dict[str, str]:
        """An AdminClient's settings (topic creation by ``init``, ``replay`` and the embedded stack)."""
        return {"bootstrap.servers": self.bootstrap_servers, **self.client_settings()}

    def faust_credentials(self) -> BrokerCredentials:
        """The same security for the Faust app (``broker_credentials``): every aiokafka client it creates,
        and the recovery consumer, which takes the app's. None for PLAINTEXT."""
        import ssl

        import faust

        context = ssl.create_default_context(cafile=self.ssl_ca_location or None) if self.uses_tls else None
        if self.sasl_mechanism:
            return faust.SASLCredentials(
                username=self.sasl_username,
                password=self.sasl_password,
                mechanism=self.sasl_mechanism,
                ssl_context=context,
            )
        return faust.SSLCredentials(context) if context is not None else None


@dataclass(frozen=True, kw_only=True)
class ProducerSettings:
    """The publisher in every producing process (torch hook, agent, replay, demo) and its outage spool."""

    spool_on_disk: bool = True
    """Off: the spool is in memory, lost if the process ends while the broker is away."""
    spool_dir: str = ""
    """Empty: ``<data_dir>/spool``. Each process spools in its own ``<spool_dir>/<client id>``."""
    spool_max_bytes: int = 268_435_456
    delivery_timeout_ms: int = 30_000
    retry_backoff_max_ms: int = 5_000
    heartbeat_interval_ms: int = 1000
    """How often the PyTorch hook publishes each rank's heartbeat (its step and collective), also while the
    training thread is blocked."""

    def __post_init__(self) -> None:
        if self.heartbeat_interval_ms < 1:
            raise ValueError(f"heartbeat_interval_ms must be >= 1, got {self.heartbeat_interval_ms}")
        PublisherConfig(  # one set of rules: the publisher's own validation
            bootstrap_servers="-",
            spool_max_bytes=self.spool_max_bytes,
            delivery_timeout_ms=self.delivery_timeout_ms,
            retry_backoff_max_ms=self.retry_backoff_max_ms,
        )


@dataclass(frozen=True, kw_only=True)
class StreamSettings:
    app_id: str = "fleetscope-streams"
    stages: tuple[str, ...] = STAGES
    """The stream stages this worker runs. Workers of one ``app_id`` must run the same stages (a Faust
    app's members share all its topics); to size the stages apart, run each as an app of its own
    ``app_id``: windowers grow with raw events, the differential with jobs and ranks."""
    take_max_events: int = 256
    take_within_ms: int = 200
    job_idle_ms: int = 2000
    job_end_ms: int = 120_000
    """A job without input (patterns, heartbeats) this long has ended: its open findings close (job_ended)."""
    state_chunk_bytes: int = 512 * 1024
    """State records (a job's differential state: megabytes at a thousand ranks) larger than this are written in
    chunks of it: keep it under the broker's ``max.message.bytes`` (1 MB by default) less the key."""
    state_share: float = 0.1
    """The differential's state records, in bytes, at most this share of the pattern bytes each job takes: a
    record that only scored iterations would change waits for its share and at least 10 s (at most 5 min),
    so a crash replays the larger of 2/share records' worth of patterns and 10 s of them."""
    scoring_processes: int = 0
    """Processes that decode and score the differential's iterations beside the worker (``streams.scoring``):
    one job's differential on several cores, for jobs of thousands of ranks. 0: the worker scores them."""
    score_across_workers: bool = False
    """Every worker of the app scores a share of each job's iterations (``streams.striped_scoring``): one job
    on several machines. Iterations go by stripe to the partitions of ``<prefix>.score-requests``, so a job
    uses at most ``kafka.derived_partitions`` workers. Not with ``scoring_processes``."""
    windower: WindowerConfig = field(default_factory=WindowerConfig)
    differential: DifferentialConfig = field(default_factory=DifferentialConfig)
    profiling: ProfileRequestConfig = field(default_factory=ProfileRequestConfig)
    """Automatic profile requests of the differential stage."""

    def __post_init__(self) -> None:
        if self.job_end_ms <= self.job_idle_ms:
            raise ValueError(f"job_end_ms ({self.job_end_ms}) must be > job_idle_ms ({self.job_idle_ms})")
        if not 0 <= self.scoring_processes <= 256:
            raise ValueError(f"scoring_processes must be between 0 and 256, got {self.scoring_processes}")
        if self.score_across_workers and (self.scoring_processes or "differential" not in self.stages):
            raise ValueError("score_across_workers needs the differential stage and scoring_processes = 0")
        if self.state_chunk_bytes < 1024:
            raise ValueError(f"state_chunk_bytes must be >= 1024, got {self.state_chunk_bytes}")
        if not 0.0 < self.state_share <= 1.0:
            raise ValueError(f"state_share must be > 0 and <= 1, got {self.state_share}")
        unknown = [stage for stage in self.stages if stage not in STAGES]
        if unknown or not self.stages or len(set(self.stages)) < len(self.stages):
            raise ValueError(
                f"stages: expected one or both of {', '.join(STAGES)} (each once), got {list(self.stages)}"
            )


@dataclass(frozen=True, kw_only=True)
class EmbeddedSettings:
    """Loopback ports of what ``fleetscope up`` starts. Fixed by default, so producers, ``alerts`` and
    Grafana find it again after a restart; a port in use falls back to a free one (0: always free)."""

    broker_port: int = 19092
    store_port: int = 18123
    """The store's ClickHouse-compatible HTTP interface (token-protected, see ``endpoint.json``)."""
    serve_store: bool = True
    store_server: StoreServerBounds = field(default_factory=StoreServerBounds)
    """Bounds of the served store's HTTP interface: body caps per token, idle timeout, connections."""

    def __post_init__(self) -> None:
        for name in ("broker_port", "store_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} {getattr(self, name)} is not a TCP port (0 = any free port)")


@dataclass(frozen=True, kw_only=True)
class Config:
    data_dir: str = ".fleetscope"
    log_level: str = "WARNING"
    metrics_port: int = 0
    """Prometheus /metrics port of the worker, sink and agent processes; 0 = off."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint binds; ``0.0.0.0`` for a scraper on another machine."""
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    producer: ProducerSettings = field(default_factory=ProducerSettings)
    store: StoreConfig = field(default_factory=StoreConfig)
    streams: StreamSettings = field(default_factory=StreamSettings)
    embedded: EmbeddedSettings = field(default_factory=EmbeddedSettings)
    limits: IntakeLimits = field(default_factory=IntakeLimits)
    """Bounds on raw messages: the publisher drops, the intake dead-letters what passes them."""

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port {self.metrics_port} is not a TCP port (0 = off)")
        if not self.metrics_host.strip():
            raise ValueError("metrics_host must not be empty (127.0.0.1: this machine only)")

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def finite_float(value: float) -> bool:
    """The one rule for a float setting: finite. NaN passes no comparison (``z >= nan`` is false), so a
    NaN threshold silences every finding; an infinite one, the same."""
    return math.isfinite(value)


def _nonfinite_floats(obj: object, prefix: str = "") -> list[str]:
    """Every float field of a built configuration (defaults and given instances included) that breaks
    ``finite_float``, as 'key.path: message'."""
    out: list[str] = []
    if not dataclasses.is_dataclass(obj):
        return out
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += _nonfinite_floats(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not finite_float(value):
            out.append(f"{prefix}{f.name}: expected a finite number, got {value!r}")
    return out


def _coerce(tp: object, value: object, path: str, errors: list[str]) -> object:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            errors.append(f"{path}: expected a table of settings, got {type(value).__name__}")
            return None
        return _build(tp, value, f"{path}.", errors)
    if origin in (typing.Union, types.UnionType):
        return value
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, list | tuple) and all(isinstance(item, str) for item in items):
            return tuple(item.strip() for item in items)
        errors.append(f"{path}: expected a list of strings, got {value!r}")
        return None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
    elif tp is float:
        number: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and finite_float(number):
            return number
        if number is not None:
            errors.append(f"{path}: expected a finite number, got {value!r}")
            return None
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        return value
    errors.append(f"{path}: expected {tp.__name__}, got {value!r}")
    return None


def _build(cls: type, data: Mapping[str, object], prefix: str, errors: list[str]) -> object:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, object] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            errors.append(f"{path}: unknown key" + (f" (did you mean {close[0]!r}?)" if close else ""))
            continue
        before = len(errors)
        coerced = _coerce(hints[key], value, path, errors)
        if len(errors) == before:
            kwargs[key] = coerced
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        errors.append(f"{prefix.rstrip('.') or 'config'}: {exc}")
        return None


def _merge(base: dict[str, object], extra: Mapping[str, object]) -> dict[str, object]:
    out = dict(base)
    for key, value in extra.items():
        existing = out.get(key)
        if isinstance(value, Mapping) and isinstance(existing, dict):
            out[key] = _merge(existing, value)
        else:
            out[key] = value
    return out


def split_secrets(config: Config) -> tuple[dict[str, object], dict[str, str]]:
    """``config`` as a dict without its secrets (fields hidden from ``repr``), and those secrets as the
    ``FLEETSCOPE__...`` environment variables that put them back: a child process gets its password from
    the environment, never from a file."""
    env: dict[str, str] = {}

    def walk(obj: DataclassInstance, path: list[str]) -> dict[str, object]:
        out: dict[str, object] = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                out[f.name] = walk(value, [*path, f.name])
            elif not f.repr and isinstance(value, str):
                if value:
                    env[ENV_PREFIX + "__".join(p.upper() for p in [*path, f.name])] = value
            else:
                is_instance = dataclasses.is_dataclass(value) and not isinstance(value, type)
                out[f.name] = dataclasses.asdict(value) if is_instance else value
        return out

    return walk(config, []), env


def _table(node: dict[str, object], key: str) -> dict[str, object]:
    """``node[key]`` as a table of settings, made empty where it is absent or a value (the table wins)."""
    child = node.get(key)
    if not isinstance(child, dict):
        child = node[key] = {}
    return child


def _from_env(env: Mapping[str, str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        node = out
        for part in parts[:-1]:
            node = _table(node, part)
        node[parts[-1]] = value
    return out


def _dotted(overrides: Mapping[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = out
        for part in parts[:-1]:
            node = _table(node, part)
        node[parts[-1]] = value
    return out


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Config:
    """Build the validated configuration; raise ``ConfigError`` listing every problem.

    ``overrides`` use dotted keys (``{"kafka.bootstrap_servers": "host:9092"}``); environment
    variables use ``FLEETSCOPE__SECTION__KEY``.
    """
    data: dict[str, object] = {}
    errors: list[str] = []
    if path:
        p = Path(path)
        try:
            text = _read_config_file(p)
            data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        except (OSError, ValueError) as exc:
            raise ConfigError([f"{p}: {exc}"]) from exc
    data = _merge(data, _from_env(os.environ if env is None else env))
    data = _merge(data, _dotted(overrides or {}))
    given = data.setdefault("store", {})
    store = given if isinstance(given, dict) else {}
    if not store.get("url"):  # the embedded store lives in the data directory unless a URL is given
        store["url"] = f"chdb://{Path(str(data.get('data_dir', Config.data_dir))).resolve() / 'store'}"
    config = _build(Config, data, "", errors)
    if config is not None:
        errors += _nonfinite_floats(config)
    if errors:
        raise ConfigError(errors)
    return typing.cast(Config, config)


def _read_config_file(p: Path) -> str:
    """A configuration file's text: a regular file of at most ``MAX_CONFIG_BYTES`` (``/dev/zero``, a
    FIFO or a huge file is refused before it is read)."""
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without waiting for a writer
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ValueError(f"larger than {MAX_CONFIG_BYTES} bytes: not a configuration file")
    return data.decode()
