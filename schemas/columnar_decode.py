"""Column-oriented Avro batches decoded straight into numpy columns, without a Python object per value.

fastavro builds a Python int or float for every value and numpy then copies the lists again: for a
batch of a thousand events that is most of the decode cost. Our raw batches are records of arrays of
numbers, so this decoder walks each record once with scalar reads (the header, block counts, strings)
and decodes the numbers in bulk afterwards:

1. The walk notes where each array block of longs/ints starts and how many values it holds. A varint
   ends at a byte < 0x80; the positions of the buffer's bytes < 0x80 (one ``nonzero``), and how many
   of them come before the block (``bytes.translate`` counts those since the last block), give where
   the block ends without decoding it. Doubles are taken with ``np.frombuffer``. Arrays written in
   several blocks (a negative count carries a byte size, which is skipped) are consecutive values.
2. Every varint at once: each one's first 8 bytes are read as a little-endian word (an unaligned view
   with a one-byte stride over the zero-padded buffer), bytes past its end are masked off, and the
   7-bit groups are packed in three steps, each adding a multiple of the lower group of every pair
   (SWAR); bytes 9 and 10 of long varints are added on top, and zigzag decoding is one vector step.
   ``decode_many`` puts several messages in one buffer, so a whole take of messages is one pass.
3. Runs of scalar and string fields (the header's identity, the name dictionary) repeat in every
   batch of a producer, so their decoded values are kept by their exact bytes: a later message whose
   bytes at that point equal a kept run's decodes to the same values and takes the same bytes. Fields
   that change with every batch (``seq``, ``sent_ns``) end a run and are always decoded.
4. Schema resolution covers what the catalog uses: fields the reader added (taken from their
   defaults) and fields it dropped (skipped). Types must otherwise match.

The decoder vouches only for input it fully understands: a schema outside that subset, and any
malformed, truncated, over-long or out-of-range input, gives None, and the caller decodes the message
with fastavro, which stays the reference and decides the error.
"""

from __future__ import annotations

import itertools
import struct
from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas.columnar_plan import (
    BOOLEAN,
    DOUBLE,
    DOUBLES,
    LONG,
    RUN,
    STRING,
    STRINGS,
    VARINTS,
    Plan,
    plan_for,
)

_HIGH_BYTES = bytes(range(0x80, 0x100))
_PAD = bytes(16)
_LOW_MASKS = np.array([0] + [(1 << (8 * k)) - 1 for k in range(1, 8)] + [2**64 - 1] * 3, dtype=np.uint64)
"""By varint length: its bytes among the first 8."""
_HIGH_MASKS = np.array([0] * 9 + [0xFF, 0xFFFF], dtype=np.uint64)
"""By varint length: its bytes 9 and 10."""


def _u64(value: int) -> npt.NDArray[np.uint64]:
    return np.array(value, dtype=np.uint64)  # 0-d arrays: cheaper in ufuncs than numpy scalars


_ONE, _SEVEN, _THREE, _FIFTEEN, _SHIFT56 = (_u64(v) for v in (1, 7, 3, 15, 56))
_B7F, _B80, _B7F7F = _u64(0x7F), _u64(0x80), _u64(0x7F7F7F7F7F7F7F7F)
_LANE16, _LANE32, _LANE64 = _u64(0x007F007F007F007F), _u64(0x0000FFFF0000FFFF), _u64(0x00000000FFFFFFFF)
_DOUBLE_LE = struct.Struct("<d")
_NAMES: dict[bytes, str] = {}
_NAMES_KEPT = 100_000
"""Strings of arrays of strings by their bytes (function names), up to this many: each decoded once."""
_BLOCKS: dict[bytes, list[str]] = {}
_BLOCKS_KEPT_BYTES = 64 << 20
_blocks_bytes = 0
"""Whole blocks of names by their bytes (a rank's function list), up to this many bytes (and ``_NAMES_KEPT``
blocks) kept in all; then they start afresh."""


def _keep_block(block: bytes, names: list[str]) -> None:
    global _blocks_bytes
    if _blocks_bytes + len(block) > _BLOCKS_KEPT_BYTES or len(_BLOCKS) >= _NAMES_KEPT:
        _BLOCKS.clear()
        _blocks_bytes = 0
    _BLOCKS[block] = names
    _blocks_bytes += len(block)


