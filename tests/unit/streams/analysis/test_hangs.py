"""Hangs diagnosed from heartbeats: who never entered the collective the others wait in, or a stuck
collective, or a desync; on each rank's own clock, with every rank silent and no GPU samples."""

import json

from fleetscope.schemas import decode, encode
from fleetscope.streams.analysis.differential import JobDifferential
from fleetscope.streams.analysis.hangs import VERDICTS, diagnose_hang, job_stopped, snapshot_hang

S = 10**9
WORLD = 4


def heartbeat(rank: int, sent_s: float, last_step: int, last_step_s: float, seq: int = 149, inside: bool = False,
              op: str = "allreduce", nbytes: int = 4096, pg: str = "0", skew_s: float = 0.0, n: int = 0,
              profiling: bool = False) -> dict:  # fmt: skip
    """A heartbeat as the producer builds it (schema heartbeat.v1); times on the rank's clock."""
    off = skew_s * S
    return {
        "job": "j", "rank": rank, "host": f"node{rank // 2}", "world_size": WORLD, "producer_id": f"p{rank}",
        "seq": n, "sent_ns": int(sent_s * S + off), "last_step": last_step, "last_step_ns": int(last_step_s * S + off),
        "in_collective": inside, "collective_op": op, "collective_pg": pg, "collective_group_ranks": [],
        "collective_seq": seq, "collective_nbytes": nbytes,
        "collective_entered_ns": int((last_step_s + 0.04) * S + off),
        "profiling": profiling,
    }  # fmt: skip


def blocked_at_150(sent_s: float, culprit: int = 0, n: int = 0) -> dict[int, dict]:
    """Rank ``culprit`` blocked forever in step 150's forward; the others wait in allreduce #150."""
    out = {}
    for r in range(WORLD):
        if r == culprit:
            out[r] = heartbeat(r, sent_s, 149, 100.0, seq=149, n=n, skew_s=-3.0)
        else:
            out[r] = heartbeat(r, sent_s, 149, 100.0, seq=150, inside=True, n=n, skew_s=2.0 * r)
    return out


def test_the_rank_that_never_entered_the_collective_is_the_culprit_and_the_others_wait():
    sig = diagnose_hang(blocked_at_150(115.0), WORLD, threshold_ns=10 * S)
    assert sig is not None and sig.category == "hang" and sig.member_ranks() == (0,) and sig.subject == "rank:0"
    ev = sig.evidence
    assert (ev["kind"], ev["group"], ev["seq"], ev["op"]) == ("missing_member", "0", 150, "allreduce")
    assert ev["entered"] == [1, 2, 3] and ev["not_entered"] == [0]
    assert 14 * S < ev["waiting_ns"] < 15 * S  # on the waiters' own clocks, whatever their skew


def test_where_groups_overlap_the_culprit_is_the_absent_rank_in_no_collective_not_one_held_up_elsewhere():
    """HSDP's shard pairs {0, 1}, {2, 3} replicated over {0, 2}, {1, 3}: rank 1 blocks outside any collective.
    Rank 0 waits for it in their shard pair, rank 3 in their replica pair, and rank 2, which went on with its
    own shard pair, waits in its replica pair for rank 0, longest of all (a real 4-rank HSDP job: rank 0 was
    named). Rank 0 is absent there because it waits itself: the culprit is rank 1."""

    def inside(rank: int, pg: str, ranks: list[int], seq: int, entered_s: float) -> dict:
        hb = heartbeat(rank, 130.0, 99, 100.0, seq=seq, inside=True, pg=pg)
        return dict(hb, collective_group_ranks=ranks, collective_entered_ns=int(entered_s * S))

    latest = {
        0: inside(0, "3", [0, 1], 100, 101.0),
        1: dict(heartbeat(1, 130.0, 99, 100.0, seq=99, pg="3"), collective_group_ranks=[0, 1]),
        2: inside(2, "1", [0, 2], 200, 100.5),
        3: inside(3, "2", [1, 3], 200, 101.2),
    }
    sig = diagnose_hang(latest, WORLD, threshold_ns=10 * S)
    assert sig is not None and sig.member_ranks() == (1,) and sig.subject == "rank:1", sig
    assert sig.evidence["kind"] == "missing_member" and sig.evidence["not_entered"] == [1]
    assert sig.evidence["group"] in {"3", "2"} and sig.evidence["waiting_elsewhere"] == []


