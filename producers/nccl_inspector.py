"""NCCL Inspector plugin logs -> collective ``EventBatch`` es per rank, and the job's groups from membership.

The Inspector (NVIDIA/nccl ``plugins/profiler/inspector``, once ``ext-profiler/inspector``) writes one file
per process, ``<hostname>-pid<pid>.log``, one JSON object a line per completed operation of each of the
process's communicators: ``header`` (``id``: the communicator hash, ``comm_name``, ``rank`` and ``n_ranks``
within the communicator, ``nnodes``), ``metadata`` (``dump_timestamp_us``, ``hostname``, ``pid``...) and
``coll_perf`` (``coll``, ``coll_sn``, ``coll_msg_size_bytes``, ``coll_exec_time_us``, ``coll_timing_source``,
``coll_algobw_gbs``, ``coll_busbw_gbs``; verbose: ``event_trace_ts``) or ``p2p_perf`` (the same with
``p2p_`` and ``p2p_peer``). The rules here:

1. A communicator is a process group named by its hash; its members are the processes that reported it.
2. A process's global rank is its rank in a communicator that spans every process of the job (the world),
   else its position in (hostname, pid) order, the order launchers start local ranks in.
3. An operation's time: with the verbose event trace, its kernels' first start (launch: the collective's
   start on the host); else it ended by its dump time (the dump thread writes what completed since its last
   pass), and operations of one communicator dumped together ran back to back, in sequence order, before it.
   The duration is the execution time: the kernel's, which includes the wait for late peers.
4. A line that is not such an object costs that line, with a one-line reason (``LineProblem``).

Pure functions and a small incremental state (``InspectorJob``) shared by ``fleetscope inspector`` (live)
and ``analyze``/``replay`` (files): no I/O but ``read_inspector_files``, no torch.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from fleetscope.producers.kineto import TraceRank
from fleetscope.producers.kineto_comms import canonical_op
from fleetscope.schemas import COLUMNS, BatchHeader, EventBatch, EventKind
from fleetscope.schemas.layout import JobLayout, ProcessGroup, derive_layout, role_of_name

MAX_LINE_BYTES = 1 << 20
"""A longer line is refused: a verbose record with every channel's kernel events is a few KiB."""
INSPECTOR_SUFFIX = ".log"
_LIMIT = 2**62
_PER_RANK_SIZE_OPS = frozenset({"allgather", "reduce_scatter"})
"""Ops whose ``msg_size_bytes`` is one rank's share: the Inspector's traffic is it times ``n_ranks``."""


TRUNCATED = "no newline at the end (truncated): "
"""How the reason for a file's last line starts when that line lacks its newline and does not parse."""


class LineProblem(ValueError):
    """A line that is no Inspector record: ``str(exc)`` is the one-line reason."""


@dataclass(frozen=True, slots=True)
class InspectorOp:
    """One completed collective or point-to-point operation of one communicator, as one process saw it."""

    comm: str
    comm_name: str
    comm_rank: int
    comm_size: int
    host: str
    pid: int
    op: str
    """The vocabulary's name (``allreduce``, ``reduce_scatter``, ``send``...)."""
    seq: int
    nbytes: int
    """nccl-tests message size: the whole output for all-gather and reduce-scatter, the input for the rest."""
    exec_ns: int
    dump_ns: int
    kernel_start_ns: int = -1
    """The first kernel channel's start (verbose event trace); -1 when not written."""
    host_start_ns: int = -1
    """The operation's start on the host (verbose ``coll_start_ts``); -1 when not written."""
    peer: int = -1
    """A point-to-point operation's peer, as its rank in the communicator; -1 for collectives."""
    timing_source: str = ""
    algbw_gbs: float = 0.0
    busbw_gbs: float = 0.0


def looks_like_inspector(first_line: bytes) -> bool:
    """Whether a file's first line is an Inspector record (how ``analyze`` tells the format by content)."""
    try:
        doc = json.loads(first_line)
    except ValueError:
        return False
    return type(doc) is dict and type(doc.get("header")) is dict and ("coll_perf" in doc or "p2p_perf" in doc)