class _Malformed(Exception):
    """Input this decoder will not vouch for."""


_NO_STOPS = np.zeros(0, dtype=np.intp)


class _Message:
    """One message being decoded: the scalar walk's position and the varints it left for the bulk step."""

    __slots__ = ("data", "pos", "limit", "stops", "counted_pos", "counted_stops", "runs", "run_open", "pending")

    def __init__(self, data: bytes, pos: int, limit: int, stops: npt.NDArray[np.intp], stops_before: int) -> None:
        self.data = data
        """The buffer that holds the message at ``pos:limit`` (several messages share one buffer)."""
        self.pos = pos
        self.limit = limit
        self.stops = stops
        """Positions of the buffer's bytes < 0x80: the end bytes of varints, among others."""
        self.counted_pos = pos
        self.counted_stops = stops_before
        """How many of ``stops`` come before ``counted_pos``."""
        self.runs: list[list[int]] = []
        """[first, end) indices into ``stops`` of the end bytes of consecutive varints (blocks and the
        counts between them); the end byte before ``first`` is the one of the first block's count."""
        self.run_open = False
        self.pending: list[tuple[dict[str, Any], str, str, list[tuple[int, int]]]] = []
        """(record, field, avro type, blocks as (index in ``stops`` of the first value's end byte, values))."""

    def long(self) -> int:
        data, pos = self.data, self.pos
        b = data[pos]
        n = b & 0x7F
        shift = 7
        while b & 0x80:
            pos += 1
            if shift > 63:
                raise _Malformed("varint longer than 10 bytes")
            b = data[pos]
            n |= (b & 0x7F) << shift
            shift += 7
        if n >> 64:
            raise _Malformed("varint beyond 64 bits")
        self.pos = pos + 1
        return (n >> 1) ^ -(n & 1)

    def raw(self, size: int) -> bytes:
        end = self.pos + size
        if size < 0 or end > self.limit:
            raise _Malformed("length past the end")
        out = self.data[self.pos : end]
        self.pos = end
        self.run_open = False
        return out

    def string(self) -> str:
        return self.raw(self.long()).decode("utf-8")

    def strings(self, n: int, out: list[str]) -> None:
        """Append the next ``n`` strings. A pattern record lists hundreds of function names, mostly the same
        list as the rank's last record: a block of names under 64 bytes each (one-byte lengths) is found by
        its lengths alone and taken whole from the blocks seen before by its bytes; other names are each
        decoded once per process."""
        data, limit = self.data, self.limit
        pos = end = self.pos
        for _ in range(n):
            b = data[end] if end < limit else 0x80
            if b >= 0x80 or b & 1:
                break
            end += 1 + (b >> 1)
        else:
            if end <= limit:
                block = data[pos:end]
                names = _BLOCKS.get(block)
                if names is None:
                    names = self._names(n, pos)
                    _keep_block(block, names)
                out += names
                self.pos = end
                self.run_open = False
                return
        out += self._names(n, pos)
        self.run_open = False

    def _names(self, n: int, pos: int) -> list[str]:
        data, limit, known = self.data, self.limit, _NAMES
        out: list[str] = []
        for _ in range(n):
            b = data[pos]
            if b < 0x80 and not b & 1:
                pos += 1
                end = pos + (b >> 1)
            else:
                self.pos = pos
                size = self.long()
                pos = self.pos
                end = pos + size
                if size < 0:
                    raise _Malformed("negative string length")
            if end > limit:
                raise _Malformed("length past the end")
            raw = data[pos:end]
            name = known.get(raw)
            if name is None:
                name = raw.decode("utf-8")
                if len(known) < _NAMES_KEPT:
                    known[raw] = name
            out.append(name)
            pos = end
        self.pos = pos
        return out

    def count(self, item_bytes: int) -> int:
        """Items in the next array block (0: the array ended)."""
        n = self.long()
        if n < 0:
            n = -n
            self.long()
        if n * item_bytes > self.limit - self.pos:
            raise _Malformed("block count past the end")
        return n

    def varint_block(self, n: int) -> tuple[int, int]:
        k = self.counted_stops + len(self.data[self.counted_pos : self.pos].translate(None, _HIGH_BYTES))
        if k + n > self.stops.size or self.stops[k + n - 1] >= self.limit:
            raise _Malformed("varint block past the end")
        if self.run_open:
            self.runs[-1][1] = k + n
        else:
            self.runs.append([k, k + n])
            self.run_open = True
        self.pos = self.counted_pos = int(self.stops[k + n - 1]) + 1
        self.counted_stops = k + n
        return k, n

    def record(self, plan: Plan) -> dict[str, Any]:
        data = self.data
        out: dict[str, Any] = {}
        value: Any = None
        for code, name, arg in plan.steps:
            if code == LONG:
                b = data[self.pos]
                if b < 0x80:
                    self.pos += 1
                    value = (b >> 1) ^ -(b & 1)
                else:
                    value = self.long()
            elif code == STRING:
                value = self.string()
            elif code == VARINTS:
                blocks = []
                while n := self.count(1):
                    blocks.append(self.varint_block(n))
                if name is not None:
                    self.pending.append((out, name, arg, blocks))
                continue
            elif code == RUN:
                arg.read(self, out)
                self.run_open = False
                continue
            elif code == DOUBLES:
                parts = []
                while n := self.count(8):
                    parts.append(np.frombuffer(self.raw(8 * n), dtype="<f8").astype(np.float64))
                value = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0)
            elif code == STRINGS:
                value = []
                while n := self.count(1):
                    self.strings(n, value)
            elif code == DOUBLE:
                value = _DOUBLE_LE.unpack(self.raw(8))[0]
            elif code == BOOLEAN:
                b = self.raw(1)[0]
                if b > 1:
                    raise _Malformed("boolean byte not 0 or 1")
                value = b == 1
            else:
                value = self.record(arg)
            if name is not None:
                out[name] = value
        for name, default in plan.defaults:
            out[name] = default.copy() if isinstance(default, np.ndarray | list) else default
        return out


