"""Physics of one training iteration of the whole job, vectorised across ranks.

Why: the detector must be judged on data whose causes are known and whose symptoms follow from the
physics of how faults show up, not from hand-written symptoms. Model, in true time (float ns
relative to ``start_ns``; clock skew is added only when timestamps are written):

1. Host (CPU): ``dataloader.next``, then per microbatch a ``forward`` launch span, then per microbatch a
   ``backward`` launch span; kernels are launched evenly across their span. The CPU runs ahead of the GPU
   until it blocks for the gradients (the found-inf/grad-norm ``.item()`` before the optimizer), then runs
   ``gc.collect`` (when one happens), ``optimizer.step`` and, rarely, ``checkpoint.save``; the step ends at
   ``loss.item()`` (host and GPU done).
2. GPU compute stream, in order: H2D memcpy, then forward and backward kernels; each kernel starts at
   max(launch, previous end). Tensor-parallel all-reduces (one per layer and direction) sit on this stream.
3. A collective ends on every member at (last arrival) + latency + transfer, the transfer paced by the
   group's slowest link; a group spanning hosts moves its bytes over PCIe/NIC (and NVLink when a host holds
   two or more members), a group inside one host over NVLink.
4. Pipeline (GPipe): stage s receives the microbatch from s-1, runs its layers, sends to s+1; the backward
   flows in reverse. A transfer starts when both sides have posted (each side's stream reached it) and both
   streams wait for it, so a slow stage makes the next stages wait in ``recv`` and bubbles emerge.
5. Data-parallel gradient buckets are all-reduced on a separate comm stream as soon as the last
   microbatch's backward has produced them, overlapping the rest of the backward.

A hang is modelled with infinity: the hung rank's launches after its stop time never happen, so every
collective that needs it never ends, and everything that waits for those never starts. Events that do not
end (``inf``) are never emitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fleetscope.producers.simulation.faults import CHECKPOINT_FUNCTION, GC_FUNCTION, HOST_FUNCTIONS
from fleetscope.producers.simulation.program import B1, F64, I64, OPTIMIZER, PER_LAYER, Layout

_MS = 1e6  # ns
DATALOADER_NS = 4.0 * _MS
FORWARD_LAUNCH_NS = 0.25 * _MS  # per launched op: 12 ms for 12 layers x 4 kernels
BACKWARD_LAUNCH_NS = 20.0 * _MS / 48  # 20 ms for 12 layers x 4 kernels
OPTIMIZER_NS = 3.0 * _MS
HOST_GAP_NS = 0.05 * _MS
STEP_GAP_NS = 0.2 * _MS
NCCL_LATENCY_NS = 0.015 * _MS
PYTHON_NAMES = (*HOST_FUNCTIONS, GC_FUNCTION, CHECKPOINT_FUNCTION)
"""Host functions after the step marker, in the order of the python batch's name dictionary."""


@dataclass(slots=True)
class Inputs:
    """Everything that differs between iterations and ranks: fault effects and noise, already resolved."""

    step: int
    gpu_factor: F64  # (R,) compute kernels x
    host_factor: F64  # (R,) every host span x
    host_extra_ns: F64  # (R, 4) added to HOST_FUNCTIONS spans (spread over microbatches)
    gc_ns: F64  # (R,) gc.collect duration, 0 = none
    pause_ns: float  # checkpoint.save on every rank, 0 = none
    nvlink_bps: F64  # (R,)
    pcie_bps: F64  # (R,)
    congestion: F64  # (hosts,) NIC slowdown, 1 = none
    hang_rank: int = -1
    jitter: float = 0.0


