"""The differential's matrices: the fast gather gives what the plain build gives, and scoring agrees."""

import pickle
from dataclasses import asdict

import numpy as np
import pytest

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import FunctionKind
from fleetscope.streams.analysis import outliers
from fleetscope.streams.analysis.differential import JobDifferential
from fleetscope.streams.analysis.links import _median_by_group, _paced_share
from fleetscope.streams.analysis.outliers import build_matrices, gather_matrices, score_iteration
from fleetscope.streams.analysis.peermatrix import FunctionIndex, PeerMatrices
from fleetscope.streams.analysis.stats import nan_median, quiet_nan_warnings
from fleetscope.streams.analysis.timeline import TIMELINE_FIELDS
from fleetscope.streams.offline import OfflinePipeline

COMPUTE, COLLECTIVE, PYTHON = int(FunctionKind.COMPUTE), int(FunctionKind.COLLECTIVE), int(FunctionKind.PYTHON)


def simulated(faults: tuple[str, ...] = (), **kw) -> dict[int, list[dict]]:
    cfg = SimulatorConfig(ranks=16, iterations=4, seed=5, faults=tuple(parse_fault(f) for f in faults), **kw)
    pipeline = OfflinePipeline(keep_patterns=True).add_all(simulate(cfg))
    pipeline.finish()
    by_it: dict[int, list[dict]] = {}
    for p in pipeline.patterns:
        by_it.setdefault(p["iteration"], []).append(p)
    return by_it


def fresh(records: list[dict]) -> list[dict]:
    """The records as the next decode gives them: new strings, new lists."""
    out = []
    for r in records:
        rec = {k: (list(v) if isinstance(v, list) else v) for k, v in r.items()}
        rec["function"] = [name.encode().decode() for name in r["function"]]
        out.append(rec)
    return out


def shuffled(records: list[dict], seed: int) -> list[dict]:
    """Each rank lists its functions in an order of its own, and drops a few of them."""
    rng = np.random.default_rng(seed)
    out = []
    for r in records:
        keep = rng.permutation(len(r["function"]))[: len(r["function"]) - int(rng.integers(0, 3))]
        out.append({k: ([v[i] for i in keep] if isinstance(v, list) and k not in TIMELINE_FIELDS else v)
                    for k, v in r.items()})  # fmt: skip
    return out


def assert_same(got: PeerMatrices, want: PeerMatrices) -> None:
    assert np.array_equal(got.ranks, want.ranks) and got.hosts == want.hosts
    for kind in (COMPUTE, COLLECTIVE, PYTHON):
        g, w = got.of_kind(kind), want.of_kind(kind)
        assert g.functions == w.functions
        assert np.array_equal(g.kind, w.kind)
        for name, x in g.features.items():
            assert np.array_equal(x, w.features[name], equal_nan=True), (kind, name)
            assert x.flags.f_contiguous == w.features[name].flags.f_contiguous  # same order of additions
        for name in g.on_demand:
            rows = np.arange(0, len(g.ranks), 3)
            assert np.array_equal(g.feature_rows(name, rows), w.feature_rows(name, rows), equal_nan=True)


def test_gather_gives_the_plain_build_matrices_with_one_index_across_iterations():
    index = FunctionIndex()
    for it, records in simulated(("slow_link:3",), tp=2, pp=2).items():
        records = shuffled(records, seed=it) if it % 2 else records
        got = gather_matrices(fresh(records), index, staged=True)
        assert got is not None
        assert_same(got, build_matrices(records))
        for rows in outliers.peer_group_rows(records):  # a pipeline stage: its rows, its functions
            assert_same(got.rows(rows), build_matrices([records[i] for i in rows.tolist()]))


def test_scoring_through_gather_equals_scoring_through_the_plain_build(monkeypatch):
    by_it = simulated(("slow_gpu:6:1.4", "host_slow:11:1.5"))
    index = FunctionIndex()
    fast = [[asdict(s) for s in score_iteration(fresh(r), index=index)] for r in by_it.values()]
    monkeypatch.setattr(outliers, "gather_matrices", lambda *a, **k: None)
    plain = [[asdict(s) for s in score_iteration(r)] for r in by_it.values()]
    assert fast == plain
    assert {(s["rank"], s["category"]) for sigs in fast for s in sigs} >= {(6, "gpu_slow"), (11, "host_slow")}