def _finish(msgs: list[_Message]) -> list[bool]:
    """Decode every varint the walks noted (all messages of one buffer) in one vector pass and put the
    arrays into their records; per message, whether it went well (an int out of range fails it alone).
    Raises ``_Malformed`` when some varint is too long, without telling whose."""
    runs = [run for m in msgs for run in m.runs]
    if not runs:  # every varint array is empty
        for m in msgs:
            for record, name, avro_type, _ in m.pending:
                record[name] = np.zeros(0, dtype=np.int64 if avro_type == "long" else np.int32)
        return [True] * len(msgs)
    stops = msgs[0].stops
    if len(runs) == 1:
        first, end = runs[0]
        prev, ends = stops[first - 1 : end - 1], stops[first:end]
    else:
        prev = np.concatenate([stops[a - 1 : b - 1] for a, b in runs])
        ends = np.concatenate([stops[a:b] for a, b in runs])
    lens = ends - prev
    widest = int(np.maximum.reduce(lens))
    if widest > 10:
        raise _Malformed("varint longer than 10 bytes")
    begins = prev + 1
    data = msgs[0].data
    words = np.ndarray(shape=(len(data) + 8,), dtype="<u8", buffer=data + _PAD, strides=(1,))
    raw = _swar_pack(words[begins] & _LOW_MASKS[lens])
    if widest > 8:
        high = words[begins + 8] & _HIGH_MASKS[lens]
        if int(np.maximum.reduce(high)) >= 0x200:
            raise _Malformed("varint beyond 64 bits")
        raw |= ((high & _B7F) | ((high >> _ONE) & _B80)) << _SHIFT56
    values = ((raw >> _ONE) ^ -(raw & _ONE)).view(np.int64)
    run_starts = [a for a, _ in runs]
    run_bases = list(itertools.accumulate((b - a for a, b in runs), initial=0))
    alone = len(msgs) == 1
    ok = []
    for m in msgs:
        fine = True
        for record, name, avro_type, blocks in m.pending:
            spans = []
            for k, n in blocks:
                r = bisect_right(run_starts, k) - 1
                spans.append((run_bases[r] + k - run_starts[r], n))
            if avro_type == "long":  # a copy when several messages share the array: each batch owns its columns
                record[name] = _join(values, spans) if alone else _join(values, spans).copy()
            elif not spans or int(np.maximum.reduce(_join(raw, spans))) < 2**32:  # zigzag: int32 <=> < 2**32
                record[name] = _join(values, spans).astype(np.int32)
            else:
                fine = False
        ok.append(fine)
    return ok


