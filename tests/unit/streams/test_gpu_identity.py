"""A rank's finding names its GPU (local rank and UUID, from the rank's batch headers), so an operator can
match it to DCGM data or drain the right device; a finding about a host, stage or job names no GPU."""

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import decode, encode
from fleetscope.streams.offline import OfflinePipeline


def _findings(*faults: str, pp: int = 1) -> list[dict]:
    cfg = SimulatorConfig(ranks=16, iterations=12, pp=pp, faults=tuple(parse_fault(f) for f in faults))
    uuids = {b.header.rank: (b.header.local_rank, b.header.gpu_uuid) for b in simulate(cfg)}
    result = OfflinePipeline().add_all(simulate(cfg)).finish()
    for f in result.findings:
        f["expected_gpu"] = uuids.get(f["rank"], (-1, ""))
    return result.findings


def test_a_rank_finding_carries_the_rank_s_gpu_identity_through_the_findings_schema() -> None:
    (finding,) = _findings("slow_gpu:5:1.5")
    assert finding["rank"] == 5 and finding["gpu_uuid"].startswith("GPU-")
    assert (finding["local_rank"], finding["gpu_uuid"]) == finding["expected_gpu"]
    _, decoded = decode(encode("findings", {k: v for k, v in finding.items() if k != "expected_gpu"}))
    assert (decoded["local_rank"], decoded["gpu_uuid"]) == finding["expected_gpu"]


def test_a_stage_finding_names_no_gpu() -> None:
    findings = _findings("stage_imbalance:1:1.4", pp=2)
    assert findings and all(f["rank"] == -1 for f in findings)
    assert all((f["local_rank"], f["gpu_uuid"]) == (-1, "") for f in findings)
