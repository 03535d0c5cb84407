"""The records a store keeps, read from the Avro schemas: their fields, the defaults of fields added later,
and how many rows a PatternBatch explodes into. Store-neutral: the sink counts rows with it, every store's
writer builds its columns from it, so the record contract is defined once (in ``schemas/avro``)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from fleetscope.schemas import CATALOG
from fleetscope.schemas.records import PATTERN_TIMELINE_FIELDS

STORED_SUBJECTS = ("iterations", "patterns", "findings")
"""The subjects the sink stores, in the order it writes them."""


_NOT_STORED = frozenset(PATTERN_TIMELINE_FIELDS)
"""Record fields the store has no column for: a pattern record's timeline is per call, its rows per function."""


def avro_fields(subject: str) -> list[tuple[str, Any]]:
    """(name, Avro type) of the newest schema of ``subject`` that the store keeps, in schema order."""
    return [(f["name"], f["type"]) for f in CATALOG.latest(subject).parsed["fields"] if f["name"] not in _NOT_STORED]


def avro_defaults(*subjects: str) -> dict[str, Any]:
    """Defaults of fields added by later schema versions: records built before them (or by hand) lack them."""
    return {f["name"]: f["default"] for s in subjects for f in CATALOG.latest(s).parsed["fields"] if "default" in f}


def is_array(avro_type: Any) -> bool:
    return isinstance(avro_type, dict) and avro_type.get("type") == "array"


@functools.cache
def _pattern_array_names() -> tuple[str, ...]:
    return tuple(name for name, avro_type in avro_fields("patterns") if is_array(avro_type))


def pattern_rows(record: Mapping[str, Any]) -> int:
    """Rows a PatternBatch explodes into; ValueError when its column arrays differ in length (an optional one
    the record lacks, absent or empty, is zeros: ``pattern_entries``). Every record is counted once by the sink
    and once by its writer: the lengths are read in place, no column is built."""
    n = len(record["function"])
    optional = _optional_arrays()
    for name in _pattern_array_names():
        if name in optional:
            values = record.get(name)
            if values is None or not len(values):
                continue
        else:
            values = record[name]
        if len(values) != n:
            raise ValueError(f"pattern column {name!r} has {len(values)} entries, function has {n}")
    return n


@functools.cache
def _optional_arrays() -> frozenset[str]:
    """Pattern arrays added later with default ``[]``: a record from an older producer has none."""
    return frozenset(n for n, v in avro_defaults("patterns").items() if v == [] and n in _pattern_array_names())


def pattern_entries(record: Mapping[str, Any], name: str) -> Any:
    """A pattern column; an optional one the record lacks (absent or empty) is zeros."""
    values = record.get(name)
    if name in _optional_arrays() and not (values is not None and len(values)):
        return np.zeros(len(record["function"]), dtype=np.int64)
    return record[name]
