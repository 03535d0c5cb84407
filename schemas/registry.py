"""Where wire-format schema ids come from: the embedded catalog, or a Confluent-compatible schema registry.

Why a resolver: the message framing (magic byte + 4-byte schema id) is the same either way, but the ids
differ. Without a registry they are the catalog's fixed ids (101, 102, ...). With one, producers register
the catalog's newest schema of a subject under ``<topic>-value`` (TopicNameStrategy) and write the id the
registry hands out, so any Confluent-aware consumer (ksqlDB, Kafka Connect, a Java client) can read our
topics; our consumers fetch the writer schema of an id from the registry and resolve it to the catalog's
newest schema of the same record, which stays the reader. One deployment uses one mode: catalog ids and
registry ids overlap, so a topic cannot mix them.

The registry client is confluent-kafka's ``SchemaRegistryClient`` (``pip install 'fleetscope[registry]'``);
ids are cached forever (an id's schema never changes), so the registry is asked once per subject and id.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from fastavro import parse_schema
from fastavro.schema import to_parsing_canonical_form

from fleetscope.schemas.catalog import CATALOG, SchemaCatalog, SchemaEntry
from fleetscope.schemas.codec import SchemaError

if TYPE_CHECKING:  # the registry extras are optional: imported where a registry is configured
    from confluent_kafka.schema_registry import Schema

logger = logging.getLogger(__name__)


class RegistryClient(Protocol):
    """The two calls of confluent-kafka's ``SchemaRegistryClient`` used here (tests pass their own)."""

    def register_schema(self, subject_name: str, schema: Schema, /) -> int: ...

    def get_schema(self, schema_id: int, /) -> Schema: ...


class SchemaResolver(Protocol):
    """Maps codec subjects to the schema id written on the wire, and wire ids back to writer schemas."""

    def schema_id(self, subject: str) -> int:
        """Id to frame a record of ``subject`` (written with the catalog's newest schema of it)."""
        ...

    def writer_schema(self, schema_id: int) -> SchemaEntry:
        """The schema a message with ``schema_id`` was written with; ``SchemaError`` if there is none."""
        ...


class RegistryError(RuntimeError):
    """The registry could not be reached or refused a request. Not a ``SchemaError``: the message may be
    fine, so a consumer must not dead-letter it; the process stops and replays after a restart."""


class CatalogResolver:
    """The embedded default: the catalog's own ids, no network."""

    def __init__(self, catalog: SchemaCatalog = CATALOG) -> None:
        self._catalog = catalog

    def schema_id(self, subject: str) -> int:
        """The subject's schema id: the catalog's own, no network."""
        return self._catalog.latest(subject).schema_id

    def writer_schema(self, schema_id: int) -> SchemaEntry:
        """The schema a message of this id was written with (``SchemaError`` for an unknown id)."""
        entry = self._catalog.by_id(schema_id)
        if entry is None:
            raise SchemaError(f"unknown schema id {schema_id}")
        return entry


@dataclass(frozen=True, kw_only=True)
class RegistryConfig:
    """How to reach the registry. The password is never logged."""

    url: str
    topic_prefix: str = "fleetscope"
    username: str = ""
    password: str = field(default="", repr=False)
    timeout_s: float = 10.0
    max_retries: int = 3

    def __post_init__(self) -> None:
        errors: list[str] = []
        if not all(u.strip().startswith(("http://", "https://")) for u in self.url.split(",")):
            errors.append(f"url: expected http(s)://HOST:PORT[,...], got {self.url!r}")
        if not self.topic_prefix:
            errors.append("topic_prefix: must not be empty")
        if self.password and not self.username:
            errors.append("password: given without a username")
        if self.timeout_s <= 0 or self.max_retries < 0:
            errors.append("timeout_s must be > 0 and max_retries >= 0")
        if errors:
            raise ValueError("invalid RegistryConfig: " + "; ".join(errors))

    def client_settings(self) -> dict[str, object]:
        """``SchemaRegistryClient`` settings (contain the password: never log them)."""
        out: dict[str, object] = {
            "url": self.url,
            "timeout": self.timeout_s,
            "max.retries": self.max_retries,
            "retries.wait.ms": 200,
            "retries.max.wait.ms": 2000,
        }
        if self.username:
            out["basic.auth.user.info"] = f"{self.username}:{self.password}"
        return out


def schema_text(entry: SchemaEntry) -> str:
    """The schema as the registry should store it: self-contained JSON without fastavro's private
    ``__fastavro_parsed``/``__named_schemas`` keys (``SchemaEntry.json`` keeps them), docs and defaults
    kept (the registry's compatibility checks need the defaults)."""

    def clean(node: object) -> object:
        if isinstance(node, dict):
            return {k: clean(v) for k, v in node.items() if not k.startswith("__")}
        if isinstance(node, list):
            return [clean(v) for v in node]
        return node

    return json.dumps(clean(json.loads(entry.json)), separators=(",", ":"))