def test_a_function_with_two_kinds_or_a_repeated_name_falls_back_to_the_plain_build():
    records = simulated()[1]
    two_kinds = fresh(records)
    two_kinds[3]["kind"][0] = COLLECTIVE if two_kinds[3]["kind"][0] != COLLECTIVE else COMPUTE
    repeated = fresh(records)
    repeated[2]["function"][1] = repeated[2]["function"][0]
    for broken in (two_kinds, repeated):
        assert gather_matrices(broken) is None
        assert isinstance(score_iteration(broken), list)


def test_a_column_shorter_than_the_functions_is_rejected():
    records = fresh(simulated()[1])
    records[4]["pcie_cv"] = records[4]["pcie_cv"][:-1]
    with pytest.raises(ValueError, match="pcie_cv"):
        gather_matrices(records)


def test_the_scoring_cache_pickles_empty_and_the_job_state_restores_without_it():
    jd = JobDifferential("j")
    for rec in simulated()[0]:
        jd.add(rec)
    assert jd.scoring_cache.functions.names
    restored = pickle.loads(pickle.dumps(jd))
    assert restored.scoring_cache.functions.names == [] and restored.scoring_cache.graph is None
    assert restored.iterations_scored == 1
    older = JobDifferential.__new__(JobDifferential)  # a record of format 3 or before: the index, no cache
    state = {k: v for k, v in pickle.loads(pickle.dumps(jd)).__dict__.items() if k != "_cache"}
    older.__setstate__({**state, "_functions": FunctionIndex()})
    assert isinstance(older.scoring_cache.functions, FunctionIndex) and "_functions" not in older.__dict__


def test_the_index_forgets_its_names_when_they_keep_changing():
    index = FunctionIndex(max_names=10)
    records = fresh(simulated()[1])
    gather_matrices(records, index)
    assert len(index.names) > 10
    gather_matrices(fresh(records), index)
    assert len(index.names) <= len({f for r in records for f in r["function"]})


def test_group_medians_equal_numpy_nanmedian_per_group():
    rng = np.random.default_rng(1)
    for trial in range(200):
        n, c, g = int(rng.integers(1, 40)), int(rng.integers(1, 5)), int(rng.integers(1, 9))
        group = rng.integers(0, g, n)
        x = rng.normal(size=(n, c)) * 10.0 ** rng.integers(-3, 9)
        x[rng.random((n, c)) < 0.3] = np.nan
        x[rng.random((n, c)) < 0.05] = np.inf
        x = np.asfortranarray(x) if trial % 2 else x
        want = np.full((g, c), np.nan)
        with quiet_nan_warnings():
            for h in np.unique(group):
                want[h] = np.nanmedian(x[group == h], axis=0)
        assert np.array_equal(_median_by_group(x, group, g), want, equal_nan=True)


def _nan_data(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.normal(size=shape) * 10.0 ** rng.integers(-3, 9)
    x[rng.random(shape) < 0.3] = np.nan
    x[rng.random(shape) < 0.05] = np.inf
    return x


def test_nan_median_equals_numpy_nanmedian_on_every_axis():
    rng = np.random.default_rng(2)
    for _ in range(300):
        shape = tuple(int(n) for n in rng.integers(0, 7, int(rng.integers(1, 4))))
        x = _nan_data(rng, shape)
        for axis in range(x.ndim):
            if x.shape[axis] == 0:
                continue
            with quiet_nan_warnings():
                want = np.nanmedian(x, axis=axis)
            assert np.array_equal(nan_median(x, axis=axis), want, equal_nan=True)


def test_paced_share_equals_each_hosts_numpy_nanmedian_of_the_others():
    """Every host at once (one sort) gives what a loop over hosts with ``np.nanmedian`` gave, bit for bit."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        hosts, columns = int(rng.integers(1, 9)), int(rng.integers(1, 6))
        active, peak = _nan_data(rng, (hosts, columns)), np.abs(_nan_data(rng, (hosts, columns)))
        want = np.zeros((hosts, columns))
        others = ~np.eye(hosts, dtype=bool)
        with quiet_nan_warnings(), np.errstate(invalid="ignore", divide="ignore"):
            for h in range(hosts):
                used = np.nanmedian(active[others[h]], axis=0) / np.nanmedian(peak[others[h]], axis=0)
                want[h] = np.nan_to_num(np.clip(1.0 - used, 0.0, 1.0))
        assert np.array_equal(_paced_share(active, peak), want)
