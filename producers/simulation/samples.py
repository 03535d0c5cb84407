"""NVML-style throughput samples of every rank, on a fixed true-time grid, vectorised across ranks.

Why: a slow link is seen in its throughput during transfers, not in collective durations (DESIGN.md). The
patterns: a healthy link moves a ring's bytes in bursts at full peak (busy for rate/peak of the time); a
degraded one (slow NVLink, downgraded PCIe) is saturated at its reduced capacity, low and steady; a
congested NIC fluctuates between near peak and near zero, the same pattern on every rank of its host.
Outside transfers links idle (a little more while waiting inside a collective); PCIe also carries the
host-to-device input copy during ``dataloader.next`` and the memcpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fleetscope.producers.simulation.engine import Timeline
from fleetscope.producers.simulation.program import Layout

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

METRICS = (
    "nvlink_tx_bytes_per_s",
    "nvlink_rx_bytes_per_s",
    "pcie_tx_bytes_per_s",
    "pcie_rx_bytes_per_s",
    "pcie_gen",
    "pcie_gen_max",
    "pcie_width",
    "pcie_width_max",
)
PCIE_GEN_MAX = 5
PCIE_WIDTH_MAX = 16
PCIE_LOAD_BPS = 12e9
PCIE_IDLE_BPS = 1e8


def pcie_link_state(factor: F64) -> tuple[F64, F64]:
    """(gen, width) per rank of PCIe links running at 1/factor of their bandwidth: a loss up to 2.5x reads
    as width x8 at gen 5, a larger one as gen 3 at x16 (a quarter of gen 5)."""
    down = factor > 1.0
    gen = np.where(down & (factor >= 2.5), 3.0, float(PCIE_GEN_MAX))
    width = np.where(down & (factor < 2.5), 8.0, float(PCIE_WIDTH_MAX))
    return gen, width


@dataclass(slots=True)
class LinkState:
    """Per-rank link condition in one iteration (factors are slowdowns, 1 = healthy)."""

    nvlink_factor: F64  # (R,)
    pcie_factor: F64  # (R,)
    congestion: F64  # (hosts,)
    pcie_gen: F64  # (R,)
    pcie_width: F64  # (R,)


@dataclass(slots=True)
class Samples:
    """Rank r's samples are k in [lo[r], hi[r]), taken at ``(k0 + k) * dt_ns``; values (R, S, metrics)."""

    k0: int
    dt_ns: int
    lo: I64
    hi: I64
    values: F64


def _on(u: F64) -> F64:
    """A burst: 90-100 % of peak (mean 0.95)."""
    return 0.9 + 0.1 * u


def _off(u: F64) -> F64:
    """Between bursts: 5-40 % of peak (mean 0.225)."""
    return 0.05 + 0.35 * u


def _burst_share(load: F64) -> F64:
    """Share of samples in a burst so that the mean equals the link's load (bytes are conserved), at
    least 0.2 so that a healthy link always shows its full peak."""
    return np.clip((load - 0.225) / (0.95 - 0.225), 0.2, 1.0)[..., None]


def _occupancy(n: int, s: int, dt: float, k0: int, rows: I64, a: F64, b: F64, w: F64 | None) -> F64:
    """(R, S) sum over intervals [a, b) of ``w`` (or 1) at each grid sample inside them (difference array)."""
    a, b = np.nan_to_num(a, nan=np.inf), np.nan_to_num(b, nan=np.inf)  # never started / never ends
    ia = np.clip(np.ceil(a / dt) - k0, 0, s).astype(np.int64)
    ib = np.clip(np.ceil(b / dt) - k0, 0, s).astype(np.int64)
    keep = ib > ia
    base = rows[keep] * (s + 1)
    weights = None if w is None else w[keep]
    size = n * (s + 1)
    acc = np.bincount(base + ia[keep], weights, size) - np.bincount(base + ib[keep], weights, size)
    return np.cumsum(acc.reshape(n, s + 1), axis=1)[:, :s]


