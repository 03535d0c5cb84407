"""The one codec: Confluent wire format around schemaless Avro (fastavro).

Schema ids come from the embedded catalog unless a resolver (a schema registry, see ``registry.py``) is
installed for the process with ``use_resolver`` or passed to one call. Raw event batches and pattern
records are decoded by ``columnar_decode`` (numbers in bulk, straight into numpy); fastavro stays the reference
and reads any message that decoder does not vouch for, so both give the same values or the same
``SchemaError``.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from fastavro import schemaless_reader, schemaless_writer

from fleetscope.schemas.catalog import CATALOG, SchemaCatalog, SchemaEntry
from fleetscope.schemas.columnar_decode import decode_columns, decode_many, decode_scalars
from fleetscope.schemas.columnar_encode import encode_columns
from fleetscope.schemas.records import ID_COLUMNS, EventBatch, EventKind

if TYPE_CHECKING:
    from fleetscope.schemas.registry import SchemaResolver

_MAGIC = 0
_PREFIX = struct.Struct(">bI")
_EVENT_SUBJECTS = frozenset(k.value for k in EventKind)
_COLUMN_SUBJECTS = frozenset({"patterns"})
"""Records of per-function arrays that ``encode`` and ``decode`` take as numpy columns: hundreds of functions
a record, for which fastavro's Python object per value costs ~1 ms each way (docs/scaling.md)."""
COLUMNS_FROM_FUNCTIONS = 80
COLUMNS_FROM_BYTES = 4_000
"""Where the numpy encoder and decoder start to pay (a record of this many functions; a message of this many
bytes, about 24 functions): below, their fixed cost per field exceeds fastavro's per value. The encoder's is
higher (the timeline's arrays are fields too): fastavro writes a record of 48 functions 1.3x as fast, of 64
about as fast, of 96 0.9x, with 6 or 100 calls (docs/scaling.md)."""


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
    record: Mapping[str, object],
    catalog: SchemaCatalog = CATALOG,
    *,
    resolver: SchemaResolver | None = None,
    fast: bool = True,
) -> bytes:
    """Serialise a record with the newest schema of its subject. A pattern record of ``COLUMNS_FROM_FUNCTIONS``
    functions or more is written by ``columnar_encode`` (the same bytes); ``fast=False``, or a record it does not
    vouch for: by fastavro."""
    entry = catalog.latest(subject)
    r = resolver or _resolver
    prefix = _PREFIX.pack(_MAGIC, entry.schema_id if r is None else r.schema_id(subject))
    functions = record.get("function") if isinstance(record, dict) else None
    if (
        fast
        and subject in _COLUMN_SUBJECTS
        and isinstance(functions, list)
        and len(functions) >= COLUMNS_FROM_FUNCTIONS
    ):
        body = encode_columns(record, entry.parsed)
        if body is not None:
            return prefix + body
    buf = io.BytesIO()
    buf.write(prefix)
    schemaless_writer(buf, entry.parsed, record)
    return buf.getvalue()


def schema_id_of(message: bytes) -> int:
    """The schema id in a message's wire-format prefix; ``SchemaError`` where the prefix is short or its
    magic byte wrong."""
    if len(message) < _PREFIX.size:
        raise SchemaError(f"message of {len(message)} bytes is shorter than the wire-format prefix")
    magic, schema_id = _PREFIX.unpack_from(message)
    if magic != _MAGIC:
        raise SchemaError(f"bad magic byte {magic}")
    return int(schema_id)


def decode(
    message: bytes,
    catalog: SchemaCatalog = CATALOG,
    *,
    resolver: SchemaResolver | None = None,
    fast: bool = True,
) -> tuple[str, dict[str, Any]]:
    """Return (subject, record), resolving the writer schema to the newest version of its subject.

    A pattern record's per-function columns come as numpy arrays (``columnar_decode``; integers as int64), as
    the windower builds them, from ``COLUMNS_FROM_BYTES``; ``fast=False`` reads it with fastavro only (the
    reference: lists)."""
    schema_id, writer = _writer_of(message, catalog, resolver)
    reader = catalog.latest(writer.subject)
    if fast and writer.subject in _COLUMN_SUBJECTS and len(message) >= COLUMNS_FROM_BYTES:
        record = decode_columns(message, _PREFIX.size, writer.parsed, reader.parsed)
        if record is not None:
            return writer.subject, {k: v.astype(np.int64) if _is_int32(v) else v for k, v in record.items()}
    return writer.subject, _read_record(message, schema_id, writer, reader)


PATTERN_HEAD = (
    ("job", "string"), ("rank", "int"), ("host", "string"), ("world_size", "int"), ("tp_rank", "int"),
    ("pp_rank", "int"), ("dp_rank", "int"), ("iteration", "long"), ("iteration_start_ns", "long"),
    ("iteration_ns", "long"),
)  # fmt: skip
"""The fields a pattern record starts with: enough to place it in its job's iteration (``decode_head``)."""
_HEADS: dict[int, bool] = {}