def test_in_a_pipeline_the_culprit_is_the_stage_rank_its_next_stage_waits_for_in_its_receive() -> None:
    """dp2 x pp2 by hand: data pairs {0, 1}, {2, 3}; the stages' pairs 0 -> 2, 1 -> 3 send and receive. Rank 1
    blocks outside any collective: rank 0 waits for it in their all-reduce, rank 3 in its receive from it
    (the hook numbers a pair's sends and receives on their own, group ``<pg>:p2p:<a>-<b>``), and rank 2 in its
    all-reduce for rank 3. Before the hook timed receives, rank 3 was in no collective, and the live job's
    hang named it (rank 2 blocked: rank 0 was named)."""

    def inside(rank: int, pg: str, ranks: list[int], seq: int, entered_s: float, op: str = "allreduce") -> dict:
        hb = heartbeat(rank, 130.0, 99, 100.0, seq=seq, inside=True, pg=pg, op=op)
        return dict(hb, collective_group_ranks=ranks, collective_entered_ns=int(entered_s * S))

    latest = {
        0: inside(0, "1", [0, 1], 300, 100.4),
        1: dict(heartbeat(1, 130.0, 99, 100.0, seq=299, pg="1"), collective_group_ranks=[0, 1]),
        2: inside(2, "2", [2, 3], 300, 100.3),
        3: inside(3, "0:p2p:1-3", [1, 3], 800, 100.2, op="recv"),
    }
    sig = diagnose_hang(latest, WORLD, threshold_ns=10 * S)
    assert sig is not None and sig.member_ranks() == (1,) and sig.subject == "rank:1", sig
    assert sig.evidence["not_entered"] == [1] and sig.evidence["group"] in {"1", "0:p2p:1-3"}


def test_a_job_still_inside_its_threshold_or_profiling_is_not_hung():
    assert diagnose_hang(blocked_at_150(105.0), WORLD, threshold_ns=10 * S) is None
    latest = blocked_at_150(115.0)
    latest[2] = dict(latest[2], profiling=True)  # a window holds its events back: no stall
    assert diagnose_hang(latest, WORLD, threshold_ns=10 * S) is None
    del latest[2]
    assert not job_stopped(latest, WORLD, 10 * S)  # a rank never heard of: no verdict


def test_every_member_inside_is_a_stuck_collective_and_disagreement_is_a_desync():
    stuck = {r: heartbeat(r, 120.0, 149, 100.0, seq=150, inside=True) for r in range(WORLD)}
    sig = diagnose_hang(stuck, WORLD, 10 * S)
    assert sig is not None and sig.evidence["kind"] == "collective_stuck" and sig.member_ranks() == (0, 1, 2, 3)
    assert sig.subject == "job" and sig.evidence["not_entered"] == []
    desync = dict(stuck)
    desync[3] = heartbeat(3, 120.0, 149, 100.0, seq=150, inside=True, op="allgather")
    sig = diagnose_hang(desync, WORLD, 10 * S)
    assert sig is not None and sig.evidence["kind"] == "desync" and sig.member_ranks() == (3,)
    assert sig.evidence["calls"] == {"allreduce/4096": [0, 1, 2], "allgather/4096": [3]}
    assert (sig.evidence["verdict"], sig.evidence["mismatch"]) == ("metadata mismatch", ["op"])
    desync[3] = heartbeat(3, 120.0, 149, 100.0, seq=150, inside=True, nbytes=8192)
    sig = diagnose_hang(desync, WORLD, 10 * S)
    assert sig is not None and sig.evidence["mismatch"] == ["size"] and sig.member_ranks() == (3,)


def test_each_verdict_has_its_torchcomms_name() -> None:
    stuck = {r: heartbeat(r, 120.0, 149, 100.0, seq=150, inside=True) for r in range(WORLD)}
    outside = {r: heartbeat(r, 120.0, 149 - (r == 2), 100.0) for r in range(WORLD)}
    signals = [diagnose_hang(latest, WORLD, 10 * S) for latest in (blocked_at_150(115.0), stuck, outside)]
    assert [sig.evidence["verdict"] if sig else None for sig in signals] == [
        "rank never joined", "stuck inside", "stuck outside"]  # fmt: skip
    assert signals[2] is not None and signals[2].rank == 2
    assert set(VERDICTS) == {"missing_member", "collective_stuck", "desync", "outside_collectives"}


