"""Records of per-function columns written to Avro in bulk: the exact bytes fastavro writes, without a
Python object per value.

A pattern record holds two dozen arrays over the rank's functions (hundreds of them): fastavro turns every
value into a Python number and writes it alone, about 0.9 ms a record of 300 functions, as much as the
windowing that made it. Here every integer of the record is zigzag- and varint-encoded in one vector pass
(``_varints``: each value's 7-bit groups spread into the bytes of a word, its first bytes taken), doubles
are the array's own bytes, and a list of names is written once per process and then taken by its strings.

The encoder vouches only for what it fully understands: a schema outside its subset, a missing field, a
value of another type or out of its Avro range gives None, and the caller writes the record with fastavro,
which stays the reference and decides the error. Its output equals fastavro's byte for byte (a test).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

STRING, INT, LONG, DOUBLE, BOOLEAN, STRINGS, INTS, LONGS, DOUBLES = range(9)
_SCALARS = {"string": STRING, "int": INT, "long": LONG, "double": DOUBLE, "boolean": BOOLEAN}
_ARRAYS = {"string": STRINGS, "int": INTS, "long": LONGS, "double": DOUBLES}
_INT32 = (-(2**31), 2**31 - 1)
_DOUBLE_LE = struct.Struct("<d")
_SHIFTS = np.arange(0, 70, 7, dtype=np.uint64)
_BOUNDS = np.array([1 << s for s in range(7, 64, 7)], dtype=np.uint64)
"""A varint needs one byte more than the count of these its value reaches."""
_M28, _H28 = np.uint64(0x0FFFFFFF), np.uint64(0x00FFFFFFF0000000)
_M14, _H14 = np.uint64(0x00003FFF00003FFF), np.uint64(0x0FFFC0000FFFC000)
_M7, _H7 = np.uint64(0x007F007F007F007F), np.uint64(0x3F803F803F803F80)
_ONE, _TWO, _FOUR = np.uint64(1), np.uint64(2), np.uint64(4)
_CONTINUED = np.array([0] + [sum(0x80 << (8 * i) for i in range(n - 1)) for n in range(1, 9)], dtype=np.uint64)
"""By varint length (up to 8): the high bit of every byte but its last."""
_NAME_LISTS: dict[tuple[str, ...], bytes] = {}
_NAME_LISTS_KEPT = 100_000

Plan = tuple[tuple[str, int], ...]
_plans: dict[int, tuple[Any, Plan | None]] = {}


def plan_for(schema: Any) -> Plan | None:
    """(field, code) per field of a record schema (fastavro-parsed), cached; None outside the subset."""
    hit = _plans.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    plan: Plan | None = None
    if isinstance(schema, dict) and schema.get("type") == "record":
        steps = [(f["name"], _code(f["type"])) for f in schema["fields"]]
        plan = tuple((name, code) for name, code in steps if code is not None)
        if len(plan) < len(steps):
            plan = None
    _plans[id(schema)] = (schema, plan)
    return plan


def _code(avro_type: Any) -> int | None:
    if isinstance(avro_type, str):
        return _SCALARS.get(avro_type)
    if isinstance(avro_type, dict) and avro_type.get("type") == "array" and isinstance(avro_type.get("items"), str):
        return _ARRAYS.get(avro_type["items"])
    return None


class _Unsupported(Exception):
    """A value this encoder leaves to fastavro."""


def encode_columns(record: Mapping[str, Any], schema: Any) -> bytes | None:
    """``record`` in Avro binary (schemaless) as fastavro writes it with ``schema``; None when this encoder
    does not vouch for the result (fastavro then writes it, or says what is wrong with it)."""
    plan = plan_for(schema)
    if plan is None:
        return None
    try:
        return _encode(record, plan)
    except (_Unsupported, KeyError, TypeError, ValueError, OverflowError, UnicodeError):
        return None


def _encode(record: Mapping[str, Any], plan: Plan) -> bytes:
    parts: list[Any] = []
    integers: list[npt.NDArray[np.int64]] = []
    slots: list[int] = []
    """Where each integer array's bytes go in ``parts``: filled after one vector pass over all of them."""
    for name, code in plan:
        value = record[name]
        if code == STRING:
            if type(value) is not str:
                raise _Unsupported(name)
            raw = value.encode("utf-8")
            parts += (_varint(len(raw)), raw)
        elif code in (INT, LONG):
            parts.append(_varint(_integer(value, code == INT)))
        elif code == DOUBLE:
            if type(value) not in (float, int) and not isinstance(value, np.floating):
                raise _Unsupported(name)
            parts.append(_DOUBLE_LE.pack(float(value)))
        elif code == BOOLEAN:
            if type(value) is not bool and not isinstance(value, np.bool_):
                raise _Unsupported(name)
            parts.append(b"\x01" if value else b"\x00")
        elif code == STRINGS:
            parts.append(_names(value))
        elif code == DOUBLES:
            values = _array(value, "fi")
            parts.append(_block(values.size, values.astype("<f8").tobytes()) if values.size else b"\x00")
        else:
            values = _array(value, "iu")
            if values.size and code == INTS and (int(values.min()) < _INT32[0] or int(values.max()) > _INT32[1]):
                raise _Unsupported(name)
            if values.size and values.dtype.kind == "u" and int(values.max()) >= 2**63:
                raise _Unsupported(name)
            integers.append(values.astype(np.int64))
            slots.append(len(parts))
            parts.append(None)
    if integers:
        _fill(parts, slots, integers)
    return b"".join(parts)


