"""Schema catalog: every schema version the pipeline has ever written, with a stable id.

A reader decodes any message whose writer schema is in the catalog, resolving it to the newest
version of the same subject (Avro schema resolution: added fields take their defaults).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from typing import Any

from fastavro import parse_schema
from fastavro.schema import expand_schema

# (schema id, subject, version, file). Ids are forever: never reuse or renumber one.
_ENTRIES: tuple[tuple[int, str, int, str], ...] = (
    (101, "kernels", 1, "kernels.v1.avsc"),
    (102, "kernels", 2, "kernels.v2.avsc"),
    (201, "collectives", 1, "collectives.v1.avsc"),
    (301, "python", 1, "python.v1.avsc"),
    (401, "throughput", 1, "throughput.v1.avsc"),
    (501, "iterations", 1, "iterations.v1.avsc"),
    (502, "iterations", 2, "iterations.v2.avsc"),
    (503, "iterations", 3, "iterations.v3.avsc"),
    (601, "patterns", 1, "patterns.v1.avsc"),
    (602, "patterns", 2, "patterns.v2.avsc"),
    (603, "patterns", 3, "patterns.v3.avsc"),
    (604, "patterns", 4, "patterns.v4.avsc"),
    (701, "findings", 1, "findings.v1.avsc"),
    (702, "findings", 2, "findings.v2.avsc"),
    (801, "control", 1, "control.v1.avsc"),
    (901, "stall", 1, "stall.v1.avsc"),
    (1001, "heartbeat", 1, "heartbeat.v1.avsc"),
    (1101, "pattern_batch", 1, "pattern_batch.v1.avsc"),
)


@dataclass(frozen=True, slots=True)
class SchemaEntry:
    schema_id: int
    subject: str
    version: int
    parsed: Any
    """fastavro-parsed schema, self-contained (named types expanded)."""

    @property
    def json(self) -> str:
        """The schema as a self-contained JSON document, e.g. for a schema registry."""
        return json.dumps(expand_schema(self.parsed))


class SchemaCatalog:
    """Schema ids <-> parsed schemas, and the newest version per subject."""

    def __init__(self, entries: tuple[tuple[int, str, int, str], ...] = _ENTRIES) -> None:
        self._raw_entries = entries

    @cached_property
    def _by_id(self) -> dict[int, SchemaEntry]:
        folder = resources.files("fleetscope.schemas").joinpath("avro")
        named: dict[str, Any] = {}
        parse_schema(json.loads(folder.joinpath("header.avsc").read_text()), named)
        out: dict[int, SchemaEntry] = {}
        for schema_id, subject, version, filename in self._raw_entries:
            doc = json.loads(folder.joinpath(filename).read_text())
            parsed = parse_schema(doc, dict(named))
            out[schema_id] = SchemaEntry(schema_id, subject, version, expand_schema(parsed))
        return out

    @cached_property
    def _latest(self) -> dict[str, SchemaEntry]:
        latest: dict[str, SchemaEntry] = {}
        for entry in self._by_id.values():
            if entry.subject not in latest or entry.version > latest[entry.subject].version:
                latest[entry.subject] = entry
        return latest

    def by_id(self, schema_id: int) -> SchemaEntry | None:
        """The schema of this id, or None when the catalog has none."""
        return self._by_id.get(schema_id)

    def latest(self, subject: str) -> SchemaEntry:
        """The newest version of the subject's schema: what writers use (``KeyError`` for an unknown one)."""
        try:
            return self._latest[subject]
        except KeyError:
            raise KeyError(f"no schema for subject {subject!r}") from None

    def subjects(self) -> list[str]:
        """Every subject, sorted."""
        return sorted(self._latest)

    def entries(self) -> list[SchemaEntry]:
        """Every schema version the catalog holds: readers accept all of them."""
        return list(self._by_id.values())


CATALOG = SchemaCatalog()
