"""Run a simulated job: resolve faults and noise per iteration, advance the physics, emit the batches.

Why here: faults change a rank's inputs only (its compute, host time, links); every symptom on the other
ranks follows from the physics in ``engine``. Host faults are sized on the job's healthy iteration time,
measured by running the same physics without faults or noise first, so ``x1.1`` always costs about 10 %.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from fleetscope.producers.simulation.config import SimulatorConfig
from fleetscope.producers.simulation.emit import Emitter, coalesce
from fleetscope.producers.simulation.engine import Engine, Inputs, Timeline
from fleetscope.producers.simulation.faults import GC_FUNCTION, HOST_FUNCTIONS, host_index
from fleetscope.producers.simulation.program import Layout
from fleetscope.producers.simulation.samples import (
    LinkState,
    pcie_link_state,
    sample,
)
from fleetscope.schemas import EventBatch

_MS = 1e6
HEALTHY_GC_NS = 0.5 * _MS
PAUSE_NS = (20 * _MS, 100 * _MS)
GLITCH = (1.2, 1.5)


def healthy_iteration_ns(lay: Layout) -> float:
    """Mean iteration time of the job without faults or noise (second iteration: steady pipeline)."""
    cfg, n = lay.cfg, lay.ranks
    engine = Engine(lay, np.random.default_rng(0), np.random.default_rng(0))
    quiet = Inputs(
        step=0,
        gpu_factor=np.ones(n),
        host_factor=np.ones(n),
        host_extra_ns=np.zeros((n, len(HOST_FUNCTIONS))),
        gc_ns=np.zeros(n),
        pause_ns=0.0,
        nvlink_bps=np.full(n, cfg.link_peak_bytes_per_s),
        pcie_bps=np.full(n, cfg.pcie_peak_bytes_per_s),
        congestion=np.ones(cfg.hosts),
    )
    engine.run(quiet)
    tl = engine.run(quiet)
    return float(np.mean(tl.next_h0 - tl.h0))


class Fleet:
    """The simulated job, iteration by iteration, with its random streams and fault inputs."""

    def __init__(self, cfg: SimulatorConfig) -> None:
        self.cfg = cfg
        self.lay = Layout(cfg)
        physics, skew, noise, samples, congestion = np.random.SeedSequence(cfg.seed).spawn(5)
        skew_ms = np.random.default_rng(skew).uniform(-cfg.clock_skew_ms, cfg.clock_skew_ms, cfg.hosts)
        self.engine = Engine(self.lay, np.random.default_rng(physics), np.random.default_rng(congestion))
        self.noise = np.random.default_rng(noise)
        self.sample_rng = np.random.default_rng(samples)
        self.emitter = Emitter(self.lay, np.rint(skew_ms * _MS).astype(np.int64))
        self.healthy_ns = healthy_iteration_ns(self.lay)

    def inputs(self, i: int) -> tuple[Inputs, LinkState]:
        """Fault effects and noise of iteration i (0-based), with a fixed number of draws per iteration."""
        cfg, lay, rng = self.cfg, self.lay, self.noise
        n = lay.ranks
        gpu, host = np.ones(n), np.ones(n)
        extra = np.zeros((n, len(HOST_FUNCTIONS)))
        gc_fault = np.zeros(n)
        nv_f, pcie_f, congestion = np.ones(n), np.ones(n), np.ones(cfg.hosts)
        hang = -1
        for f in cfg.faults:
            if f.kind == "hang":
                hang = f.rank if i == f.start else hang
                continue
            if not f.active(i):
                continue
            ranks, x = list(cfg.fault_ranks(f)), f.slowdown
            cost = (x - 1.0) * self.healthy_ns  # host faults are sized on the iteration
            if f.kind in ("slow_gpu", "stage_imbalance", "job_slowdown"):
                gpu[ranks] *= x
            elif f.kind == "slow_link":
                nv_f[ranks] *= x
            elif f.kind == "pcie_downgrade":
                pcie_f[ranks] *= x
            elif f.kind == "cpu_contention":
                host[ranks] *= x
            elif f.kind == "dataloader_stall":
                extra[ranks, 0] += cost
            elif f.kind == "host_slow" and f.function == GC_FUNCTION:
                gc_fault[ranks] += cost
            elif f.kind == "host_slow":
                extra[ranks, HOST_FUNCTIONS.index(f.function)] += cost
            elif f.kind == "net_congestion":
                congestion[host_index(f.host) or 0] *= x
        glitch = rng.random(n) < cfg.glitch_rate
        on_gpu = rng.random(n) < 0.5
        glitch_x = rng.uniform(*GLITCH, n)
        gpu *= np.where(glitch & on_gpu, glitch_x, 1.0)
        host *= np.where(glitch & ~on_gpu, glitch_x, 1.0)
        gc_jitter = np.exp(rng.normal(0.0, cfg.jitter, n)) if cfg.jitter > 0 else np.ones(n)
        gc_healthy = np.where(rng.random(n) < cfg.gc_rate, HEALTHY_GC_NS * gc_jitter, 0.0)
        pause = rng.uniform(*PAUSE_NS) if rng.random() < cfg.pause_rate else 0.0
        gen, width = pcie_link_state(pcie_f)
        inp = Inputs(
            step=cfg.first_step + i,
            gpu_factor=gpu,
            host_factor=host,
            host_extra_ns=extra,
            gc_ns=(gc_healthy + gc_fault) * host,
            pause_ns=float(pause),
            nvlink_bps=cfg.link_peak_bytes_per_s / nv_f,
            pcie_bps=cfg.pcie_peak_bytes_per_s / pcie_f,
            congestion=congestion,
            hang_rank=hang,
            jitter=cfg.jitter,
        )
        state = LinkState(
            nvlink_factor=nv_f,
            pcie_factor=pcie_f,
            congestion=congestion,
            pcie_gen=gen,
            pcie_width=width,
        )
        return inp, state

    def run(self) -> Iterator[EventBatch]:
        durations: list[float] = []
        for i in range(self.cfg.iterations):
            inp, state = self.inputs(i)
            tl: Timeline = self.engine.run(inp)
            if inp.hang_rank < 0:
                until = tl.next_h0
            else:  # the NVML sampler keeps running after the job stopped
                mean = float(np.mean(durations)) if durations else self.healthy_ns
                until = np.full(self.lay.ranks, tl.stop_ns + self.cfg.hang_tail_iterations * mean)
            smp = sample(self.lay, tl, state, until, self.sample_rng)
            yield from self.emitter.iteration(tl, smp)
            if inp.hang_rank >= 0:
                return
            durations.append(float(np.mean(tl.next_h0 - tl.h0)))


def simulate(config: SimulatorConfig) -> Iterator[EventBatch]:
    """Yield, iteration by iteration and rank by rank, the rank's kernel, collective, python and throughput
    batches (a kind with more than ``MAX_BATCH_EVENTS`` events is split into several batches).

    Same config (seed included) => identical batches. Cost grows with ranks x iterations x events per
    rank-iteration; 512 ranks x 20 iterations at the defaults take a few seconds. For big layouts keep
    ``layers`` small (8-16) and raise ``sample_interval_us`` (2000-5000): kernels and samples dominate.
    """
    batches = Fleet(config).run()
    if config.flush_interval_ms > 0:
        batches = coalesce(batches, int(config.flush_interval_ms * 1e6))
    yield from batches