def _integer(value: Any, int32: bool) -> int:
    if type(value) is not int and not isinstance(value, np.integer):
        raise _Unsupported(value)
    v = int(value)
    low, high = _INT32 if int32 else (-(2**63), 2**63 - 1)
    if not low <= v <= high:
        raise _Unsupported(value)
    return v


def _array(value: Any, kinds: str) -> npt.NDArray[Any]:
    if not isinstance(value, np.ndarray | list | tuple):
        raise _Unsupported(value)
    values = np.asarray(value)
    if values.ndim != 1 or (values.size and values.dtype.kind not in kinds):
        raise _Unsupported(value)
    return values


def _names(value: Any) -> bytes:
    if not isinstance(value, list | tuple):
        raise _Unsupported(value)
    key = tuple(value)
    kept = _NAME_LISTS.get(key)
    if kept is not None:
        return kept
    if not all(type(v) is str for v in key):
        raise _Unsupported(value)
    body = b"".join(_varint(len(raw)) + raw for raw in (v.encode("utf-8") for v in key))
    out = _block(len(key), body) if key else b"\x00"
    if len(_NAME_LISTS) >= _NAME_LISTS_KEPT:
        _NAME_LISTS.clear()
    _NAME_LISTS[key] = out
    return out


def _block(n: int, body: bytes) -> bytes:
    """An array of ``n`` items as fastavro writes it: one block, then the end."""
    return _varint(n) + body + b"\x00"


def _varint(v: int) -> bytes:
    z = (v << 1) ^ (v >> 63)
    if z < 0x80:
        return bytes((z,))
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _fill(parts: list[Any], slots: list[int], integers: list[npt.NDArray[np.int64]]) -> None:
    """Every integer array's block in one pass (``_varints``), cut back into arrays by their byte counts."""
    values = np.concatenate(integers)
    data, lengths = _varints(values) if values.size else (b"", values)
    ends = np.cumsum(lengths).tolist()
    at = 0
    for slot, array in zip(slots, integers, strict=True):
        n = array.size
        if not n:
            parts[slot] = b"\x00"
            continue
        begin = ends[at - 1] if at else 0
        parts[slot] = _block(n, data[begin : ends[at + n - 1]])
        at += n


def _varints(values: npt.NDArray[np.int64]) -> tuple[bytes, npt.NDArray[np.intp]]:
    """The zigzag varints of ``values``, end to end, and each one's length in bytes.

    Up to 8 bytes (zigzag values below 2**56, nearly all), each value's 7-bit groups are spread to the bytes of
    a word (the inverse of the decoder's packing), the high bit set on all but its last byte, and its first
    ``length`` bytes taken; longer ones, each value's 10 possible bytes as a row, those past its end dropped."""
    z = ((values << 1) ^ (values >> 63)).view(np.uint64)
    lengths = np.searchsorted(_BOUNDS, z, side="right") + 1
    if int(lengths.max()) <= 8:
        w = (z & _M28) | ((z & _H28) << _FOUR)
        w = (w & _M14) | ((w & _H14) << _TWO)
        w = (w & _M7) | ((w & _H7) << _ONE)
        w |= _CONTINUED[lengths]
        ends = np.cumsum(lengths)
        first = np.arange(0, 8 * lengths.size, 8) - (ends - lengths)
        return w.view(np.uint8)[np.arange(int(ends[-1])) + np.repeat(first, lengths)].tobytes(), lengths
    rows = ((z[:, None] >> _SHIFTS[None, :]) & np.uint64(0x7F)).astype(np.uint8)
    column = np.arange(10)[None, :]
    rows[column < (lengths - 1)[:, None]] |= 0x80
    return rows[column < lengths[:, None]].tobytes(), lengths