@dataclass(slots=True)
class Timeline:
    """One iteration of every rank in true time; NaN marks an event a rank does not have."""

    step: int
    h0: F64
    next_h0: F64
    step_end: F64
    py_start: F64  # (R, P): step marker, dataloader, forward x M, backward x M, gc, optimizer, checkpoint
    py_end: F64
    k_launch: F64  # (R, K)
    k_start: F64
    k_end: F64
    c_launch: F64  # (R, C) in Layout's slots
    c_start: F64
    c_end: F64
    h2d: F64  # (R, 4): dataloader start/end, memcpy start/end (PCIe host-to-device traffic)
    stop_ns: float = np.inf  # when a hang stopped the job
    xfer: list[tuple[I64, F64, F64, F64, B1, B1]] = field(default_factory=list)
    """Transfer phases: (ranks, start, end, bytes/s per link, on NVLink, on PCIe/NIC)."""
    wait: list[tuple[I64, F64, F64]] = field(default_factory=list)
    """Time a rank sat in a collective waiting for its peers: (ranks, start, end)."""


def in_order_stream(launch: F64, dur: F64, free: F64) -> tuple[F64, F64]:
    """Start/end of kernels on in-order streams (one per row): each starts at max(launch, previous end).

    Closed form of the recurrence: end_j = C_j + max_{k<=j}(launch_k - C_{k-1}), C = cumsum(dur).
    """
    eff = launch.copy()
    eff[:, 0] = np.maximum(eff[:, 0], free)
    c = np.cumsum(dur, axis=1)
    end = c + np.maximum.accumulate(eff - (c - dur), axis=1)
    return end - dur, end


def spread(start: F64, dur: F64, k: int) -> F64:
    """Launch times of k ops spread evenly across each row's host span."""
    return start[:, None] + (np.arange(k) + 0.5) / k * dur[:, None]


