"""Iteration windowing when a rank's streams arrive out of step (separate topics, separate lag)."""

from dataclasses import replace

from fleetscope.producers import SimulatorConfig, simulate
from fleetscope.schemas import EventKind, FunctionKind
from fleetscope.streams.analysis.windowing import RankWindower, WindowerConfig


def rank0_batches(iterations: int = 8):
    return [b for b in simulate(SimulatorConfig(ranks=4, iterations=iterations)) if b.header.rank == 0]


def collectives_per_iteration(closed):
    return {c.iteration["iteration"]: sum(k == FunctionKind.COLLECTIVE for k in c.patterns["kind"]) for c in closed}


def test_a_lagging_declared_stream_holds_steps_open_until_it_arrives():
    batches = rank0_batches()
    order = [EventKind.KERNELS, EventKind.PYTHON, EventKind.THROUGHPUT, EventKind.COLLECTIVES]
    w = RankWindower()
    closed = []
    for i, kind in enumerate(order):  # a whole topic at a time, seconds apart
        for b in (b for b in batches if b.kind is kind):
            closed += w.add(b, now_ns=i * 10**10)
    closed += w.flush()
    assert w.counters.late_events == 0
    assert collectives_per_iteration(closed) == {i: 2 for i in range(8)}


def test_undeclared_streams_are_waited_for_only_during_discovery():
    batches = [replace(b, header=replace(b.header, streams=())) for b in rank0_batches(4)]
    early = [b for b in batches if b.kind is not EventKind.COLLECTIVES]
    late = [b for b in batches if b.kind is EventKind.COLLECTIVES]
    w = RankWindower(WindowerConfig(stream_discovery_ms=1000, idle_close_ms=60_000))
    assert sum((w.add(b, now_ns=0) for b in early), []) == []  # still discovering: nothing closes
    closed = w.poll(now_ns=2 * 10**9)  # discovery over: close without the unseen stream
    assert [c.iteration["iteration"] for c in closed] == [0, 1, 2]
    for b in late:
        w.add(b, now_ns=2 * 10**9)
    assert w.counters.late_events == 3 * 6  # the three closed steps' collectives came too late


def test_an_idle_rank_closes_its_last_step():
    w = RankWindower(WindowerConfig(idle_close_ms=100))
    closed = []
    for b in rank0_batches(3):
        closed += w.add(b, now_ns=0)
    assert [c.iteration["iteration"] for c in closed] == [0, 1]
    assert [c.iteration["iteration"] for c in w.poll(now_ns=200_000_000)] == [2]


def test_a_state_saved_before_a_field_existed_restores_with_that_field_at_its_default():
    w = RankWindower()
    for b in rank0_batches(3):
        w.add(b, 0)
    state = dict(w.__dict__)
    del state["_progress_span_ns"]
    restored = RankWindower.__new__(RankWindower)
    restored.__setstate__(state)
    assert restored._progress_span_ns == {} and restored._names == w._names
    for b in rank0_batches(5)[-4:]:
        restored.add(b, 0)  # and it goes on working
