"""The numpy decoder gives exactly what fastavro gives (the reference), or leaves the message to it."""

from __future__ import annotations

import io
import re
import struct
from typing import Any

import numpy as np
import pytest
from fastavro import schemaless_writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetscope.producers import SimulatorConfig, simulate
from fleetscope.schemas import (
    CATALOG,
    COLUMNS,
    BatchHeader,
    EventBatch,
    EventKind,
    SchemaError,
    decode_event_batch,
    decode_event_batches,
    encode_event_batch,
)
from fleetscope.schemas.columnar_decode import decode_columns, decode_many, plan_for
from tests.unit.schemas import mutations

EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INT64 = st.integers(-(2**63), 2**63 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
ADDRESS = re.compile(r" at 0x[0-9a-f]+")
"""fastavro's messages name the stream object they read from."""


def outcome(message: bytes, fast: bool) -> tuple[Any, ...]:
    """What decoding gives, comparable across decoders: the batch's contents (floats by their bits),
    or the error's type and text."""
    try:
        b = decode_event_batch(message, fast=fast)
    except SchemaError as exc:
        return ("error", ADDRESS.sub("", str(exc)))
    columns = {
        name: (col.dtype.str, (col.view(np.uint64) if col.dtype == np.float64 else col).tolist())
        for name, col in b.columns.items()
    }
    return ("batch", b.kind, b.header, b.names, columns)


def vouched(message: bytes) -> bool:
    """Whether the numpy decoder decoded the message itself rather than leaving it to fastavro."""
    writer = CATALOG.by_id(struct.unpack(">I", message[1:5])[0])
    return decode_columns(message, 5, writer.parsed, CATALOG.latest(writer.subject).parsed) is not None


def assert_same(message: bytes, canonical: bool = True) -> tuple[Any, ...]:
    """Both decoders end alike; a well-formed message that fastavro decodes, the numpy decoder decodes
    itself (odd encodings that fastavro tolerates, such as varints past 64 bits, it leaves to fastavro)."""
    reference = outcome(message, fast=False)
    assert outcome(message, fast=True) == reference
    if canonical and reference[0] == "batch":
        assert vouched(message)
    return reference


@st.composite
def headers(draw: st.DrawFn) -> BatchHeader:
    text = st.text(max_size=12)
    return BatchHeader(
        job=draw(text), rank=draw(INT32), world_size=draw(INT32), producer_id=draw(text), seq=draw(INT64),
        cluster=draw(text), local_rank=draw(INT32), host=draw(text), gpu_uuid=draw(text), tp_rank=draw(INT32),
        streams=tuple(draw(st.lists(text, max_size=4))), clock=draw(text), sent_ns=draw(INT64),
    )  # fmt: skip


@st.composite
def batches(draw: st.DrawFn, kind: EventKind | None = None) -> EventBatch:
    kind = kind or draw(st.sampled_from(list(EventKind)))
    names = draw(st.lists(st.text(max_size=20), min_size=1, max_size=6))
    n = draw(st.integers(0, 40))
    columns: dict[str, Any] = {}
    for name, dtype in COLUMNS[kind].items():
        if name == "launch_ns" and draw(st.booleans()):
            continue  # unknown launch times: an empty column
        if name.endswith("_id"):
            values = st.integers(0, len(names) - 1) | st.integers(-3, len(names) + 3)
        elif dtype is np.float64:
            values = st.floats(allow_nan=True, allow_infinity=True, width=64)
        elif dtype is np.int64:
            values = INT64 | st.integers(1_767_225_600 * 10**9, 1_767_225_700 * 10**9) | st.integers(-300, 300)
        else:
            values = INT32 | st.integers(-70, 70)
        columns[name] = draw(st.lists(values, min_size=n, max_size=n))
    return EventBatch(kind=kind, header=draw(headers()), names=names, columns=columns)


@EXAMPLES
@given(batches())
def test_random_batches_decode_exactly_as_with_fastavro(batch: EventBatch) -> None:
    result = assert_same(encode_event_batch(batch))
    ids_fit = all(c.size == 0 or 0 <= int(c.min()) <= int(c.max()) < len(batch.names)
                  for k, c in batch.columns.items() if k.endswith("_id"))  # fmt: skip
    assert (result[0] == "batch") == ids_fit


def test_simulated_batches_take_the_numpy_path_and_match_fastavro() -> None:
    for batch in simulate(SimulatorConfig(job="fd", ranks=2, iterations=3, tp=2)):
        assert assert_same(encode_event_batch(batch))[0] == "batch"


# -- Avro written by hand: several blocks per array, negative block counts, odd varints ------------


def varint(u: int) -> bytes:
    out = bytearray()
    while u >= 0x80:
        out.append(u & 0x7F | 0x80)
        u >>= 7
    out.append(u)
    return bytes(out)


def long(v: int) -> bytes:
    return varint(((v << 1) ^ (v >> 63)) & (2**64 - 1))


def array(body: list[bytes], blocks: list[tuple[int, bool]]) -> bytes:
    """Items in blocks of the given sizes; a block marked True is written with a negative count and its
    byte size, as the Avro spec allows."""
    out, i = bytearray(), 0
    for size, negative in blocks:
        chunk = b"".join(body[i : i + size])
        i += size
        out += long(-size) + long(len(chunk)) + chunk if negative else long(size) + chunk
    assert i == len(body)
    return bytes(out + long(0))


def header_bytes(header: BatchHeader) -> bytes:
    buf = io.BytesIO()
    header_schema = CATALOG.latest("kernels").parsed["fields"][0]["type"]
    schemaless_writer(buf, header_schema, header.to_record())
    return buf.getvalue()


def string(s: str) -> bytes:
    raw = s.encode()
    return long(len(raw)) + raw


@st.composite
def splits(draw: st.DrawFn, n: int) -> list[tuple[int, bool]]:
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(draw(st.integers(1, n - sum(sizes))))
    return [(s, draw(st.booleans())) for s in sizes]


def throughput_message(
    header: BatchHeader, names: list[str], t: list[bytes], metric: list[bytes], value: list[bytes], draw: st.DrawFn
) -> bytes:
    body = header_bytes(header)
    body += array([string(s) for s in names], draw(splits(len(names))))
    for items in (t, metric, value):
        body += array(items, draw(splits(len(items))) if items else [])
    return struct.pack(">bI", 0, CATALOG.latest("throughput").schema_id) + body


@EXAMPLES
@given(st.data())
def test_arrays_in_several_blocks_with_negative_counts_decode_as_with_fastavro(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 30))
    names = data.draw(st.lists(st.text(max_size=8), min_size=1, max_size=4))
    t = [long(v) for v in data.draw(st.lists(INT64, min_size=n, max_size=n))]
    metric = [long(v) for v in data.draw(st.lists(st.integers(0, len(names) - 1), min_size=n, max_size=n))]
    value = [struct.pack("<d", v) for v in data.draw(st.lists(st.floats(width=64), min_size=n, max_size=n))]
    message = throughput_message(data.draw(headers()), names, t, metric, value, data.draw)
    assert assert_same(message)[0] == "batch"