def _int(doc: Mapping[str, object], key: str, where: str, low: int = 0) -> int:
    v = doc.get(key)
    if type(v) is not int or not low <= v < _LIMIT:
        raise LineProblem(f"{where}.{key} is {str(v)[:40]!r}, not an integer >= {low}")
    return v


def _float(doc: Mapping[str, object], key: str) -> float:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        return 0.0
    return float(v) if math.isfinite(v) else 0.0


def _us_ns(v: object) -> int:
    return v * 1000 if type(v) is int and 0 < v < _LIMIT // 1000 else -1


def parse_line(line: str | bytes) -> InspectorOp:
    """One Inspector JSON line -> ``InspectorOp``; ``LineProblem`` with a one-line reason if it is none."""
    if len(line) > MAX_LINE_BYTES:
        raise LineProblem(f"line of {len(line)} bytes, over {MAX_LINE_BYTES}")
    try:
        doc = json.loads(line)
    except ValueError as exc:
        raise LineProblem(f"not JSON ({str(exc).splitlines()[0][:80]}): truncated or malformed") from None
    if type(doc) is not dict:
        raise LineProblem(f"a JSON {type(doc).__name__}, not an object")
    header, meta = doc.get("header"), doc.get("metadata")
    if type(header) is not dict or type(meta) is not dict:
        raise LineProblem("no header or metadata object")
    p2p = "p2p_perf" in doc
    perf = doc.get("p2p_perf" if p2p else "coll_perf")
    if type(perf) is not dict:
        raise LineProblem("no coll_perf or p2p_perf object")
    comm = header.get("id")
    if type(comm) is not str or not comm or len(comm) > 64:
        raise LineProblem(f"header.id is {str(comm)[:40]!r}, not a communicator hash")
    size = _int(header, "n_ranks", "header", low=1)
    rank = _int(header, "rank", "header")
    if rank >= size:
        raise LineProblem(f"header.rank {rank} outside n_ranks {size}")
    p = "p2p" if p2p else "coll"
    name = perf.get(p)
    if type(name) is not str or not name or len(name) > 64:
        raise LineProblem(f"{p}_perf.{p} is {str(name)[:40]!r}, not an operation name")
    op = canonical_op(name)
    op = "allgather" if op == "allgatherv" else op
    nbytes = _int(perf, f"{p}_msg_size_bytes", f"{p}_perf")
    if op in _PER_RANK_SIZE_OPS:
        nbytes *= size
    host = meta.get("hostname")
    kernel_start, host_start = _event_trace(perf.get("event_trace_ts"), p)
    return InspectorOp(
        comm=comm,
        comm_name=name_of(header.get("comm_name")),
        comm_rank=rank,
        comm_size=size,
        host=host[:256] if type(host) is str else "",
        pid=_int(meta, "pid", "metadata") if "pid" in meta else 0,
        op=op,
        seq=_int(perf, f"{p}_sn", f"{p}_perf"),
        nbytes=min(nbytes, _LIMIT),
        exec_ns=_int(perf, f"{p}_exec_time_us", f"{p}_perf") * 1000,
        dump_ns=_int(meta, "dump_timestamp_us", "metadata", low=1) * 1000,
        kernel_start_ns=kernel_start,
        host_start_ns=host_start,
        peer=_int(perf, "p2p_peer", "p2p_perf") if p2p else -1,
        timing_source=str(perf.get(f"{p}_timing_source", ""))[:32],
        algbw_gbs=_float(perf, f"{p}_algobw_gbs"),
        busbw_gbs=_float(perf, f"{p}_busbw_gbs"),
    )


def name_of(raw: object) -> str:
    """A communicator's name as a group description: the Inspector writes ``unknown`` for none."""
    return raw[:128] if type(raw) is str and raw != "unknown" else ""


