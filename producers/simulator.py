"""A seeded, deterministic data-parallel training fleet with fault injection.

Why: the detector must be tested, benchmarked and demonstrated on data whose ground truth is known. The
simulator follows the physics in DESIGN.md ("How faults show up"): every rank runs the same host script
(dataloader, forward, backward, optimizer), kernels queue on an in-order compute stream, gradient buckets are
all-reduced on a comm stream with ring physics shared by all ranks (a collective ends on every member at the
latest arrival plus one transfer time paced by the slowest link), and the step ends when the optimizer's
kernels finish. Faults change a rank's inputs only; their symptoms on the other ranks follow from the physics.

All physics runs in true time relative to ``start_ns``, in float ns; a host's clock skew is added only when
timestamps are written. Same config (seed included) => identical batches.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import BatchHeader, EventBatch, EventKind, step_marker_name

F64 = npt.NDArray[np.float64]

FAULT_KINDS = ("slow_gpu", "slow_link", "host_slow")
DEFAULT_FACTORS = {"slow_gpu": 1.5, "slow_link": 2.0, "host_slow": 3.0}
HOST_FUNCTIONS = ("dataloader.next", "forward", "backward", "optimizer.step")
DEFAULT_START_NS = 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z: runs are reproducible byte for byte
MAX_BATCH_EVENTS = 4096
COMPUTE_STREAM = 7
COMM_STREAM = 13
METRICS = ("nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s", "pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s")

_MS = 1e6  # ns
_HOST_BASE_NS = (4.0 * _MS, 12.0 * _MS, 20.0 * _MS, 3.0 * _MS)  # same order as HOST_FUNCTIONS
_HOST_GAP_NS = 0.05 * _MS
_STEP_GAP_NS = 0.2 * _MS
_NCCL_LATENCY_NS = 0.015 * _MS
_LAST_BUCKET_SHARE = 0.6
_PCIE_LOAD_BPS = 12e9
_PCIE_IDLE_BPS = 1e8
_MEMCPY = ("Memcpy HtoD (Pageable -> Device)", 1.0 * _MS)
_FORWARD = (
    ("ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_tn", 0.55 * _MS),  # qkv projection
    ("flash_fwd_kernel", 0.45 * _MS),
    ("ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_nn", 0.9 * _MS),  # mlp
    ("vectorized_layer_norm_kernel", 0.3 * _MS),
)
_BACKWARD = (  # about twice the forward time per layer
    ("flash_bwd_dq_dk_dv_loop_kernel", 1.1 * _MS),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_nt", 1.4 * _MS),  # dgrad
    ("ampere_bf16_s16816gemm_bf16_64x128_ldg8_f2f_tn", 1.4 * _MS),  # wgrad
    ("vectorized_layer_norm_backward_kernel", 0.5 * _MS),
)
_OPTIMIZER = (
    ("multi_tensor_apply_kernel", 0.6 * _MS),
    ("multi_tensor_apply_kernel", 0.6 * _MS),
    ("multi_tensor_apply_kernel", 0.6 * _MS),
    ("elementwise_kernel", 0.25 * _MS),
)
_COLLECTIVE_NAMES = ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "allreduce", "0")


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault on one rank; ``factor`` defaults per kind (see ``DEFAULT_FACTORS``).

    slow_gpu: the rank's compute kernels last ``factor`` times longer. slow_link: the rank's link bandwidth
    is divided by ``factor``. host_slow: the rank's host-side ``function`` lasts ``factor`` times longer.
    """

    kind: str
    rank: int
    factor: float | None = None
    """None means the kind's default; always a float after construction."""
    function: str = "dataloader.next"

    def __post_init__(self) -> None:
        problems: list[str] = []
        if self.kind not in FAULT_KINDS:
            problems.append(f"unknown fault kind {self.kind!r} (valid: {', '.join(FAULT_KINDS)})")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            problems.append(f"rank must be an integer >= 0, got {self.rank!r}")
        if self.factor is None:
            object.__setattr__(self, "factor", DEFAULT_FACTORS.get(self.kind, 1.0))
        factor = self.factor
        if not isinstance(factor, int | float) or not math.isfinite(factor) or factor <= 1.0:
            problems.append(f"factor must be a finite slowdown > 1, got {factor!r}")
        if self.kind == "host_slow" and self.function not in HOST_FUNCTIONS:
            problems.append(f"unknown host function {self.function!r} (valid: {', '.join(HOST_FUNCTIONS)})")
        if self.kind != "host_slow" and self.function != "dataloader.next":
            problems.append(f"function applies to host_slow faults only, not {self.kind!r}")
        if problems:
            raise ValueError("invalid fault: " + "; ".join(problems))

    @property
    def slowdown(self) -> float:
        """The resolved factor as a plain float."""
        return float(self.factor if self.factor is not None else DEFAULT_FACTORS[self.kind])


