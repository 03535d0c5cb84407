"""A decoded record's fields, narrowed to the type its schema declares: records are ``Mapping[str, object]``
to whoever reads them, and a field is read as the number or list it must be, not trusted as ``Any``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import SupportsFloat, SupportsInt


def as_int(value: object) -> int:
    """A numeric field (Avro int or long, numpy integers included) as an ``int``; ``TypeError`` otherwise."""
    if isinstance(value, SupportsInt):
        return int(value)
    raise TypeError(f"expected an integer field, got {type(value).__name__}")


def as_float(value: object) -> float:
    """A numeric field (Avro double, float, int or long) as a ``float``; ``TypeError`` otherwise."""
    if isinstance(value, SupportsFloat):
        return float(value)
    raise TypeError(f"expected a numeric field, got {type(value).__name__}")


def as_float_or_none(value: object) -> float | None:
    """An optional numeric field: None stays None (a value not measured), else ``as_float``."""
    return None if value is None else as_float(value)


def as_list(value: object) -> list[object]:
    """An array field (a list, tuple or numpy array) as a list (None: empty); ``TypeError`` for a scalar,
    a string or a mapping."""
    if value is None:
        return []
    if isinstance(value, Iterable) and not isinstance(value, str | bytes | Mapping):
        return list(value)
    raise TypeError(f"expected an array field, got {type(value).__name__}")
