"""Pattern records through the numpy encoder and decoder: fastavro's bytes and values (the reference).

The windower writes one pattern record per rank and iteration, each with hundreds of functions, and the
differential and the sink read them; ``encode`` and ``decode`` take them with ``columnar_encode`` and
``columnar_decode`` (docs/scaling.md). What either does not vouch for is fastavro's, so both end alike on every
input: the same bytes, the same values (as numpy columns), or the same error.
"""

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

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import CATALOG, SchemaError, codec, decode, encode
from fleetscope.schemas.columnar_decode import decode_columns
from fleetscope.schemas.columnar_encode import encode_columns
from fleetscope.schemas.records import PATTERN_TIMELINE_FIELDS
from fleetscope.sinks.records import avro_fields
from fleetscope.streams.offline import OfflinePipeline
from tests.unit.schemas.mutations import mutated


@pytest.fixture(autouse=True)
def numpy_paths_at_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small records too (the codec leaves those to fastavro, which is quicker there: its own test below)."""
    monkeypatch.setattr(codec, "COLUMNS_FROM_FUNCTIONS", 0)
    monkeypatch.setattr(codec, "COLUMNS_FROM_BYTES", 0)


EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ADDRESS = re.compile(r" at 0x[0-9a-f]+")
FIELDS = CATALOG.latest("patterns").parsed["fields"]
ARRAYS = {f["name"]: f["type"]["items"] for f in FIELDS if isinstance(f["type"], dict)}


def comparable(value: Any) -> Any:
    """A decoded value as plain data: floats by their bits (NaN equals NaN), arrays and lists alike."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list):
        return [comparable(v) for v in value]
    if isinstance(value, float):
        return ("f", struct.pack("<d", value))
    return value


def outcome(message: bytes, fast: bool) -> tuple[Any, ...]:
    try:
        subject, record = decode(message, fast=fast)
    except SchemaError as exc:
        return ("error", ADDRESS.sub("", str(exc)))
    return ("record", subject, {k: comparable(v) for k, v in record.items()})


def vouched(message: bytes) -> bool:
    writer = CATALOG.by_id(struct.unpack(">I", message[1:5])[0])
    return decode_columns(message, 5, writer.parsed, CATALOG.latest(writer.subject).parsed) is not None


def simulated_patterns() -> list[dict[str, Any]]:
    pipe = OfflinePipeline(keep_patterns=True)
    pipe.add_all(
        simulate(SimulatorConfig(job="pat", ranks=4, iterations=6, tp=2, faults=(parse_fault("slow_gpu:1:1.4"),)))
    )
    pipe.finish()
    return pipe.patterns


PATTERNS = simulated_patterns()


def test_simulated_pattern_records_take_the_numpy_path_with_fastavros_values() -> None:
    assert len(PATTERNS) >= 20
    for record in PATTERNS:
        message = encode("patterns", record)
        assert vouched(message)
        assert outcome(message, fast=True) == outcome(message, fast=False)
        _, got = decode(message)
        assert all(isinstance(got[name], np.ndarray) for name in ARRAYS if name != "function")
        assert all(got[name].dtype in (np.int64, np.float64) for name in ARRAYS if name != "function")
        assert got["function"] == list(record["function"]) and isinstance(got["profiled"], bool)


NAMES = st.text(min_size=0, max_size=90) | st.sampled_from(["aten::mm", "x" * 63, "y" * 64, "ü" * 40])


@st.composite
def pattern_records(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(0, 12))
    record = {k: v for k, v in PATTERNS[0].items() if k not in ARRAYS}
    record.update(
        rank=draw(st.integers(0, 2**31 - 1)), iteration=draw(st.integers(-(2**63), 2**63 - 1)),
        profiled=draw(st.booleans()), host=draw(NAMES), function=draw(st.lists(NAMES, min_size=n, max_size=n)),
    )  # fmt: skip
    numbers = {
        "int": st.integers(-(2**31), 2**31 - 1),
        "long": st.integers(-(2**63), 2**63 - 1),
        "double": st.floats(allow_nan=True, allow_infinity=True),
    }
    for name, items in ARRAYS.items():
        if name != "function":
            record[name] = draw(st.lists(numbers[items], min_size=n, max_size=n))
    return record