def _event_trace(trace: object, p: str) -> tuple[int, int]:
    """(first kernel start, host start) in ns of a verbose record's ``event_trace_ts``; -1 where absent."""
    if type(trace) is not dict:
        return -1, -1
    host = _us_ns(trace.get(f"{p}_start_ts"))
    kernels = trace.get("kernel_events")
    starts = [_us_ns(k.get("kernel_start_ts")) for k in kernels if type(k) is dict] if type(kernels) is list else []
    starts = [s for s in starts if s > 0]
    return (min(starts) if starts else host), host


def op_times(ops: Sequence[InspectorOp]) -> tuple[list[int], list[int]]:
    """(start, launch) in ns of each of one process's operations (rule 3 of the module docstring)."""
    start = [0] * len(ops)
    launch = [0] * len(ops)
    # Untraced operations of one communicator and dump, latest first: each ends where the next one starts.
    order = sorted(range(len(ops)), key=lambda i: (ops[i].comm, ops[i].dump_ns, ops[i].seq), reverse=True)
    prev: tuple[str, int] | None = None
    end = 0
    for i in order:
        o = ops[i]
        if o.kernel_start_ns > 0:
            start[i] = o.kernel_start_ns
            launch[i] = o.host_start_ns if 0 < o.host_start_ns <= o.kernel_start_ns else o.kernel_start_ns
            continue
        if prev != (o.comm, o.dump_ns):
            prev, end = (o.comm, o.dump_ns), o.dump_ns
        start[i] = launch[i] = end = max(end - o.exec_ns, 0)
    return start, launch


def role_desc(comm_name: str) -> str:
    """A communicator name a framework chose (``TENSOR_MODEL_PARALLEL_GROUP``, ``DP Group 0``) as a group
    description, when it names a role (its first word may: ``DP``); else none (membership decides)."""
    if not comm_name:
        return ""
    if role_of_name(comm_name) is not None:
        return comm_name
    first = comm_name.replace("_", " ").split()[0]
    return first if role_of_name(first) is not None else ""


