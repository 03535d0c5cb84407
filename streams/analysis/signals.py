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


class OutlierScorer(Protocol):
    """Scores each row of a (ranks x functions) matrix against its column's peers; ``x`` is shared
    by several tests, so a scorer must not write to it."""

    def __call__(self, x: F64, abs_scale_floor: float = 0.0) -> RobustScores: ...


@dataclass(frozen=True, kw_only=True)
class ScoringConfig:
    """Thresholds of the per-iteration differential test."""

    z_threshold: float = 5.0
    min_relative_gap: float = 0.05
    min_loss_fraction: float = 0.01
    min_peers: int = 4
    rel_scale_floor: float = 0.01
    host_share_floor: float = 0.002
    """Scale floor for host functions compared as a share of the iteration (0.2 %)."""
    host_min_relative_gap: float = 0.2
    """Hosts' link fluctuation must differ this much: hosts are few and their traffic mixes."""
    transfer_min_relative_gap: float = 0.5
    """A collective group's transfer must exceed equivalent groups' by this much, per byte and outright
    (``links.score_transfers``): the shortest member's mean kernel still holds the waits that arrival jitter
    leaves in it (a ring paced by a degraded link takes 2-3 times as long)."""
    host_group_min_share: float = 0.75
    """Ranks of one host flagged together become a host finding when they are this share of it."""
    shards: int = 1
    """Functions split this many ways (``shards``): each shard's columns apart, then one merge; the same
    signals for any number. In process here; a deployment would run each shard in a worker of its own."""

    def __post_init__(self) -> None:
        errors = []  # each bound written so that NaN fails it (NaN compares false): a NaN z silences every flag
        if not self.z_threshold > 0:
            errors.append("z_threshold must be > 0")
        if not 0 <= self.min_relative_gap < 1:
            errors.append("min_relative_gap must be in [0, 1)")
        if not 0 <= self.min_loss_fraction < 1:
            errors.append("min_loss_fraction must be in [0, 1)")
        if self.min_peers < 3:
            errors.append("min_peers must be >= 3 (a median of fewer is no peer group)")
        if self.shards < 1:
            errors.append("shards must be >= 1")
        if not self.transfer_min_relative_gap > 0:
            errors.append("transfer_min_relative_gap must be > 0")
        if not 0 < self.host_group_min_share <= 1:
            errors.append("host_group_min_share must be in (0, 1]")
        if errors:
            raise ValueError("; ".join(errors))

    def scorer(self) -> OutlierScorer:
        """The default scorer (``robust_z``) with these thresholds."""
        return robust_z(self)


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


SCORERS: dict[str, Callable[[ScoringConfig], OutlierScorer]] = {"robust_z": robust_z, "mean_z": mean_z}
"""The scorers the configuration can name (``streams.differential.scorer``), each built from the thresholds."""
DEFAULT_SCORER = "robust_z"


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
