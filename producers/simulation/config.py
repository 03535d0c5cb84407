"""The simulated job's configuration, its parallel layout and the ground truth a detector should find."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fleetscope.producers.simulation.faults import TARGETS, Fault, host_index, host_name

DEFAULT_START_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z: runs are reproducible byte for byte
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class ExpectedFinding:
    """What a perfect detector reports for one injected fault (the quality bench's ground truth).

    ``host`` is the one host all ``ranks`` live on ("" when they span hosts); ``stage`` the one pipeline
    stage they share when the job is pipelined (-1 otherwise); ``onset`` the step number
    (``first_step + fault.start``) of the first iteration the fault acts on.
    """

    category: str
    ranks: tuple[int, ...]
    host: str
    stage: int
    onset: int
    kind: str
    every: int = 1


@dataclass(frozen=True, kw_only=True)
class SimulatorConfig:
    """The simulated job: its shape, its physics, its noise and its faults. Units are in field names.

    Big runs: events per rank-iteration grow with ``layers / pp * microbatches`` (kernels, TP all-reduces)
    and with iteration time / ``sample_interval_us`` (8 throughput values per sample). For hundreds of ranks
    keep ``layers`` at 8-16 and ``sample_interval_us`` at 2000-5000; see ``simulate``.
    """

    job: str = "demo"
    ranks: int = 16
    iterations: int = 40
    seed: int = 0
    gpus_per_host: int = 8
    faults: tuple[Fault, ...] = ()
    start_ns: int = DEFAULT_START_NS
    tp: int = 1
    """Tensor-parallel size: consecutive ranks; one all-reduce per layer in forward and in backward."""
    pp: int = 1
    """Pipeline stages; ``layers`` are split evenly across them (GPipe schedule)."""
    microbatches: int = 4
    """Microbatches per iteration when ``pp > 1`` (a job without pipeline runs one pass per iteration)."""
    layers: int = 12
    buckets: int = 6
    """Gradient buckets per stage (capped at its layer count), all-reduced among data-parallel peers."""
    bucket_bytes: int = 50_000_000
    tp_bytes: int = 8_000_000
    """Message size of each tensor-parallel all-reduce."""
    p2p_bytes: int = 16_000_000
    """Activation (forward) and gradient (backward) size sent between pipeline stages per microbatch."""
    link_peak_bytes_per_s: float = 25e9
    """NVLink, per direction: what a healthy link reaches while a transfer runs."""
    pcie_peak_bytes_per_s: float = 25e9
    """PCIe/NIC path of inter-node collectives, per direction."""
    sample_interval_us: int = 1000
    jitter: float = 0.02
    """Lognormal sigma of every kernel and host-span duration."""
    clock_skew_ms: float = 0.0
    """Each host's clock is off by a fixed uniform(-skew, +skew) value."""
    named_groups: bool = True
    """The published process groups carry Megatron's ``group_desc``; off: undescribed, so the layout is
    derived from their membership and the pipeline's p2p edges."""
    first_step: int = 0
    gc_rate: float = 0.1
    """Probability per rank-iteration of a short healthy ``gc.collect`` (about 0.5 ms)."""
    glitch_rate: float = 0.0
    """Probability per rank-iteration of a one-off slow iteration (compute or host x uniform(1.2, 1.5))."""
    pause_rate: float = 0.0
    """Probability per iteration of a job-wide ``checkpoint.save`` pause of 20-100 ms on every rank."""
    hang_tail_iterations: float = 8.0
    """After a hang, throughput samples go on for this many mean iteration times, then the stream ends."""
    flush_interval_ms: float = 0.0
    """0: one batch per rank, kind and iteration; > 0: batches cut as the real producers flush them (the
    ``Recorder`` and the NVML sampler: every 500 ms, at most ``MAX_BATCH_EVENTS`` events; see ``coalesce``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(self.faults))  # a list from a CLI stays hashable
        p: list[str] = []
        if not self.job or "/" in self.job:
            p.append(f"job must be non-empty without '/', got {self.job!r}")
        finite_pos = ("link_peak_bytes_per_s", "pcie_peak_bytes_per_s")
        checks = [
            ("ranks", self.ranks >= 2, ">= 2"),
            ("iterations", self.iterations >= 1, ">= 1"),
            ("gpus_per_host", self.gpus_per_host >= 1, ">= 1"),
            ("start_ns", self.start_ns >= 0, ">= 0"),
            ("tp", self.tp >= 1, ">= 1"),
            ("pp", self.pp >= 1, ">= 1"),
            ("microbatches", self.microbatches >= 1, ">= 1"),
            ("layers", self.layers >= 1, ">= 1"),
            ("buckets", self.buckets >= 1, ">= 1"),
            ("bucket_bytes", self.bucket_bytes >= 1, ">= 1"),
            ("tp_bytes", self.tp_bytes >= 1, ">= 1"),
            ("p2p_bytes", self.p2p_bytes >= 1, ">= 1"),
            *((n, math.isfinite(getattr(self, n)) and getattr(self, n) > 0, "> 0") for n in finite_pos),
            ("sample_interval_us", self.sample_interval_us >= 1, ">= 1"),
            ("jitter", 0.0 <= self.jitter < 0.5, "in [0, 0.5)"),
            ("clock_skew_ms", math.isfinite(self.clock_skew_ms) and self.clock_skew_ms >= 0, ">= 0"),
            ("first_step", self.first_step >= 0, ">= 0"),
            *((n, 0.0 <= getattr(self, n) <= 1.0, "in [0, 1]") for n in ("gc_rate", "glitch_rate", "pause_rate")),
            ("hang_tail_iterations", 0.0 <= self.hang_tail_iterations <= 1000, "in [0, 1000]"),
            ("flush_interval_ms", 0.0 <= self.flush_interval_ms <= 60_000, "in [0, 60000]"),
        ]
        p += [f"{name} must be {rule}, got {getattr(self, name)!r}" for name, ok, rule in checks if not ok]
        if self.tp >= 1 and self.pp >= 1 and self.ranks % (self.tp * self.pp):
            p.append(f"ranks ({self.ranks}) must be a multiple of tp * pp ({self.tp} * {self.pp})")
        if self.pp >= 1 and self.layers % self.pp:
            p.append(f"layers ({self.layers}) must be a multiple of pp ({self.pp}): stages get equal layers")
        p += self._fault_problems()
        if p:
            raise ValueError("invalid simulator config: " + "; ".join(p))

    def _fault_problems(self) -> list[str]:
        p: list[str] = []
        seen: set[tuple[str, str, object]] = set()
        hosts = (self.ranks - 1) // max(self.gpus_per_host, 1) + 1
        hangs = 0
        for i, fault in enumerate(self.faults):
            if not isinstance(fault, Fault):
                p.append(f"faults[{i}] is a {type(fault).__name__}, not a Fault")
                continue
            where = f"faults[{i}] ({fault.kind})"
            target, value = fault.target_key()
            if target == "rank" and fault.rank >= self.ranks:
                p.append(f"{where} targets rank {fault.rank}, but ranks = {self.ranks}")
            if target == "host" and (host_index(fault.host) or 0) >= hosts:
                p.append(f"{where} targets host {fault.host}, but the job has {hosts} hosts")
            if target == "stage" and self.pp < 2:
                p.append(f"{where} needs a pipeline (pp > 1), but pp = {self.pp}")
            elif target == "stage" and fault.stage >= self.pp:
                p.append(f"{where} targets stage {fault.stage}, but pp = {self.pp}")
            if fault.start >= self.iterations:
                p.append(f"{where} starts at iteration {fault.start}, but iterations = {self.iterations}")
            hangs += fault.kind == "hang"
            key = (fault.kind, target, value)
            if key in seen:
                p.append(f"faults[{i}]: duplicate {fault.kind} fault on {target} {value}".replace(" None", ""))
            seen.add(key)
        if hangs > 1:
            p.append("at most one hang fault: the job stops at the first")
        return p

    # -- layout ----------------------------------------------------------------------------------

    @property
    def dp(self) -> int:
        """Data-parallel size: ranks // (tp * pp)."""
        return self.ranks // (self.tp * self.pp)

    @property
    def hosts(self) -> int:
        """Number of hosts (the last one may hold fewer than ``gpus_per_host`` ranks)."""
        return (self.ranks - 1) // self.gpus_per_host + 1

    @property
    def pipeline_microbatches(self) -> int:
        """Microbatches actually run per iteration: ``microbatches`` with a pipeline, else 1."""
        return self.microbatches if self.pp > 1 else 1

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of a rank; Megatron order rank = pp*(dp*tp) + dp*tp + tp."""
        return rank % self.tp, rank // (self.dp * self.tp), (rank // self.tp) % self.dp

    def host_of(self, rank: int) -> str:
        return host_name(rank // self.gpus_per_host)

    @property
    def _hang(self) -> Fault | None:
        return next((f for f in self.faults if f.kind == "hang"), None)

    @property
    def expected_iterations(self) -> int:
        """Complete iterations every rank reports: all of them, or those before a hang."""
        return self._hang.start if self._hang is not None else self.iterations

    def fault_ranks(self, fault: Fault) -> tuple[int, ...]:
        """The ranks a fault acts on directly (its culprits)."""
        target = TARGETS[fault.kind]
        if target == "rank":
            return (fault.rank,)
        if target == "host":
            first = (host_index(fault.host) or 0) * self.gpus_per_host
            return tuple(range(first, min(first + self.gpus_per_host, self.ranks)))
        if target == "stage":
            size = self.dp * self.tp
            return tuple(range(fault.stage * size, (fault.stage + 1) * size))
        return tuple(range(self.ranks))

    def expected_findings(self) -> list[ExpectedFinding]:
        """Ground truth per fault, in the order of ``faults``."""
        out: list[ExpectedFinding] = []
        for f in self.faults:
            ranks = self.fault_ranks(f)
            hosts = {r // self.gpus_per_host for r in ranks}
            stages = {self.coordinates(r)[1] for r in ranks}
            out.append(
                ExpectedFinding(
                    category=f.category,
                    ranks=ranks,
                    host=host_name(hosts.pop()) if len(hosts) == 1 else "",
                    stage=stages.pop() if self.pp > 1 and len(stages) == 1 else -1,
                    onset=self.first_step + f.start,
                    kind=f.kind,
                    every=f.every,
                )
            )
        return out