@pytest.mark.parametrize(
    ("t_value", "metric_value"),
    [
        (b"\x80\x00", long(0)),  # a non-canonical (padded) varint is still a varint
        (b"\xff" * 9 + b"\x01", long(0)),  # ten bytes, the largest value
        (b"\xff" * 9 + b"\x02", long(0)),  # ten bytes, beyond 64 bits
        (b"\x80" * 10 + b"\x00", long(0)),  # eleven bytes
        (long(5), long(2**31)),  # an int column value beyond int32
        (long(5), long(-(2**31) - 1)),
        (long(5), long(7)),  # an id outside the name dictionary
    ],
)
def test_odd_varints_and_out_of_range_values_end_like_fastavro(t_value: bytes, metric_value: bytes) -> None:
    header = BatchHeader(job="j", rank=0, world_size=1, producer_id="p", seq=1)
    value = [struct.pack("<d", 1.5)]
    names = ["nvlink_tx_bytes_per_s"]
    message = throughput_message(header, names, [t_value], [metric_value], value, lambda _: [(1, False)])
    assert_same(message, canonical=len(t_value) < 10 or t_value[-1] == 1)


def test_batches_of_the_old_kernel_schema_decode_as_with_fastavro() -> None:
    v1 = CATALOG.by_id(101)
    for batch in simulate(SimulatorConfig(job="v1", ranks=2, iterations=2)):
        if batch.kind is not EventKind.KERNELS:
            continue
        record = batch.to_record()
        del record["launch_ns"]
        buf = io.BytesIO()
        buf.write(struct.pack(">bI", 0, 101))
        schemaless_writer(buf, v1.parsed, record)
        result = assert_same(buf.getvalue())
        assert result[0] == "batch" and result[4]["launch_ns"] == ("<i8", [])


