"""Cost against truth: each injected fault's true cost beside the what-if's saving of its top cause.

    python bench/whatif_truth.py [--iterations 12] [--only sim|tracegen]

For every fault kind the simulator (``producers/simulation/faults.py``) and the trace generator
(``producers/tracegen.py``) inject, the same job (same seed) is generated with and without the fault; the
true cost is the difference of the job's iteration time (median rank, mean over the steady iterations).
Each faulty iteration is replayed (``streams/analysis/replay.py``) and every candidate cause priced
(``streams/analysis/whatif.py``). Printed per fault: the true cost, the top cause's estimated saving, the
error, whether the top cause is the injected one, any other cause that would be named (a victim), and the
replay's error on the healthy job. Timelines are the windower's (pattern records through the in-process
stages ``fleetscope analyze`` runs).

Not a test: figures depend on the jobs' sizes and seeds.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleetscope.producers import SimulatorConfig, simulate
from fleetscope.producers.simulation.faults import FAULT_KINDS, Fault
from fleetscope.schemas import EventBatch, EventKind
from fleetscope.streams.analysis.replay import call_graph, replay
from fleetscope.streams.analysis.timeline import RankTimeline
from fleetscope.streams.analysis.whatif import MIN_SAVING_SHARE, Cause, others_named, what_if
from fleetscope.streams.offline import OfflinePipeline

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import CollectingPublisher  # noqa: E402  (the tests' recording publisher: one definition)

PERSISTENT = 0.8
"""A cause is named where it is the top cause in this share of the judged iterations (one replica of two
being the slowest of a step by chance is not a fault)."""
Step = tuple[list[dict[str, object]], list[RankTimeline | None] | None]
"""One iteration's records and their timelines (None: the records' own, ``timeline_of``)."""


def job_steps(batches: Iterable[EventBatch]) -> dict[int, Step]:
    """Per iteration: every rank's pattern record, as the windower publishes it (its timeline inside), through
    the in-process stages ``fleetscope analyze`` runs (``streams/offline.py``); the last iteration left out."""
    pipeline = OfflinePipeline(keep_patterns=True)
    pipeline.add_all(batches)
    pipeline.finish()
    by: dict[int, list[dict[str, object]]] = {}
    for rec in pipeline.patterns:
        by.setdefault(int(rec["iteration"]), []).append(rec)
    ranks = max((len(v) for v in by.values()), default=0)
    return {it: (sorted(v, key=lambda r: r["rank"]), None) for it, v in sorted(by.items()) if len(v) == ranks}


def job_iteration_ns(steps: dict[int, Step], keep: Sequence[int]) -> float:
    """The job's iteration time: the median rank's, mean over the kept steps."""
    return float(np.mean([np.median([r["iteration_ns"] for r in steps[s][0]]) for s in keep]))


@dataclass
class Row:
    source: str
    fault: str
    true_ns: float
    est_ns: float
    top: Cause | None
    right: bool
    victims: list[Cause]
    replay_error: float
    iteration_ns: float = 0.0
    job_wide: bool = False
    """No fault, or a job-wide one: nothing may be named, there is no cause to price."""

    def line(self) -> str:
        err = (self.est_ns - self.true_ns) / self.true_ns * 100 if self.true_ns > 0.01 * self.iteration_ns else None
        top = f"{self.top.kind}{list(self.top.ranks)[:4]}{self.top.group or ''}" if self.top else "-"
        vic = ",".join(f"{v.kind}{list(v.ranks)[:3]}" for v in self.victims[:2]) or "no"
        right = "yes" if self.right else "NO"
        return (
            f"{self.source:8s} {self.fault:17s} {self.true_ns / 1e6:9.2f} {self.est_ns / 1e6:9.2f} "
            f"{'n/a' if err is None else f'{err:.1f}':>7s} {top:28s} {right:5s} {vic:24s} "
            f"{self.replay_error * 100:6.2f}"
        )


def priced(steps: dict[int, Step], keep: Sequence[int]) -> tuple[list[list[Cause]], float]:
    """Every kept step's causes, and the worst replay error of the job's time."""
    causes, worst = [], 0.0
    for s in keep:
        records, timelines = steps[s]
        g = call_graph(records, timelines)
        worst = max(worst, abs(replay(records, g).job_error))
        causes.append(what_if(records, graph=g))
    return causes, worst


def _identity(c: Cause) -> tuple[object, ...]:
    return (c.kind, c.ranks, c.group, c.stage)


def judged(
    source: str, fault: str, healthy: dict[int, Step], faulty: dict[int, Step], expected: object, first: int = -1
) -> Row:
    """One fault's row. A cause is named where it is the top cause, saving ``MIN_SAVING_SHARE`` of the
    iteration or more, in ``PERSISTENT`` of the judged iterations or more (a stand-in for the persistence test); its
    estimate is its mean saving over them all."""
    common = sorted(set(healthy) & set(faulty))
    keep = [s for s in common if s > first] if first >= 0 else common[2:]
    true = job_iteration_ns(faulty, keep) - job_iteration_ns(healthy, keep)
    causes, _ = priced(faulty, keep)
    _, healthy_err = priced(healthy, keep)
    it = job_iteration_ns(faulty, keep)
    tops = Counter(_identity(cs[0]) for cs in causes if cs and cs[0].saving_ns >= MIN_SAVING_SHARE * it)
    named_id = [k for k, n in tops.items() if n >= PERSISTENT * len(keep)]
    best_id = max(tops, key=lambda k: tops[k]) if tops else None
    top = next((c for cs in causes for c in cs[:1] if _identity(c) == best_id), None)
    est = float(np.mean([next((c.saving_ns for c in cs if _identity(c) == best_id), 0.0) for cs in causes]))
    others = Counter(_identity(c) for cs in causes for c in others_named(cs, it))
    named = [c for cs in causes for c in cs if _identity(c) in named_id and _identity(c) != best_id]
    named += [c for cs in causes for c in cs if others[_identity(c)] >= PERSISTENT * len(keep)]
    if expected is None:  # no fault, or a job-wide one: no peer is a cause
        right = not named_id
        return Row(source, fault, true, est, top, right, named, healthy_err, it, True)
    victims = [c for c in named if not expected(c)]
    right = top is not None and bool(expected(top)) and best_id in named_id
    return Row(source, fault, true, est, top, right, victims, healthy_err, it, False)


def _sim_expected(f: Fault, cfg: SimulatorConfig) -> object:
    kind = f.kind
    if kind == "slow_gpu":
        return lambda c: c.kind == "rank_compute" and c.ranks == (f.rank,)
    if kind in ("host_slow", "dataloader_stall", "cpu_contention"):
        return lambda c: c.kind == "rank_host" and c.ranks == (f.rank,)
    if kind in ("slow_link", "pcie_downgrade"):
        return lambda c: c.kind in ("group_transfer", "rank_transfer") and f.rank in c.ranks
    if kind == "net_congestion":
        return lambda c: c.kind == "host_transfer" and c.group == f.host
    if kind == "stage_imbalance":
        return lambda c: c.kind == "stage_compute" and c.stage == f.stage
    return None


def sim_rows(iterations: int) -> list[Row]:
    base = dict(ranks=16, tp=2, pp=2, iterations=iterations, layers=8, microbatches=4, gc_rate=0.0, seed=3,
                sample_interval_us=5000, gpus_per_host=4)  # fmt: skip
    healthy = job_steps(simulate(SimulatorConfig(**base)))  # type: ignore[arg-type]
    rows = [judged("sim", "healthy", healthy, healthy, None)]
    faults = {
        "slow_gpu": Fault(kind="slow_gpu", rank=5),
        "slow_link": Fault(kind="slow_link", rank=5),
        "host_slow": Fault(kind="host_slow", rank=5),
        "pcie_downgrade": Fault(kind="pcie_downgrade", rank=5),
        "dataloader_stall": Fault(kind="dataloader_stall", rank=1),
        "cpu_contention": Fault(kind="cpu_contention", rank=5),
        "net_congestion": Fault(kind="net_congestion", host="node001"),
        "stage_imbalance": Fault(kind="stage_imbalance", stage=1),
        "job_slowdown": Fault(kind="job_slowdown"),
    }
    for kind in FAULT_KINDS:
        if kind not in faults:
            print(f"sim      {kind:17s} skipped: no iteration to replay", file=sys.stderr)
            continue
        cfg = SimulatorConfig(**base, faults=(faults[kind],))  # type: ignore[arg-type]
        rows.append(judged("sim", kind, healthy, job_steps(simulate(cfg)), _sim_expected(faults[kind], cfg)))
    return rows


def tracegen_rows(iterations: int) -> list[Row]:
    from fleetscope.producers.kineto import parse_trace
    from fleetscope.producers.trace_layout import job_layouts, with_layout
    from fleetscope.producers.tracegen import FAULTS, TraceJob, write_traces

    def steps_of(job: TraceJob) -> dict[int, Step]:
        with tempfile.TemporaryDirectory() as d:
            paths = write_traces(job, Path(d) / "job")
            traces = [parse_trace(p) for p in paths]
            layouts = job_layouts(traces)
            return job_steps(b for t in traces for b in with_layout(t, layouts[t.job]).batches)

    base = dict(dp=2, pp=4, tp=1, steps=iterations)
    shapes = {
        "slow_link": dict(dp=2, pp=2, tp=2, steps=iterations),
        "a2a_imbalance": dict(dp=4, ep=2, steps=iterations),
    }
    healthy: dict[str, dict[int, Step]] = {}
    rows = []
    for fault in FAULTS:
        shape = shapes.get(fault, base)
        key = repr(shape)
        if key not in healthy:
            healthy[key] = steps_of(TraceJob(**shape))  # type: ignore[arg-type]
            rows.append(judged("tracegen", f"healthy {_shape(shape)}", healthy[key], healthy[key], None))
        if fault == "healthy":
            spread = steps_of(TraceJob(**base, work_spread=0.1))  # type: ignore[arg-type]
            rows.append(judged("tracegen", "seq-length spread", spread, spread, None))
            continue
        job = TraceJob(**shape, fault=fault, fault_rank=2)  # type: ignore[arg-type]
        ranks = set(job.culprits())
        exp: object
        if fault == "regression":
            exp = None
        elif fault == "slow_stage":
            exp = lambda c, job=job: c.kind == "stage_compute" and c.stage == job.pp - 1  # noqa: E731
        elif fault == "slow_link":
            exp = lambda c, ranks=ranks: c.kind.endswith("_transfer") and bool(ranks & set(c.ranks))  # noqa: E731
        else:
            exp = lambda c, ranks=ranks: c.kind.startswith("rank_") and set(c.ranks) <= ranks  # noqa: E731
        rows.append(judged("tracegen", fault, healthy[key], steps_of(job), exp, job.fault_step + 1))
    return rows


def _shape(shape: dict[str, int]) -> str:
    return "x".join(f"{k}{v}" for k, v in shape.items() if k in ("dp", "tp", "pp", "ep") and v > 1)


def synthetic_job(dp: int, pp: int, microbatches: int, seed: int = 0) -> Step:
    """One iteration of a dp x pp GPipe job (forward 2 ms, backward 4 ms, transfers 0.2 ms, 2 % jitter, one
    all-reduce per stage), vectorised over the replicas: ``4 * microbatches + 1`` calls per middle rank."""
    rng = np.random.default_rng(seed)
    fwd, bwd, p2p, ar = 2e6, 4e6, 2e5, 1e6
    t = np.tile(1e6 * (1 + 0.02 * rng.standard_normal(dp)), (pp, 1))
    calls: list[list[tuple[str, int, np.ndarray, np.ndarray]]] = [[] for _ in range(pp)]
    pair_seq = [[0, 0] for _ in range(pp)]  # per stage: calls with the stage before, with the stage after

    def transfer(src: int, dst: int, ready: np.ndarray) -> None:
        start = np.maximum(ready, t[dst])
        end = start + p2p
        a, b = (0, 1) if dst > src else (1, 0)
        calls[src].append(("send", pair_seq[src][b], ready, end))
        calls[dst].append(("recv", pair_seq[dst][a], t[dst].copy(), end))
        pair_seq[src][b] += 1
        pair_seq[dst][a] += 1
        t[src], t[dst] = end, end

    for backward in (False, True):
        for _ in range(microbatches):
            order = range(pp - 1, -1, -1) if backward else range(pp)
            for s in order:
                t[s] += (bwd if backward else fwd) * (1 + 0.02 * rng.standard_normal(dp))
                nxt = s - 1 if backward else s + 1
                if 0 <= nxt < pp:
                    transfer(s, nxt, t[s].copy())
    for s in range(pp):
        end = np.full(dp, t[s].max() + ar)
        calls[s].append(("allreduce", 0, t[s].copy(), end))
        t[s] = end + 1e6
    records, timelines = [], []
    for s in range(pp):
        for d in range(dp):
            names = [f"nccl:recv[pg=pp{d},<=1MiB]", f"nccl:send[pg=pp{d},<=1MiB]", f"nccl:allreduce[pg=dp{s},<=32MiB]"]
            kinds = {"recv": 0, "send": 1, "allreduce": 2}
            order = np.argsort([c[2][d] for c in calls[s]], kind="stable")
            cs = [calls[s][i] for i in order]
            rec = {"rank": s * dp + d, "pp_rank": s, "dp_rank": d, "tp_rank": 0, "host": f"node{(s * dp + d) // 8}"}
            rec |= {"iteration_ns": int(t[s][d]), "function": names, "calls": [1, 1, 1], "nbytes": [1 << 20] * 3}
            records.append(rec)
            timelines.append(RankTimeline(
                function=np.array([kinds[c[0]] for c in cs], dtype=np.int64),
                seq=np.array([c[1] for c in cs], dtype=np.int64),
                enter_ns=np.array([c[2][d] for c in cs]).astype(np.int64),
                leave_ns=np.array([c[3][d] for c in cs]).astype(np.int64),
                compute_ns=None, iteration_ns=int(t[s][d]),
            ))  # fmt: skip
    return records, timelines


def _real_rank(rank: int, port: int, steps: int, slow: int, slow_s: float, out: str) -> None:
    """One rank of a real dp2 x pp2 pipeline by hand (gloo, 4 micro-batches sent forward and their gradients
    back, then each stage's pair all-reduces): the torch hook's own timeline. ``slow`` sleeps ``slow_s`` in
    each micro-batch's forward (host work)."""
    import pickle

    import torch
    import torch.distributed as dist

    import fleetscope.producers.torch_hook as fs
    from fleetscope.producers.rank_recorder import RankIdentity, Recorder, RecorderConfig

    torch.set_num_threads(1)
    publisher = CollectingPublisher()
    recorder = Recorder(RankIdentity(job="real", rank=rank, world_size=4, host=f"h{rank // 2}"), publisher,
                        RecorderConfig(flush_interval_ms=60_000))  # fmt: skip
    monitor = fs.Monitor(recorder)
    monitor.start()
    fs._monitor = monitor
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    data = [dist.new_group(g, group_desc="DATA_PARALLEL_GROUP") for g in ([0, 1], [2, 3])][rank // 2]
    for g in ([0, 2], [1, 3]):
        dist.new_group(g, group_desc="PIPELINE_MODEL_PARALLEL_GROUP")
    for r in range(4):
        dist.new_group([r], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    stage, peer = rank // 2, rank + 2 if rank < 2 else rank - 2
    torch.manual_seed(stage)
    dim = 512
    layer = torch.nn.Sequential(
        torch.nn.Linear(dim, dim), torch.nn.Tanh(), torch.nn.Linear(dim, dim if stage == 0 else 1)
    )
    opt = torch.optim.SGD(layer.parameters(), lr=1e-4)
    try:
        for _ in range(steps):
            batches = [torch.randn(32, dim) for _ in range(4)]
            opt.zero_grad()
            if stage == 0:
                outputs = []
                for x in batches:
                    outputs.append(layer(x))
                    if rank == slow:
                        time.sleep(slow_s)
                    dist.send(outputs[-1].detach(), dst=peer)
                for h in outputs:
                    grad = torch.empty_like(h)
                    dist.recv(grad, src=peer)
                    h.backward(grad)
            else:
                grads = []
                for _ in batches:
                    h = torch.empty(32, dim)
                    dist.recv(h, src=peer)
                    h.requires_grad_()
                    layer(h).pow(2).mean().backward()
                    if rank == slow:
                        time.sleep(slow_s)
                    grads.append(h.grad)
                for grad in grads:
                    dist.send(grad, dst=peer)
            for p in layer.parameters():
                dist.all_reduce(p.grad, group=data)
            opt.step()
            fs.step()
    finally:
        dist.destroy_process_group()
        fs._monitor = None
        monitor.stop()
        recorder._flush()
        with open(f"{out}/{rank}.pkl", "wb") as f:
            pickle.dump(publisher.batches, f)


def real_steps(steps: int, slow: int = -1, slow_s: float = 0.0) -> dict[int, Step]:
    """A real 4-rank job (``_real_rank``) run in forked processes, through the windower."""
    import pickle
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_real_rank, args=(port, steps, slow, slow_s, out), nprocs=4, join=True,
                           start_method="fork")  # fmt: skip
        batches = [b for r in range(4) for b in pickle.loads(Path(f"{out}/{r}.pkl").read_bytes())]
    batches.sort(key=lambda b: b.kind is EventKind.HOST)  # a step closes after its events
    return job_steps(batches)


def real_rows(iterations: int) -> list[Row]:
    """The real pipeline job healthy and with rank 1 (stage 0) 3 ms slower per micro-batch forward."""
    steps = max(iterations, 12) + 4
    healthy = real_steps(steps)
    rows = [judged("real", "healthy dp2xpp2", healthy, healthy, None, 3)]
    slow = real_steps(steps, 1, 0.003)
    rows.append(
        judged("real", "slow host rank 1", healthy, slow, lambda c: c.ranks == (1,) and c.kind.startswith("rank_"), 3)
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--only", choices=("sim", "tracegen", "real"), default=None)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    if a.only in (None, "sim"):
        rows += sim_rows(a.iterations)
    if a.only in (None, "tracegen"):
        rows += tracegen_rows(a.iterations)
    if a.only in (None, "real"):
        rows += real_rows(a.iterations)
    print(f"{'source':8s} {'fault':17s} {'true ms':>9s} {'est ms':>9s} {'err %':>7s} {'top cause':28s} "
          f"{'right':5s} {'victim named':24s} {'replay %':>8s}")  # fmt: skip
    for r in rows:
        print(r.line())
    faults = [r for r in rows if not r.job_wide]
    within = sum(1 for r in faults if abs(r.est_ns - r.true_ns) <= 0.2 * r.true_ns)
    print(
        f"{within}/{len(faults)} peer faults within +-20 %, {sum(r.right for r in rows)}/{len(rows)} rows right "
        f"(no-fault and job-wide rows: right when nothing is named), "
        f"{sum(bool(r.victims) for r in rows)} with a victim named; {time.perf_counter() - t0:.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
