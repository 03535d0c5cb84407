"""What the differential's tests produce (``RankSignal``) and the thresholds they share.

Kept apart from the tests themselves so that the modules that read layouts, stages and time lost can
use them without importing every detector.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from fleetscope.streams.analysis.peermatrix import PeerMatrix
from fleetscope.streams.analysis.stats import F64, RobustScores, mean_std_scores, robust_scores
from fleetscope.streams.settings import SCORER_NAMES, ScoringConfig


class OutlierScorer(Protocol):
    """Scores each row of a (ranks x functions) matrix against its column's peers; ``x`` is shared
    by several tests, so a scorer must not write to it."""

    def __call__(self, x: F64, abs_scale_floor: float = 0.0) -> RobustScores: ...


def robust_z(cfg: ScoringConfig) -> OutlierScorer:
    """Median and MAD of the peers (``robust_scores``): an outlier does not move the yardstick it is read on."""

    def score(x: F64, abs_scale_floor: float = 0.0) -> RobustScores:
        return robust_scores(x, cfg.rel_scale_floor, abs_scale_floor, cfg.min_peers)

    return score


def mean_z(cfg: ScoringConfig) -> OutlierScorer:
    """Mean and standard deviation of the peers (``mean_std_scores``), the textbook z-score: one outlier among
    n ranks scores at most sqrt(n - 1), so with the default threshold of 5 it finds no single outlier below 26 ranks."""

    def score(x: F64, abs_scale_floor: float = 0.0) -> RobustScores:
        return mean_std_scores(x, cfg.rel_scale_floor, abs_scale_floor, cfg.min_peers)

    return score


SCORERS: dict[str, Callable[[ScoringConfig], OutlierScorer]] = dict(zip(SCORER_NAMES, (robust_z, mean_z), strict=True))
"""The scorers the configuration can name (``SCORER_NAMES``), each built from the thresholds."""


def scorer_named(name: str, cfg: ScoringConfig) -> OutlierScorer:
    """The registered scorer ``name`` with ``cfg``'s thresholds; ``ValueError`` listing the known names."""
    factory = SCORERS.get(name)
    if factory is None:
        raise ValueError(f"scorer {name!r} is not one of {', '.join(sorted(SCORERS))}")
    return factory(cfg)


def flagged(
    scores: RobustScores, cfg: ScoringConfig, *, low: bool = False, min_gap: float | None = None
) -> npt.NDArray[np.bool_]:
    """The one flag rule: beyond ``cfg.z_threshold`` robust z's and the minimum relative gap from the peers,
    above them (slower, longer) or, with ``low``, below them (a rank that waits least at a collective, a
    link that moves fewer bytes). ``min_gap`` replaces ``cfg.min_relative_gap`` (hosts use their own)."""
    gap = cfg.min_relative_gap if min_gap is None else min_gap
    if low:
        return (scores.z <= -cfg.z_threshold) & (scores.rel_gap <= -gap)
    return (scores.z >= cfg.z_threshold) & (scores.rel_gap >= gap)


@dataclass(frozen=True, slots=True)
class RankSignal:
    """One rank (or host, stage) that stands out in one iteration, for one category, with evidence.

    ``rank`` is -1 for a group; ``subject`` names what the finding is about ("rank:7",
    "host:node003", "stage:2", "job") so that findings of different scopes never merge.
    """

    rank: int
    host: str
    category: str
    function: str
    metric: str
    value: float
    peer_median: float
    score: float
    loss_ns: float
    evidence: dict[str, Any] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()
    subject: str = ""

    def key(self) -> tuple[str, str]:
        """What a finding tracks the signal by: its subject (the rank if none) and category, so a rank's
        finding and its host's never merge."""
        return (self.subject or f"rank:{self.rank}", self.category)

    def member_ranks(self) -> tuple[int, ...]:
        """The ranks the signal is about: a group's members, or its one rank."""
        return self.ranks or (self.rank,)


def top_functions(functions: list[str], excess: F64, value: F64, med: F64, z: F64, k: int = 5) -> list[dict[str, Any]]:
    """The ``k`` functions of largest excess, each with its value, the peers' median and score: the
    evidence a finding shows."""
    order = np.argsort(-np.nan_to_num(excess))[:k]
    return [
        {
            "function": functions[j],
            "value": float(value[j]),
            "peer_median": float(med[j]),
            "z": float(np.round(z[j], 2)),
            "excess_ns": float(np.round(excess[j])),
        }
        for j in order
        if excess[j] > 0
    ]


def row_signal(pm: PeerMatrix, i: int, **fields: Any) -> RankSignal:
    """A signal about row ``i`` of a peer matrix."""
    return RankSignal(rank=int(pm.ranks[i]), host=pm.hosts[i], **fields)
