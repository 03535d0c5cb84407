"""The stream stages' settings: validated dataclasses and the bounds they default to, no maths.

They live apart from ``streams/analysis`` so that the configuration (``fleetscope.config``), which every
training rank loads, builds them without importing the analysis. Each stage's module imports its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_FUNCTIONS = 4_096
"""Pattern rows of one rank-iteration at most, ``OTHER_FUNCTIONS`` included (``capped_functions``)."""
MAX_FUNCTION_CHARS = 262_144
"""Characters of one rank-iteration's function names at most: with ``MAX_FUNCTIONS`` rows of fixed columns
(157 bytes a row at worst, measured: every long near 2**63, every double random) a pattern message is at
most 905 kB, under the topics' 1 MB message size."""
SCORER_NAMES = ("robust_z", "mean_z")
"""The scorers the configuration can name (``streams.differential.scorer``); ``signals.SCORERS`` builds each."""
DEFAULT_SCORER = "robust_z"


@dataclass(frozen=True, kw_only=True)
class WindowerConfig:
    """When a rank's steps close (the rules: ``streams/analysis/windowing.py``)."""

    idle_close_ms: int = 1500
    stream_discovery_ms: int = 5000
    max_open_steps: int = 64
    """Steps a rank may hold while a stream they wait for is quiet (no batch for ``idle_close_ms``);
    16 times this many close whatever the streams do (memory bound)."""
    stall_factor: float = 5.0
    """A rank is stalled when its clock moved this many mean iterations past its last progress..."""
    stall_silence_ms: int = 1500
    """...and no kernel, collective or host batch of it arrived for this long (processing time): batches
    still arriving are a backlog. 0 where processing time means nothing (offline input, complete)."""
    max_functions: int = MAX_FUNCTIONS
    """Pattern rows of one rank-iteration: the longest by time are kept, the rest summed in one row."""
    max_function_chars: int = MAX_FUNCTION_CHARS
    """Characters of one rank-iteration's function names (with ``max_functions``: a message under 1 MB)."""
    max_names: int = 65_536
    """Distinct names a rank's windower holds (kernels, host functions, metrics; well-formed step markers
    apart: one per step). Later new names are filed as ``OTHER_FUNCTIONS``: a rank's memory is bounded
    whatever its producer sends (a name is at most ``max_name_chars``)."""

    def __post_init__(self) -> None:
        if self.idle_close_ms <= 0:
            raise ValueError("idle_close_ms must be > 0")
        if self.stream_discovery_ms < 0:
            raise ValueError("stream_discovery_ms must be >= 0")
        if self.max_open_steps < 1:
            raise ValueError("max_open_steps must be >= 1")
        if self.stall_silence_ms < 0:
            raise ValueError("stall_silence_ms must be >= 0")
        if self.max_functions < 2 or self.max_function_chars < 1024 or self.max_names < 16:
            raise ValueError("max_functions must be >= 2, max_function_chars >= 1024, max_names >= 16")


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