@dataclass
class InspectorJob:
    """What a job's Inspector files said so far: each process's source, the communicators' members, and
    the global rank given to each process (kept once given: a rank's key must not change mid-stream)."""

    job: str
    processes: dict[str, tuple[str, int]] = field(default_factory=dict)
    """source (file path) -> (hostname, pid)."""
    members: dict[str, dict[int, str]] = field(default_factory=dict)
    """communicator -> {rank in it: source}."""
    sizes: dict[str, int] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    ops: dict[str, set[str]] = field(default_factory=dict)
    peers: set[tuple[str, str, int, str]] = field(default_factory=set)
    """(source, communicator, peer's rank in it, op) of point-to-point operations."""
    given: dict[str, int] = field(default_factory=dict)
    """source -> its global rank, once batches of it were made."""

    def note(self, source: str, ops: Iterable[InspectorOp]) -> list[tuple[InspectorOp, str]]:
        """Record membership; return the operations refused with their reason: a second rank of one
        communicator in one file (a process driving several GPUs: its records cannot be told apart)."""
        refused: list[tuple[InspectorOp, str]] = []
        for o in ops:
            if source not in self.processes:
                self.processes[source] = (o.host, o.pid)
            members = self.members.setdefault(o.comm, {})
            mine = [r for r, s in members.items() if s == source]
            if mine and mine[0] != o.comm_rank:
                refused.append((o, f"communicator {o.comm} rank {o.comm_rank} in a file of its rank {mine[0]}"))
                continue
            members.setdefault(o.comm_rank, source)
            self.sizes[o.comm] = max(self.sizes.get(o.comm, 1), o.comm_size)
            if o.comm_name:
                self.names.setdefault(o.comm, o.comm_name)
            self.ops.setdefault(o.comm, set()).add(o.op)
            if o.peer >= 0:
                self.peers.add((source, o.comm, o.peer, o.op))
        return refused

    @property
    def world_size(self) -> int:
        return max([len(self.processes), *self.sizes.values(), *(r + 1 for r in self.given.values())])

    def ranks(self) -> dict[str, int]:
        """source -> global rank (rule 2), the ranks already given kept."""
        world = self.world_size
        worlds = [c for c, n in self.sizes.items() if n == world]
        out = dict(self.given)
        for comm in worlds:
            for r, source in self.members[comm].items():
                out.setdefault(source, r)
        taken = set(out.values())
        free = (r for r in range(world + len(self.processes)) if r not in taken)
        for source in sorted(self.processes, key=lambda s: (*self.processes[s], s)):
            if source not in out:
                out[source] = next(free)
        return out

    def groups(self, ranks: Mapping[str, int]) -> list[ProcessGroup]:
        """Every communicator of more than one process as a process group: its members' global ranks."""
        out = []
        for comm, members in sorted(self.members.items()):
            ordered = [ranks[s] for _, s in sorted(members.items()) if s in ranks]
            if len(ordered) > 1:
                out.append(ProcessGroup(name=comm, ranks=tuple(ordered), desc=role_desc(self.names.get(comm, "")),
                                        ops=frozenset(self.ops.get(comm, ()))))  # fmt: skip
        return out

    def p2p(self, ranks: Mapping[str, int]) -> tuple[set[tuple[int, int]], set[int]]:
        """Global point-to-point edges (``src -> dst``) and the ranks that send (to order pipeline stages)."""
        edges: set[tuple[int, int]] = set()
        for source, comm, peer, op in self.peers:
            other = self.members.get(comm, {}).get(peer)
            if other is None or source not in ranks or other not in ranks:
                continue
            me, them = ranks[source], ranks[other]
            edges.add((me, them) if op == "send" else (them, me))
        return edges, {s for s, _ in edges}

    def layout(self, ranks: Mapping[str, int]) -> JobLayout:
        """The job's layout from the communicators' membership (``schemas.layout.derive_layout``)."""
        edges, senders = self.p2p(ranks)
        return derive_layout(self.groups(ranks), world_size=self.world_size, p2p=edges, first_senders=senders)

    def batches(
        self, source: str, ops: Sequence[InspectorOp], layout: JobLayout, ranks: Mapping[str, int], first_seq: int
    ) -> list[EventBatch]:
        """Collectives batches of a process's operations (by launch, ``BATCH_EVENTS`` each), its rank given
        for good; ``first_seq``: the producer sequence number of the first."""
        if not ops:
            return []
        rank = self.given.setdefault(source, ranks[source])
        host, _ = self.processes.get(source, ("", 0))
        header = BatchHeader(
            job=self.job, rank=rank, world_size=max(self.world_size, rank + 1),
            producer_id=f"inspector-{source}"[-256:], seq=first_seq, host=host, streams=(EventKind.COLLECTIVES.value,),
            **(layout.role(rank).header_fields() if layout.known else {}),
        )  # fmt: skip
        return collectives_batches(header, ops)


BATCH_EVENTS = 4096
"""Operations per batch (about 200 KB encoded, far below a message's limit)."""


def collectives_batches(header: BatchHeader, ops: Sequence[InspectorOp]) -> list[EventBatch]:
    """The operations as collectives batches: name ``nccl:<op>``, group = communicator hash, by launch."""
    start, launch = op_times(ops)
    ids: dict[str, int] = {}

    def intern(name: str) -> int:
        return ids.setdefault(name, len(ids))

    rows = sorted(
        (launch[i], start[i], o.exec_ns, intern(f"nccl:{o.op}"), intern(o.op), intern(o.comm), o.seq,
         min(o.comm_size, 2**31 - 1), o.nbytes)
        for i, o in enumerate(ops)
    )  # fmt: skip
    spec = COLUMNS[EventKind.COLLECTIVES]
    order = ("launch_ns", "start_ns", "dur_ns", "name_id", "op_id", "pg_id", "seq", "group_size", "nbytes")
    columns = {c: np.asarray(v, dtype=spec[c]) for c, v in zip(order, zip(*rows, strict=True), strict=True)}
    out = []
    for k, lo in enumerate(range(0, len(rows), BATCH_EVENTS)):
        chunk = {c: columns[c][lo : lo + BATCH_EVENTS] for c in spec}
        sent = int((chunk["start_ns"] + chunk["dur_ns"]).max())
        h = replace(header, seq=header.seq + k, sent_ns=sent)
        out.append(EventBatch(kind=EventKind.COLLECTIVES, header=h, names=list(ids), columns=chunk))
    return out


