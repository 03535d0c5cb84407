"""Fuzzing the raw intake: random, mutated and implausible messages never crash the decoder or the
windower step; every message that is not a plausible batch gets a dead-letter reason."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetscope.producers import SimulatorConfig, simulate
from fleetscope.schemas import (
    COLUMNS,
    BatchHeader,
    EventBatch,
    EventKind,
    SchemaError,
    decode_event_batch,
    encode,
    encode_event_batch,
)
from fleetscope.streams.analysis.validation import check_batch
from fleetscope.streams.analysis.windowing import RankWindower, WindowerConfig
from fleetscope.streams.intake import intake

WALL_NS = 1_767_225_600_000_000_000 + 30 * 86_400 * 10**9  # a month after the simulator's default start
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONFIG = WindowerConfig(idle_close_ms=1000, stream_discovery_ms=0, max_open_steps=4)
PREFIXES = ("schema: ", "header: ", "value: ")


@functools.cache
def valid_messages() -> tuple[bytes, ...]:
    return tuple(encode_event_batch(b) for b in simulate(SimulatorConfig(job="fz", ranks=2, iterations=3)))


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid message with bits flipped, bytes overwritten, cut short or extended."""
    data = bytearray(draw(st.sampled_from(valid_messages())))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "byte", "truncate", "extend", "splice"]))
        if op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        elif op == "truncate":
            del data[draw(st.integers(0, len(data))) :]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=64))
        elif op == "splice" and data:
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


_LONG = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.integers(WALL_NS - 10**12, WALL_NS + 10**12),
    st.integers(-5, 10**10),
)
_INT = st.integers(-(2**31), 2**31 - 1)


@st.composite
def implausible_batch(draw: st.DrawFn) -> bytes:
    """A well-formed message carrying arbitrary header values and columns (names included)."""
    kind = draw(st.sampled_from(list(EventKind)))
    names = draw(st.lists(st.one_of(st.text(max_size=12), st.from_regex(r"ProfilerStep#[0-9]{1,25}", fullmatch=True),
                                    st.sampled_from(["optimizer.step", "dataloader.next", "ncclKernel_AllReduce"])),
                          min_size=1, max_size=5))  # fmt: skip
    n = draw(st.integers(0, 12))
    plausible = draw(st.booleans())  # half pass validation, so the windower itself gets fuzzed
    longs = st.integers(WALL_NS - 10**12, WALL_NS - 10**12 + 10**10) if plausible else _LONG
    columns = {}
    for name, dtype in COLUMNS[kind].items():
        if name.endswith("_id"):
            values = draw(st.lists(st.integers(0, len(names) - 1), min_size=n, max_size=n))
        elif dtype is np.float64:
            values = draw(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=n, max_size=n))
        elif name == "dur_ns" and plausible:
            values = draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n))
        elif dtype is np.int64:
            values = draw(st.lists(st.one_of(longs, _LONG) if name in ("seq", "nbytes") else longs,
                                   min_size=n, max_size=n))  # fmt: skip
        else:
            values = draw(st.lists(_INT, min_size=n, max_size=n))
        columns[name] = values
    world = draw(st.integers(1, 3) if plausible else st.integers(-1, 4))
    header = BatchHeader(
        job=draw(st.sampled_from(["fz", "other"] if plausible else ["fz", ""])),
        rank=draw(st.integers(0, world - 1) if plausible else st.integers(-2, 5)),
        world_size=world, producer_id=draw(st.sampled_from(["p", "q"])),
        seq=draw(st.integers(0, 10) if plausible else st.integers(-2, 10)),
        streams=tuple(draw(st.lists(st.sampled_from([k.value for k in EventKind]), max_size=4))),
        clock=draw(st.sampled_from(["realtime", "trace"])),
    )  # fmt: skip
    return encode_event_batch(EventBatch(kind=kind, header=header, names=names, columns=columns))


ANY_MESSAGE = st.one_of(st.binary(max_size=256), mutated(), implausible_batch(), st.sampled_from(valid_messages()))


def expected_reason(message: bytes) -> str | None:
    try:
        return check_batch(decode_event_batch(message), WALL_NS)
    except SchemaError as exc:
        return f"schema: {exc}"


@FUZZ
@given(st.one_of(st.binary(max_size=512), mutated()))
def test_the_decoder_returns_a_batch_or_raises_schema_error_only(message: bytes) -> None:
    try:
        batch = decode_event_batch(message)
    except SchemaError:
        return
    assert isinstance(batch, EventBatch)


@FUZZ
@given(st.lists(ANY_MESSAGE, min_size=1, max_size=12))
def test_the_worker_step_never_raises_and_gives_every_bad_message_a_reason(messages: list[bytes]) -> None:
    windowers: dict[tuple[str, int], RankWindower] = {}
    for i, message in enumerate(messages):
        result = intake(message, windowers, i * 10**9, CONFIG, wall_ns=WALL_NS)
        expected = expected_reason(message)
        if expected is None:
            assert result.reason is None, result.reason  # plausible input never trips the windower
        else:
            assert result.reason and result.reason.startswith(PREFIXES) and result.closed == []
        for c in result.closed:  # whatever closes can be sent on
            encode("iterations", c.iteration)
            encode("patterns", c.patterns)
    for w in windowers.values():
        for c in w.poll(10**15) + w.flush():
            encode("iterations", c.iteration)
            encode("patterns", c.patterns)
        w.take_progress()


def test_valid_messages_close_iterations_through_the_worker_step() -> None:
    windowers: dict[tuple[str, int], RankWindower] = {}
    closed = []
    for message in valid_messages():
        result = intake(message, windowers, 0, CONFIG, wall_ns=WALL_NS)
        assert result.reason is None and result.events > 0
        closed += result.closed
    closed += [c for w in windowers.values() for c in w.flush()]
    assert sorted((c.iteration["rank"], c.iteration["iteration"]) for c in closed) == [
        (r, i) for r in range(2) for i in range(3)
    ]


def test_a_windower_failure_becomes_a_dead_letter_reason(monkeypatch) -> None:
    def broken(self, batch, now_ns):
        raise ZeroDivisionError("boom\nsecond line")

    monkeypatch.setattr(RankWindower, "add", broken)
    result = intake(valid_messages()[0], {}, 0, CONFIG, wall_ns=WALL_NS)
    assert result.reason == "windower: boom second line" and result.closed == []


def test_a_message_without_a_value_is_dead_lettered() -> None:
    assert intake(None, {}, 0, CONFIG, wall_ns=WALL_NS).reason.startswith("schema: ")
    h = decode_event_batch(valid_messages()[0])
    bad = encode_event_batch(replace(h, header=replace(h.header, rank=9)))
    assert intake(bad, {}, 0, CONFIG, wall_ns=WALL_NS).reason == "header: rank 9 outside world size 2"
