"""NCCL Inspector files of a simulated dp x tp job, written field by field as the plugin writes them.

What a file holds follows ``plugins/profiler/inspector/inspector_json.cc`` (format ``v4.0``): one file per
process, ``<hostname>-pid<pid>.log``; one line per completed operation, ``{"header": {id, comm_name, rank,
n_ranks, nnodes}, "metadata": {inspector_output_format_version, git_rev, rec_mechanism, dump_timestamp_us,
hostname, pid}, "coll_perf": {coll, coll_sn, coll_msg_size_bytes, coll_exec_time_us, coll_timing_source,
coll_algobw_gbs, coll_busbw_gbs[, event_trace_sn, event_trace_ts]}}``. Bandwidths as ``inspectorComputeOpBw``
computes them; operations below ``NCCL_INSPECTOR_DUMP_MIN_SIZE_BYTES`` are not written; the dump thread
wakes every ``dump_interval_us`` and writes, communicator by communicator, what completed since.

The physics: a collective ends on every member at the last arrival plus the transfer; each member's kernel
runs from its own arrival to that end, so a slow rank (its compute x ``slow_factor``) arrives last, its
kernels are the transfer alone, and its peers' kernels hold their wait. Each iteration: the optimizer and
data loading, ``layers`` forward layers each ending in a tensor-parallel all-reduce, as many backward ones,
then the data-parallel gradient all-reduce in ``buckets``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

_FORMAT = {"inspector_output_format_version": "v4.0", "git_rev": "", "rec_mechanism": "nccl_profiler_interface"}


@dataclass(frozen=True, kw_only=True)
class InspectorJobSpec:
    """The job the files describe (ranks in Megatron order: tensor slot fastest)."""

    dp: int = 4
    tp: int = 2
    iterations: int = 12
    layers: int = 4
    buckets: int = 2
    gpus_per_host: int = 4
    slow_rank: int = -1
    slow_factor: float = 1.0
    jitter: float = 0.02
    start_us: int = 1_752_867_000_000_000
    dump_interval_us: int = 500
    min_size_bytes: int = 8192
    verbose: bool = False
    seed: int = 0
    forward_us: int = 3000
    backward_us: int = 6000
    optimizer_us: int = 20_000
    tp_bytes: int = 16 << 20
    dp_bytes: int = 256 << 20
    bus_gbs: float = 200.0

    @property
    def world(self) -> int:
        return self.dp * self.tp


@dataclass(eq=False)
class _Comm:
    hash: str
    members: tuple[int, ...]
    sn: int = 0


def _bandwidths(op: str, nbytes: int, nranks: int, exec_us: int) -> tuple[float, float]:
    """``inspectorComputeOpBw``: algorithm bandwidth from the traffic, bus bandwidth by the op's factor."""
    traffic, factor = float(nbytes), 1.0
    if op == "AllReduce":
        factor = 2 * (nranks - 1) / nranks
    elif op in ("ReduceScatter", "AllGather"):
        traffic, factor = float(nbytes * nranks), (nranks - 1) / nranks
    algbw = traffic / 1e9 / (exec_us / 1e6) if exec_us else 0.0
    return algbw, algbw * factor


