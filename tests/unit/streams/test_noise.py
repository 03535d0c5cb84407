"""The straggler-by-arrival rule must not name a rank that chance alone makes last (few ranks)."""

from __future__ import annotations

import numpy as np

from fleetscope.streams.analysis.noise import _chance_last, _mostly_last


def test_the_chance_of_being_last_is_the_binomial_tail() -> None:
    rng = np.random.default_rng(0)
    for ranks in (2, 4):
        last = rng.integers(0, ranks, size=(200_000, 8)) == 0
        simulated = float(np.mean(last.sum(axis=1) >= 7))
        assert abs(simulated - _chance_last(8, 7, ranks)) < 3e-3


def test_two_ranks_last_by_turns_are_never_a_straggler_four_ranks_one_always_last_is() -> None:
    rng = np.random.default_rng(1)
    windows = [rng.normal(size=(8, 2)) for _ in range(2_000)]  # 2 ranks, random order: healthy
    assert not any(_mostly_last(w, col) for w in windows for col in (0, 1))
    late = rng.normal(size=(8, 4))
    late[:, 2] += 10.0  # rank 2 always last
    assert _mostly_last(late, 2) and not _mostly_last(late, 0)
    late[3, 2] = -10.0  # last in 7 of 8: still far beyond chance with 4 ranks
    assert _mostly_last(late, 2)
