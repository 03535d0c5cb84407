"""dp x pp jobs composed from a real Kineto trace's kernels, with faults placed by who waits for whom.

Real (``tests/data/real_traces``, from HolisticTraceAnalysis' test data): each kernel's name, duration, grid
and registers, in its recorded order, from three profiled steps of a PyTorch DDP job; the phase each kernel
belongs to (the ``## forward/backward/optimizer ##`` annotation its launch falls in); the gradient buckets'
all-reduce kernels with their recorded element counts, dtype and durations (2 ranks). Composed here: the
layout (ranks ordered dp fastest, then pp, as Megatron), the split of each phase into ``pp`` stages of equal
kernel time (backward in reverse), the 1F1B schedule, the pipeline send/recv (the source has none: a real
NCCL 2.17 ``SendRecv`` kernel name, the activations' size below, carried at the source's measured all-reduce
bandwidth), a ring of ``dp`` moving each recorded bucket (its recorded time x 2(n-1)/n, a ring all-reduce's
traffic against the recorded ring of 2), kernels launched ahead (the source's host gaps, a profiled
launch-bound run, clipped to ``GAP_CAP_US``), one clock for all ranks. Microbatch j of step k on replica d
replays the source step (d + j + k) mod 3: the variation between ranks is the source's own.
Physics: a collective ends on every member at the last arrival plus its transfer; a receive ends when its send
has arrived and been carried; a rank's next kernel starts when its previous call ends.
"""

from __future__ import annotations

import functools
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

SOURCE = Path(__file__).parent / "data" / "real_traces" / "hta_nccl_data_rank0.json.gz"
PHASES = ("## forward ##", "## backward ##", "## optimizer ##")
SEND_RECV = "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"
ACTIVATION_BYTES = 4 * 1024 * 1024
"""Composed: what a stage sends per microbatch (the source has no pipeline)."""
GAP_CAP_US = 3.0
COMPUTE_STREAM, DP_STREAM, P2P_STREAM = 7, 40, 41
FAULTS = ("healthy", "slow_worker", "slow_stage", "slow_link")
DESCS = {"dp": "DATA_PARALLEL_GROUP", "pp": "PIPELINE_MODEL_PARALLEL_GROUP"}

Kernel = tuple[dict[str, Any], float, float]
"""(the source event, its duration in us, the gap before it in us)."""


@dataclass(frozen=True)
class SourceStep:
    """One recorded step: each phase's compute kernels, and its gradient buckets' all-reduce kernels."""

    phases: dict[str, list[Kernel]]
    buckets: list[dict[str, Any]]


@functools.cache
def _source_doc(path: Path = SOURCE) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(gzip.decompress(path.read_bytes()))
    return doc


def load_source(path: Path = SOURCE) -> list[SourceStep]:
    """The recorded steps, in order."""
    doc = _source_doc(path)
    events = doc["traceEvents"]
    launch = {e["args"]["correlation"]: e["ts"] for e in events if e.get("cat") == "cuda_runtime"}
    notes = sorted((e for e in events if e.get("name") in PHASES), key=lambda e: e["ts"])
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")), key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    out = []
    for s in steps:
        inside = [k for k in kernels if s["ts"] <= k["ts"] < s["ts"] + s["dur"]]
        phases: dict[str, list[Kernel]] = {p: [] for p in PHASES}
        for k in inside:
            if k["args"]["stream"] != COMPUTE_STREAM:
                continue
            at = launch[k["args"]["correlation"]]
            phase = next(n["name"] for n in notes if n["ts"] <= at <= n["ts"] + n["dur"])
            run = phases[phase]
            gap = k["ts"] - (run[-1][0]["ts"] + run[-1][0]["dur"]) if run else 0.0
            run.append((k, float(k["dur"]), min(max(gap, 0.0), GAP_CAP_US)))
        buckets = [k for k in inside if k["args"].get("Collective name") == "allreduce"]
        out.append(SourceStep(phases, buckets))
    return out


def _split(run: list[Kernel], parts: int) -> list[list[Kernel]]:
    """Contiguous parts of about equal kernel time."""
    cum = np.cumsum([d for _, d, _ in run])
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, parts) / parts)
    return [list(p) for p in np.split(np.array(run, dtype=object), cuts)]


