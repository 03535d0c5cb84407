"""The simulated job's static shape: rank coordinates, process groups and the links they use, the kernel
program of one iteration and the collective slots, the same for every iteration (``Layout``)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from fleetscope.producers.simulation.config import SimulatorConfig

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
B1 = npt.NDArray[np.bool_]

_MS = 1e6  # ns
LAST_BUCKET_SHARE = 0.6
MEMCPY = ("Memcpy HtoD (Pageable -> Device)", 1.0 * _MS)
FORWARD = (
    ("ampere_bf16_s16816gemm_bf16_128x256_ldg8_f2f_tn", 0.55 * _MS),  # qkv projection
    ("flash_fwd_kernel", 0.45 * _MS),
    ("ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_nn", 0.9 * _MS),  # mlp
    ("vectorized_layer_norm_kernel", 0.3 * _MS),
)
BACKWARD = (  # about twice the forward time per layer
    ("flash_bwd_dq_dk_dv_loop_kernel", 1.1 * _MS),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_nt", 1.4 * _MS),  # dgrad
    ("ampere_bf16_s16816gemm_bf16_64x128_ldg8_f2f_tn", 1.4 * _MS),  # wgrad
    ("vectorized_layer_norm_backward_kernel", 0.5 * _MS),
)
OPTIMIZER = (
    ("multi_tensor_apply_kernel", 0.6 * _MS),
    ("multi_tensor_apply_kernel", 0.6 * _MS),
    ("multi_tensor_apply_kernel", 0.6 * _MS),
    ("elementwise_kernel", 0.25 * _MS),
)
ALLREDUCE_KERNEL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
SENDRECV_KERNEL = "ncclDevKernel_SendRecv"
PER_LAYER = len(FORWARD)


def _groups_links(members: I64, host: I64) -> tuple[B1, B1]:
    """Per group (rows of rank indices): (uses NVLink, uses PCIe/NIC)."""
    h = np.sort(host[members], axis=1)
    nv = (np.diff(h, axis=1) == 0).any(axis=1) if h.shape[1] > 1 else np.zeros(h.shape[0], bool)
    nic = h[:, 0] != h[:, -1]
    return nv, nic


class Layout:
    """Static shape of the job: coordinates, groups, their links, kernel program, collective slots."""

    def __init__(self, cfg: SimulatorConfig) -> None:
        self.cfg = cfg
        r = np.arange(cfg.ranks)
        self.ranks, self.tp, self.pp, self.dp = cfg.ranks, cfg.tp, cfg.pp, cfg.dp
        self.block = cfg.dp * cfg.tp  # ranks per stage, contiguous
        self.m = cfg.pipeline_microbatches
        self.lps = cfg.layers // cfg.pp
        self.n_buckets = min(cfg.buckets, self.lps)
        self.tp_rank, self.pp_rank, self.dp_rank = r % cfg.tp, r // self.block, (r // cfg.tp) % cfg.dp
        self.host = r // cfg.gpus_per_host
        self.hosts = cfg.hosts
        self.tp_group = r // cfg.tp
        self.dp_group = self.pp_rank * cfg.tp + self.tp_rank
        self.pp_group = self.dp_rank * cfg.tp + self.tp_rank
        tp_nv, tp_nic = _groups_links(r.reshape(-1, cfg.tp), self.host)
        self.tp_nv, self.tp_nic = tp_nv[self.tp_group], tp_nic[self.tp_group]
        dp_members = r.reshape(cfg.pp, cfg.dp, cfg.tp).transpose(0, 2, 1).reshape(-1, cfg.dp)
        dp_nv, dp_nic = _groups_links(dp_members, self.host)
        self.dp_nv, self.dp_nic = dp_nv[self.dp_group], dp_nic[self.dp_group]
        nxt = np.minimum(r + self.block, cfg.ranks - 1)  # p2p to the next stage (same dp, tp)
        self.p2p_nv = self.host == self.host[nxt]  # indexed by the lower stage's rank
        self._program()
        self._collective_slots()

    def _program(self) -> None:
        """Kernel columns: memcpy, forward of each microbatch, backward of each, optimizer."""
        fwd = [k for _ in range(self.lps) for k in FORWARD]
        bwd = [k for _ in range(self.lps) for k in BACKWARD]
        program = [MEMCPY, *fwd * self.m, *bwd * self.m, *OPTIMIZER]
        self.kernel_names = list(dict.fromkeys(n for n, _ in program))
        ids = {n: i for i, n in enumerate(self.kernel_names)}
        self.k_ids = np.array([ids[n] for n, _ in program], dtype=np.int32)
        self.k_base = np.array([d for _, d in program])
        self.k_compute = np.arange(len(program)) != 0  # the memcpy does not slow with the SMs
        self.per_pass = self.lps * PER_LAYER
        self.opt_col = 1 + 2 * self.m * self.per_pass
        groups = np.array_split(np.arange(self.lps), self.n_buckets)  # backward order: last layer first
        last_pass = 1 + (2 * self.m - 1) * self.per_pass
        self.bucket_cols = np.array([last_pass + (g[-1] + 1) * PER_LAYER - 1 for g in groups])
        sizes = np.full(self.n_buckets, self.cfg.bucket_bytes, dtype=np.int64)
        if self.n_buckets > 1:
            sizes[-1] = max(1, int(self.cfg.bucket_bytes * LAST_BUCKET_SHARE))
        self.bucket_bytes = sizes

    def _collective_slots(self) -> None:
        """Collective columns (same for every rank): TP all-reduces, p2p (recv, send) per pass, DP buckets."""
        cfg, m = self.cfg, self.m
        self.n_tp = 2 * m * self.lps if cfg.tp > 1 else 0
        self.n_p2p = 4 * m if cfg.pp > 1 else 0
        self.n_dp = self.n_buckets if cfg.dp > 1 else 0
        self.p2p0, self.dp0 = self.n_tp, self.n_tp + self.n_p2p
        n = self.dp0 + self.n_dp
        names = [ALLREDUCE_KERNEL, "allreduce"]
        if cfg.pp > 1:
            names += [SENDRECV_KERNEL, "send", "recv"]
        pg = len(names)
        self.pg_names = [("dp", cfg.dp > 1), ("tp", cfg.tp > 1), ("pp", cfg.pp > 1)]
        pg_ids = {}
        for name, used in self.pg_names:
            if used:
                pg_ids[name] = pg
                pg += 1
        self.collective_names_base = names
        self.c_name = np.zeros(n, np.int32)
        self.c_op = np.ones(n, np.int32)
        self.c_pg = np.zeros(n, np.int32)
        self.c_size = np.zeros(n, np.int32)
        self.c_bytes = np.zeros(n, np.int64)
        self.c_seq_mult = np.zeros(n, np.int64)
        self.c_seq_base = np.zeros(n, np.int64)
        self.c_valid = np.ones((cfg.pp, n), bool)
        if self.n_tp:
            t = slice(0, self.n_tp)
            self.c_pg[t], self.c_size[t], self.c_bytes[t] = pg_ids["tp"], cfg.tp, cfg.tp_bytes
            self.c_seq_mult[t], self.c_seq_base[t] = self.n_tp, np.arange(self.n_tp)
        if self.n_p2p:
            p = slice(self.p2p0, self.dp0)
            j = np.arange(self.n_p2p)
            is_send = j % 2 == 1
            self.c_name[p] = names.index(SENDRECV_KERNEL)
            self.c_op[p] = np.where(is_send, names.index("send"), names.index("recv"))
            self.c_pg[p], self.c_size[p], self.c_bytes[p] = pg_ids["pp"], 2, cfg.p2p_bytes
            self.c_seq_mult[p], self.c_seq_base[p] = 2 * m, j // 2
            backward = j // 2 >= m
            for s in range(cfg.pp):
                recv_ok = np.where(backward, s < cfg.pp - 1, s > 0)
                send_ok = np.where(backward, s > 0, s < cfg.pp - 1)
                self.c_valid[s, p] = np.where(is_send, send_ok, recv_ok)
        if self.n_dp:
            d = slice(self.dp0, n)
            self.c_pg[d], self.c_size[d], self.c_bytes[d] = pg_ids["dp"], cfg.dp, self.bucket_bytes
            self.c_seq_mult[d], self.c_seq_base[d] = self.n_buckets, np.arange(self.n_buckets)

    def collective_names(self, rank: int) -> list[str]:
        """The collectives batch's name dictionary of one rank (its process-group names included)."""
        groups = {"dp": self.dp_group, "tp": self.tp_group, "pp": self.pp_group}
        return self.collective_names_base + [f"{n}{groups[n][rank]}" for n, used in self.pg_names if used]

    def ops_per_pass(self, stage: int, backward: bool) -> tuple[bool, bool, int]:
        """(has recv, has send, launched ops) of one stage's forward or backward pass of a microbatch."""
        first, last = stage == 0, stage == self.pp - 1
        has_recv = not last if backward else not first
        has_send = not first if backward else not last
        return has_recv, has_send, int(has_recv) + self.lps * (PER_LAYER + (self.tp > 1)) + int(has_send)
