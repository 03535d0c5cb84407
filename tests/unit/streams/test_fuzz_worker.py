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
from fleetscope.schemas.limits import CLOCKS, IntakeLimits
from fleetscope.streams.analysis.validation import MAX_FUTURE_NS, MIN_TIMESTAMP_NS, batch_reach_ns, check_batch
from fleetscope.streams.analysis.windowing import RankWindower, WindowerConfig
from fleetscope.streams.intake import intake

WALL_NS = 1_767_225_600_000_000_000 + 30 * 86_400 * 10**9  # a month after the simulator's default start
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONFIG = WindowerConfig(idle_close_ms=1000, stream_discovery_ms=0, max_open_steps=4)
PREFIXES = ("schema: ", "header: ", "value: ", "size: ")
DEFAULT_LIMITS = IntakeLimits()
TIGHT = IntakeLimits(
    max_message_bytes=2048, max_events_per_batch=8, max_world_size=3, max_label_chars=16, max_name_chars=64
)


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
    names = draw(st.lists(st.one_of(st.text(max_size=12), st.text(min_size=60, max_size=70),
                                    st.from_regex(r"ProfilerStep#[0-9]{1,25}", fullmatch=True),
                                    st.sampled_from(["optimizer.step", "dataloader.next", "ncclKernel_AllReduce"])),
                          min_size=1, max_size=5))  # fmt: skip
    n = draw(st.integers(0, 12))
    plausible = draw(st.booleans())  # half pass validation, so the windower itself gets fuzzed
    label = st.sampled_from(["fz", "other"])
    if not plausible:
        label = st.one_of(st.sampled_from(["fz", ""]), st.text(max_size=20))
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
    world = draw(st.integers(1, 3) if plausible else st.one_of(st.integers(-1, 4), st.just(2**31 - 1)))
    header = BatchHeader(
        job=draw(label), host=draw(label),
        rank=draw(st.integers(0, world - 1) if plausible else st.integers(-2, 5)),
        world_size=world, producer_id=draw(st.sampled_from(["p", "q"])),
        seq=draw(st.integers(0, 10) if plausible else st.integers(-2, 10)),
        streams=tuple(draw(st.lists(st.sampled_from([k.value for k in EventKind]), max_size=4))),
        clock="realtime" if plausible else draw(st.sampled_from(["realtime", "trace", "", "x" * 300])),
    )  # fmt: skip
    return encode_event_batch(EventBatch(kind=kind, header=header, names=names, columns=columns))


ANY_MESSAGE = st.one_of(st.binary(max_size=256), mutated(), implausible_batch(), st.sampled_from(valid_messages()))


def expected_reason(message: bytes, limits: IntakeLimits = DEFAULT_LIMITS) -> str | None:
    if len(message) > limits.max_message_bytes:
        return "size: too large"
    try:
        return check_batch(decode_event_batch(message), WALL_NS, limits)
    except SchemaError as exc:
        return f"schema: {exc}"


def within_bounds(message: bytes, limits: IntakeLimits) -> bool:
    """The bounds restated apart from ``check_batch``: what the intake accepts must satisfy them."""
    batch = decode_event_batch(message)
    h = batch.header
    labels = [h.job, h.host, h.cluster, h.producer_id, h.gpu_uuid, *h.streams]
    times = [batch.columns[c] for c in ("start_ns", "launch_ns", "t_ns") if c in batch.columns]
    return (
        len(message) <= limits.max_message_bytes
        and h.clock in CLOCKS
        and 1 <= h.world_size <= limits.max_world_size
        and len(batch) <= limits.max_events_per_batch
        and all(len(text) <= limits.max_label_chars for text in labels)
        and all(len(name) <= limits.max_name_chars for name in batch.names)
        and all(np.isfinite(batch.columns.get("value", np.zeros(0))))
        and all(int(t.min()) >= MIN_TIMESTAMP_NS and int(t.max()) <= WALL_NS + MAX_FUTURE_NS for t in times if t.size)
    )


def clock_jump(message: bytes, windowers: dict[tuple[str, int], RankWindower]) -> int:
    """How far a plausible message reaches past its rank's clock and every peer's, and past the wall clock
    (0: no clock yet)."""
    batch = decode_event_batch(message)
    own = windowers.get((batch.header.job, batch.header.rank))
    reach = batch_reach_ns(batch)
    if own is None or own.clock_ns is None or reach is None:
        return 0
    clocks = [w.clock_ns for (job, _), w in windowers.items() if job == batch.header.job and w.clock_ns is not None]
    return min(reach - max(clocks), reach - WALL_NS)


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
        expected = expected_reason(message)
        jump = clock_jump(message, windowers) if expected is None else 0
        result = intake(message, windowers, i * 10**9, CONFIG, wall_ns=WALL_NS)
        floor = DEFAULT_LIMITS.max_clock_jump_ms * 10**6
        if expected is None and jump > floor + len(messages) * 10**9:  # beyond the floor plus any quiet here
            assert result.reason is not None and "a clock jump" in result.reason
        elif expected is None and jump > floor:
            assert result.reason is None or "a clock jump" in result.reason
        elif expected is None:
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
        w.take_stalls()


@FUZZ
@given(st.lists(st.one_of(implausible_batch(), mutated(), st.sampled_from(valid_messages())), min_size=1, max_size=8))
def test_what_the_intake_accepts_is_within_every_bound(messages: list[bytes]) -> None:
    """Tight limits: an accepted message satisfies every bound (clock, finite values, dates, sizes); a refused
    one names the rule it broke."""
    windowers: dict[tuple[str, int], RankWindower] = {}
    for i, message in enumerate(messages):
        result = intake(message, windowers, i * 10**9, CONFIG, wall_ns=WALL_NS, limits=TIGHT)
        if result.reason is None:
            assert within_bounds(message, TIGHT)
        else:
            assert result.reason.startswith(PREFIXES) and result.closed == [] and len(result.reason) <= 500
            assert (expected_reason(message, TIGHT) or "").split(":")[0] == result.reason.split(":")[0]


def test_an_oversized_message_is_refused_before_it_is_decoded() -> None:
    big = valid_messages()[0] + bytes(2048)  # would also fail to decode: the size rule answers first
    result = intake(big, {}, 0, CONFIG, wall_ns=WALL_NS, limits=TIGHT)
    assert result.reason == f"size: message of {len(big)} bytes > max_message_bytes 2048"


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
