"""Modern-format Kineto traces of a transformer job, written from a timing model of its own.

Why: the analysis must be judged on layouts it did not produce itself. This writer knows nothing of the
simulator: ``tracegen_model`` runs a 1F1B pipeline schedule over ``dp x tp x pp`` (optionally ZeRO and a
mixture-of-experts layer), and this module writes one JSON file per rank as PyTorch 2.x writes it:
``ncclDevKernel_*`` names, ``distributedInfo`` with ``pg_config``, the collective args
``record_param_comms`` copies onto kernels (``Process Group Ranks``, ``Src Rank``/``Dst Rank``...),
``cudaLaunchKernel`` correlations, ``ProfilerStep#N`` spans and host clock skew of several ms per host.
Faults: ``slow_stage`` (the last stage's compute x1.25), ``slow_worker`` (one rank's compute x2.35),
``a2a_imbalance`` (one expert rank gets 2x the tokens), ``host_bound`` (one rank's GPU waits for each
launch: kernels are launched just before they start, so its gaps are its host's), ``slow_link`` (every ring
collective one rank is in transfers 3x slower), ``late_start`` (one rank starts every step late in host
work), ``regression`` (every rank's compute x1.12 from the middle step on).
``python -m fleetscope.producers.tracegen DIR`` writes a job.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fleetscope.producers.tracegen_model import (
    BASE_NS,
    DESCS,
    EXPERT_GEMM,
    FAULTS,
    RankActivity,
    TraceJob,
    simulate,
)
from fleetscope.schemas.fields import as_list

__all__ = ["EXPERT_GEMM", "FAULTS", "TraceJob", "documents", "main", "simulate", "write_traces"]


def documents(job: TraceJob) -> list[dict[str, object]]:
    """One Kineto JSON document per rank."""
    ranks, steps = simulate(job)
    rng = np.random.default_rng(job.seed + 1)
    hosts = (job.world_size - 1) // job.gpus_per_host + 1
    skew_us = rng.uniform(-job.skew_ms, job.skew_ms, hosts) * 1000.0
    start_us = 3_600_000_000.0  # an hour after the base, so skewed times stay positive
    groups = job.groups()
    return [
        _document(job, r, ranks[r], steps[r], start_us + skew_us[r // job.gpus_per_host], groups)
        for r in range(job.world_size)
    ]


def _document(
    job: TraceJob,
    rank: int,
    rk: RankActivity,
    steps: list[tuple[float, float]],
    offset_us: float,
    groups: list[tuple[str, str, tuple[int, ...]]],
) -> dict[str, object]:
    pid, tid = 4000 + rank, 4000 + rank
    events: list[dict[str, object]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": "python3"}},
        {"ph": "M", "name": "process_name", "pid": rank % job.gpus_per_host, "tid": 0, "args": {"name": "python3"}},
        {
            "ph": "M",
            "name": "process_labels",
            "pid": rank % job.gpus_per_host,
            "tid": 0,
            "args": {"labels": f"GPU {rank % job.gpus_per_host}"},
        },
    ]

    def us(x: float) -> float:
        return round(x + offset_us, 3)

    ext = itertools.count(1)
    for i, (s, e) in enumerate(steps):
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{job.first_step + i}",
                "pid": pid,
                "tid": tid,
                "ts": us(s),
                "dur": round(e - s, 3),
                "args": {"External id": next(ext)},
            }
        )
    for s, d, name in rk.spans:
        events.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": name,
                "pid": pid,
                "tid": tid,
                "ts": us(s),
                "dur": round(d, 3),
                "args": {"External id": next(ext)},
            }
        )
    bounds = [s for s, _ in steps]
    device = rank % job.gpus_per_host
    for corr, (ts, dur, name, stream, extra) in enumerate(sorted(rk.kernels, key=lambda k: k[0]), start=1):
        i = max(0, int(np.searchsorted(bounds, ts, side="right")) - 1)
        launch = max(bounds[i] + 1.0, ts - 8.0)
        e = next(ext)
        events.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "pid": pid,
                "tid": tid,
                "ts": us(launch),
                "dur": 4.0,
                "args": {"External id": e, "cbid": 211, "correlation": corr},
            }
        )
        args = {
            "External id": e,
            "queued": 0,
            "device": device,
            "context": 1,
            "stream": stream,
            "correlation": corr,
            "registers per thread": 128,
            "shared memory": 0,
            "grid": [132, 1, 1],
            "block": [384, 1, 1],
            "est. achieved occupancy %": 12,
            **extra,
        }
        events.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": name,
                "pid": device,
                "tid": stream,
                "ts": us(ts),
                "dur": round(dur, 3),
                "args": args,
            }
        )
    pg_config = [
        {
            "pg_name": "0",
            "pg_desc": "default_pg",
            "backend_config": "cuda:nccl",
            "pg_size": job.world_size,
            "ranks": list(range(job.world_size)),
        }
    ]
    for role, name, members in groups:
        if rank in members:
            pg_config.append(
                {
                    "pg_name": name,
                    "pg_desc": DESCS[job.names][role],
                    "backend_config": "cuda:nccl",
                    "pg_size": len(members),
                    "ranks": list(members),
                }
            )
    return {
        "schemaVersion": 1,
        "deviceProperties": [
            {
                "id": device,
                "name": "NVIDIA H100 80GB HBM3",
                "totalGlobalMem": 85031714816,
                "computeMajor": 9,
                "computeMinor": 0,
                "numSms": 132,
            }
        ],
        "distributedInfo": {
            "backend": "nccl",
            "rank": rank,
            "world_size": job.world_size,
            "pg_count": len(pg_config),
            "pg_config": pg_config,
            "nccl_version": "2.21.5",
        },
        "record_shapes": 0,
        "with_stack": 0,
        "cupti_version": 22,
        "cuda_runtime_version": 12040,
        "cuda_driver_version": 12040,
        "hostname": f"node{rank // job.gpus_per_host:03d}",
        "trace_id": f"{job.seed:08X}{rank:08X}",
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": BASE_NS,
        "traceEvents": events,
        "traceName": f"rank-{rank}.pt.trace.json",
    }


def write_traces(job: TraceJob, directory: str | Path, *, compress: bool = False) -> list[Path]:
    """Write ``rank-<r>.pt.trace.json[.gz]`` per rank into ``directory``; returns the paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for r, doc in enumerate(documents(job)):
        data = _kineto_json(doc).encode()
        path = out / f"rank-{r}.pt.trace.json{'.gz' if compress else ''}"
        path.write_bytes(gzip.compress(data, 1) if compress else data)
        paths.append(path)
    return paths