def parse_fault(spec: str) -> Fault:
    """Parse a CLI fault spec ``kind:rank[:factor[:function]]``, e.g. ``host_slow:3:2.5:optimizer.step``."""
    parts = spec.strip().split(":")
    if not 2 <= len(parts) <= 4 or not all(parts):
        raise ValueError(f"bad fault spec {spec!r}: expected kind:rank[:factor[:function]]")
    kind, rank_text, *rest = parts
    if kind not in FAULT_KINDS:
        raise ValueError(f"bad fault spec {spec!r}: unknown kind {kind!r} (valid: {', '.join(FAULT_KINDS)})")
    try:
        rank = int(rank_text)
    except ValueError:
        raise ValueError(f"bad fault spec {spec!r}: rank {rank_text!r} is not an integer") from None
    factor: float | None = None
    if rest:
        try:
            factor = float(rest[0])
        except ValueError:
            raise ValueError(f"bad fault spec {spec!r}: factor {rest[0]!r} is not a number") from None
    kwargs: dict[str, Any] = {"kind": kind, "rank": rank, "factor": factor}
    if len(rest) == 2:
        kwargs["function"] = rest[1]
    try:
        return Fault(**kwargs)
    except ValueError as exc:
        raise ValueError(f"bad fault spec {spec!r}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class SimulatorConfig:
    """The simulated job: its shape, its physics and its faults. Durations and rates carry units in names."""

    job: str = "demo"
    ranks: int = 16
    iterations: int = 40
    seed: int = 0
    gpus_per_host: int = 8
    faults: tuple[Fault, ...] = ()
    start_ns: int = DEFAULT_START_NS
    layers: int = 12
    buckets: int = 6
    bucket_bytes: int = 50_000_000
    link_peak_bytes_per_s: float = 25e9
    """Per direction: what a healthy link reaches while a transfer runs."""
    sample_interval_us: int = 1000
    jitter: float = 0.02
    """Lognormal sigma of kernel durations (host spans get twice as much)."""
    clock_skew_ms: float = 0.0
    """Each host's clock is off by a fixed uniform(-skew, +skew) value."""
    first_step: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(self.faults))  # a list from a CLI stays hashable
        p: list[str] = []
        if not self.job or "/" in self.job:
            p.append(f"job must be non-empty without '/', got {self.job!r}")
        checks = (
            ("ranks", self.ranks >= 2, ">= 2"),
            ("iterations", self.iterations >= 1, ">= 1"),
            ("gpus_per_host", self.gpus_per_host >= 1, ">= 1"),
            ("start_ns", self.start_ns >= 0, ">= 0"),
            ("layers", self.layers >= 1, ">= 1"),
            ("buckets", 1 <= self.buckets <= self.layers, f"in 1..layers ({self.layers})"),
            ("bucket_bytes", self.bucket_bytes >= 1, ">= 1"),
            (
                "link_peak_bytes_per_s",
                math.isfinite(self.link_peak_bytes_per_s) and self.link_peak_bytes_per_s > 0,
                "> 0",
            ),
            ("sample_interval_us", self.sample_interval_us >= 1, ">= 1"),
            ("jitter", 0.0 <= self.jitter < 0.5, "in [0, 0.5)"),
            ("clock_skew_ms", math.isfinite(self.clock_skew_ms) and self.clock_skew_ms >= 0, ">= 0"),
            ("first_step", self.first_step >= 0, ">= 0"),
        )
        p += [f"{name} must be {rule}, got {getattr(self, name)!r}" for name, ok, rule in checks if not ok]
        seen: set[tuple[str, int]] = set()
        for i, fault in enumerate(self.faults):
            if not isinstance(fault, Fault):
                p.append(f"faults[{i}] is a {type(fault).__name__}, not a Fault")
                continue
            if fault.rank >= self.ranks:
                p.append(f"faults[{i}] ({fault.kind}) targets rank {fault.rank}, but ranks = {self.ranks}")
            if (fault.kind, fault.rank) in seen:
                p.append(f"faults[{i}]: duplicate {fault.kind} fault on rank {fault.rank}")
            seen.add((fault.kind, fault.rank))
        if p:
            raise ValueError("invalid simulator config: " + "; ".join(p))

    @property
    def expected_iterations(self) -> int:
        """Complete iterations every rank will report (the simulator never truncates a step)."""
        return self.iterations


