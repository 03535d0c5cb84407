import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetscope.streams.analysis.stats import (
    _sorted_by_group,
    covered_ns,
    group_duration_stats,
    merge_intervals,
    robust_scores,
    samples_within,
)

durations = st.lists(st.integers(min_value=0, max_value=10**9), min_size=1, max_size=60)


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10**6)), min_size=1, max_size=80))
def test_group_stats_match_numpy_per_group(pairs):
    group = np.array([g for g, _ in pairs])
    dur = np.array([d for _, d in pairs], dtype=np.int64)
    stats = group_duration_stats(group, dur, 5)
    for g in range(5):
        d = dur[group == g]
        assert stats.calls[g] == d.size
        if d.size == 0:
            assert np.isnan(stats.mean[g])
            continue
        assert stats.total[g] == d.sum()
        assert stats.max[g] == d.max()
        assert np.isclose(stats.mean[g], d.mean())
        assert np.isclose(stats.p50[g], np.percentile(d, 50))
        assert np.isclose(stats.p99[g], np.percentile(d, 99))


@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(-(2**63), 2**63 - 1) | st.integers(-5, 5)), max_size=80),
    st.integers(0, 3),
)
def test_durations_sorted_within_groups_are_the_lexsorts(pairs, extra_groups):
    """One key sort where (group, duration) fits in an int64, the lexsort where it does not: the same order."""
    group = np.array([g for g, _ in pairs], dtype=np.int64)
    dur = np.array([d for _, d in pairs], dtype=np.int64)
    calls = np.bincount(group, minlength=int(group.max(initial=-1)) + 1 + extra_groups)
    got = _sorted_by_group(group, dur, calls)
    assert got.dtype == np.int64 and np.array_equal(got, dur[np.lexsort((dur, group))])


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 100)), max_size=50))
def test_merged_intervals_cover_exactly_the_union(spans):
    start = np.array([s for s, _ in spans], dtype=np.int64)
    end = start + np.array([d for _, d in spans], dtype=np.int64)
    covered = np.zeros(1200, dtype=bool)
    for s, e in zip(start, end, strict=True):
        covered[s:e] = True
    seg_s, seg_e = merge_intervals(start, end)
    assert np.all(seg_s[1:] > seg_e[:-1])
    assert int(np.sum(seg_e - seg_s)) == covered.sum()
    assert covered_ns(start, end, 100, 600) == covered[100:600].sum()


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=60), st.data())
def test_samples_within_matches_a_loop_over_intervals(values, data):
    v = np.array(values)
    t = np.sort(np.array(data.draw(st.lists(st.integers(0, 100), min_size=v.size, max_size=v.size))))
    spans = data.draw(st.lists(st.tuples(st.integers(-5, 105), st.integers(0, 30), st.integers(0, 2)), max_size=12))
    start = np.array([s for s, _, _ in spans], dtype=np.int64)
    end = start + np.array([d for _, d, _ in spans], dtype=np.int64)
    group = np.array([g for _, _, g in spans], dtype=np.int64)
    got = samples_within(t, v, start, end, group, 3)
    for g in range(3):
        inside = [x for s, e, h in zip(start, end, group, strict=True) if h == g for tt, x in zip(t, v, strict=True)
                  if s <= tt <= e]  # fmt: skip
        assert got.count[g] == len(inside)
        if not inside:
            assert np.isnan(got.mean[g]) and np.isnan(got.peak[g])
            continue
        assert got.peak[g] == max(inside)
        assert np.isclose(got.mean[g], np.mean(inside), rtol=1e-9, atol=1e-6)


def test_samples_within_pools_samples_per_group():
    t = np.arange(0, 100, 10, dtype=np.int64)  # 0..90
    value = np.arange(10, dtype=np.float64)
    start = np.array([0, 25, 60], dtype=np.int64)
    end = np.array([20, 45, 60], dtype=np.int64)
    group = np.array([0, 0, 1])
    s = samples_within(t, value, start, end, group, 3)
    # group 0: samples at 0,10,20 and 30,40 -> values 0,1,2,3,4; group 1: the sample at 60 -> 6
    assert list(s.count) == [5, 1, 0]
    assert s.mean[0] == 2.0 and s.peak[0] == 4.0
    assert s.mean[1] == 6.0 and s.peak[1] == 6.0
    assert np.isnan(s.mean[2]) and np.isnan(s.peak[2])


@settings(max_examples=50)
@given(st.integers(8, 64), st.floats(1.2, 3.0), st.integers(0, 2**31))
def test_robust_z_flags_one_planted_outlier_and_only_it(n, factor, seed):
    """From 7 peers on: the MAD of 4 is itself noisy (two pairs 3 sigma apart give a scale of 4.6 sigma, and a
    planted x1.22 scores 4.6: seed 262144, found by this test once), which is why small jobs are also judged
    against their own history (``noise``)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(100.0, 1.0, size=(n, 3))
    x[n // 2, 1] *= factor
    sc = robust_scores(x)
    flagged = (sc.z >= 5) & (sc.rel_gap >= 0.05)
    assert flagged[n // 2, 1]
    assert flagged.sum() == 1


def test_robust_z_ignores_absent_functions_and_constant_columns():
    x = np.array([[1.0, np.nan], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])
    sc = robust_scores(x)
    assert np.all(sc.z[:, 0] == 0)
    assert np.isnan(sc.z[0, 1])