def _kineto_json(doc: dict[str, object]) -> str:
    """The text as Kineto writes it: ``"key": value`` spacing and one event per line (tools such as
    HolisticTraceAnalysis find the rank by a ``"rank": N`` pattern on the header's lines)."""
    head = {k: v for k, v in doc.items() if k != "traceEvents"}
    events = ",\n  ".join(json.dumps(e) for e in as_list(doc["traceEvents"]))
    return json.dumps(head, indent=1)[:-2] + ',\n "traceEvents": [\n  ' + events + "\n ]\n}\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fleetscope.producers.tracegen", description=__doc__)
    p.add_argument("directory")
    for dim in ("dp", "tp", "pp", "ep"):
        p.add_argument(f"--{dim}", type=int, default=4 if dim == "dp" else 1)
    p.add_argument("--order", default="tp,dp,pp", help="rank order, fastest first (default: tp,dp,pp)")
    p.add_argument("--names", choices=sorted(DESCS), default="megatron")
    p.add_argument("--zero", action="store_true")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--fault", choices=FAULTS, default="healthy")
    p.add_argument("--fault-rank", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    job = TraceJob(
        dp=a.dp,
        tp=a.tp,
        pp=a.pp,
        ep=a.ep,
        order=tuple(a.order.split(",")),
        names=a.names,
        zero=a.zero,
        steps=a.steps,
        fault=a.fault,
        fault_rank=a.fault_rank,
        seed=a.seed,
    )
    for path in write_traces(job, a.directory):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