def sample(lay: Layout, tl: Timeline, state: LinkState, until: F64, rng: np.random.Generator) -> Samples:
    """Samples of [h0, until) for every rank, drawn from one generator (R x S values per draw)."""
    cfg = lay.cfg
    n = lay.ranks
    dt_ns = cfg.sample_interval_us * 1000
    dt = float(dt_ns)
    lo_abs = np.ceil(tl.h0 / dt).astype(np.int64)
    hi_abs = np.ceil(until / dt).astype(np.int64)
    k0 = int(lo_abs.min())
    s = max(int(hi_abs.max()) - k0, 0)

    def occ(rows: I64, a: F64, b: F64, w: F64 | None = None) -> F64:
        return _occupancy(n, s, dt, k0, rows, a, b, w)

    if tl.xfer:
        rows, a, b, rate, on_nv, on_nic = (np.concatenate(x) for x in zip(*tl.xfer, strict=True))
        nv_busy = occ(rows[on_nv], a[on_nv], b[on_nv])
        nv_rate = occ(rows[on_nv], a[on_nv], b[on_nv], rate[on_nv])
        nic_busy = occ(rows[on_nic], a[on_nic], b[on_nic])
        nic_rate = occ(rows[on_nic], a[on_nic], b[on_nic], rate[on_nic])
    else:
        nv_busy = nv_rate = nic_busy = nic_rate = np.zeros((n, s))
    if tl.wait:
        rows, a, b = (np.concatenate(x) for x in zip(*tl.wait, strict=True))
        waiting = occ(rows, a, b) > 0.5
    else:
        waiting = np.zeros((n, s), bool)
    everyone = np.arange(n)
    h2d = (occ(everyone, tl.h2d[:, 0], tl.h2d[:, 1]) + occ(everyone, tl.h2d[:, 2], tl.h2d[:, 3])) > 0.5

    values = np.empty((n, s, len(METRICS)))
    u, coin, pu, pcoin = (rng.random((n, s, 2)) for _ in range(4))
    cong_u, cong_v = rng.random((lay.hosts, s)), rng.random((lay.hosts, s))

    nv_peak = cfg.link_peak_bytes_per_s
    healthy = np.where(coin < _burst_share(nv_rate / nv_peak), nv_peak * _on(u), nv_peak * _off(u))
    f = state.nvlink_factor[:, None, None]
    busy = np.where(f > 1.0, nv_peak / f * (0.95 + 0.05 * u), healthy)
    quiet = np.where(waiting, 0.02, 0.01)[..., None] * nv_peak * u
    values[..., 0:2] = np.where((nv_busy > 0.5)[..., None], busy, quiet)

    p_peak = cfg.pcie_peak_bytes_per_s
    nic = np.where(pcoin < _burst_share(nic_rate / p_peak), p_peak * _on(pu), p_peak * _off(pu))
    f = state.pcie_factor[:, None, None]
    nic = np.where(f > 1.0, p_peak / f * (0.95 + 0.05 * pu), nic)
    c = state.congestion
    if (c > 1).any():  # on a congested host every rank sees the same fluctuation, averaging peak / factor
        q = np.clip((1.0 / c - 0.015) / (0.975 - 0.015), 0.0, 1.0)[:, None]
        pattern = np.where(cong_u < q, p_peak * (0.95 + 0.05 * cong_v), p_peak * 0.03 * cong_v)
        shared = pattern[lay.host] / np.maximum(state.pcie_factor, 1.0)[:, None]
        nic = np.where((c > 1)[lay.host][:, None, None], shared[..., None], nic)
    idle = PCIE_IDLE_BPS * (0.5 + pu)
    loading = PCIE_LOAD_BPS * (0.3 + 0.3 * pu[..., 1])
    in_nic = (nic_busy > 0.5)[..., None]
    values[..., 2:4] = np.where(in_nic, nic, idle)
    values[..., 3] = np.where(~in_nic[..., 0] & h2d, loading, values[..., 3])
    values[..., 4] = state.pcie_gen[:, None]
    values[..., 5] = PCIE_GEN_MAX
    values[..., 6] = state.pcie_width[:, None]
    values[..., 7] = PCIE_WIDTH_MAX
    return Samples(k0=k0, dt_ns=dt_ns, lo=lo_abs - k0, hi=np.maximum(hi_abs - k0, lo_abs - k0), values=values)


def grid_ns(smp: Samples) -> I64:
    """True-time sample instants of the grid (ns relative to ``start_ns``)."""
    return (smp.k0 + np.arange(smp.values.shape[1], dtype=np.int64)) * smp.dt_ns
