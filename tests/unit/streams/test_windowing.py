"""Iteration windowing when a rank's streams arrive out of step (separate topics, separate lag)."""

from dataclasses import replace

import numpy as np

from fleetscope.producers import SimulatorConfig, simulate
from fleetscope.schemas import CPU_WAIT, EventKind, FunctionKind
from fleetscope.streams.analysis.windowing import RankWindower, WindowerConfig


def rank0_batches(iterations: int = 8):
    return [b for b in simulate(SimulatorConfig(ranks=4, iterations=iterations)) if b.header.rank == 0]


def collectives_per_iteration(closed):
    return {c.iteration["iteration"]: sum(k == FunctionKind.COLLECTIVE for k in c.patterns["kind"]) for c in closed}


def test_a_lagging_declared_stream_holds_steps_open_until_it_arrives():
    batches = rank0_batches()
    order = [EventKind.KERNELS, EventKind.HOST, EventKind.SAMPLES, EventKind.COLLECTIVES]
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


def kernel_functions(closed):
    return {c.iteration["iteration"]: sum(k != FunctionKind.PYTHON and k != FunctionKind.COLLECTIVE
                                          for k in c.patterns["kind"]) for c in closed}  # fmt: skip


def test_a_backlog_whose_light_streams_run_far_ahead_loses_no_kernel():
    """A restart re-reading its topics gets the python and collective backlog long before the kernels (a fetch
    holds many more of their batches): more steps than ``max_open_steps`` wait, but the kernels keep coming."""
    batches = rank0_batches(12)
    ahead = [b for b in batches if b.kind is not EventKind.KERNELS]
    kernels = [b for b in batches if b.kind is EventKind.KERNELS]
    w = RankWindower(WindowerConfig(max_open_steps=3, idle_close_ms=1000))
    closed = []
    for b in ahead:
        closed += w.add(b, now_ns=0)
    for i, b in enumerate(kernels):  # no clock time passes between batches of a backlog
        closed += w.add(b, now_ns=10 * i)
    closed += w.flush()
    clean = RankWindower()
    reference = sum((clean.add(b, now_ns=0) for b in batches), []) + clean.flush()
    assert w.counters.incomplete == 0 and w.counters.late_events == 0
    assert kernel_functions(closed) == kernel_functions(reference)
    assert all(n > 0 for n in kernel_functions(closed).values())


def test_steps_waiting_for_a_quiet_stream_close_after_max_open_steps_and_are_counted():
    batches = rank0_batches(12)
    ahead = [b for b in batches if b.kind is not EventKind.KERNELS]
    w = RankWindower(WindowerConfig(max_open_steps=3, idle_close_ms=1000))
    w.add(next(b for b in batches if b.kind is EventKind.KERNELS), now_ns=0)  # kernels seen once, then quiet
    closed = []
    for b in ahead:
        closed += w.add(b, now_ns=2 * 10**9)  # the kernels have been quiet for 2 s
    assert len(closed) >= 8 and w.counters.incomplete == len(closed)
    hard = RankWindower(WindowerConfig(max_open_steps=1, idle_close_ms=60_000))
    long_ahead = [b for b in rank0_batches(40) if b.kind is not EventKind.KERNELS]
    closed = sum((hard.add(b, now_ns=0) for b in long_ahead), [])
    assert hard.counters.incomplete == len(closed) > 0  # past 16 x max_open_steps, whatever the streams do


def test_collectives_ahead_of_the_host_stream_wait_for_its_step_markers():
    """A real pipeline rank (torch hook, gloo) published its first collectives, the receives early in its
    first step, before its first step marker. The collective period cut 26 one-receive iterations out of
    them in 250 ms, the steps whose numbers they took were lost, and the baseline they made gave a false
    ``job_regression``. Boundaries inferred from collectives now wait for the host stream to pass them: a
    step marker there replaces them."""
    batches = rank0_batches(8)
    host = [b for b in batches if b.kind is EventKind.HOST]
    first = host[0]
    names = [first.names[i] for i in first.columns["name_id"]]
    early = names.index("forward")  # the host stream's first batch: one span, no step marker, no phase
    w = RankWindower()
    closed = w.add(replace(first, columns={k: v[early : early + 1] for k, v in first.columns.items()}), now_ns=0)
    for b in batches:
        if b.kind is not EventKind.HOST:
            closed += w.add(b, now_ns=0)
    assert closed == []
    for b in host:
        closed += w.add(b, now_ns=0)
    closed += w.flush()
    assert [(c.iteration["iteration"], c.iteration["detected_by"]) for c in closed] == [
        (i, "step_marker") for i in range(8)
    ]
    assert collectives_per_iteration(closed) == {i: 2 for i in range(8)}


def test_steps_inferred_from_collectives_close_as_a_host_stream_without_markers_passes_them():
    """A host stream with no step marker and no phase still tells how far it has reported, also where all it
    sends is the producer's own spans (each step's run-queue wait): the collectives' steps close as it
    passes them, not only when too many wait."""
    w = RankWindower()
    closed = []
    for n, b in enumerate(b for b in rank0_batches(8)):
        if b.kind is EventKind.HOST:
            names = [CPU_WAIT if name == "backward" else name for name in b.names]
            rows = [b.names[i] for i in b.columns["name_id"]]
            keep = np.array([row == ("forward" if n == 2 else "backward") for row in rows])
            b = replace(b, names=names, columns={k: v[keep] for k, v in b.columns.items()})
        closed += w.add(b, now_ns=0)
    assert {c.iteration["detected_by"] for c in closed} == {"collective_period"}
    assert len(closed) >= 5, len(closed)  # all but the last one or two, before any flush