@EXAMPLES
@given(pattern_records(), st.booleans())
def test_random_pattern_records_encode_and_decode_exactly_as_with_fastavro(
    record: dict[str, Any], arrays: bool
) -> None:
    if arrays:  # as the windower builds them
        record = {k: np.asarray(v) if k in ARRAYS and k != "function" else v for k, v in record.items()}
    message = encode("patterns", record)
    assert encode_columns(record, CATALOG.latest("patterns").parsed) is not None
    assert message == encode("patterns", record, fast=False)
    assert vouched(message)
    assert outcome(message, fast=True) == outcome(message, fast=False)


def written(record: dict[str, Any], fast: bool) -> tuple[str, Any]:
    try:
        return ("bytes", encode("patterns", record, fast=fast))
    except Exception as exc:  # fastavro's own errors, of many types
        return ("error", f"{type(exc).__name__}: {ADDRESS.sub('', str(exc))}")


ODD_VALUES = {
    "rank": [2**31, -(2**31) - 1, True, 1.0, np.int64(3), "1"],
    "iteration": [2**63, np.uint64(2**63), -(2**63), np.int32(-5)],
    "iteration_ns": [None],
    "profiled": [1, np.bool_(True), None],
    "host": [b"node", None, "\ud800"],
    "kind": [[2**31], np.array([-(2**31) - 1]), [True, False], [1.0], np.zeros((1, 1), np.int64), "1"],
    "total_ns": [np.array([2**63], dtype=np.uint64), [2**63], np.array([1.5]), [None], np.array([-1], np.int8)],
    "mean_ns": [[1], np.array([1], np.int64), ["1"], [True], np.array([1.0], np.float32), None],
    "function": [["a", 1], ("a",), np.array(["a"]), "a", ["\ud800"]],
}


@pytest.mark.parametrize("field", list(ODD_VALUES))
def test_odd_values_are_written_as_fastavro_writes_them_or_refused_as_it_refuses_them(field: str) -> None:
    """Each value outside the plain case: the numpy encoder writes fastavro's bytes or leaves it to fastavro,
    so a value out of its Avro range, of another type or of another shape ends as it always did."""
    base = dict(PATTERNS[0])
    n = 1 if field in ARRAYS else len(base["function"])
    if field in ARRAYS:
        base = {k: (v[:1] if k in ARRAYS else v) for k, v in base.items()}
    for value in ODD_VALUES[field]:
        record = {**base, field: value}
        assert written(record, fast=True) == written(record, fast=False), (field, value, n)
    missing = {k: v for k, v in base.items() if k != field}
    assert written(missing, fast=True) == written(missing, fast=False)


def test_a_names_block_taken_whole_by_its_bytes_is_the_same_list_and_a_copy() -> None:
    """The second record's names come from the kept block; editing what a decode returned changes no
    later decode; a message cut inside the names is an error, not a kept block."""
    message = encode("patterns", PATTERNS[0])
    _, first = decode(message)
    first["function"].append("edited")
    _, second = decode(message)
    assert second["function"] == list(PATTERNS[0]["function"])
    cut = message.index(PATTERNS[0]["function"][-1].encode()) + 1
    with pytest.raises(SchemaError):
        decode(message[:cut])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated([encode("patterns", p) for p in PATTERNS[:8]]))
def test_mutated_pattern_records_end_exactly_like_fastavro(message: bytes) -> None:
    assert outcome(message, fast=True) == outcome(message, fast=False)


def test_pattern_records_of_older_schemas_get_the_readers_defaults() -> None:
    record = dict(PATTERNS[0])
    for schema_id in (601, 602, 603):
        writer = CATALOG.by_id(schema_id)
        buf = io.BytesIO()
        buf.write(struct.pack(">bI", 0, schema_id))
        schemaless_writer(
            buf, writer.parsed, {k: list(v) if isinstance(v, np.ndarray) else v for k, v in record.items()}
        )
        message = buf.getvalue()
        assert vouched(message)
        fast = outcome(message, fast=True)
        assert fast == outcome(message, fast=False)
        assert fast[2]["cpu_wait_ns"] == -1
        assert fast[2]["sync_function"] == [] and fast[2]["sync_tail_compute_us"] == -1  # no timeline