class Engine:
    """The evolving job: stream-free times and the next iteration's start per rank."""

    def __init__(self, layout: Layout, rng: np.random.Generator, congestion_rng: np.random.Generator):
        self.lay = layout
        self.cfg = layout.cfg
        self.rng = rng
        self.congestion_rng = congestion_rng
        r = layout.ranks
        self.h0 = np.zeros(r)
        self.gpu_free = np.zeros(r)
        self.comm_free = np.zeros(r)

    def _lognormal(self, sigma: float, shape: tuple[int, ...]) -> F64:
        return np.exp(self.rng.normal(0.0, sigma, shape)) if sigma > 0 else np.ones(shape)

    def _link_draw(self, n: int, sigma: float) -> F64:
        return self.rng.uniform(1.0 - sigma, 1.0, n) if sigma > 0 else np.ones(n)

    def _member_bps(self, rows: slice | I64, nv: B1, nic: B1, inp: Inputs) -> F64:
        """What each member's links allow in this call: NVLink and/or NIC (with congestion) by group."""
        nic_bps = inp.pcie_bps[rows]
        if (inp.congestion > 1).any():
            c = inp.congestion
            avail = np.minimum(1.0, self.congestion_rng.uniform(0.9, 1.1, c.size) / c)
            nic_bps = nic_bps * np.where(c > 1, avail, 1.0)[self.lay.host[rows]]
        bps = np.minimum(np.where(nv, inp.nvlink_bps[rows], np.inf), np.where(nic, nic_bps, np.inf))
        return bps * self._link_draw(bps.size, inp.jitter)

    def run(self, inp: Inputs) -> Timeline:
        """Advance every rank by one iteration."""
        lay = self.lay
        n, m, sig = lay.ranks, lay.m, inp.jitter
        hf = inp.host_factor
        # 1. Host timeline to the end of the backward launches: [dl, (gap, span) x 2M].
        hj = self._lognormal(sig, (n, 5 + 4 * m))
        seg = np.empty((n, 1 + 4 * m))
        seg[:, 0] = DATALOADER_NS * hj[:, 0] * hf + inp.host_extra_ns[:, 0]
        seg[:, 1::2] = HOST_GAP_NS * hj[:, 1 : 1 + 4 * m : 2] * hf[:, None]
        ops = np.array([[lay.ops_per_pass(s, b)[2] for b in (False, True)] for s in range(lay.pp)])
        per_op = np.array([FORWARD_LAUNCH_NS, BACKWARD_LAUNCH_NS])
        base = np.repeat(ops[lay.pp_rank] * per_op, m, axis=1)  # (R, 2M): forward passes, backward passes
        extra = np.repeat(inp.host_extra_ns[:, 1:3] / m, m, axis=1)
        seg[:, 2::2] = base * hj[:, 2 : 2 + 4 * m : 2] * hf[:, None] + extra
        ends = self.h0[:, None] + np.cumsum(seg, axis=1)
        starts = ends - seg
        span_s, span_e = starts[:, 2::2], ends[:, 2::2]  # launches are spread over these
        stop = np.full(n, np.inf)
        if inp.hang_rank >= 0:  # the rank stops in the middle of its first backward launch span
            stop[inp.hang_rank] = 0.5 * (span_s[inp.hang_rank, m] + span_e[inp.hang_rank, m])
        self._stop = stop
        host_s = np.where(span_s > stop[:, None], np.inf, span_s)  # what the host really got done
        host_e = np.where(span_e > stop[:, None], np.inf, span_e)
        tl = Timeline(
            step=inp.step,
            h0=self.h0.copy(),
            next_h0=np.empty(n),
            step_end=np.empty(n),
            py_start=np.full((n, 2 * m + 5), np.nan),
            py_end=np.full((n, 2 * m + 5), np.nan),
            k_launch=np.empty((n, lay.k_base.size)),
            k_start=np.empty((n, lay.k_base.size)),
            k_end=np.empty((n, lay.k_base.size)),
            c_launch=np.full((n, lay.c_name.size), np.nan),
            c_start=np.full((n, lay.c_name.size), np.nan),
            c_end=np.full((n, lay.c_name.size), np.nan),
            h2d=np.empty((n, 4)),
            stop_ns=float(stop.min()),
        )
        tl.py_start[:, 1], tl.py_end[:, 1] = starts[:, 0], ends[:, 0]
        tl.py_start[:, 2 : 2 + 2 * m], tl.py_end[:, 2 : 2 + 2 * m] = host_s, host_e
        # 2. GPU: memcpy, then the pipeline passes (stage by stage, microbatch by microbatch).
        k_factor = np.where(lay.k_compute, inp.gpu_factor[:, None], 1.0)
        self._kdur = lay.k_base * k_factor * self._lognormal(sig, (n, lay.k_base.size))
        gfree = self.gpu_free.copy()
        dl_end = ends[:, 0]
        tl.k_launch[:, 0] = dl_end
        tl.k_start[:, 0] = np.maximum(dl_end, gfree)
        tl.k_end[:, 0] = gfree = tl.k_start[:, 0] + self._kdur[:, 0]
        tl.h2d[:] = np.column_stack([self.h0, dl_end, tl.k_start[:, 0], tl.k_end[:, 0]])
        pending: dict[int, tuple[F64, F64, F64]] = {}
        for backward in (False, True):
            for mb in range(m):
                for s in reversed(range(lay.pp)) if backward else range(lay.pp):
                    self._pass(tl, inp, gfree, pending, s, mb, backward, span_s, span_e)
        # 3. Data-parallel gradient buckets on the comm stream.
        grads = self._buckets(tl, inp) if lay.n_dp else np.full(n, -np.inf)
        # 4. Host blocks for the gradients, then gc.collect, optimizer.step, loss.item(), checkpoint.
        tail = hj[:, 1 + 4 * m :]
        t_sync = np.maximum.reduce([host_e[:, -1] + HOST_GAP_NS * tail[:, 0] * hf, grads, gfree])
        has_gc = inp.gc_ns > 0
        gc_end = t_sync + inp.gc_ns
        tl.py_start[:, -3] = np.where(has_gc, t_sync, np.nan)
        tl.py_end[:, -3] = np.where(has_gc, gc_end, np.nan)
        opt_s = gc_end + HOST_GAP_NS * tail[:, 1] * hf
        opt_dur = OPTIMIZER_NS * tail[:, 2] * hf + inp.host_extra_ns[:, 3]
        opt_launch = spread(opt_s, opt_dur, len(OPTIMIZER))
        o = slice(lay.opt_col, None)
        o_start, o_end = in_order_stream(opt_launch, self._kdur[:, o], gfree)
        tl.k_launch[:, o], tl.k_start[:, o], tl.k_end[:, o] = opt_launch, o_start, o_end
        tl.py_start[:, -2], tl.py_end[:, -2] = opt_s, opt_s + opt_dur
        done = np.maximum(opt_s + opt_dur, o_end[:, -1])
        if inp.pause_ns > 0:
            tl.py_start[:, -1], tl.py_end[:, -1] = done, done + inp.pause_ns
            done = done + inp.pause_ns
        tl.step_end[:] = done
        tl.py_start[:, 0], tl.py_end[:, 0] = self.h0, done
        tl.next_h0[:] = done + STEP_GAP_NS * tail[:, 3] * hf
        self.h0, self.gpu_free = tl.next_h0.copy(), o_end[:, -1].copy()
        return tl

    def _launch(self, start: F64, end: F64, k: int, rows: slice) -> F64:
        launch = spread(start, end - start, k)
        return np.where(launch > self._stop[rows, None], np.inf, launch)

    def _pass(
        self,
        tl: Timeline,
        inp: Inputs,
        gfree: F64,
        pending: dict[int, tuple[F64, F64, F64]],
        s: int,
        mb: int,
        backward: bool,
        span_s: F64,
        span_e: F64,
    ) -> None:
        """One stage's forward or backward pass of one microbatch: recv, layers (+ TP all-reduces), send."""
        lay, m = self.lay, self.lay.m
        rows = slice(s * lay.block, (s + 1) * lay.block)
        j = mb + (m if backward else 0)
        has_recv, has_send, n_ops = lay.ops_per_pass(s, backward)
        launch = self._launch(span_s[rows, j], span_e[rows, j], n_ops, rows)
        op = 0
        if has_recv:
            post, xs, end = pending.pop(s)
            col = lay.p2p0 + 2 * j
            tl.c_launch[rows, col], tl.c_start[rows, col], tl.c_end[rows, col] = launch[:, 0], post, end
            gfree[rows] = end
            op = 1
        c0 = 1 + j * lay.per_pass
        if lay.tp == 1:
            cols = slice(c0, c0 + lay.per_pass)
            kl = launch[:, op : op + lay.per_pass]
            ks, ke = in_order_stream(kl, self._kdur[rows, cols], gfree[rows])
            tl.k_launch[rows, cols], tl.k_start[rows, cols], tl.k_end[rows, cols] = kl, ks, ke
            gfree[rows] = ke[:, -1]
        else:
            for layer in range(lay.lps):
                cols = slice(c0 + layer * PER_LAYER, c0 + (layer + 1) * PER_LAYER)
                kl = launch[:, op : op + PER_LAYER]
                ks, ke = in_order_stream(kl, self._kdur[rows, cols], gfree[rows])
                tl.k_launch[rows, cols], tl.k_start[rows, cols], tl.k_end[rows, cols] = kl, ks, ke
                ar_launch = launch[:, op + PER_LAYER]
                op += PER_LAYER + 1
                gfree[rows] = self._tp_allreduce(tl, inp, rows, j * lay.lps + layer, ar_launch, ke[:, -1])
        if has_send:
            self._send(tl, inp, gfree, pending, s, j, backward, launch[:, -1], span_s, span_e)

    def _tp_allreduce(self, tl: Timeline, inp: Inputs, rows: slice, col: int, launch: F64, ready: F64) -> F64:
        """A synchronous all-reduce of every TP group of one stage; returns its end per rank."""
        lay, tp = self.lay, self.lay.tp
        arrive = np.maximum(launch, ready)
        last = arrive.reshape(-1, tp).max(axis=1).repeat(tp)
        bps = self._member_bps(rows, lay.tp_nv[rows], lay.tp_nic[rows], inp)
        rate = bps.reshape(-1, tp).min(axis=1).repeat(tp)
        end: F64 = last + NCCL_LATENCY_NS + 2.0 * (tp - 1) / tp * self.cfg.tp_bytes / rate * 1e9
        tl.c_launch[rows, col], tl.c_start[rows, col], tl.c_end[rows, col] = launch, arrive, end
        idx = np.arange(rows.start, rows.stop)
        tl.xfer.append((idx, last, end, rate, lay.tp_nv[rows], lay.tp_nic[rows]))
        tl.wait.append((idx, arrive, last))
        return end

    def _send(
        self,
        tl: Timeline,
        inp: Inputs,
        gfree: F64,
        pending: dict[int, tuple[F64, F64, F64]],
        s: int,
        j: int,
        backward: bool,
        launch: F64,
        span_s: F64,
        span_e: F64,
    ) -> None:
        """Blocking p2p to the next stage of the pass; the receiver's side is completed in its pass."""
        lay = self.lay
        d = s - 1 if backward else s + 1
        rows = slice(s * lay.block, (s + 1) * lay.block)
        drows = slice(d * lay.block, (d + 1) * lay.block)
        _, _, d_ops = lay.ops_per_pass(d, backward)
        recv_launch = self._launch(span_s[drows, j], span_e[drows, j], d_ops, drows)[:, 0]
        send_post = np.maximum(launch, gfree[rows])
        recv_post = np.maximum(recv_launch, gfree[drows])
        xs = np.maximum(send_post, recv_post)
        low = rows if s < d else drows
        nv = lay.p2p_nv[low]
        bps = np.minimum(self._member_bps(rows, nv, ~nv, inp), self._member_bps(drows, nv, ~nv, inp))
        end = xs + NCCL_LATENCY_NS + self.cfg.p2p_bytes / bps * 1e9
        col = lay.p2p0 + 2 * j + 1
        tl.c_launch[rows, col], tl.c_start[rows, col], tl.c_end[rows, col] = launch, send_post, end
        gfree[rows] = end
        pending[d] = (recv_post, xs, end)
        for r, post in ((rows, send_post), (drows, recv_post)):
            idx = np.arange(r.start, r.stop)
            tl.xfer.append((idx, xs, end, bps, nv, ~nv))
            tl.wait.append((idx, post, xs))

    def _buckets(self, tl: Timeline, inp: Inputs) -> F64:
        """Gradient all-reduces among data-parallel peers, bucket after bucket; returns the last end."""
        lay = self.lay
        pp, dp, tp = lay.pp, lay.dp, lay.tp
        comm = self.comm_free.copy()
        everyone = np.arange(lay.ranks)
        for b, col in enumerate(lay.bucket_cols):
            launch, ready = tl.k_launch[:, col], tl.k_end[:, col]
            arrive = np.maximum.reduce([launch, ready, comm])
            last = np.broadcast_to(arrive.reshape(pp, dp, tp).max(axis=1)[:, None, :], (pp, dp, tp)).ravel()
            bps = self._member_bps(slice(None), lay.dp_nv, lay.dp_nic, inp)
            rate_g = bps.reshape(pp, dp, tp).min(axis=1)[:, None, :]
            rate = np.broadcast_to(rate_g, (pp, dp, tp)).ravel()
            nbytes = lay.bucket_bytes[b]
            end = last + NCCL_LATENCY_NS + 2.0 * (dp - 1) / dp * nbytes / rate * 1e9
            c = lay.dp0 + b
            tl.c_launch[:, c], tl.c_start[:, c], tl.c_end[:, c] = launch, arrive, end
            tl.xfer.append((everyone, last, end, rate, lay.dp_nv, lay.dp_nic))
            tl.wait.append((everyone, arrive, last))
            comm = end
        self.comm_free = comm
        return comm
