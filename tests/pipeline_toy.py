"""A toy dp x pp job run by its own physics, for the replay's and the what-if's unit tests.

Each rank runs a program of work, sends, receives and data-parallel all-reduces (GPipe: every microbatch's
forward down the pipeline, then every backward up it, then one all-reduce per stage among its replicas). A
transfer ends on both ends at the later arrival plus its time; an all-reduce at the last arrival plus its
time. Iterations run back to back (a rank's next one starts where it ended), so the job reaches its steady
period; each rank's timeline is relative to its own start, as the windower writes them. Importable from
every test as ``pipeline_toy``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetscope.streams.analysis.timeline import RankTimeline


@dataclass(frozen=True, kw_only=True)
class ToyJob:
    dp: int = 2
    pp: int = 2
    microbatches: int = 4
    forward_ns: float = 2e6
    backward_ns: float = 4e6
    head_ns: float = 1e6
    tail_ns: float = 1e6
    p2p_ns: float = 2e5
    allreduce_ns: tuple[float, ...] = ()
    """Per stage (default 1 ms each)."""
    allreduce_bytes: tuple[int, ...] = ()
    """Per stage (default 32 MiB each)."""
    compute: dict[int, float] = field(default_factory=dict)
    """Rank -> factor on its forward and backward work."""
    tail: dict[int, float] = field(default_factory=dict)
    """Rank -> extra tail ns (host work after the last call)."""
    ring: dict[int, float] = field(default_factory=dict)
    """Stage -> factor on its all-reduce's time."""
    jitter: float = 0.0
    seed: int = 0
    seq_per_group: bool = False
    """Number p2p calls per process group on each rank (as a Kineto trace's ordinal does), not per pair."""

    def rank(self, stage: int, replica: int) -> int:
        return stage * self.dp + replica


def _program(job: ToyJob, r: int, rng: np.random.Generator) -> list[tuple[Any, ...]]:
    s = r // job.dp
    f = job.compute.get(r, 1.0)

    def w(ns: float, compute: bool = True) -> tuple[str, float, bool]:
        return ("work", ns * (1.0 + job.jitter * rng.standard_normal()) if job.jitter else ns, compute)

    ops: list[tuple[Any, ...]] = [w(job.head_ns, False)]
    up, down = r - job.dp, r + job.dp
    for mb in range(job.microbatches):
        if s > 0:
            ops.append(("recv", up, ("f", mb)))
        ops.append(w(job.forward_ns * f))
        if s < job.pp - 1:
            ops.append(("send", down, ("f", mb)))
    for mb in range(job.microbatches):
        if s < job.pp - 1:
            ops.append(("recv", down, ("b", mb)))
        ops.append(w(job.backward_ns * f))
        if s > 0:
            ops.append(("send", up, ("b", mb)))
    if job.dp > 1:
        ops.append(("coll", s, ("c", s)))
    ops.append(w(job.tail_ns + job.tail.get(r, 0.0), False))
    return ops


Call = tuple[str, int, float, float, float]
"""(function, seq, enter, leave, compute before it), times after the rank's iteration start."""


def _iteration(job: ToyJob, start: np.ndarray, rng: np.random.Generator) -> tuple[list[list[Call]], np.ndarray]:
    n = job.dp * job.pp
    ar_ns = job.allreduce_ns or (1e6,) * job.pp
    progs = [_program(job, r, rng) for r in range(n)]
    pc, t, comp = [0] * n, start.copy(), [0.0] * n
    calls: list[list[Call]] = [[] for _ in range(n)]
    arrived: dict[Any, dict[int, float]] = {}
    seqs: dict[tuple[int, Any], int] = {}
    while any(pc[r] < len(progs[r]) for r in range(n)):
        moved = False
        for r in range(n):
            while pc[r] < len(progs[r]):
                op = progs[r][pc[r]]
                if op[0] == "work":
                    t[r] += op[1]
                    comp[r] += op[1] if op[2] else 0.0
                    pc[r] += 1
                    moved = True
                    continue
                p2p = op[0] != "coll"
                key = (op[2], min(r, op[1]), max(r, op[1])) if p2p else op[2]
                got = arrived.setdefault(key, {})
                got.setdefault(r, float(t[r]))
                if len(got) < (2 if p2p else job.dp):
                    break
                end = max(got.values()) + (job.p2p_ns if p2p else ar_ns[op[1]] * job.ring.get(op[1], 1.0))
                group = (("pp",) if job.seq_per_group else ("pair", key[1], key[2])) if p2p else ("dp", op[1])
                seq = seqs.get((r, group), 0)
                seqs[(r, group)] = seq + 1
                name = f"nccl:{op[0]}[pg=pp{r % job.dp},<=1MiB]" if p2p else f"nccl:allreduce[pg=dp{op[1]},<=32MiB]"
                calls[r].append((name, seq, got[r] - start[r], end - start[r], comp[r]))
                comp[r] = 0.0
                t[r] = end
                pc[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("toy job deadlocked")
    return calls, t


def run(job: ToyJob, iterations: int = 6) -> list[tuple[list[dict[str, Any]], list[RankTimeline | None]]]:
    """Every iteration's records and timelines (records carry coordinates, functions, bytes, iteration_ns)."""
    rng = np.random.default_rng(job.seed)
    n = job.dp * job.pp
    ar_bytes = job.allreduce_bytes or (32 << 20,) * job.pp
    start = np.zeros(n)
    out = []
    for _ in range(iterations):
        calls, end = _iteration(job, start, rng)
        records, timelines = [], []
        for r in range(n):
            names = sorted({c[0] for c in calls[r]})
            index = {x: i for i, x in enumerate(names)}
            counts = [sum(1 for c in calls[r] if c[0] == x) for x in names]
            per_call = [ar_bytes[r // job.dp] if "allreduce" in x else 1 << 20 for x in names]
            it = int(end[r] - start[r])
            records.append({"rank": r, "pp_rank": r // job.dp, "dp_rank": r % job.dp, "tp_rank": 0,
                            "host": f"node{r // 4:03d}", "iteration_ns": it, "function": names, "calls": counts,
                            "nbytes": [b * k for b, k in zip(per_call, counts, strict=True)]})  # fmt: skip
            timelines.append(RankTimeline(
                function=np.array([index[c[0]] for c in calls[r]], dtype=np.int64),
                seq=np.array([c[1] for c in calls[r]], dtype=np.int64),
                enter_ns=np.array([c[2] for c in calls[r]]).astype(np.int64),
                leave_ns=np.array([c[3] for c in calls[r]]).astype(np.int64),
                compute_ns=np.array([c[4] for c in calls[r]]).astype(np.int64), iteration_ns=it,
            ))  # fmt: skip
        out.append((records, timelines))
        start = end.copy()
    return out


def period_ns(job: ToyJob, iterations: int = 6) -> float:
    """The job's steady iteration time: the median rank's last iteration."""
    records = run(job, iterations)[-1][0]
    return float(np.median([r["iteration_ns"] for r in records]))
