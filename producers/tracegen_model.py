"""The trace generator's timing model: a transformer step under a 1F1B pipeline, its own physics.

Per-layer compute kernels (each with its own noise), tensor-parallel all-reduces that wait for the slowest
member, p2p sends/receives whose receiver waits in ``recv``, data-parallel gradient sync (all-reduce, or
ZeRO's reduce-scatter + all-gather), a mixture-of-experts layer (all-to-all, expert compute scaled by the
tokens a rank receives). Times are global microseconds; ``tracegen`` writes them as Kineto files.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fleetscope.schemas.vocabulary import RING_COLLECTIVES

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
EXPERT_GEMM = "cutlass_grouped_gemm_bf16_moe_kernel"
KERNELS_FWD = (("flash_fwd_kernel", 0.30), (GEMM, 0.45), ("vectorized_elementwise_kernel", 0.05), (GEMM, 0.20))
KERNELS_BWD = (("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", 0.35), (GEMM, 0.55), ("reduce_kernel", 0.10))
NCCL = {
    "allreduce": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
    "reduce_scatter": "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
    "allgather": "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
    "all_to_all": "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)",
    "send": "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)",
    "recv": "ncclDevKernel_SendRecv(ncclDevComm*, unsigned long, ncclWork*)",
}
DESCS = {
    "megatron": {
        "tp": "TENSOR_MODEL_PARALLEL_GROUP",
        "dp": "DATA_PARALLEL_GROUP",
        "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
        "ep": "EXPERT_MODEL_PARALLEL_GROUP",
    },
    "mesh": {"tp": "mesh_tp", "dp": "mesh_dp", "pp": "mesh_pp", "ep": "mesh_ep"},
    "none": dict.fromkeys(("tp", "dp", "pp", "ep"), "undefined"),
}
FAULTS = (
    "healthy", "slow_stage", "slow_worker", "a2a_imbalance", "host_bound", "slow_link", "late_start", "regression",
)  # fmt: skip
HOST_BOUND_GAP = 0.6
"""``host_bound``: before each of its compute kernels the culprit's GPU waits this share of the kernel's time
for the launch (its CPU needs 1.6x the GPU's time per kernel: Python overhead, a slow or busy host)."""
SLOW_LINK_FACTOR = 3.0
"""``slow_link``: every ring collective the culprit is a member of (tensor- and data-parallel) transfers this
many times slower: its link paces each ring it is in, so every member's kernel grows alike."""
LATE_START_SHARE = 0.15
"""``late_start``: from its second step on, the culprit starts each step this share of its last step late, in
host work that no annotation covers (a blocking call before the data loader): its GPU work is as fast as its
peers', and they wait for it at the step's first collective only, then run in step with it."""
REGRESSION_FACTOR = 1.12
"""``regression``: from the middle step of the run on, every rank's compute takes this many times as long (a
new code path, a changed configuration): the whole job slows alike, no rank stands out among its peers."""
_EXPECTED = {
    "healthy": "",
    "slow_stage": "stage_imbalance",
    "host_bound": "host_slow",
    "slow_link": "link_slow",
    "late_start": "straggler",
    "regression": "job_regression",
}
BASE_NS = 1_761_955_200_000_000_000  # a quarter boundary, as Kineto floors baseTimeNanoseconds
COMPUTE_STREAM, P2P_STREAM = 7, 21


@dataclass(frozen=True, kw_only=True)
class TraceJob:
    """The job to write: its layout, model, schedule and the one fault it carries."""

    dp: int = 4
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert-parallel size: experts spread over ``ep`` consecutive data-parallel replicas."""
    order: tuple[str, ...] = ("tp", "dp", "pp")
    """Rank order, fastest-varying first (Megatron: tp, dp, pp)."""
    names: str = "megatron"
    """Group descriptions: ``megatron``, ``mesh`` (DeviceMesh) or ``none``."""
    zero: bool = False
    layers: int = 8
    microbatches: int = 4
    steps: int = 8
    first_step: int = 10
    layer_ms: float = 1.2
    gpus_per_host: int = 8
    inter_host_factor: float = 1.0
    """A ring whose members are on more than one host transfers this many times slower (the links between
    hosts are slower than NVLink within one); 1: as fast."""
    skew_ms: float = 6.0
    noise: float = 0.02
    rank_spread: float = 0.0
    """Each rank's own speed, lognormal with this sigma and steady all run: healthy GPUs of one model differ
    by a percent or two (silicon, clocks, cooling); 0: all alike."""
    stall_rate: float = 0.0
    """The chance that a rank starts a step late by up to ``stall_ms`` (uniform) in unannotated host work: an
    OS hiccup, a page fault, a descheduled thread, a different rank each time; 0: never."""
    stall_ms: float = 5.0
    work_spread: float = 0.0
    """Each step, each data-parallel replica's batch takes this much more or less compute (lognormal sigma):
    sequences of varying length, not packed, so a different replica is the slowest each step; 0: alike."""
    fault: str = "healthy"
    fault_rank: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if sorted(self.order) != ["dp", "pp", "tp"] or self.names not in DESCS or self.fault not in FAULTS:
            raise ValueError(f"bad tracegen job: order {self.order}, names {self.names}, fault {self.fault}")
        if min(self.dp, self.tp, self.pp, self.ep) < 1 or self.dp % self.ep or self.layers % self.pp:
            raise ValueError("need dp % ep == 0 and layers % pp == 0, sizes >= 1")
        if self.rank_spread < 0 or not 0 <= self.stall_rate <= 1 or self.stall_ms < 0 or self.work_spread < 0:
            raise ValueError("need rank_spread >= 0, stall_rate in [0, 1], stall_ms >= 0 and work_spread >= 0")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"tp", "pp", "dp", "ep"}`` of a rank (ep: its slot in its expert group)."""
        c, rest = {}, rank
        for dim in self.order:
            size = getattr(self, dim)
            c[dim], rest = rest % size, rest // size
        c["ep"] = c["dp"] % self.ep
        return c

    def rank_of(self, tp: int, pp: int, dp: int) -> int:
        rank, stride = 0, 1
        for dim, value in zip(self.order, (dict(tp=tp, pp=pp, dp=dp)[d] for d in self.order), strict=True):
            rank, stride = rank + value * stride, stride * getattr(self, dim)
        return rank

    def groups(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(role, pg_name, members in coordinate order) in creation order: names "1", "2"... as PyTorch."""
        out: list[tuple[str, tuple[int, ...]]] = []
        sizes = {"tp": self.tp, "dp": self.dp, "pp": self.pp}
        for role in ("tp", "dp", "pp"):
            others = [d for d in ("tp", "pp", "dp") if d != role]
            for fixed in itertools.product(*(range(sizes[d]) for d in others)):
                c = dict(zip(others, fixed, strict=True))
                members = tuple(self.rank_of(**{**c, role: i}) for i in range(sizes[role]))
                out.append((role, members))
        if self.ep > 1:
            for tp, pp, block in itertools.product(range(self.tp), range(self.pp), range(self.dp // self.ep)):
                out.append(("ep", tuple(self.rank_of(tp, pp, block * self.ep + i) for i in range(self.ep))))
        return [(role, str(i + 1), m) for i, (role, m) in enumerate(out) if len(m) > 1]

    @property
    def expected_category(self) -> str:
        """The finding the fault should give: a whole slow stage, a launch-bound rank's host, a rank's slow
        link, else one rank's slow GPU work."""
        return _EXPECTED.get(self.fault, "gpu_slow")

    @property
    def fault_step(self) -> int:
        """The first step the fault acts on (a late start needs a step before it to be late by; a regression
        needs a baseline before it: the middle step)."""
        if self.fault == "regression":
            return self.first_step + self.steps // 2
        return self.first_step + (self.fault == "late_start")

    def culprits(self) -> tuple[int, ...]:
        """The ranks the fault acts on."""
        if self.fault == "slow_stage":
            return tuple(r for r in range(self.world_size) if self.coordinates(r)["pp"] == self.pp - 1)
        if self.fault == "regression":
            return tuple(range(self.world_size))
        return () if self.fault == "healthy" else (self.fault_rank,)


@dataclass
class RankActivity:
    """One rank's recorded activity: kernels and CPU annotations, in global microseconds."""

    kernels: list[tuple[float, float, str, int, dict[str, object]]] = field(default_factory=list)
    spans: list[tuple[float, float, str]] = field(default_factory=list)
    seq: dict[str, int] = field(default_factory=dict)


class _Model:
    """The timing model: walks every iteration's 1F1B schedule and records each rank's events."""

    def __init__(self, job: TraceJob) -> None:
        self.job = job
        self.rng = np.random.default_rng(job.seed)
        self.ranks = [RankActivity() for _ in range(job.world_size)]
        self.pg: dict[tuple[str, int], tuple[str, tuple[int, ...]]] = {}
        for role, name, members in job.groups():
            for r in members:
                self.pg[(role, r)] = (name, members)
        self.speed = np.ones(job.world_size)
        if job.rank_spread > 0:  # drawn only when asked, so that jobs without it keep their random sequence
            self.speed = self.rng.lognormal(0.0, job.rank_spread, job.world_size)
        for r in range(job.world_size):
            if job.fault == "slow_worker" and r == job.fault_rank:
                self.speed[r] *= 2.35
            if job.fault == "slow_stage" and job.coordinates(r)["pp"] == job.pp - 1:
                self.speed[r] *= 1.25
        self.work = np.ones(job.world_size)
        """Each rank's share of work in the current step (``work_spread``: its replica's batch)."""
        self.lps = job.layers // job.pp
        self.launch_gap = np.zeros(job.world_size)
        if job.fault == "host_bound":
            self.launch_gap[job.fault_rank] = HOST_BOUND_GAP

    def cell(self, pp: int, dp: int) -> list[int]:
        return [self.job.rank_of(t, pp, dp) for t in range(self.job.tp)]

    def collective(
        self,
        op: str,
        role: str,
        ranks: Sequence[int],
        ready: dict[int, float],
        xfer_us: float,
        nelems: int,
        peer: int | None = None,
    ) -> float:
        """Every member's kernel runs from its own arrival to the last arrival plus the transfer (at the pace
        of the ring's slowest link)."""
        if self.job.fault == "slow_link" and self.job.fault_rank in ranks and op in RING_COLLECTIVES:
            xfer_us *= SLOW_LINK_FACTOR
        if len({r // self.job.gpus_per_host for r in ranks}) > 1:
            xfer_us *= self.job.inter_host_factor
        end = max(ready[r] for r in ranks) + xfer_us
        for r in ranks:
            self._nccl(r, op, role, ready[r], end - ready[r], nelems, peer)
        return end

    def _nccl(self, r: int, op: str, role: str, ts: float, dur: float, nelems: int, peer: int | None = None) -> None:
        name, members = self.pg.get((role, r), ("0", tuple(range(self.job.world_size))))
        rk = self.ranks[r]
        rk.seq[name] = rk.seq.get(name, 0) + 1
        n = len(members)
        out_n = nelems * n if op == "allgather" else nelems // n if op == "reduce_scatter" else nelems
        args: dict[str, object] = {
            "Collective name": "_allgather_base" if op == "allgather" else op,
            "In msg nelems": nelems,
            "Out msg nelems": out_n,
            "Group size": n,
            "dtype": "BFloat16",
            "In split size": "[]",
            "Out split size": "[]",
            "Process Group Name": name,
            "Process Group Description": DESCS[self.job.names][role] if name != "0" else "default_pg",
            "Process Group Ranks": str(list(members)),
            "Seq": rk.seq[name],
        }
        if peer is not None:  # ProcessGroupNCCL numbers the peer within the group
            args["Dst Rank" if op == "send" else "Src Rank"] = members.index(peer)
        stream = P2P_STREAM if op in ("send", "recv") else 20 + int(name) % 8
        rk.kernels.append((ts, dur, NCCL[op], stream, args))

    def compute(self, r: int, t: float, total_us: float, table: Sequence[tuple[str, float]]) -> float:
        """A layer's kernels on one rank, each with its own noise; returns its end."""
        for name, share in table:
            d = total_us * share * self.speed[r] * self.work[r] * float(self.rng.lognormal(0.0, self.job.noise))
            t += d * self.launch_gap[r]  # a launch-bound rank's GPU idles until its host launches the kernel
            self.ranks[r].kernels.append((t, d, name, COMPUTE_STREAM, {}))
            t += d
        return t

    def layer(self, pp: int, t: dict[int, float], backward: bool, last_layer: bool) -> None:
        """One layer on every data-parallel replica of a stage: compute, tp all-reduce, expert a2a."""
        job = self.job
        base = job.layer_ms * 1000.0 * (2.0 if backward else 1.0) / job.tp
        for dp in range(job.dp):
            cell = self.cell(pp, dp)
            ready = {r: self.compute(r, t[r], base, KERNELS_BWD if backward else KERNELS_FWD) for r in cell}
            end = self.collective("allreduce", "tp", cell, ready, 60.0, 4_194_304) if job.tp > 1 else ready[cell[0]]
            for r in cell:
                t[r] = end
        if job.ep > 1 and last_layer:
            self.experts(pp, t)

    def experts(self, pp: int, t: dict[int, float]) -> None:
        """The MoE layer: dispatch all-to-all, expert compute scaled by tokens received, combine."""
        job = self.job
        for tp, block in itertools.product(range(job.tp), range(job.dp // job.ep)):
            group = [job.rank_of(tp, pp, block * job.ep + i) for i in range(job.ep)]
            end = self.collective("all_to_all", "ep", group, t, 150.0, 2_097_152)
            ready = {}
            for r in group:
                tokens = 2.0 if job.fault == "a2a_imbalance" and r == job.fault_rank else 1.0
                ready[r] = self.compute(r, end, job.layer_ms * 500.0 * tokens, ((EXPERT_GEMM, 1.0),))
            end = self.collective("all_to_all", "ep", group, ready, 150.0, 2_097_152)
            for r in group:
                t[r] = end

    def iteration(self, start: dict[int, float]) -> dict[int, float]:
        """One 1F1B iteration from each rank's start; returns each rank's end."""
        job, m, p = self.job, self.job.microbatches if self.job.pp > 1 else 1, self.job.pp
        t = dict(start)
        for dp in range(job.dp):
            for r in self.cell(0, dp):  # only the first stage reads batches
                self.ranks[r].spans.append((t[r], 400.0, "dataloader.next"))
                t[r] += 400.0
        schedule = {s: self._schedule(s, m, p) for s in range(p)}
        done: dict[tuple[str, int, int], dict[int, float]] = {}
        pos = dict.fromkeys(range(p), 0)
        while any(pos[s] < len(schedule[s]) for s in range(p)):
            for s in range(p):
                while pos[s] < len(schedule[s]):
                    kind, mb = schedule[s][pos[s]]
                    dep = (kind, s - 1 if kind == "F" else s + 1, mb)
                    if 0 <= dep[1] < p and dep not in done:
                        break
                    if 0 <= dep[1] < p:
                        self._p2p(dep[1], s, done[dep], t)
                    t0 = {r: t[r] for dp in range(job.dp) for r in self.cell(s, dp)}
                    for i in range(self.lps):
                        self.layer(s, t, kind == "B", i == self.lps - 1)
                    for r in t0:
                        self.ranks[r].spans.append(
                            (t0[r], t[r] - t0[r], "## forward ##" if kind == "F" else "## backward ##")
                        )
                    done[(kind, s, mb)] = {r: t[r] for r in t0}
                    pos[s] += 1
        self._gradients(t)
        return t

    @staticmethod
    def _schedule(s: int, m: int, p: int) -> list[tuple[str, int]]:
        warm = min(p - s - 1, m)
        ops = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            ops += [("F", warm + i), ("B", i)]
        return ops + [("B", i) for i in range(m - warm, m)]

    def _p2p(self, src_stage: int, dst_stage: int, sent: dict[int, float], t: dict[int, float]) -> None:
        """Activations (or gradients) from one stage to the next: the receiver waits in ``recv``."""
        job = self.job
        for dp, tp in itertools.product(range(job.dp), range(job.tp)):
            a, b = job.rank_of(tp, src_stage, dp), job.rank_of(tp, dst_stage, dp)
            end = max(sent[a], t[b]) + 120.0
            self._nccl(a, "send", "pp", sent[a], end - sent[a], 1_048_576, peer=b)
            self._nccl(b, "recv", "pp", t[b], end - t[b], 1_048_576, peer=a)
            t[b] = end

    def _gradients(self, t: dict[int, float]) -> None:
        """Data-parallel gradient sync per (stage, tp slot), the optimizer, ZeRO's parameter all-gather."""
        job = self.job
        for pp, tp in itertools.product(range(job.pp), range(job.tp)):
            group = [job.rank_of(tp, pp, dp) for dp in range(job.dp)]
            nelems = 50_331_648 // (job.pp * job.tp)
            if job.dp > 1:
                end = self.collective("reduce_scatter" if job.zero else "allreduce", "dp", group, t, 2500.0, nelems)
                t.update(dict.fromkeys(group, end))
            for r in group:
                t[r] = self.compute(r, t[r], 600.0 / (job.dp if job.zero else 1), (("multi_tensor_apply_kernel", 1.0),))
            if job.zero and job.dp > 1:
                end = self.collective("allgather", "dp", group, t, 2000.0, nelems // job.dp)
                t.update(dict.fromkeys(group, end))


def simulate(job: TraceJob) -> tuple[list[RankActivity], list[list[tuple[float, float]]]]:
    """Every rank's events and its (start, end) per step, in global microseconds."""
    model = _Model(job)
    t = {r: float(model.rng.uniform(0.0, 50.0)) for r in range(job.world_size)}
    steps: list[list[tuple[float, float]]] = [[] for _ in range(job.world_size)]
    for step in range(job.steps):
        start = dict(t)  # the step begins here; a late-starting rank's first work begins later, inside it
        if job.fault == "late_start" and step:
            r = job.fault_rank
            start[r] += LATE_START_SHARE * (steps[r][-1][1] - steps[r][-1][0])
        if job.fault == "regression" and step == job.steps // 2:
            model.speed *= REGRESSION_FACTOR
        if job.work_spread > 0:
            batch = model.rng.lognormal(0.0, job.work_spread, job.dp)
            model.work = np.array([batch[job.coordinates(r)["dp"]] for r in range(job.world_size)])
        if job.stall_rate > 0:
            stalled = model.rng.random(job.world_size) < job.stall_rate
            for r in np.flatnonzero(stalled).tolist():
                start[r] += float(model.rng.uniform(0.0, job.stall_ms * 1000.0))
        end = model.iteration(start)
        for r in range(job.world_size):
            steps[r].append((t[r], end[r]))
            t[r] = end[r] + 30.0
    return model.ranks, steps