@dataclass(frozen=True)
class InspectorFile:
    """One file read whole: its operations and the lines refused (1-based line number, reason)."""

    path: Path
    ops: list[InspectorOp]
    refused: list[tuple[int, str]]
    lines: int


def read_inspector_file(path: Path, max_bytes: int) -> InspectorFile:
    """Every complete line of the file parsed (a last line without its newline is truncated: refused)."""
    data = path.read_bytes()[: max_bytes + 1]
    if len(data) > max_bytes:
        raise LineProblem(f"{path}: over {max_bytes} bytes")
    ops: list[InspectorOp] = []
    refused: list[tuple[int, str]] = []
    lines = data.split(b"\n")
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            ops.append(parse_line(line))
        except LineProblem as exc:
            refused.append((n, f"{TRUNCATED}{exc}" if n == len(lines) else str(exc)))
    return InspectorFile(path=path, ops=ops, refused=refused, lines=sum(1 for line in lines if line.strip()))


def inspector_traces(
    paths: Sequence[Path], job: str | None, max_bytes: int
) -> tuple[list[TraceRank], list[tuple[Path, str]]]:
    """Inspector files read whole and grouped by job (``job``, else each file's folder name): one
    ``TraceRank`` per process with its collectives and the groups it is in, in rank order; and what was
    refused: (path, ``"<path>: <reason>"``) for each unreadable file or bad line."""
    refused: list[tuple[Path, str]] = []
    by_job: dict[str, list[tuple[InspectorFile, float]]] = {}
    for path in paths:
        t0 = time.perf_counter()
        try:
            f = read_inspector_file(path, max_bytes)
        except (OSError, LineProblem) as exc:
            refused.append((path, f"{path}: cannot be read ({exc})"))
            continue
        refused += [(path, f"{path}: line {n}: {reason}") for n, reason in f.refused]
        name = job or path.absolute().parent.name or "inspector"
        by_job.setdefault(name, []).append((f, time.perf_counter() - t0))
    out: list[TraceRank] = []
    for name, files in by_job.items():
        state = InspectorJob(name)
        kept: dict[str, list[InspectorOp]] = {}
        for f, _ in files:
            notes = state.note(str(f.path), f.ops)
            refused += [(f.path, f"{f.path}: {reason}") for _, reason in notes]
            bad = {id(o) for o, _ in notes}
            kept[str(f.path)] = [o for o in f.ops if id(o) not in bad]
        ranks = state.ranks()
        groups = state.groups(ranks)
        edges, _ = state.p2p(ranks)
        no_layout = JobLayout(world_size=state.world_size, roles={})
        for f, parse_s in files:
            source = str(f.path)
            ops = kept[source]
            if not ops:
                refused.append((f.path, f"{f.path}: no Inspector record in {f.lines} line(s)"))
                continue
            rank = ranks[source]
            batches = state.batches(source, ops, no_layout, ranks, 0)
            out.append(TraceRank(
                path=f.path, job=name, rank=rank, world_size=batches[0].header.world_size,
                host=batches[0].header.host, local_rank=0, time_base="inspector", steps=(), events=f.lines,
                kernels=0, kernel_ns=0, memory_ops=0, collectives=len(ops), host_spans=0,
                skipped_events=f.lines - len(ops), parse_s=parse_s, batches=tuple(batches),
                groups=tuple(g for g in groups if rank in g.ranks),
                p2p=tuple(e for e in edges if rank in e), first_p2p="",
            ))  # fmt: skip
    out.sort(key=lambda t: (t.job, t.rank))
    return out, refused