ALL_STREAMS = tuple(kind.value for kind in EventKind)


def gpu_uuid(job: str, rank: int) -> str:
    """A stable, UUID-shaped id for a simulated GPU."""
    h = hashlib.sha256(f"{job}/{rank}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass(slots=True)
class _Iteration:
    """One iteration of all ranks, in true time (float ns relative to start_ns); arrays are (ranks, ...)."""

    step: int
    host_start: F64  # (R, 4), HOST_FUNCTIONS order
    host_end: F64
    h0: F64  # (R,)
    step_end: F64
    k_launch: F64  # (R, K)
    k_start: F64
    k_end: F64
    c_ready: F64  # (R, B)
    c_arrive: F64
    c_end: F64  # (B,)
    c_rate: F64  # (B,) per-link bytes/s the ring achieved (its slowest link)
    c_bytes: npt.NDArray[np.int64]  # (B,)
    samples: list[tuple[F64, F64]]  # per rank: (t (n,), values (n, 4))


class _Fleet:
    """The evolving state of the simulated job (stream-free times, rng) and its per-rank fault inputs."""

    def __init__(self, cfg: SimulatorConfig) -> None:
        self.cfg = cfg
        r = cfg.ranks
        physics_seq, skew_seq = np.random.SeedSequence(cfg.seed).spawn(2)
        self.rng = np.random.default_rng(physics_seq)
        n_hosts = (r - 1) // cfg.gpus_per_host + 1
        skew_ms = np.random.default_rng(skew_seq).uniform(-cfg.clock_skew_ms, cfg.clock_skew_ms, n_hosts)
        self.host_offset_ns = np.rint(skew_ms * _MS).astype(np.int64)
        self.gpu_factor = np.ones(r)
        self.link_factor = np.ones(r)
        self.host_factor = np.ones((r, len(HOST_FUNCTIONS)))
        for f in cfg.faults:
            if f.kind == "slow_gpu":
                self.gpu_factor[f.rank] = f.slowdown
            elif f.kind == "slow_link":
                self.link_factor[f.rank] = f.slowdown
            else:
                self.host_factor[f.rank, HOST_FUNCTIONS.index(f.function)] = f.slowdown
        # Compute-stream program of one iteration: memcpy, forward, backward (reversed layers), optimizer.
        self.kernel_names = list(dict.fromkeys(n for n, _ in (_MEMCPY, *_FORWARD, *_BACKWARD, *_OPTIMIZER)))
        ids = {n: i for i, n in enumerate(self.kernel_names)}
        fwd = [k for _ in range(cfg.layers) for k in _FORWARD]
        bwd = [k for _ in range(cfg.layers) for k in _BACKWARD]
        program = [_MEMCPY, *fwd, *bwd]
        self.n_fwd, self.n_bwd = len(fwd), len(bwd)
        self.main_ids = np.array([ids[n] for n, _ in program], dtype=np.int32)
        self.main_base = np.array([d for _, d in program])
        self.opt_ids = np.array([ids[n] for n, _ in _OPTIMIZER], dtype=np.int32)
        self.opt_base = np.array([d for _, d in _OPTIMIZER])
        # Backward runs layers L-1..0; buckets group them in that order; a bucket is ready at its last kernel.
        groups = np.array_split(np.arange(cfg.layers), cfg.buckets)
        per_layer = len(_BACKWARD)
        self.bucket_last = np.array([1 + self.n_fwd + (g[-1] + 1) * per_layer - 1 for g in groups])
        sizes = np.full(cfg.buckets, cfg.bucket_bytes, dtype=np.int64)
        if cfg.buckets > 1:
            sizes[-1] = max(1, int(cfg.bucket_bytes * _LAST_BUCKET_SHARE))
        self.bucket_bytes = sizes
        self.h0 = np.zeros(r)
        self.compute_free = np.zeros(r)
        self.comm_free = np.zeros(r)

    def _lognormal(self, sigma: float, shape: tuple[int, ...]) -> F64:
        return np.exp(self.rng.normal(0.0, sigma, shape)) if sigma > 0 else np.ones(shape)

    def step(self, i: int) -> _Iteration:
        """Advance every rank by one iteration."""
        cfg, rng, n = self.cfg, self.rng, self.cfg.ranks
        # 1. Host spans, back to back; host_slow stretches one of them and shifts the rest.
        host_dur = np.array(_HOST_BASE_NS) * self.host_factor * self._lognormal(2 * cfg.jitter, (n, 4))
        gaps = _HOST_GAP_NS * self._lognormal(2 * cfg.jitter, (n, 4))
        gaps[:, 0] = 0.0
        host_end = self.h0[:, None] + np.cumsum(gaps + host_dur, axis=1)
        host_start = host_end - host_dur
        # 2. Compute stream: memcpy at the end of dataloader.next, kernels launched evenly across their span.
        launch = np.concatenate(
            [
                host_end[:, :1],
                _spread(host_start[:, 1], host_dur[:, 1], self.n_fwd),
                _spread(host_start[:, 2], host_dur[:, 2], self.n_bwd),
            ],
            axis=1,
        )
        factor = np.where(np.arange(self.main_base.size) == 0, 1.0, self.gpu_factor[:, None])
        dur = self.main_base * factor * self._lognormal(cfg.jitter, launch.shape)
        k_start, k_end = _in_order_stream(launch, dur, self.compute_free)
        # 3. Gradient all-reduce per bucket: ring paced by the slowest link, ends together on every rank.
        ready = k_end[:, self.bucket_last]
        arrive = np.empty_like(ready)
        c_end = np.empty(cfg.buckets)
        c_rate = np.empty(cfg.buckets)
        peak = cfg.link_peak_bytes_per_s
        for b in range(cfg.buckets):
            bw = peak / self.link_factor * rng.uniform(1.0 - cfg.jitter, 1.0, n)
            c_rate[b] = bw.min()
            transfer_ns = 2.0 * (n - 1) / n * self.bucket_bytes[b] / c_rate[b] * 1e9
            arrive[:, b] = np.maximum(ready[:, b], self.comm_free)
            c_end[b] = arrive[:, b].max() + _NCCL_LATENCY_NS + transfer_ns
            self.comm_free = np.full(n, c_end[b])
        # 4. Optimizer kernels wait for the last all-reduce; the step ends at loss.item() (host or GPU).
        opt_launch = _spread(host_start[:, 3], host_dur[:, 3], len(_OPTIMIZER))
        opt_dur = self.opt_base * self.gpu_factor[:, None] * self._lognormal(cfg.jitter, opt_launch.shape)
        o_start, o_end = _in_order_stream(opt_launch, opt_dur, np.maximum(k_end[:, -1], c_end[-1]))
        step_end = np.maximum(host_end[:, 3], o_end[:, -1])
        next_h0 = step_end + _STEP_GAP_NS * self._lognormal(2 * cfg.jitter, (n,))
        it = _Iteration(
            step=cfg.first_step + i,
            host_start=host_start,
            host_end=host_end,
            h0=self.h0.copy(),
            step_end=step_end,
            k_launch=np.concatenate([launch, opt_launch], axis=1),
            k_start=np.concatenate([k_start, o_start], axis=1),
            k_end=np.concatenate([k_end, o_end], axis=1),
            c_ready=ready,
            c_arrive=arrive,
            c_end=c_end,
            c_rate=c_rate,
            c_bytes=self.bucket_bytes,
            samples=[],
        )
        # 5. Hardware samples on a fixed true-time grid, tiling [h0, next h0) of each rank.
        it.samples = [self._samples(it, r, next_h0[r]) for r in range(n)]
        self.h0 = next_h0
        self.compute_free = o_end[:, -1]
        return it

    def _samples(self, it: _Iteration, r: int, until: float) -> tuple[F64, F64]:
        """NVLink/PCIe rates of rank r: bursty at peak on healthy links, steady and low on a slow one."""
        cfg, rng = self.cfg, self.rng
        dt = cfg.sample_interval_us * 1000
        t = np.arange(math.ceil(it.h0[r] / dt), math.ceil(until / dt), dtype=np.float64) * dt
        peak = cfg.link_peak_bytes_per_s
        last_arrival = it.c_arrive.max(axis=0)
        in_transfer = (t[:, None] >= last_arrival) & (t[:, None] < it.c_end)
        transfer = in_transfer.any(axis=1)
        waiting = ((t[:, None] >= it.c_arrive[r]) & (t[:, None] < last_arrival)).any(axis=1) & ~transfer
        # A healthy link moves the ring's bytes in bursts at full peak: busy for rate/peak of the time.
        p_burst = np.where(in_transfer, np.maximum(0.2, it.c_rate / peak), 0.0).max(axis=1)
        u, coin = rng.random((t.size, 2)), rng.random((t.size, 2))
        if self.link_factor[r] > 1.0:
            busy = peak / self.link_factor[r] * (0.95 + 0.05 * u)
        else:
            busy = np.where(coin < p_burst[:, None], peak * (0.9 + 0.1 * u), peak * (0.05 + 0.35 * u))
        quiet = np.where(waiting[:, None], 0.02, 0.01) * peak * u
        nvlink = np.where(transfer[:, None], busy, quiet)
        in_dataloader = (t >= it.h0[r]) & (t < it.host_end[r, 0])
        in_memcpy = (t >= it.k_start[r, 0]) & (t < it.k_end[r, 0])
        pu = rng.random((t.size, 2))
        pcie_tx = _PCIE_IDLE_BPS * (0.5 + pu[:, 0])
        loading = _PCIE_LOAD_BPS * (0.3 + 0.3 * pu[:, 1])
        pcie_rx = np.where(in_dataloader | in_memcpy, loading, _PCIE_IDLE_BPS * (0.5 + pu[:, 1]))
        return t, np.column_stack([nvlink, pcie_tx, pcie_rx])

    def batches(self, it: _Iteration, r: int, seq: int) -> list[EventBatch]:
        """The four batches (kernels, collectives, python, throughput) of rank r's iteration."""
        cfg = self.cfg
        offset = cfg.start_ns + int(self.host_offset_ns[r // cfg.gpus_per_host])

        def ts(x: F64) -> npt.NDArray[np.int64]:
            return np.rint(x).astype(np.int64) + offset

        def header(sent_ns: int) -> BatchHeader:
            nonlocal seq
            seq += 1
            return BatchHeader(
                job=cfg.job,
                rank=r,
                world_size=cfg.ranks,
                producer_id=f"sim-{cfg.job}-{r}",
                seq=seq - 1,
                local_rank=r % cfg.gpus_per_host,
                host=f"node{r // cfg.gpus_per_host:03d}",
                gpu_uuid=gpu_uuid(cfg.job, r),
                tp_rank=0,
                pp_rank=0,
                dp_rank=r,
                tp_size=1,
                pp_size=1,
                dp_size=cfg.ranks,
                streams=ALL_STREAMS,
                sent_ns=sent_ns,
            )

        out: list[EventBatch] = []

        def emit(kind: EventKind, names: list[str], cols: dict[str, npt.NDArray[Any]], ends: Any) -> None:
            """Append the kind's batches, split at MAX_BATCH_EVENTS; ``ends`` gives each batch's sent_ns."""
            size = len(next(iter(cols.values())))
            for lo in range(0, size, MAX_BATCH_EVENTS):  # an empty kind sends nothing
                sl = slice(lo, lo + MAX_BATCH_EVENTS)
                sent = int(np.max(ends[sl]))
                chunk = {k: v[sl] for k, v in cols.items()}
                out.append(EventBatch(kind=kind, header=header(sent), names=names, columns=chunk))

        k_s, k_e = ts(it.k_start[r]), ts(it.k_end[r])
        emit(
            EventKind.KERNELS,
            self.kernel_names,
            {
                "start_ns": k_s,
                "dur_ns": k_e - k_s,
                "name_id": np.concatenate([self.main_ids, self.opt_ids]),
                "stream": np.full(k_s.size, COMPUTE_STREAM, dtype=np.int32),
                "launch_ns": ts(it.k_launch[r]),
            },
            k_e,
        )
        c_s, c_e, nb = ts(it.c_arrive[r]), ts(it.c_end), it.c_bytes.size
        emit(
            EventKind.COLLECTIVES,
            list(_COLLECTIVE_NAMES),
            {
                "start_ns": c_s,
                "dur_ns": c_e - c_s,
                "name_id": np.zeros(nb, np.int32),
                "op_id": np.ones(nb, np.int32),
                "pg_id": np.full(nb, 2, np.int32),
                "seq": it.step * cfg.buckets + np.arange(nb, dtype=np.int64),
                "group_size": np.full(nb, cfg.ranks, np.int32),
                "nbytes": it.c_bytes,
                "launch_ns": ts(it.c_ready[r]),
            },
            c_e,
        )
        p_s = ts(np.concatenate([it.h0[r : r + 1], it.host_start[r]]))
        p_e = ts(np.concatenate([it.step_end[r : r + 1], it.host_end[r]]))
        emit(
            EventKind.PYTHON,
            [step_marker_name(it.step), *HOST_FUNCTIONS],
            {
                "start_ns": p_s,
                "dur_ns": p_e - p_s,
                "name_id": np.arange(5, dtype=np.int32),
                "depth": np.array([0, 1, 1, 1, 1], dtype=np.int32),
            },
            p_e,
        )
        t, values = it.samples[r]
        t_ns = np.repeat(ts(t), len(METRICS))
        emit(
            EventKind.THROUGHPUT,
            list(METRICS),
            {
                "t_ns": t_ns,
                "metric_id": np.tile(np.arange(len(METRICS), dtype=np.int32), t.size),
                "value": values.reshape(-1),
            },
            t_ns,
        )
        return out


def _spread(start: F64, dur: F64, k: int) -> F64:
    """Launch times of k kernels spread evenly across each rank's host span."""
    return start[:, None] + (np.arange(k) + 0.5) / k * dur[:, None]


def _in_order_stream(launch: F64, dur: F64, free: F64) -> tuple[F64, F64]:
    """Start/end of kernels on in-order streams (one per row): each starts at max(launch, previous end).

    Closed form of the recurrence: end_j = C_j + max_{k<=j}(launch_k - C_{k-1}), C = cumsum(dur).
    """
    eff = launch.copy()
    eff[:, 0] = np.maximum(eff[:, 0], free)
    c = np.cumsum(dur, axis=1)
    end = c + np.maximum.accumulate(eff - (c - dur), axis=1)
    return end - dur, end


def simulate(config: SimulatorConfig) -> Iterator[EventBatch]:
    """Yield, iteration by iteration and rank by rank, the rank's kernel, collective, python and throughput
    batches (a kind with more than ``MAX_BATCH_EVENTS`` events is split into several batches)."""
    fleet = _Fleet(config)
    seqs = [0] * config.ranks
    for i in range(config.iterations):
        it = fleet.step(i)
        for r in range(config.ranks):
            batches = fleet.batches(it, r, seqs[r])
            seqs[r] += len(batches)
            yield from batches
