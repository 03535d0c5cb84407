"""The replay of one iteration from its ranks' timelines: measured jobs come back as measured, and the physics
of who waits for whom (a collective's last arrival, a transfer's two ends, a rank's own chain) holds."""

from __future__ import annotations

import numpy as np
from pipeline_toy import ToyJob, run

from fleetscope.streams.analysis.callmatch import MATCH_TOLERANCE_NS
from fleetscope.streams.analysis.replay import (
    FEW_MEMBERS,
    call_graph,
    call_kind,
    replay,
    replay_times,
    steady_period,
)
from fleetscope.streams.analysis.timeline import RankTimeline

AR = "nccl:allreduce[pg=0,<=1MiB]"


def _timeline(calls: list[tuple[int, int, int, int]], iteration_ns: int) -> RankTimeline:
    """calls: (function index, seq, enter, leave) in ns."""
    a = np.array(calls, dtype=np.int64).reshape(-1, 4)
    return RankTimeline(function=a[:, 0], seq=a[:, 1], enter_ns=a[:, 2], leave_ns=a[:, 3],
                        compute_ns=None, iteration_ns=iteration_ns)  # fmt: skip


def _record(rank: int, functions: list[str], iteration_ns: int, **coords: int) -> dict[str, object]:
    return {"rank": rank, "function": functions, "iteration_ns": iteration_ns, "calls": [1] * len(functions),
            "nbytes": [1 << 20] * len(functions), **coords}  # fmt: skip


def test_a_measured_pipeline_job_replays_to_its_own_times() -> None:
    """dp4 x pp4, GPipe, 2 % jitter: every rank's replayed iteration within 0.5 % of its measured one, every
    send matched with its receive although the stages start their iterations at different moments."""
    records, timelines = run(ToyJob(dp=4, pp=4, jitter=0.02, seed=1))[-1]
    g = call_graph(records, timelines)
    r = replay(records, g)
    assert g.unmatched_p2p == 0 and g.matched_p2p == 4 * 2 * 3 * 4  # replicas x passes x stage pairs x mbs
    assert np.max(np.abs(r.error)) < 0.005
    assert abs(r.job_error) < 0.01
    assert np.ptp(g.start_ns) > 1e6  # the last stage starts its iteration well before the first


def test_transfers_numbered_per_group_are_matched_by_their_ends() -> None:
    """A Kineto trace numbers a rank's p2p calls in its group, so a send and its receive differ in number
    (and equal numbers meet by chance): every transfer is still matched, and the replay holds."""
    records, timelines = run(ToyJob(dp=2, pp=4, jitter=0.02, seed=3, seq_per_group=True))[-1]
    g = call_graph(records, timelines)
    assert g.unmatched_p2p == 0 and g.matched_p2p == 2 * 2 * 3 * 4
    assert np.max(np.abs(replay(records, g).error)) < 0.005


def test_a_collective_ends_at_the_last_arrival_plus_the_transfer_of_the_last_to_arrive() -> None:
    """Rank 0 arrives at 10 us and waits; rank 1 arrives at 25 and spends 5 in it: both leave at 30. Taking
    10 us of rank 1's work away makes both leave 10 earlier; taking rank 0's away saves nothing."""
    us = 1000
    records = [_record(0, [AR], 60 * us), _record(1, [AR], 60 * us)]
    timelines = [_timeline([(0, 0, 10 * us, 30 * us), (0, 1, 40 * us, 50 * us)], 60 * us),
                 _timeline([(0, 0, 25 * us, 30 * us), (0, 1, 40 * us, 50 * us)], 60 * us)]  # fmt: skip
    g = call_graph(records, timelines)
    assert g.transfer_ns.tolist() == [5 * us, 10 * us]
    assert replay_times(g).tolist() == [60 * us, 60 * us]
    faster = g.work_ns.copy()
    faster[2] -= 10 * us  # rank 1's work before the first call
    assert replay_times(g, faster).tolist() == [50 * us, 50 * us]
    idle = g.work_ns.copy()
    idle[0] -= 5 * us  # rank 0 only arrives sooner to wait longer
    assert replay_times(g, idle).tolist() == [60 * us, 60 * us]