def write_inspector_job(spec: InspectorJobSpec, folder: Path) -> list[Path]:
    """Write one Inspector file per rank into ``folder``; return their paths in rank order."""
    rng = random.Random(spec.seed)
    world = spec.world
    tp_groups = [tuple(range(d * spec.tp, (d + 1) * spec.tp)) for d in range(spec.dp)]
    dp_groups = [tuple(range(t, world, spec.tp)) for t in range(spec.tp)]
    comms = [_Comm(f"0x{rng.getrandbits(56):x}", g) for g in tp_groups + dp_groups]
    tp_of = {r: comms[r // spec.tp] for r in range(world)}
    dp_of = {r: comms[spec.dp + r % spec.tp] for r in range(world)}
    clock = [spec.start_us + rng.randrange(100) for _ in range(world)]
    done: list[list[tuple[int, _Comm, dict[str, object]]]] = [[] for _ in range(world)]

    def compute(rank: int, us: int) -> None:
        factor = spec.slow_factor if rank == spec.slow_rank else 1.0
        clock[rank] += max(1, round(us * factor * rng.lognormvariate(0.0, spec.jitter)))

    def collective(group: dict[int, _Comm], op: str, nbytes: int) -> None:
        for comm in {id(c): c for c in group.values()}.values():
            comm.sn += 1
            transfer_us = nbytes / (spec.bus_gbs * 1e3) * rng.lognormvariate(0, 0.01)
            end = max(clock[r] for r in comm.members) + round(transfer_us)
            for r in comm.members:
                start, clock[r] = clock[r], end
                if nbytes >= spec.min_size_bytes:
                    done[r].append((end, comm, _perf(op, comm, nbytes, start, end, spec.verbose)))

    for _ in range(spec.iterations):
        for r in range(world):
            compute(r, spec.optimizer_us)
        for phase_us in (spec.forward_us, spec.backward_us):
            for _ in range(spec.layers):
                for r in range(world):
                    compute(r, phase_us)
                collective(tp_of, "AllReduce", spec.tp_bytes)
        for _ in range(spec.buckets):
            for r in range(world):
                compute(r, 1000)
            collective(dp_of, "AllReduce", spec.dp_bytes // spec.buckets)
    folder.mkdir(parents=True, exist_ok=True)
    return [_write_rank(spec, folder, r, done[r], rng.randrange(spec.dump_interval_us)) for r in range(world)]


def _perf(op: str, comm: _Comm, nbytes: int, start: int, end: int, verbose: bool) -> dict[str, object]:
    exec_us = end - start
    algbw, busbw = _bandwidths(op, nbytes, len(comm.members), exec_us)
    perf: dict[str, object] = {
        "coll": op, "coll_sn": comm.sn, "coll_msg_size_bytes": nbytes, "coll_exec_time_us": exec_us,
        "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": round(algbw, 6), "coll_busbw_gbs": round(busbw, 6),
    }  # fmt: skip
    if verbose:
        perf["event_trace_sn"] = {"coll_start_sn": 1, "coll_stop_sn": 2, "kernel_events": [
            {"channel_id": 0, "kernel_start_sn": 3, "kernel_stop_sn": 5, "kernel_record_sn": 4}]}  # fmt: skip
        perf["event_trace_ts"] = {"coll_start_ts": start - 20, "coll_stop_ts": start - 15, "kernel_events": [
            {"channel_id": 0, "kernel_start_ts": start, "kernel_stop_ts": end, "kernel_record_ts": end}]}  # fmt: skip
    return perf


def _write_rank(
    spec: InspectorJobSpec, folder: Path, rank: int, done: list[tuple[int, _Comm, dict[str, object]]], phase: int
) -> Path:
    """The dump thread: at each wake-up, every communicator's operations completed since, in sn order."""
    host = f"node{rank // spec.gpus_per_host + 1:03d}"
    pid = 4000 + rank
    comm_rank = {id(c): c.members.index(rank) for _, c, _ in done}
    order = {id(c): i for i, c in enumerate(dict.fromkeys(c for _, c, _ in done))}
    interval = spec.dump_interval_us
    lines = []
    for end, comm, perf in sorted(done, key=lambda d: (_tick(d[0], phase, interval), order[id(d[1])], d[0])):
        nodes = len({m // spec.gpus_per_host for m in comm.members})
        header = {"id": comm.hash, "comm_name": "unknown", "rank": comm_rank[id(comm)], "n_ranks": len(comm.members),
                  "nnodes": nodes}  # fmt: skip
        meta = {**_FORMAT, "dump_timestamp_us": _tick(end, phase, interval), "hostname": host, "pid": pid}
        lines.append(json.dumps({"header": header, "metadata": meta, "coll_perf": perf}, separators=(",", ":")))
    path = folder / f"{host}-pid{pid}.log"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _tick(end_us: int, phase: int, interval: int) -> int:
    """The dump thread's first wake-up at or after ``end_us``."""
    return end_us + (phase - end_us) % interval