# -- malformed input: the same SchemaError as fastavro, never garbage --------------------------------

VALID = [encode_event_batch(b) for b in simulate(SimulatorConfig(job="fz", ranks=2, iterations=2))]


def mutated() -> st.SearchStrategy[bytes]:
    return mutations.mutated(VALID)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutated_messages_end_exactly_like_fastavro(message: bytes) -> None:
    assert_same(message, canonical=False)


def test_every_truncation_of_a_message_of_every_kind_is_a_schema_error() -> None:
    """Every cut of the smallest simulated message of each kind (every field and column of it non-empty): each
    position class of the encoding, in a tenth of the time that cutting one long throughput batch took."""
    smallest: dict[EventKind, bytes] = {}
    for batch in simulate(SimulatorConfig(job="cut", ranks=2, iterations=1, layers=1, buckets=1)):
        smallest.setdefault(batch.kind, encode_event_batch(batch))
    assert set(smallest) == set(EventKind)
    for kind, message in smallest.items():
        for cut in range(len(message)):
            with pytest.raises(SchemaError):
                decode_event_batch(message[:cut])
        assert decode_event_batch(message).kind is kind


@EXAMPLES
@given(st.lists(mutated() | st.sampled_from(VALID) | st.binary(max_size=40), min_size=1, max_size=8))
def test_decoding_many_messages_at_once_equals_one_by_one(messages: list[bytes]) -> None:
    together = decode_event_batches(messages)
    for message, got in zip(messages, together, strict=True):
        if isinstance(got, SchemaError):
            assert outcome(message, fast=False) == ("error", ADDRESS.sub("", str(got)))
        else:
            columns = {k: (v.dtype.str, v.view(np.uint64).tolist() if v.dtype == np.float64 else v.tolist())
                       for k, v in got.columns.items()}  # fmt: skip
            assert outcome(message, fast=False) == ("batch", got.kind, got.header, got.names, columns)


def test_kept_header_bytes_never_stand_for_a_different_header() -> None:
    """Two producers whose identities have the same length, interleaved, and a message cut inside its
    header: each decodes to its own header."""
    base = next(iter(simulate(SimulatorConfig(job="kept", ranks=2, iterations=1))))
    variants = [
        EventBatch(kind=base.kind, header=BatchHeader(**{**base.header.to_record(), "streams": (),
                                                         "host": host, "seq": seq}),
                   names=base.names, columns=dict(base.columns))
        for host in ("node-a", "node-b") for seq in (1, 300, 2**40)
    ]  # fmt: skip
    messages = [encode_event_batch(v) for v in variants] * 2
    for got, want in zip(decode_event_batches(messages), variants * 2, strict=True):
        assert isinstance(got, EventBatch) and got.header == want.header
    with pytest.raises(SchemaError):
        decode_event_batch(messages[0][:40])


def test_schemas_outside_the_supported_subset_are_left_to_fastavro() -> None:
    union = {"type": "record", "name": "U", "fields": [{"name": "x", "type": ["null", "long"]}]}
    assert plan_for(union, union) is None
    assert decode_many([(b"\x00\x00\x00\x00\x00\x02", 5, union, union)]) == [None]
    promoted = {"type": "record", "name": "U", "fields": [{"name": "x", "type": "double"}]}
    written = {"type": "record", "name": "U", "fields": [{"name": "x", "type": "long"}]}
    assert plan_for(written, promoted) is None