@dataclass(frozen=True, kw_only=True)
class LifecycleConfig:
    persist_iterations: int = 3
    window_iterations: int = 8
    recover_iterations: int = 8
    update_every: int = 10

    def __post_init__(self) -> None:
        for name in ("persist_iterations", "window_iterations", "recover_iterations", "update_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.persist_iterations > self.window_iterations:
            raise ValueError("persist_iterations must be <= window_iterations")


@dataclass(frozen=True, kw_only=True)
class JobLevelConfig:
    warmup_iterations: int = 2
    """The job's first iterations (compilation, allocator and autotuning warm-up) never form its baseline."""
    baseline_min_iterations: int = 4
    recent_iterations: int = 4
    """The segment tested for a step: its median against the baseline's."""
    confirm_iterations: int = 2
    """The step must hold on this many consecutive segments (one more iteration each)."""
    history_iterations: int = 50
    regression_threshold: float = 0.05
    """The smallest step reported, as a share of the baseline."""
    noise_z: float = 6.0
    """...and the step must exceed this many standard errors of the two medians (noise-adaptive)."""
    stall_factor: float = 5.0
    hang_min_stall_ms: int = 10_000
    """A job is hung when no rank completed a step for max(stall_factor x mean iteration, this)."""

    def __post_init__(self) -> None:
        if self.recent_iterations < 2 or self.history_iterations < self.baseline_min_iterations:
            raise ValueError("need recent_iterations >= 2 and baseline_min_iterations <= history_iterations")
        if self.warmup_iterations < 0 or self.baseline_min_iterations < 2 or self.confirm_iterations < 1:
            raise ValueError("need warmup_iterations >= 0, baseline_min_iterations >= 2, confirm_iterations >= 1")
        if self.regression_threshold <= 0 or self.noise_z <= 0 or self.stall_factor <= 1:
            raise ValueError("regression_threshold and noise_z must be > 0 and stall_factor > 1")
        if self.hang_min_stall_ms < 0:
            raise ValueError("hang_min_stall_ms must be >= 0")


@dataclass(frozen=True, kw_only=True)
class NoiseConfig:
    history_iterations: int = 24
    """Iterations over which each rank's jitter is measured."""
    level_iterations: int = 7
    """A persistent excess is the median over this many of the rank's latest iterations."""
    min_history: int = 4
    warmup_iterations: int = 5
    """The job's first iterations say nothing about whose host is slow or who is slow to arrive: its ranks
    start at different moments and take their first batches and optimizer steps at different speeds (a
    real 4-rank job: rank 0's first 4 batches slower, by enough to cost the step). No host_slow or
    straggler signal is raised on them."""
    max_ranks: int = 16
    """Jobs with more ranks are judged on their peers' spread in one iteration alone: the MAD of many peers
    is a reliable yardstick, and the largest jitter among hundreds of ranks would hide small faults."""
    z: float = 5.0
    """An excess in one iteration must be this many times the job's noise..."""
    level_z: float = 3.0
    """...or the rank's recent median excess this many times."""
    last_z: float = 2.0
    """A straggler by arrival is late by this many times its peers' typical jitter beyond their median..."""
    last_misses: int = 2
    """...in all but this many of its last ``level_iterations + 1`` iterations. Chance alone (a random rank
    late by that much in 6 of 8 iterations) is then about one in 100,000 windows on 4 ranks (fewer on
    more; tests/unit/streams/analysis/test_noise.py); a slow rank that contention overtook twice is still named."""
    sign_iterations: int = 12
    """Or it arrived after each peer, on its own, in all of its last this many iterations..."""
    sign_misses: int = 1
    """...but this many (``_late_throughout``)."""
    lead_allowance: float = 1.0
    """Or its lead over the latest peer, in units of that jitter, less this allowance, summed over the
    same iterations (a CUSUM, restarting at zero)..."""
    lead_cap: float = 3.0
    """...each iteration's lead counted up to this many units (one descheduling proves little)..."""
    lead_alarm: float = 8.0
    """...reaches this: at least 4 iterations in a row behind every peer by the cap (a burst of 3 is not)."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_history <= self.history_iterations or self.level_iterations < 1:
            raise ValueError("need 2 <= min_history <= history_iterations and level_iterations >= 1")
        # each bound written so that NaN fails it: NaN compares false, so a NaN z would never flag anything
        if not (self.z > 0 and self.level_z > 0 and self.last_z > 0):
            raise ValueError("z, level_z and last_z must be > 0")
        if not 0 <= self.last_misses < self.level_iterations:
            raise ValueError("need 0 <= last_misses < level_iterations")
        if not 0 <= self.sign_misses < self.sign_iterations // 4 or self.sign_iterations > self.history_iterations:
            raise ValueError("need 0 <= sign_misses < sign_iterations / 4 and sign_iterations <= history_iterations")
        if not (0 < self.lead_allowance < self.lead_cap and self.lead_alarm > 0):
            raise ValueError("need 0 < lead_allowance < lead_cap and lead_alarm > 0")


@dataclass(frozen=True, kw_only=True)
class AttributionConfig:
    window: int = 8
    """Iterations a rank's credit is averaged over (a cause may show every few iterations only)."""
    min_share: float = 0.1
    """Share of the budget (``ScoringConfig.min_loss_fraction`` of the iteration) a credit must reach."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"attribution window must be at least 1, got {self.window}")
        if not 0 <= self.min_share <= 1:
            raise ValueError(f"attribution min_share must be in [0, 1], got {self.min_share}")


@dataclass(frozen=True, kw_only=True)
class DifferentialConfig:
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    job_level: JobLevelConfig = field(default_factory=JobLevelConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    """What a rank's host or arrival excess must stand out from: the job's own iteration-to-iteration noise."""
    attribution: AttributionConfig = field(default_factory=AttributionConfig)
    """What a signal's ranks must save, replayed, to be named (``attribution``)."""
    missing_rank_wait_iterations: int = 3
    """An iteration still missing ranks is scored anyway once this many later iterations are complete."""
    missing_rank_timeout_ms: int = 10_000
    """...or once every rank it lacks sent nothing while its peers advanced this far in event time (the ends
    of their iterations, on their own clocks): a backlog delays the peers' records too, so it is never silence,
    whatever the worker's input gaps."""
    scorer: str = DEFAULT_SCORER
    """How a rank is compared with its peers: a name in ``SCORERS`` (``robust_z``: median and MAD; ``mean_z``:
    mean and standard deviation)."""

    def __post_init__(self) -> None:
        if self.scorer not in SCORER_NAMES:
            raise ValueError(f"scorer {self.scorer!r} is not one of {', '.join(sorted(SCORER_NAMES))}")
