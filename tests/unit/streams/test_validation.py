"""The plausibility rules that send a decoded batch to the dead-letter topic, one rule at a time."""

from dataclasses import replace

import numpy as np
import pytest

from fleetscope.schemas import BatchHeader, EventBatch, EventKind, IntakeLimits
from fleetscope.streams.analysis.validation import MAX_FUTURE_NS, MIN_TIMESTAMP_NS, check_batch

NOW = 1_780_000_000 * 10**9
T = NOW - 3_600 * 10**9


def header(**changes) -> BatchHeader:
    return replace(BatchHeader(job="j", rank=1, world_size=4, producer_id="p", seq=0), **changes)


def kernels(start=(T, T + 10), dur=(5, 5), launch=(), **header_changes) -> EventBatch:
    n = len(start)
    return EventBatch(
        kind=EventKind.KERNELS,
        header=header(**header_changes),
        names=["gemm"],
        columns={"start_ns": start, "dur_ns": dur, "name_id": [0] * n, "stream": [7] * n, "launch_ns": launch},
    )


def samples(t_ns) -> EventBatch:
    n = len(t_ns)
    return EventBatch(
        kind=EventKind.SAMPLES,
        header=header(),
        names=["nvlink_tx_bps"],
        columns={"t_ns": t_ns, "metric_id": [0] * n, "value": [1.0] * n},
    )


def test_a_plausible_batch_passes():
    assert check_batch(kernels(launch=(T - 1, T + 9)), NOW) is None
    assert check_batch(samples([T, NOW + MAX_FUTURE_NS]), NOW) is None
    assert check_batch(kernels(start=(), dur=()), NOW) is None  # empty: nothing to judge


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"job": ""}, "header: empty job"),
        ({"world_size": 0, "rank": 0}, "header: world size 0 < 1"),
        ({"world_size": -3, "rank": 0}, "header: world size -3 < 1"),
        ({"rank": 4}, "header: rank 4 outside world size 4"),
        ({"rank": -1}, "header: rank -1 outside world size 4"),
        ({"seq": -1}, "header: seq -1 < 0"),
    ],
)
def test_implausible_headers_are_rejected_with_a_header_reason(changes, expected):
    assert check_batch(kernels(**changes), NOW) == expected


def test_negative_durations_are_rejected():
    assert check_batch(kernels(dur=(5, -1)), NOW) == "value: negative duration -1 ns in kernels"


@pytest.mark.parametrize("column", ["start_ns", "launch_ns"])
def test_timestamps_before_2000_are_rejected(column):
    early = (MIN_TIMESTAMP_NS - 1, T)
    batch = kernels(start=early) if column == "start_ns" else kernels(launch=early)
    reason = check_batch(batch, NOW)
    assert reason is not None and reason.startswith(f"value: kernels {column}") and "before 2000-01-01" in reason


def test_timestamps_more_than_a_day_ahead_of_now_are_rejected():
    reason = check_batch(samples([T, NOW + MAX_FUTURE_NS + 1]), NOW)
    assert reason is not None and reason.startswith("value: throughput t_ns") and "1 day in the future" in reason
    assert check_batch(kernels(start=(T, NOW + 2 * MAX_FUTURE_NS)), NOW).startswith("value: kernels start_ns")


def test_an_event_ending_more_than_a_day_ahead_is_rejected_without_overflow():
    huge = np.iinfo(np.int64).max
    assert check_batch(kernels(dur=(5, huge)), NOW) == "value: a kernels event ends more than 1 day in the future"


@pytest.mark.parametrize("clock", ["trace", "", "REALTIME", "monotonic", "x" * 10_000])
def test_every_clock_label_is_checked_and_an_unknown_one_is_refused(clock):
    """A label the rules do not know would skip the timestamp bounds (rows dated 1970 or 2100 stored)."""
    for batch in (kernels(start=(0, 10), clock=clock), kernels(start=(T, T + 10), clock=clock)):
        reason = check_batch(batch, NOW)
        assert reason is not None and reason.startswith("header: unknown clock")
        assert len(reason) < 200


@pytest.mark.parametrize("start", [(0, 10), (T, 4_102_444_800 * 10**9)])  # 1970, 2100
def test_realtime_batches_dated_1970_or_2100_are_refused(start):
    assert check_batch(kernels(start=start), NOW).startswith("value: kernels start_ns")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_throughput_samples_are_refused(bad):
    batch = samples([T, T + 1])
    batch.columns["value"][1] = bad
    assert check_batch(batch, NOW) == f"value: non-finite throughput value {bad!r}"


LIMITS = IntakeLimits(max_events_per_batch=3, max_world_size=64, max_label_chars=16, max_name_chars=64)


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        (kernels(start=(T,) * 4, dur=(1,) * 4), "size: 4 events > max_events_per_batch 3"),
        (kernels(world_size=2**31 - 1), "size: world size 2147483647 > max_world_size 64"),
        (kernels(job="j" * 100_000), "size: job of 100000 chars > max_label_chars 16"),
        (kernels(host="h" * 17), "size: host of 17 chars > max_label_chars 16"),
        (kernels(cluster="c" * 17), "size: cluster of 17 chars > max_label_chars 16"),
        (kernels(producer_id="p" * 17), "size: producer_id of 17 chars > max_label_chars 16"),
        (kernels(gpu_uuid="g" * 17), "size: gpu_uuid of 17 chars > max_label_chars 16"),
        (kernels(streams=("kernels", "k" * 17)), "size: streams[1] of 17 chars > max_label_chars 16"),
    ],
)
def test_size_bounds_are_refused_with_a_size_reason(batch, expected):
    assert check_batch(batch, NOW, LIMITS) == expected
    assert check_batch(batch, NOW) is None or "job" in expected or "world" in expected


def test_long_names_are_refused():
    batch = kernels()
    batch.names[0] = "n" * 65
    assert check_batch(batch, NOW, LIMITS) == "size: a name of 65 chars > max_name_chars 64"
    batch.names[0] = "n" * 64
    assert check_batch(batch, NOW, LIMITS) is None


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_message_bytes must be >= 1024"):
        IntakeLimits(max_message_bytes=10)
