"""The one codec: Confluent wire format around schemaless Avro (fastavro).

Schema ids come from the embedded catalog unless a resolver (a schema registry, see ``registry.py``) is
installed for the process with ``use_resolver`` or passed to one call.
"""

from __future__ import annotations

import io
import struct
from typing import TYPE_CHECKING, Any

from fastavro import schemaless_reader, schemaless_writer

from fleetscope.schemas.catalog import CATALOG, SchemaCatalog
from fleetscope.schemas.records import EventBatch, EventKind

if TYPE_CHECKING:
    from fleetscope.schemas.registry import SchemaResolver

_MAGIC = 0
_PREFIX = struct.Struct(">bI")


_resolver: SchemaResolver | None = None


class SchemaError(ValueError):
    """Any failure to decode a message: bad framing, unknown schema id, malformed Avro, bad shape."""


def use_resolver(resolver: SchemaResolver | None) -> SchemaResolver | None:
    """Take schema ids from ``resolver`` in every encode/decode of this process (None: the embedded
    catalog); returns the previous one. Set once at start-up, before any client runs."""
    global _resolver
    previous, _resolver = _resolver, resolver
    return previous


def encode(
    subject: str,
    record: dict[str, Any],
    catalog: SchemaCatalog = CATALOG,
    *,
    resolver: SchemaResolver | None = None,
) -> bytes:
    """Serialise a record with the newest schema of its subject."""
    entry = catalog.latest(subject)
    r = resolver or _resolver
    buf = io.BytesIO()
    buf.write(_PREFIX.pack(_MAGIC, entry.schema_id if r is None else r.schema_id(subject)))
    schemaless_writer(buf, entry.parsed, record)
    return buf.getvalue()


def schema_id_of(message: bytes) -> int:
    if len(message) < _PREFIX.size:
        raise SchemaError(f"message of {len(message)} bytes is shorter than the wire-format prefix")
    magic, schema_id = _PREFIX.unpack_from(message)
    if magic != _MAGIC:
        raise SchemaError(f"bad magic byte {magic}")
    return int(schema_id)


def decode(
    message: bytes, catalog: SchemaCatalog = CATALOG, *, resolver: SchemaResolver | None = None
) -> tuple[str, dict[str, Any]]:
    """Return (subject, record), resolving the writer schema to the newest version of its subject."""
    schema_id = schema_id_of(message)
    r = resolver or _resolver
    writer = catalog.by_id(schema_id) if r is None else r.writer_schema(schema_id)
    if writer is None:
        raise SchemaError(f"unknown schema id {schema_id}")
    reader = catalog.latest(writer.subject)
    buf = io.BytesIO(message)
    buf.seek(_PREFIX.size)
    try:
        record = schemaless_reader(buf, writer.parsed, reader.parsed)
    except Exception as exc:  # fastavro raises many types on corrupt input
        raise SchemaError(f"malformed Avro for schema id {schema_id}: {exc!r}") from exc
    if buf.tell() != len(message):
        raise SchemaError(f"{len(message) - buf.tell()} trailing bytes after a schema id {schema_id} record")
    if not isinstance(record, dict):
        raise SchemaError(f"schema id {schema_id} did not decode to a record")
    return writer.subject, record


def encode_event_batch(batch: EventBatch, catalog: SchemaCatalog = CATALOG) -> bytes:
    return encode(batch.kind.value, batch.to_record(), catalog)


def decode_event_batch(message: bytes, catalog: SchemaCatalog = CATALOG) -> EventBatch:
    subject, record = decode(message, catalog)
    try:
        kind = EventKind(subject)
    except ValueError:
        raise SchemaError(f"subject {subject!r} is not a raw event batch") from None
    try:
        batch = EventBatch.from_record(kind, record)
    except (ValueError, TypeError, OverflowError) as exc:
        raise SchemaError(f"bad {subject} batch: {exc}") from exc
    n_names = len(batch.names)
    for column in ("name_id", "op_id", "pg_id", "metric_id"):
        ids = batch.columns.get(column)
        if ids is not None and ids.size and (ids.min() < 0 or ids.max() >= n_names):
            raise SchemaError(f"{subject} column {column} indexes outside the {n_names}-name dictionary")
    return batch