def test_patterns_v4_adds_the_timeline_with_defaults_and_the_store_keeps_none_of_it() -> None:
    """The timeline is all patterns.v4 added, each field with a default (older records stay readable), the
    windower fills it, and the sink, whose rows are functions, has no column for a list of calls."""
    older = [f["name"] for f in CATALOG.by_id(603).parsed["fields"]]
    newest = CATALOG.latest("patterns")
    assert newest.version == 4 and [f["name"] for f in FIELDS][: len(older)] == older
    added = FIELDS[len(older) :]
    assert tuple(f["name"] for f in added) == PATTERN_TIMELINE_FIELDS and all("default" in f for f in added)
    assert all(len(p["sync_function"]) == len(p["sync_dur_us"]) > 0 for p in PATTERNS)
    assert not {name for name, _ in avro_fields("patterns")} & set(PATTERN_TIMELINE_FIELDS)


def test_records_of_few_functions_are_left_to_fastavro_and_large_ones_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()
    small = dict(PATTERNS[0], function=PATTERNS[0]["function"][: codec.COLUMNS_FROM_FUNCTIONS - 1])
    small = {k: v[: len(small["function"])] if k in ARRAYS else v for k, v in small.items()}
    message = encode("patterns", small)
    assert len(message) < codec.COLUMNS_FROM_BYTES and isinstance(decode(message)[1]["calls"], list)
    n = codec.COLUMNS_FROM_BYTES // 20
    large = {k: np.resize(np.asarray(v), n) if k in ARRAYS and k != "function" else v for k, v in small.items()}
    large["function"] = [f"kernel_{i}" for i in range(n)]
    message = encode("patterns", large)
    assert message == encode("patterns", large, fast=False) and len(message) >= codec.COLUMNS_FROM_BYTES
    assert isinstance(decode(message)[1]["calls"], np.ndarray)
    assert outcome(message, fast=True) == outcome(message, fast=False)


def head_of(message: bytes) -> tuple[Any, ...]:
    """``decode_head``'s outcome beside ``decode``'s: the head's fields, or an error."""
    try:
        writer, head = codec.decode_head(message)
    except SchemaError:
        return ("error",)
    return ("head", writer.subject, head)


@EXAMPLES
@given(pattern_records())
def test_a_pattern_records_head_is_what_decoding_it_whole_gives(record: dict[str, Any]) -> None:
    message = encode("patterns", record)
    writer, head = codec.decode_head(message)
    _, whole = decode(message)
    assert writer.subject == "patterns" and head == {name: whole[name] for name, _ in codec.PATTERN_HEAD}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated([encode("patterns", p) for p in PATTERNS[:8]]))
def test_a_damaged_message_has_no_head_or_the_one_its_whole_decoding_has(message: bytes) -> None:
    """The head is no check of the rest (that is decoded where it is scored), but it never differs from it."""
    got = head_of(message)
    whole = outcome(message, fast=False)
    if whole[0] == "record" and got[0] == "head" and got[2] is not None:
        assert got[2] == {name: whole[2][name] for name, _ in codec.PATTERN_HEAD}
    if got[0] == "error":
        assert whole[0] == "error"


def test_older_pattern_schemas_have_the_head_other_subjects_none_and_a_cut_head_is_an_error() -> None:
    for schema_id in (601, 602):
        writer = CATALOG.by_id(schema_id)
        buf = io.BytesIO()
        buf.write(struct.pack(">bI", 0, schema_id))
        schemaless_writer(
            buf, writer.parsed, {k: list(v) if isinstance(v, np.ndarray) else v for k, v in PATTERNS[0].items()}
        )
        _, whole = decode(buf.getvalue())
        assert codec.decode_head(buf.getvalue())[1] == {name: whole[name] for name, _ in codec.PATTERN_HEAD}
    stall = {"job": "j", "rank": 0, "host": "h", "world_size": 1, "last_step": 1, "last_progress_ns": 1,
                "clock_ns": 2, "stalled_ns": 1, "mean_iteration_ns": 1, "stalled": True}  # fmt: skip
    assert codec.decode_head(encode("stall", stall, fast=False))[1] is None
    message = encode("patterns", PATTERNS[0])
    for cut in (5, 8, 12, 30):
        with pytest.raises(SchemaError, match="its head"):
            codec.decode_head(message[:cut])
