"""Producer messages that must cost only themselves (issue 38 items 5-7): pure intake and windower, no I/O."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fleetscope.producers import SimulatorConfig, simulate
from fleetscope.schemas import (
    EventBatch,
    EventKind,
    FunctionKind,
    IntakeLimits,
    encode,
    encode_event_batch,
    parse_step_marker,
)
from fleetscope.schemas.vocabulary import OTHER_FUNCTIONS
from fleetscope.streams.analysis.capping import capped_functions
from fleetscope.streams.analysis.windowing import WindowerConfig
from fleetscope.streams.settings import MAX_FUNCTION_CHARS, MAX_FUNCTIONS
from fleetscope.streams.windower import WindowerStage

WALL = 1_767_225_600 * 10**9 + 3_600 * 10**9
"""An hour after the simulator's clock starts (2026-01-01)."""


def job_batches(iterations: int = 12, ranks: int = 2) -> list[EventBatch]:
    return list(simulate(SimulatorConfig(ranks=ranks, iterations=iterations)))


def host_batch(rank: int, names: list[str], start_ns: int, dur_ns: int, like: EventBatch) -> EventBatch:
    """A host batch keyed as ``rank`` of ``like``'s job: one span per name at ``start_ns``."""
    n = len(names)
    return EventBatch(
        kind=EventKind.HOST,
        header=replace(like.header, rank=rank, seq=like.header.seq + 10_000),
        names=names,
        columns={
            "start_ns": np.full(n, start_ns, dtype=np.int64),
            "dur_ns": np.full(n, dur_ns, dtype=np.int64),
            "name_id": np.arange(n, dtype=np.int32),
            "depth": np.zeros(n, dtype=np.int32),
        },
    )


def event_times(b: EventBatch) -> np.ndarray:
    """A batch's event times: span starts, or sample times."""
    return b["start_ns"] if "start_ns" in b.columns else b["t_ns"]


def closed_steps(
    stage: WindowerStage, batches: list[EventBatch], rank: int, now_ns: list[int] | None = None, wall_ns: int = WALL
) -> tuple[list[int], list[str]]:
    """Feed the batches as broker messages in order (at input-clock times ``now_ns``, default 0, and wall
    clock ``wall_ns``), then flush; the steps of ``rank`` that closed and every refusal's reason."""
    steps, reasons = [], []
    for b, now in zip(batches, now_ns or [0] * len(batches), strict=True):
        r = stage.take(encode_event_batch(b), now_ns=now, wall_ns=wall_ns)
        if r.reason is not None:
            reasons.append(r.reason)
        steps += [c.iteration["iteration"] for c in r.closed if c.iteration["rank"] == rank]
    for key in list(stage.windowers):
        closed, _ = stage.close_rank(key)
        steps += [c.iteration["iteration"] for c in closed if c.iteration["rank"] == rank]
    return sorted(steps), reasons


def test_a_step_marker_of_5000_digits_is_no_step_and_never_raises():
    assert parse_step_marker("ProfilerStep#" + "9" * 5000) is None
    assert parse_step_marker("ProfilerStep#" + "9" * 18) == 10**18 - 1
    assert parse_step_marker("ProfilerStep#" + "9" * 19) is None
    assert parse_step_marker("ProfilerStep#12\n") is None


def test_a_5000_digit_step_marker_costs_its_event_not_the_ranks_later_batches():
    batches = job_batches()
    healthy, _ = closed_steps(WindowerStage(), batches, rank=1)
    host = [i for i, b in enumerate(batches) if b.kind is EventKind.HOST and b.header.rank == 1]
    at = host[2]
    bad = host_batch(1, ["ProfilerStep#" + "7" * 5000], int(batches[at]["start_ns"].min()), 1_000, batches[at])
    steps, reasons = closed_steps(WindowerStage(), [*batches[:at], bad, *batches[at:]], rank=1)
    assert reasons == []
    assert steps == healthy


def test_a_marker_stamped_23_hours_ahead_is_refused_and_the_rank_keeps_every_step():
    batches = job_batches()
    healthy, _ = closed_steps(WindowerStage(), batches, rank=1)
    host = [i for i, b in enumerate(batches) if b.kind is EventKind.HOST and b.header.rank == 1]
    at = host[3]
    ahead = int(batches[at]["start_ns"].max()) + 23 * 3_600 * 10**9
    forged = [host_batch(1, [f"ProfilerStep#{900 + i}"], ahead + i * 10**9, 10**6, batches[at]) for i in range(4)]
    steps, reasons = closed_steps(WindowerStage(), [*batches[:at], *forged, *batches[at:]], rank=1)
    assert steps == healthy
    assert len(reasons) == 4
    assert all("past the rank's clock and its peers' and the wall clock" in r for r in reasons)


