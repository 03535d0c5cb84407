"""The differential sharded by function: the same signals and findings for 1, 2 and 4 shards as unsharded."""

from dataclasses import asdict, replace

import numpy as np
import pytest

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import FunctionKind
from fleetscope.streams.analysis.differential import DifferentialConfig
from fleetscope.streams.analysis.outliers import ScoringConfig, gather_matrices, score_iteration
from fleetscope.streams.analysis.peermatrix import FunctionIndex
from fleetscope.streams.analysis.shards import POSITION, Columns, assemble, first_keys, shard_of, split_records
from fleetscope.streams.analysis.stats import F64
from fleetscope.streams.analysis.timeline import TIMELINE_FIELDS
from fleetscope.streams.offline import OfflinePipeline

JOBS = {  # faults of every kind the rank tests read, in the layouts that change peer groups and victims
    "gpu+host, flat": dict(ranks=16, faults=("slow_gpu:6:1.4", "host_slow:11:1.5")),
    "link+pcie, tp2 pp2": dict(ranks=32, tp=2, pp=2, faults=("slow_link:9:1.3", "pcie_downgrade:20:1.5")),
    "stage, pp4": dict(ranks=16, pp=4, faults=("stage_imbalance:2:1.3",)),
    "congestion + stall, tp2": dict(ranks=32, tp=2, faults=("net_congestion:1:1.5", "dataloader_stall:5:1.5")),
    "healthy, tp2 pp2": dict(ranks=32, tp=2, pp=2, faults=()),
}


def run(spec: dict, shards: int, iterations: int = 8) -> tuple[list[dict], list[dict]]:
    """Finding updates and patterns of one simulated job through the offline pipeline (the worker's code)."""
    cfg = SimulatorConfig(
        job="shard", iterations=iterations, seed=3, **{**spec, "faults": tuple(parse_fault(f) for f in spec["faults"])}
    )
    differential = DifferentialConfig(scoring=ScoringConfig(shards=shards))
    pipeline = OfflinePipeline(differential=differential, keep_patterns=True).add_all(simulate(cfg))
    updates = [{k: v for k, v in u.items() if k != "emitted_ns"} for u in pipeline.finish().finding_updates]
    return updates, pipeline.patterns  # emitted_ns: the wall clock at emission, the one field that may differ


@pytest.mark.parametrize("name", list(JOBS))
def test_sharded_findings_and_signals_equal_the_unsharded_ones(name):
    spec = JOBS[name]
    updates, patterns = run(spec, 1)
    by_it: dict[int, list[dict]] = {}
    for p in patterns:
        by_it.setdefault(p["iteration"], []).append(p)
    unsharded = [[asdict(s) for s in score_iteration(r)] for r in by_it.values()]
    if spec["faults"]:
        assert updates and any(unsharded)  # a fault is seen: the comparison below compares something
    else:
        assert updates == []  # a healthy job: nothing to find, sharded or not
    for shards in (2, 4):
        assert run(spec, shards)[0] == updates, shards
        index = FunctionIndex()
        sharded = [
            [asdict(s) for s in score_iteration(r, ScoringConfig(shards=shards), index=index)] for r in by_it.values()
        ]
        assert sharded == unsharded, shards


def test_shards_split_every_function_once_and_merge_in_the_unsharded_order():
    _, patterns = run(JOBS["link+pcie, tp2 pp2"], 1, iterations=3)
    records = [p for p in patterns if p["iteration"] == 1]
    rng = np.random.default_rng(0)
    for rec in records[1::2]:  # odd ranks list their functions in an order of their own
        order = rng.permutation(len(rec["function"])).tolist()
        for k, v in list(rec.items()):
            if isinstance(v, list) and len(v) == len(order) and k not in TIMELINE_FIELDS:
                rec[k] = [v[j] for j in order]
    whole = gather_matrices(records, FunctionIndex())
    assert whole is not None
    subs = split_records(records, 3)
    for r, rec in enumerate(records):
        names = [f for sub in subs for f in sub[r]["function"]]
        assert sorted(names) == sorted(rec["function"])  # every entry in exactly one shard
        for k, sub in enumerate(subs):
            assert all(shard_of(f, 3) == k for f in sub[r]["function"])
            assert [rec["function"][j] for j in sub[r][POSITION]] == sub[r]["function"]
    parts = []
    for sub in subs:
        index = FunctionIndex()
        pms = gather_matrices(sub, index)
        assert pms is not None
        rows = np.arange(len(sub))
        parts.append(Columns(pms, first_keys(pms, sub, rows, pms.row_ids, index.names)))
    assert len([p for p in parts if any(pm.functions for pm in p.pms.by_kind.values())]) >= 2
    merged = assemble(parts)
    kinds = (int(FunctionKind.COMPUTE), int(FunctionKind.COLLECTIVE), int(FunctionKind.PYTHON))
    for kind in kinds:
        got, want = merged.of_kind(kind), whole.of_kind(kind)
        assert got.functions == want.functions
        for feature, x in want.features.items():
            y: F64 = got.features[feature]
            assert np.array_equal(x, y, equal_nan=True) and y.flags.f_contiguous == x.flags.f_contiguous
        for feature in want.on_demand:
            rows = np.arange(0, len(records), 3)
            assert np.array_equal(got.feature_rows(feature, rows), want.feature_rows(feature, rows), equal_nan=True)


def test_a_function_with_two_kinds_scores_alike_sharded():
    _, patterns = run(JOBS["gpu+host, flat"], 1, iterations=3)
    records = [p for p in patterns if p["iteration"] == 1]
    records[3] = replace_kind(records[3])
    assert gather_matrices(records) is None  # the plain build, in the shard that holds the function
    want = [asdict(s) for s in score_iteration(records)]
    for shards in (2, 4):
        assert [asdict(s) for s in score_iteration(records, ScoringConfig(shards=shards))] == want


def replace_kind(rec: dict) -> dict:
    kinds = list(rec["kind"])
    kinds[0] = int(FunctionKind.COLLECTIVE) if kinds[0] != FunctionKind.COLLECTIVE else int(FunctionKind.COMPUTE)
    return {**rec, "kind": kinds}


def test_shards_must_be_positive():
    with pytest.raises(ValueError, match="shards"):
        replace(ScoringConfig(), shards=0)