@dataclass(frozen=True, kw_only=True)
class RealJob:
    """A dp x pp job of the source's kernels and the one fault it carries."""

    dp: int = 2
    pp: int = 4
    microbatches: int = 4
    steps: int = 6
    fault: str = "healthy"
    fault_rank: int = 0
    """slow_worker: the slow rank; slow_link: a rank of the slow data-parallel ring."""
    factor: float = 2.3
    """How many times longer the culprit's compute (slow_worker, slow_stage) or the ring's transfer takes."""

    def __post_init__(self) -> None:
        if self.fault not in FAULTS or min(self.dp, self.pp, self.microbatches, self.steps) < 1:
            raise ValueError(f"bad real job: {self}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    def rank_of(self, pp: int, dp: int) -> int:
        return dp + self.dp * pp

    def stage_of(self, rank: int) -> int:
        return rank // self.dp

    def culprits(self) -> tuple[int, ...]:
        if self.fault == "slow_stage":
            return tuple(self.rank_of(self.pp - 1, d) for d in range(self.dp))
        if self.fault == "slow_link":
            s = self.stage_of(self.fault_rank)
            return tuple(self.rank_of(s, d) for d in range(self.dp))
        return () if self.fault == "healthy" else (self.fault_rank,)

    def groups(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(role, pg_name, members) in creation order: dp rings per stage, then pipelines per replica."""
        out = [("dp", tuple(self.rank_of(s, d) for d in range(self.dp))) for s in range(self.pp)]
        out += [("pp", tuple(self.rank_of(s, d) for s in range(self.pp))) for d in range(self.dp)]
        return [(role, str(i + 1), m) for i, (role, m) in enumerate(out) if len(m) > 1]


@dataclass
class _Rank:
    kernels: list[tuple[float, float, dict[str, Any], int]] = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)


class _Composer:
    def __init__(self, job: RealJob, source: list[SourceStep]) -> None:
        self.job, self.src = job, source
        self.ranks = [_Rank() for _ in range(job.world_size)]
        self.pg = {(role, r): (name, m) for role, name, m in job.groups() for r in m}
        self.stages = [
            {p: _split(st.phases[p], job.pp) for p in PHASES} for st in source
        ]  # per source step, per phase: the pp parts
        big = max(source[0].buckets, key=lambda b: b["args"]["In msg nelems"])
        self.bytes_per_us = big["args"]["In msg nelems"] * 4 / big["dur"]

    def slow(self, r: int) -> float:
        job = self.job
        if job.fault == "slow_worker" and r == job.fault_rank:
            return job.factor
        if job.fault == "slow_stage" and self.job.stage_of(r) == job.pp - 1:
            return job.factor
        return 1.0

    def compute(self, r: int, t: float, part: list[Kernel]) -> float:
        for ev, dur, gap in part:
            d = dur * self.slow(r)
            t += gap
            self.ranks[r].kernels.append((t, d, ev, COMPUTE_STREAM))
            t += d
        return t

    def nccl(self, r: int, ts: float, dur: float, ev: dict[str, Any], role: str, args: dict[str, Any]) -> None:
        name, members = self.pg[(role, r)]
        full = {
            **ev["args"],
            **args,
            "Group size": len(members),
            "Process Group Name": name,
            "Process Group Description": DESCS[role],
            "Process Group Ranks": str(list(members)),
        }
        stream = P2P_STREAM if role == "pp" else DP_STREAM
        self.ranks[r].kernels.append((ts, dur, {**ev, "args": full}, stream))

    def p2p(self, a: int, b: int, sent: float, t: dict[int, float], template: dict[str, Any]) -> None:
        end = max(sent, t[b]) + ACTIVATION_BYTES / self.bytes_per_us
        ev = {**template, "name": SEND_RECV}
        n = ACTIVATION_BYTES // 4
        base = {"In msg nelems": n, "Out msg nelems": n, "dtype": "Float"}
        _, members = self.pg[("pp", a)]
        self.nccl(a, sent, end - sent, ev, "pp", {**base, "Collective name": "send", "Dst Rank": members.index(b)})
        self.nccl(b, t[b], end - t[b], ev, "pp", {**base, "Collective name": "recv", "Src Rank": members.index(a)})
        t[b] = end

    def iteration(self, k: int, t: dict[int, float]) -> None:
        job, p, m = self.job, self.job.pp, self.job.microbatches
        template = self.src[0].buckets[0]
        done: dict[tuple[str, int, int, int], float] = {}
        sched = {s: _schedule(s, m, p) for s in range(p)}
        for d in range(job.dp):
            pos = dict.fromkeys(range(p), 0)
            while any(pos[s] < len(sched[s]) for s in range(p)):
                for s in range(p):
                    while pos[s] < len(sched[s]):
                        kind, mb = sched[s][pos[s]]
                        dep_stage = s - 1 if kind == "F" else s + 1
                        r = job.rank_of(s, d)
                        if 0 <= dep_stage < p:
                            if (kind, dep_stage, mb, d) not in done:
                                break
                            self.p2p(job.rank_of(dep_stage, d), r, done[(kind, dep_stage, mb, d)], t, template)
                        src = self.stages[(d + mb + k) % len(self.src)]
                        part = src["## forward ##"][s] if kind == "F" else src["## backward ##"][p - 1 - s]
                        t[r] = self.compute(r, t[r], part)
                        done[(kind, s, mb, d)] = t[r]
                        pos[s] += 1
        self.gradients(k, t)

    def gradients(self, k: int, t: dict[int, float]) -> None:
        """Each stage's ring reduces its share of the recorded buckets (the last layers' first), one by one."""
        job, src = self.job, self.src[k % len(self.src)]
        nb = len(src.buckets)
        for s in range(job.pp):
            ring = [job.rank_of(s, d) for d in range(job.dp)]
            mine = [b for i, b in enumerate(src.buckets) if job.pp - 1 - (i * job.pp) // nb == s]
            for b in mine if job.dp > 1 else ():
                xfer = b["dur"] * 2 * (job.dp - 1) / job.dp
                if job.fault == "slow_link" and job.fault_rank in ring:
                    xfer *= job.factor
                end = max(t[r] for r in ring) + xfer
                for r in ring:
                    self.nccl(r, t[r], end - t[r], b, "dp", {})
                    t[r] = end
            for r in ring:
                part = self.stages[k % len(self.src)]["## optimizer ##"][s]
                t[r] = self.compute(r, t[r], part)


def _schedule(s: int, m: int, p: int) -> list[tuple[str, int]]:
    """1F1B: warm-up forwards, then one forward and one backward in turn, then the cool-down backwards."""
    warm = min(p - s - 1, m)
    ops = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", i) for i in range(m - warm, m)]


def compose(job: RealJob, source: list[SourceStep] | None = None) -> list[_Rank]:
    """Every rank's kernels and its (start, end) per step, in microseconds from the job's start."""
    c = _Composer(job, source or load_source())
    t = dict.fromkeys(range(job.world_size), 100.0)
    for k in range(job.steps):
        start = dict(t)
        c.iteration(k, t)
        for r in range(job.world_size):
            c.ranks[r].steps.append((start[r], t[r]))
            t[r] += 30.0
    return c.ranks


def step_ms(job: RealJob, source: list[SourceStep] | None = None) -> float:
    """The job's mean step time (its slowest rank's), without the first step."""
    ranks = compose(job, source)
    return max(float(np.mean([e - s for s, e in rk.steps[1:]])) for rk in ranks) / 1000.0


def documents(job: RealJob, source: list[SourceStep] | None = None) -> list[dict[str, Any]]:
    """One Kineto document per rank: the source's header, its kernels at their composed times."""
    head = {k: v for k, v in _source_doc().items() if k != "traceEvents"}
    origin = 4_458_000_000_000.0  # the source's own clock range
    docs = []
    for r, rk in enumerate(compose(job, source)):
        pid, tid, dev = 1000 + r, 1000 + r, r % 8
        events: list[dict[str, Any]] = []
        for i, (s, e) in enumerate(rk.steps):
            events.append(
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": f"ProfilerStep#{4 + i}",
                    "pid": pid,
                    "tid": tid,
                    "ts": origin + s,
                    "dur": round(e - s, 3),
                    "args": {"External id": i + 1},
                }
            )
        bounds = [s for s, _ in rk.steps]
        for corr, (ts, dur, ev, stream) in enumerate(sorted(rk.kernels, key=lambda x: x[0]), start=1):
            step = max(0, int(np.searchsorted(bounds, ts, side="right")) - 1)
            launch = max(bounds[step] + 1.0, ts - 8.0)
            events.append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "pid": pid,
                    "tid": tid,
                    "ts": round(origin + launch, 3),
                    "dur": 4.0,
                    "args": {"correlation": corr},
                }
            )
            args = {**ev["args"], "device": dev, "stream": stream, "correlation": corr, "External id": corr}
            events.append(
                {**ev, "pid": dev, "tid": stream, "ts": round(origin + ts, 3), "dur": round(dur, 3), "args": args}
            )
        pg = [
            {
                "pg_name": "0",
                "pg_desc": "default_pg",
                "backend_config": "cuda:nccl",
                "pg_size": job.world_size,
                "ranks": list(range(job.world_size)),
            }
        ]
        pg += [
            {"pg_name": n, "pg_desc": DESCS[role], "backend_config": "cuda:nccl", "pg_size": len(m), "ranks": list(m)}
            for role, n, m in job.groups()
            if r in m
        ]
        info = {
            **head["distributedInfo"],
            "rank": r,
            "world_size": job.world_size,
            "pg_count": len(pg),
            "pg_config": pg,
        }
        docs.append({**head, "distributedInfo": info, "traceName": f"rank-{r}.json", "traceEvents": events})
    return docs


def write_job(job: RealJob, directory: Path, source: list[SourceStep] | None = None) -> list[Path]:
    """``rank-<r>.json`` per rank into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for r, doc in enumerate(documents(job, source)):
        path = directory / f"rank-{r}.json"
        path.write_bytes(msgspec.json.encode(doc))
        paths.append(path)
    return paths