def test_a_late_tail_holds_the_others_at_the_next_iteration() -> None:
    """Rank 1 works 20 us after the last collective where rank 0 works 5: the steady period is rank 1's."""
    us = 1000
    records = [_record(0, [AR], 35 * us), _record(1, [AR], 50 * us)]
    timelines = [_timeline([(0, 0, 10 * us, 30 * us)], 35 * us), _timeline([(0, 0, 10 * us, 30 * us)], 50 * us)]
    period, _ = steady_period(call_graph(records, timelines))
    assert abs(float(period) - 50 * us) < 1


def test_an_unmatched_send_keeps_its_measured_time_and_a_record_without_calls_its_iteration() -> None:
    us = 1000
    send = "nccl:send[pg=pp0,<=1MiB]"
    records = [_record(0, [send], 40 * us, pp_rank=0, dp_rank=0, tp_rank=0), _record(1, [], 33 * us)]
    g = call_graph(records, [_timeline([(0, 0, 10 * us, 30 * us)], 40 * us), None])
    assert (g.matched_p2p, g.unmatched_p2p) == (0, 1)
    assert replay_times(g).tolist() == [40 * us, 33 * us]


def test_p2p_ends_further_apart_than_the_tolerance_are_no_transfer() -> None:
    us = 1000
    coords = [{"pp_rank": 0, "dp_rank": 0, "tp_rank": 0}, {"pp_rank": 1, "dp_rank": 0, "tp_rank": 0}]
    records = [_record(0, ["nccl:send[pg=pp0,<=1MiB]"], 40 * us, **coords[0]),
               _record(1, ["nccl:recv[pg=pp0,<=1MiB]"], 40 * us, **coords[1])]  # fmt: skip
    apart = 30 * us + 2 * MATCH_TOLERANCE_NS  # one pair only: no frequent offset, so the raw clocks decide
    g = call_graph(records, [_timeline([(0, 0, 10 * us, 30 * us)], 40 * us),
                             _timeline([(0, 0, 5 * us, apart)], apart + us)])  # fmt: skip
    assert g.matched_p2p == 0


def test_call_kinds_come_from_the_function_name() -> None:
    assert call_kind("nccl:recv[pg=pp3,<=8MiB]") == ("pp3", 2, "p2p")
    assert call_kind("nccl:send[pg=7,<=1KiB]")[:2] == ("7", 1)
    assert call_kind("nccl:allreduce[pg=dp1,<=32MiB]") == ("dp1", 0, "nccl:allreduce[<=32MiB]")


def test_scenarios_replayed_together_equal_each_replayed_alone() -> None:
    """dp18 x pp2: p2p pairs, and rings of 18 members (reduced as one block past ``FEW_MEMBERS``): every
    column of a many-scenario replay, given in the graph's order or in the levels', is that scenario's own
    replay, to the bit."""
    records, timelines = run(ToyJob(dp=18, pp=2, jitter=0.02, seed=3), 1)[-1]
    g = call_graph(records, timelines)
    assert int(g.members.max()) > FEW_MEMBERS and 2 in g.members
    rng = np.random.default_rng(0)
    work = (g.work_ns[:, None] * rng.uniform(0.5, 1.0, (g.calls, 3))).astype(np.float32)
    transfer = (g.transfer_ns[:, None] * rng.uniform(0.5, 1.0, (g.transfer_ns.size, 3))).astype(np.float32)
    together = replay_times(g, work, transfer)
    ordered = replay_times(g, work[g.levels.order], transfer[g.levels.instances], ordered=True)
    alone = np.stack([replay_times(g, work[:, j], transfer[:, j]) for j in range(3)], axis=1)
    assert np.array_equal(together, alone) and np.array_equal(ordered, alone)
    assert not np.array_equal(alone[:, 0], alone[:, 1])  # the scenarios differ


def test_a_graph_like_the_last_iterations_takes_its_order_and_replays_the_same() -> None:
    """The next iteration of a job (other times, the same calls) takes the previous graph's order; a graph of
    other calls does not; either way the replay is the one built afresh."""
    (r0, t0), (r1, t1) = run(ToyJob(dp=4, pp=4, jitter=0.02, seed=1), 2)
    first, fresh = call_graph(r0, t0), call_graph(r1, t1)
    warm = call_graph(r1, t1, like=first)
    assert warm.levels is first.levels and fresh.levels is not first.levels
    assert np.array_equal(replay(r1, warm).replayed_ns, replay(r1, fresh).replayed_ns)
    other_records, other_timelines = run(ToyJob(dp=2, pp=4), 1)[-1]
    assert call_graph(other_records, other_timelines, like=first).levels is not first.levels