def decode_head(
    message: bytes, catalog: SchemaCatalog = CATALOG, *, resolver: SchemaResolver | None = None
) -> tuple[SchemaEntry, dict[str, Any] | None]:
    """(the writer's schema, the record's ``PATTERN_HEAD`` fields) of a pattern message, read without the rest: a few
    varints where the whole record is hundreds of arrays, so one process can place every rank's record
    and leave the rest to the processes that score (``streams.scoring``). The head is None where the
    writer's schema does not start with those fields (or the message is not a pattern record): decode it
    whole. The rest of the message is not checked: its ``decode`` may still fail."""
    schema_id, writer = _writer_of(message, catalog, resolver)
    starts = _HEADS.get(schema_id)
    if starts is None:
        fields = writer.parsed.get("fields", []) if isinstance(writer.parsed, dict) else []
        named = [(f.get("name"), f.get("type")) for f in fields[: len(PATTERN_HEAD)]]
        starts = _HEADS[schema_id] = writer.subject in _COLUMN_SUBJECTS and named == list(PATTERN_HEAD)
    if not starts:
        return writer, None
    try:
        head = decode_scalars(message, _PREFIX.size, PATTERN_HEAD)
    except ValueError as exc:
        raise SchemaError(f"malformed Avro for schema id {schema_id}: its head: {exc}") from exc
    return writer, head


def _is_int32(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == np.int32


def _writer_of(message: bytes, catalog: SchemaCatalog, resolver: SchemaResolver | None) -> tuple[int, SchemaEntry]:
    schema_id = schema_id_of(message)
    r = resolver or _resolver
    writer = catalog.by_id(schema_id) if r is None else r.writer_schema(schema_id)
    if writer is None:
        raise SchemaError(f"unknown schema id {schema_id}")
    return schema_id, writer


def _read_record(message: bytes, schema_id: int, writer: SchemaEntry, reader: SchemaEntry) -> dict[str, Any]:
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
    return record


def encode_event_batch(batch: EventBatch, catalog: SchemaCatalog = CATALOG) -> bytes:
    """A raw event batch as a wire-format message of its kind's subject."""
    return encode(batch.kind.value, batch.to_record(), catalog)


def decode_event_batch(message: bytes, catalog: SchemaCatalog = CATALOG, *, fast: bool = True) -> EventBatch:
    """Decode a raw event batch; ``fast=False`` reads it with fastavro only (the reference)."""
    schema_id, writer = _writer_of(message, catalog, None)
    reader = catalog.latest(writer.subject)
    record = None
    if fast and writer.subject in _EVENT_SUBJECTS:
        record = decode_columns(message, _PREFIX.size, writer.parsed, reader.parsed)
    return _event_batch(message, schema_id, writer, reader, record)


def decode_event_batches(messages: Sequence[bytes], catalog: SchemaCatalog = CATALOG) -> list[EventBatch | SchemaError]:
    """``decode_event_batch`` of each message, its ``SchemaError`` in its place when it has one; the
    numbers of all the messages are decoded in one vector pass, which pays off from a few messages on."""
    out: dict[int, EventBatch | SchemaError] = {}
    found: list[tuple[int, int, SchemaEntry, SchemaEntry]] = []
    for i, message in enumerate(messages):
        try:
            schema_id, writer = _writer_of(message, catalog, None)
        except SchemaError as exc:
            out[i] = exc
            continue
        found.append((i, schema_id, writer, catalog.latest(writer.subject)))
    fast = [f for f in found if f[2].subject in _EVENT_SUBJECTS]
    records = decode_many([(messages[i], _PREFIX.size, w.parsed, r.parsed) for i, _, w, r in fast])
    decoded = {f[0]: record for f, record in zip(fast, records, strict=True)}
    for i, schema_id, writer, reader in found:
        try:
            out[i] = _event_batch(messages[i], schema_id, writer, reader, decoded.get(i))
        except SchemaError as exc:
            out[i] = exc
    return [out[i] for i in range(len(messages))]


def _event_batch(
    message: bytes, schema_id: int, writer: SchemaEntry, reader: SchemaEntry, record: dict[str, Any] | None
) -> EventBatch:
    """The batch of a decoded record (fastavro decodes it when ``record`` is None), checked."""
    if record is None:
        record = _read_record(message, schema_id, writer, reader)
    subject = writer.subject
    try:
        kind = EventKind(subject)
    except ValueError:
        raise SchemaError(f"subject {subject!r} is not a raw event batch") from None
    try:
        batch = EventBatch.from_record(kind, record)
    except (ValueError, TypeError, OverflowError) as exc:
        raise SchemaError(f"bad {subject} batch: {exc}") from exc
    n_names = len(batch.names)
    for column in ID_COLUMNS:
        ids = batch.columns.get(column)
        # a negative id reads as >= 2**31 unsigned, so one maximum checks both ends
        if ids is not None and ids.size and int(np.maximum.reduce(ids.view(np.uint32))) >= n_names:
            raise SchemaError(f"{subject} column {column} indexes outside the {n_names}-name dictionary")
    return batch