def _registry_client(config: RegistryConfig) -> RegistryClient:
    try:
        from confluent_kafka.schema_registry import SchemaRegistryClient
    except ImportError as exc:  # the extras (httpx2, authlib, cachetools, attrs) are missing
        raise ImportError(
            f"a schema registry needs confluent-kafka's registry client ({exc}): pip install 'fleetscope[registry]'"
        ) from exc
    return SchemaRegistryClient(config.client_settings())


def _wrap(exc: Exception, what: str, *, missing_is_bad_message: bool = False) -> Exception:
    """SchemaError only when the registry says the id does not exist (the message is bad: dead-letter it);
    RegistryError for everything else (unreachable, auth, incompatible schema: the deployment is wrong)."""
    status = getattr(exc, "http_status_code", None)
    if missing_is_bad_message and status == 404:
        return SchemaError(f"{what}: not in the schema registry ({exc})")
    detail = f"answered {status}: {exc}" if isinstance(status, int) and status > 0 else f"unavailable: {exc!r}"
    return RegistryError(f"{what}: schema registry {detail}")


class RegistryResolver:
    """Registers and looks up schemas in a Confluent-compatible registry; thread-safe, cached."""

    def __init__(
        self, config: RegistryConfig, catalog: SchemaCatalog = CATALOG, client: RegistryClient | None = None
    ) -> None:
        self.config = config
        self._catalog = catalog
        self._client = client if client is not None else _registry_client(config)
        self._lock = threading.Lock()
        self._ids: dict[str, int] = {}
        self._writers: dict[int, SchemaEntry] = {}
        entries = catalog.entries()
        self._subject_of_name = {e.parsed["name"]: e.subject for e in entries}
        self._version_of_form = {to_parsing_canonical_form(e.parsed): e.version for e in entries}

    def subject_name(self, subject: str) -> str:
        """Registry subject of a codec subject: ``<topic>-value``, the topic being ``<prefix>.<subject>``."""
        return f"{self.config.topic_prefix}.{subject}-value"

    def schema_id(self, subject: str) -> int:
        """The id the registry gives the subject's latest schema, registered on first use and cached."""
        with self._lock:
            cached = self._ids.get(subject)
        if cached is not None:
            return cached
        from confluent_kafka.schema_registry import Schema

        entry = self._catalog.latest(subject)
        name = self.subject_name(subject)
        try:
            schema_id = int(self._client.register_schema(name, Schema(schema_text(entry), "AVRO")))
        except Exception as exc:  # the client raises SchemaRegistryError, httpx2 and socket errors
            raise _wrap(exc, f"registering {name}") from exc
        logger.info("schema %s v%d registered as id %d under %s", subject, entry.version, schema_id, name)
        with self._lock:
            self._ids[subject] = schema_id
            self._writers.setdefault(schema_id, SchemaEntry(schema_id, subject, entry.version, entry.parsed))
        return schema_id

    def writer_schema(self, schema_id: int) -> SchemaEntry:
        """The schema a message of this id was written with, fetched from the registry once and cached."""
        with self._lock:
            cached = self._writers.get(schema_id)
        if cached is not None:
            return cached
        try:
            schema = self._client.get_schema(schema_id)
        except Exception as exc:
            raise _wrap(exc, f"schema id {schema_id}", missing_is_bad_message=True) from exc
        if (schema.schema_type or "AVRO") != "AVRO":
            raise SchemaError(f"schema id {schema_id} is {schema.schema_type}, not Avro")
        try:
            parsed = parse_schema(json.loads(schema.schema_str or ""))
        except Exception as exc:  # fastavro raises several types on an invalid schema
            raise SchemaError(f"schema id {schema_id} is not a valid Avro schema: {exc}") from exc
        name = parsed.get("name") if isinstance(parsed, dict) else None
        subject = self._subject_of_name.get(name) if isinstance(name, str) else None
        if subject is None:
            raise SchemaError(f"schema id {schema_id} is record {name!r}, which no fleetscope topic carries")
        version = self._version_of_form.get(to_parsing_canonical_form(parsed), 0)
        entry = SchemaEntry(schema_id, subject, version, parsed)
        with self._lock:
            self._writers[schema_id] = entry
        return entry

    def register_catalog(self) -> dict[str, int]:
        """Register the newest schema of every subject now (fail fast at start-up); subject -> id."""
        return {subject: self.schema_id(subject) for subject in self._catalog.subjects()}


def registry_resolver(url: str, *, topic_prefix: str, username: str = "", password: str = "") -> RegistryResolver:
    """A resolver for the registry at ``url`` (comma-separated for several)."""
    return RegistryResolver(RegistryConfig(url=url, topic_prefix=topic_prefix, username=username, password=password))
