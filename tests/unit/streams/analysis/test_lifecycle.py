"""A lifecycle a pager can trust: findings close when their job ends, host findings name real outliers only
(and none on a one-host job)."""

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import decode, encode
from fleetscope.streams.analysis.differential import JobDifferential
from fleetscope.streams.analysis.outliers import RankSignal, group_by_host
from fleetscope.streams.offline import OfflinePipeline


def test_a_job_that_ends_closes_its_open_findings_with_reason_job_ended():
    sim = OfflinePipeline(keep_patterns=True)
    sim.add_all(simulate(SimulatorConfig(ranks=8, iterations=12, faults=(parse_fault("slow_gpu:3:1.5"),)))).finish()
    job = JobDifferential("demo")
    opened = [f for rec in sim.patterns for f in job.add(rec) if f["status"] == "open"]
    assert [(f["category"], f["rank"]) for f in opened] == [("gpu_slow", 3)] and job.open_findings() == 1
    closed = job.end()
    assert [(f["status"], f["reason"], f["finding_id"]) for f in closed] == [
        ("closed", "job_ended", opened[0]["finding_id"])
    ]
    assert decode(encode("findings", closed[0]))[1]["reason"] == "job_ended"
    assert job.open_findings() == 0 and job.end() == []


def sig(rank: int, host: str, score: float) -> RankSignal:
    return RankSignal(rank=rank, host=host, category="host_slow", function="dataloader.next", metric="total_ns",
                      value=1.0, peer_median=0.5, score=score, loss_ns=1e6)  # fmt: skip


def records(hosts: list[str]) -> list[dict]:
    return [{"rank": r, "host": h} for r, h in enumerate(hosts)]


def test_a_host_finding_needs_every_member_to_be_a_real_outlier():
    recs = records(["a"] * 4 + ["b"] * 4)
    shared = group_by_host([sig(0, "a", 40.0), sig(1, "a", 35.0), sig(2, "a", 50.0), sig(3, "a", 30.0)], recs, 0.75)
    assert [(s.key()[0], s.member_ranks()) for s in shared] == [("host:a", (0, 1, 2, 3))]
    one = group_by_host([sig(0, "a", 5.02), sig(2, "a", 197.0), sig(3, "a", 6.74)], recs, 0.75)
    assert sorted((s.key()[0], s.member_ranks()) for s in one) == [
        ("rank:0", (0,)), ("rank:2", (2,)), ("rank:3", (3,))
    ]  # fmt: skip


def test_a_job_on_one_host_has_no_host_findings():
    recs = records(["a"] * 4)
    out = group_by_host([sig(r, "a", 40.0 + r) for r in range(4)], recs, 0.75)
    assert sorted(s.key()[0] for s in out) == ["rank:0", "rank:1", "rank:2", "rank:3"]