def _join(values: npt.NDArray[Any], spans: list[tuple[int, int]]) -> npt.NDArray[Any]:
    if len(spans) == 1:
        return values[spans[0][0] : spans[0][0] + spans[0][1]]
    return np.concatenate([values[at : at + n] for at, n in spans]) if spans else values[:0]


def _swar_pack(w: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Pack the 7 low bits of the 8 bytes of little-endian words into 56 contiguous bits.

    Each step merges neighbouring groups by adding a multiple of the lower one, which moves it up to
    meet the higher one without a carry: the groups end up shifted left by 7, undone at the end."""
    w = w & _B7F7F
    w = w + (w & _LANE16)
    w = w + (w & _LANE32) * _THREE
    w = w + (w & _LANE64) * _FIFTEEN
    return w >> _SEVEN


def decode_scalars(message: bytes, offset: int, fields: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """The leading ``fields`` (name, ``"string"``, ``"int"`` or ``"long"``) of the record at ``offset``, by the
    scalar walk alone; ``ValueError`` where the message ends inside them or they are malformed."""
    msg = _Message(message, offset, len(message), _NO_STOPS, 0)
    try:
        return {name: msg.string() if kind == "string" else msg.long() for name, kind in fields}
    except (_Malformed, IndexError, UnicodeDecodeError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from exc


def decode_columns(message: bytes, offset: int, writer: Any, reader: Any) -> dict[str, Any] | None:
    """The record at ``message[offset:]`` (it must end the message), numeric arrays as numpy columns
    (long: int64, int: int32, double: float64); None when this decoder does not vouch for the result."""
    return decode_many([(message, offset, writer, reader)])[0]


def decode_many(items: Sequence[tuple[bytes, int, Any, Any]]) -> list[dict[str, Any] | None]:
    """``decode_columns`` of several (message, offset, writer, reader) at once: the messages share one
    buffer, so finding the varints' end bytes and decoding them are one vector pass for all of them."""
    out: list[dict[str, Any] | None] = [None] * len(items)
    try:
        todo = [(i, plan) for i, (_, _, w, r) in enumerate(items) if (plan := plan_for(w, r)) is not None]
        if not todo:
            return out
        data = b"".join(items[i][0] for i, _ in todo)
        stops = (np.frombuffer(data, dtype=np.uint8) < 0x80).nonzero()[0]
        walked: list[tuple[int, _Message, dict[str, Any]]] = []
        start = low = 0
        for i, plan in todo:
            message, offset = items[i][0], items[i][1]
            head = message[:offset]
            msg = _Message(
                data, start + offset, start + len(message), stops, low + len(head.translate(None, _HIGH_BYTES))
            )
            record = _walk(msg, plan)
            if record is not None:
                walked.append((i, msg, record))
            start += len(message)
            if start < len(data):
                low += len(message.translate(None, _HIGH_BYTES))
        try:
            fine = _finish([m for _, m, _ in walked])
        except _Malformed:  # some message holds a bad varint: decode them one by one to find it
            fine = [_finish_alone(m) for _, m, _ in walked]
        for (i, _, record), good in zip(walked, fine, strict=True):
            if good:
                out[i] = record
    except Exception:  # the reference decoder is always right; this one must never turn input into a crash
        return [None] * len(items)
    return out


def _walk(msg: _Message, plan: Plan) -> dict[str, Any] | None:
    """The message's record with its varint arrays still pending; None if it does not parse to its end."""
    try:
        record = msg.record(plan)
    except Exception:  # this message only: the reference decoder will tell what is wrong with it
        return None
    return record if msg.pos == msg.limit else None


def _finish_alone(msg: _Message) -> bool:
    try:
        return _finish([msg])[0]
    except _Malformed:
        return False