def test_a_snapshot_is_hung_only_when_a_rank_waited_its_threshold_inside_a_collective() -> None:
    """Dumps written once (no steps, no later heartbeat): ranks outside collectives are no evidence, and a
    wait shorter than the threshold is a collective in progress; dtype and sizes, where named, must agree."""
    outside = {r: heartbeat(r, 120.0, -1, 0.0) for r in range(WORLD)}
    assert snapshot_hang(outside, 10 * S) is None
    latest = blocked_at_150(115.0)  # the waiters entered at 100.04 s on their clocks
    assert snapshot_hang(latest, 20 * S) is None
    sig = snapshot_hang(latest, 10 * S)
    assert sig is not None and sig.member_ranks() == (0,) and sig.evidence["verdict"] == "rank never joined"
    typed = {r: dict(hb, collective_dtype="Float", collective_sizes="[[1024]]") for r, hb in latest.items() if r}
    typed[0] = dict(typed[1], rank=0, collective_dtype="Half")
    sig = snapshot_hang(typed, 10 * S)
    assert sig is not None and sig.evidence["mismatch"] == ["dtype"] and sig.member_ranks() == (0,)


def test_a_silent_rank_is_stopped_on_its_peers_clocks():
    latest = blocked_at_150(130.0)
    latest[0] = heartbeat(0, 101.0, 149, 100.0, seq=149)  # its heartbeats stopped (process gone)
    sig = diagnose_hang(latest, WORLD, 10 * S)
    assert sig is not None and sig.member_ranks() == (0,)


def test_the_differential_opens_one_hang_from_heartbeats_alone_and_reopens_only_after_progress():
    job = JobDifferential("j")
    opened = []
    for t in range(100, 131):  # one heartbeat per second per rank, no events at all
        for hb in blocked_at_150(float(t), n=t).values():
            opened += [(t, f) for f in job.add_heartbeat(hb)]
    assert [(f["status"], f["category"], f["rank"], f["ranks"]) for _, f in opened] == [("open", "hang", 0, [0])]
    t, finding = opened[0]
    assert t == 110  # the floor (10 s) after the last completed step: no iteration time is known yet
    assert finding["subject"] == "rank:0" and json.loads(finding["evidence"])["seq"] == 150
    assert decode(encode("findings", finding))[1]["finding_id"] == finding["finding_id"]
    for hb in blocked_at_150(120.0, n=120).values():  # replayed heartbeats add nothing
        assert job.add_heartbeat(hb) == []
    resumed = [heartbeat(r, 131.0 + r * 0.01, 150, 131.0, seq=150, n=131) for r in range(WORLD)]
    assert [f for hb in resumed for f in job.add_heartbeat(hb)] == []
    again = [f for t in range(132, 145) for hb in blocked_at_150(float(t), n=t).values() for f in job.add_heartbeat(hb)]
    assert [f["status"] for f in again] == ["update"]  # hung again after progress: the open finding updates


def test_heartbeats_read_late_from_a_backlog_show_no_hang():
    job = JobDifferential("j")
    out = []
    # a healthy job's heartbeats, every rank stepping every 50 ms, read 60 s late and all at once
    for t in range(100):
        for r in range(WORLD):
            out += job.add_heartbeat(heartbeat(r, 10.0 + t * 0.05, t, 10.0 + t * 0.05 - 0.01, seq=t, n=t))
    assert out == []


def test_a_rank_missing_from_iterations_while_its_heartbeat_says_profiling_or_done_is_no_hang():
    from fleetscope.producers import SimulatorConfig, simulate
    from fleetscope.streams.offline import OfflinePipeline

    sim = OfflinePipeline(keep_patterns=True)
    sim.add_all(simulate(SimulatorConfig(job="j", ranks=8, iterations=12))).finish()

    def run(profiling: bool) -> list[dict]:
        job = JobDifferential("j")
        out = []
        for rec in sim.patterns:
            if int(rec["rank"]) == 6 and int(rec["iteration"]) >= 4:
                continue  # its records are held back by a profiler window
            out += job.add(rec)
            if int(rec["rank"]) == 0:
                hb = heartbeat(6, 100.0 + int(rec["iteration"]), 3, 100.0, profiling=profiling, n=int(rec["iteration"]))
                out += job.add_heartbeat(dict(hb, world_size=8))
        return out + job.flush()

    assert [(f["rank"], f["category"]) for f in run(profiling=False)] == [(6, "hang")]
    assert run(profiling=True) == []
