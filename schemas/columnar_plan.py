"""How ``columnar_decode`` reads one record: a plan compiled from a writer/reader schema pair, and the memo of
the field runs that repeat from batch to batch.

A plan is a tuple of steps (a code, the output name or None to skip, an argument) per written field, then
the reader's added fields with their defaults. Consecutive scalar and string fields that do not change with
every batch form a ``Run``: their decoded values are kept by their exact bytes, so a later message whose
bytes at that point are the same takes the kept values without decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

LONG, DOUBLE, STRING, STRINGS, VARINTS, DOUBLES, RECORD, RUN, BOOLEAN = range(9)
MEMO_CODES = frozenset({LONG, DOUBLE, STRING, STRINGS, BOOLEAN})
VOLATILE = frozenset({"seq", "sent_ns"})
RUN_ENTRIES = 512
RUN_BYTES = 4096
RUN_LENGTHS = 8
"""Kept runs per field run, the longest run kept, and the distinct run lengths tried per message."""
ARRAY_DTYPES: dict[str, type[np.generic]] = {"long": np.int64, "int": np.int32, "double": np.float64}


class Unsupported(Exception):
    """A schema (or writer/reader pair) outside the subset this decoder implements."""


@dataclass(frozen=True, slots=True)
class Plan:
    """How to read one record: (step code, output name or None to skip, argument) per written field,
    then the reader's added fields with their defaults."""

    steps: tuple[tuple[int, str | None, Any], ...]
    defaults: tuple[tuple[str, Any], ...]


class Walk(Protocol):
    """The decoder's position in one message (``columnar_decode._Message``), as a run reads it."""

    data: bytes
    pos: int
    limit: int

    def record(self, plan: Plan) -> dict[str, Any]: ...


class Run:
    """Consecutive scalar/string fields whose decoded values are kept by their bytes."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.kept: dict[bytes, tuple[tuple[str, Any], ...]] = {}
        self.lengths: tuple[int, ...] = ()
        """Byte lengths of the kept runs, most recently used first."""

    def read(self, msg: Walk, out: dict[str, Any]) -> None:
        data, pos = msg.data, msg.pos
        for length in self.lengths:
            hit = self.kept.get(data[pos : pos + length]) if pos + length <= msg.limit else None
            if hit is not None:
                msg.pos = pos + length
                for name, value in hit:
                    out[name] = list(value) if isinstance(value, list) else value
                if length != self.lengths[0]:
                    self.lengths = (length, *(n for n in self.lengths if n != length))
                return
        values = msg.record(self.plan)
        out.update(values)
        length = msg.pos - pos
        if length > RUN_BYTES:
            return
        if len(self.kept) >= RUN_ENTRIES:
            self.kept = {}
        self.kept[data[pos : msg.pos]] = tuple((k, list(v) if isinstance(v, list) else v) for k, v in values.items())
        self.lengths = (length, *(n for n in self.lengths if n != length))[:RUN_LENGTHS]


def _type_name(schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, dict) and isinstance(schema.get("type"), str) and not schema.get("logicalType"):
        return str(schema["type"])
    raise Unsupported(f"schema {schema!r}")


def _default(schema: Any, value: Any) -> Any:
    kind = _type_name(schema)
    items = _type_name(schema["items"]) if kind == "array" else ""
    try:
        if items in ARRAY_DTYPES:
            return np.array(value, dtype=ARRAY_DTYPES[items])
        if items == "string" and all(isinstance(v, str) for v in value):
            return list(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise Unsupported(f"default {value!r}") from exc
    if type(value) is {"long": int, "int": int, "string": str, "double": float, "boolean": bool}.get(kind):
        return value
    raise Unsupported(f"default {value!r} of {kind}")


def _step(writer: Any, reader: Any) -> tuple[int, Any]:
    kind = _type_name(writer)
    if kind != _type_name(reader):
        raise Unsupported(f"{kind} read as {_type_name(reader)}")
    if kind in ("long", "int"):
        return LONG, None
    if kind == "boolean":
        return BOOLEAN, None
    if kind in ("double", "string"):
        return (DOUBLE if kind == "double" else STRING), None
    if kind == "record":
        return RECORD, compile_plan(writer, reader)
    if kind == "array":
        items = _type_name(writer["items"])
        if items != _type_name(reader["items"]):
            raise Unsupported(f"array of {items} read as array of {_type_name(reader['items'])}")
        if items in ("long", "int"):
            return VARINTS, items
        if items in ("double", "string"):
            return (DOUBLES if items == "double" else STRINGS), None
    raise Unsupported(f"type {kind}")


def compile_plan(writer: Any, reader: Any) -> Plan:
    """How to read a record written with ``writer`` as ``reader`` (fastavro-parsed, expanded schemas).

    Raises ``Unsupported`` outside the subset: records, strings, ints, longs, doubles, booleans and arrays of
    strings and numbers, with reader fields added (with a default) or dropped.
    """
    if _type_name(writer) != "record" or _type_name(reader) != "record":
        raise Unsupported("not a record")
    if writer.get("name") != reader.get("name"):
        raise Unsupported(f"record {writer.get('name')} read as {reader.get('name')}")
    if any(f.get("aliases") for f in reader["fields"]):
        raise Unsupported("field aliases")
    reader_fields = {f["name"]: f for f in reader["fields"]}
    steps: list[tuple[int, str | None, Any]] = []
    run: list[tuple[int, str | None, Any]] = []
    for f in writer["fields"]:
        r = reader_fields.get(f["name"])
        code, arg = _step(f["type"], r["type"] if r else f["type"])
        if code in MEMO_CODES and f["name"] not in VOLATILE:
            run.append((code, f["name"] if r else None, arg))
            continue
        if run:
            steps.append((RUN, None, Run(Plan(tuple(run), ()))))
            run = []
        steps.append((code, f["name"] if r else None, arg))
    if run:
        steps.append((RUN, None, Run(Plan(tuple(run), ()))))
    written = {f["name"] for f in writer["fields"]}
    defaults = []
    for name, f in reader_fields.items():
        if name not in written:
            if "default" not in f:
                raise Unsupported(f"field {name} has no default")
            defaults.append((name, _default(f["type"], f["default"])))
    return Plan(tuple(steps), tuple(defaults))


_plans: dict[tuple[int, int], tuple[Any, Any, Plan | None]] = {}


def plan_for(writer: Any, reader: Any) -> Plan | None:
    """The plan of a writer/reader pair, cached; None when the pair is outside the subset."""
    hit = _plans.get((id(writer), id(reader)))
    if hit is not None and hit[0] is writer and hit[1] is reader:
        return hit[2]
    try:
        plan: Plan | None = compile_plan(writer, reader)
    except (Unsupported, KeyError, TypeError):
        plan = None
    _plans[(id(writer), id(reader))] = (writer, reader, plan)
    return plan