def test_a_real_clock_step_blinds_its_rank_only_until_it_was_quiet_for_clock_step_accept_ms():
    batches = job_batches(iterations=16)
    ten_min = 600 * 10**9
    times = {"start_ns", "t_ns", "launch_ns"}
    rank1 = [i for i, b in enumerate(batches) if b.header.rank == 1]
    cut = rank1[len(rank1) // 2]
    stepped = [
        b if b.header.rank != 1 or i < cut else replace(b, columns={k: v + ten_min if k in times and v.size else v
                                                                   for k, v in b.columns.items()})
        for i, b in enumerate(batches)
    ]  # fmt: skip
    now = [0 if i < cut or b.header.rank != 1 else 61 * 10**9 for i, b in enumerate(batches)]
    now[cut] = 0  # the first stepped batch comes at once: refused; the later ones after a minute of quiet
    live = max(int(event_times(b).max()) for b in batches if len(b)) + 10**9  # read live: the wall just past the events
    steps, reasons = closed_steps(WindowerStage(), stepped, rank=1, now_ns=now, wall_ns=live)
    assert len(reasons) == 1
    assert max(steps) == 15  # the rank's steps after the jump are windowed


def test_a_backlog_read_after_a_job_wide_pause_is_in_pace_and_a_live_jump_is_not():
    """Every rank paused ten minutes (a checkpoint): read from a backlog at once, after the fact, the batches
    after the pause lie behind the wall clock and are real; the same events read live would lie ten minutes
    in the future of the wall clock."""
    batches = job_batches(iterations=16)
    ten_min = 600 * 10**9
    times = {"start_ns", "t_ns", "launch_ns"}
    first = min(int(event_times(b).min()) for b in batches if len(b))
    middle = first + (max(int(event_times(b).max()) for b in batches if len(b)) - first) // 2
    paused = [
        replace(b, columns={k: v + ten_min if k in times and v.size else v for k, v in b.columns.items()})
        if len(b) and int(event_times(b).min()) > middle else b
        for b in batches
    ]  # fmt: skip
    healthy, _ = closed_steps(WindowerStage(), batches, rank=1)
    steps, reasons = closed_steps(WindowerStage(), paused, rank=1, wall_ns=WALL)
    assert (steps, reasons) == (healthy, [])
    _, live = closed_steps(WindowerStage(), paused, rank=1, wall_ns=middle + 10**9)
    assert live and all("a clock jump" in r for r in live)


def kernel_flood(like: EventBatch, names: int, start_ns: int, first: int = 0) -> EventBatch:
    """One kernels batch of ``like``'s rank: ``names`` distinct 100-char kernel names, 1 us each."""
    ids = np.arange(names, dtype=np.int32)
    return EventBatch(
        kind=EventKind.KERNELS,
        header=replace(like.header, seq=like.header.seq + 20_000),
        names=[f"flood_{first + i:094d}" for i in range(names)],
        columns={
            "start_ns": start_ns + ids.astype(np.int64),
            "dur_ns": np.full(names, 1_000, dtype=np.int64),
            "name_id": ids,
            "stream": np.zeros(names, dtype=np.int32),
            "launch_ns": start_ns + ids.astype(np.int64),
        },
    )


def test_20000_kernel_names_in_one_rank_iteration_make_a_pattern_message_under_the_topics_size():
    batches = job_batches(iterations=6)
    kernels = [i for i, b in enumerate(batches) if b.kind is EventKind.KERNELS and b.header.rank == 1]
    at = kernels[2]
    start = int(batches[at]["start_ns"].min())
    floods = [kernel_flood(batches[at], 5_000, start, first=i * 5_000) for i in range(4)]  # each under 1 MB
    stage = WindowerStage()
    patterns = []
    for b in [*batches[:at], *floods, *batches[at:]]:
        r = stage.take(encode_event_batch(b), 0, WALL)
        assert r.reason is None
        patterns += [c.patterns for c in r.closed if c.iteration["rank"] == 1]
    patterns += [c.patterns for c in stage.close_rank(("demo", 1))[0]]
    flooded = max(patterns, key=lambda p: len(p["function"]))
    sizes = [len(encode("patterns", p)) for p in patterns]
    assert max(sizes) <= IntakeLimits().max_message_bytes
    assert len(flooded["function"]) <= MAX_FUNCTIONS and flooded["function"][-1] == OTHER_FUNCTIONS
    assert sum(map(len, flooded["function"])) <= MAX_FUNCTION_CHARS
    other = flooded["function"].index(OTHER_FUNCTIONS)
    assert flooded["kind"][other] == FunctionKind.MEMORY  # summed, never scored
    assert int(np.sum(flooded["calls"])) >= 20_000  # every flooded call still counted


def test_a_ranks_name_table_stops_growing_at_max_names():
    batches = job_batches(iterations=6)
    kernels = [i for i, b in enumerate(batches) if b.kind is EventKind.KERNELS and b.header.rank == 1]
    at = kernels[2]
    start = int(batches[at]["start_ns"].min())
    floods = [kernel_flood(batches[at], 5_000, start, first=i * 5_000) for i in range(8)]
    stage = WindowerStage(WindowerConfig(max_names=4_096))
    for b in [*batches[:at], *floods, *batches[at:]]:
        assert stage.take(encode_event_batch(b), 0, WALL).reason is None
    names = stage.windowers[("demo", 1)]._names
    markers = sum(parse_step_marker(n) is not None for n in names)
    assert len(names) - markers <= 4_096 and OTHER_FUNCTIONS in names


def test_capped_functions_keep_the_longest_and_sum_the_rest_into_one_row():
    n = 10_000
    total = np.arange(n, dtype=np.int64)[::-1] * 10  # function i took (n - 1 - i) x 10 ns
    columns = {
        "kind": np.zeros(n, dtype=np.int64), "calls": np.ones(n, dtype=np.int64), "total_ns": total,
        "self_ns": total, "mean_ns": total.astype(np.float64), "max_ns": total, "p99_ns": total.astype(np.float64),
        "share": np.full(n, 1e-4), "nvlink_cv": np.zeros(n),
    }  # fmt: skip
    names, out = capped_functions([f"k{i}" for i in range(n)], columns, max_functions=64, max_chars=10**6)
    assert names == [*(f"k{i}" for i in range(63)), OTHER_FUNCTIONS]
    assert {len(col) for col in out.values()} == {64}
    assert int(out["total_ns"].sum()) == int(total.sum()) and int(out["calls"][-1]) == n - 63
    assert out["kind"][-1] == FunctionKind.MEMORY and out["max_ns"][-1] == total[63] and out["p99_ns"][-1] == 0
    assert np.isnan(out["nvlink_cv"][-1])
