"""Kineto (PyTorch profiler) Chrome-trace files -> ``EventBatch`` es: one file is one rank.

Why it looks like this: traces are the zero-code-change input (``fleetscope replay``/``analyze``) and come
in two generations (see ``reference/kineto-trace-format.md``). Old traces (<= 2023) have integer
epoch-microsecond ``ts`` and keep NCCL sizes only on the CPU op (``nccl:*`` annotation or
``record_param_comms``); new ones have ``baseTimeNanoseconds`` + relative float ``ts`` and copy the NCCL
metadata onto the kernel. Both become the same columns. ``kineto_load`` decodes a file whole, only the
fields read here (the decoded events are dropped before the batches are returned); ``kineto_comms``
reads the NCCL metadata; events go straight into compact ``array`` columns, in one pass. A bad file
raises ``TraceError`` with a one-line reason; a bad event inside a good file is skipped and counted, never fatal.
"""

from __future__ import annotations

import functools
import math
import re
import time
from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.producers.kineto_comms import CommMeta, canonical_op, meta_from_args, nbytes_of, op_from_kernel
from fleetscope.producers.kineto_comms import int_or_none as _int
from fleetscope.producers.kineto_load import NO_ARGS, Args, Event, TraceDoc, TraceError, TraceLimits, load_trace
from fleetscope.producers.kineto_threads import THREAD_BUSY_NAME, busy_outside_spans, depths
from fleetscope.producers.trace_layout import P2P_OPS, GroupNotes, groups_from_pg_config
from fleetscope.schemas import (
    COLUMNS,
    THREAD_BUSY_DEPTH,
    BatchHeader,
    EventBatch,
    EventKind,
    FunctionKind,
    classify_kernel,
)
from fleetscope.schemas import parse_step_marker as _step
from fleetscope.schemas.layout import PP, ProcessGroup, role_of_name
from fleetscope.schemas.records import ID_COLUMNS
from fleetscope.schemas.vocabulary import is_sync_call, stable_function_name

Thread = tuple[int | str | None, int | str | None]
"""A trace event's (pid, tid), each None where the trace gives neither a number nor a name."""
DEFAULT_BATCH_EVENTS = 4096
DEFAULT_PROCESS_GROUP = "0"  # PyTorch's name for the default (world) process group
_LIMIT_NS = 2**62
_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
_LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
_HOST_CATS = frozenset({"user_annotation", "python_function"})
_USED_CATS = _GPU_CATS | _LAUNCH_CATS | _HOST_CATS
_CPU_OP_PREFIXES = ("record_param_comms", "nccl:", "ProfilerStep#")
_RANK_RE = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)

__all__ = ["DEFAULT_BATCH_EVENTS", "TraceError", "TraceLimits", "TraceRank", "parse_trace"]


@dataclass(frozen=True, kw_only=True)
class TraceRank:
    """One parsed trace file: who the rank is, what it contained, and its batches (in publish order)."""

    path: Path
    job: str
    rank: int
    world_size: int
    host: str
    local_rank: int
    time_base: str
    """``"base_time_ns"`` (new: baseTimeNanoseconds + relative ts) or ``"epoch_us"`` (old: absolute ts)."""
    steps: tuple[int, ...]
    """``ProfilerStep#N`` numbers found, in time order."""
    events: int
    """Entries of ``traceEvents``."""
    kernels: int
    """GPU kernel events (``cat == "kernel"``), NCCL kernels included."""
    kernel_ns: int
    memory_ops: int
    collectives: int
    host_spans: int
    skipped_events: int
    """Events of a used category with a missing or malformed field, and gloo calls of no known group."""
    parse_s: float
    batches: tuple[EventBatch, ...] = field(repr=False)
    groups: tuple[ProcessGroup, ...] = ()
    """Process groups this rank is in: ``distributedInfo.pg_config`` and the NCCL calls' args."""
    p2p: tuple[tuple[int, int], ...] = ()
    """Distinct point-to-point edges (global ``src -> dst``) of this rank's sends and receives."""
    first_p2p: str = ""
    """``"send"`` or ``"recv"``: this rank's first point-to-point operation (the first stage sends)."""

    @property
    def streams(self) -> tuple[str, ...]:
        return self.batches[0].header.streams if self.batches else ()

    def count(self, kind: EventKind) -> int:
        """Events of one kind across this rank's batches."""
        return sum(len(b) for b in self.batches if b.kind is kind)


def _text(s: str) -> str:
    """The string as valid UTF-8 (JSON may hold lone surrogates, which Avro cannot encode)."""
    try:
        s.encode()
        return s
    except UnicodeEncodeError:
        return s.encode(errors="replace").decode()


def _ns(value: object, base: int) -> int | None:
    """Chrome-trace microseconds (int or float) -> int ns + base; None when absent or absurd."""
    if type(value) is int:
        ns = value * 1000
    elif type(value) is float and -9e12 < value < 9e12:  # value * 1000 < 2**53: exact to the ns
        ns = round(value * 1000)
    elif type(value) is float and math.isfinite(value) and abs(value) < 1e16:
        whole = math.floor(value)
        ns = whole * 1000 + round((value - whole) * 1000)
    else:
        return None
    ns += base
    return ns if -_LIMIT_NS < ns < _LIMIT_NS else None


class _Extractor:
    """One pass over ``traceEvents`` into compact columns; NCCL kernels are resolved afterwards."""

    def __init__(self, base_ns: int, rank: int) -> None:
        self.base = base_ns
        self.notes = GroupNotes(rank)
        self.names: list[str] = []
        self._ids: dict[str, int] = {}
        self._kind: dict[str, FunctionKind] = {}
        self.k = {c: array("q") for c in ("start", "dur", "name", "stream", "corr")}
        self.p = {c: array("q") for c in ("start", "dur", "name", "thread", "step")}
        self.busy = array("q")
        """(start, duration, thread) of every CPU op that is no host span, one after the other."""
        self._raw_threads: dict[tuple[object, object], int] = {}
        self.nccl: list[tuple[int, int, str, int | None, int | None, Args]] = []
        self.gloo: list[tuple[int, int, str, Args, Thread]] = []
        """(start, duration, name, args, thread) of each ``gloo:*`` annotation: a CPU job's collectives."""
        self.launch: dict[int, tuple[int, Thread]] = {}
        self.comm_by_ext: dict[int, CommMeta] = {}
        self.comm_by_thread: dict[Thread, list[tuple[int, int, CommMeta]]] = {}
        self.threads: dict[Thread, int] = {}
        self.gpu_device: int | None = None
        self.kernels = self.kernel_ns = self.memory_ops = self.skipped = 0

    def intern(self, name: str) -> int:
        i = self._ids.get(name)
        if i is None:
            i = self._ids[name] = len(self.names)
            self.names.append(_text(name))
        return i

    def _thread_id(self, e: Event) -> int:
        """The number of an event's thread (``_thread``), looked up by its raw ids first: once per CPU op."""
        key = (e.pid, e.tid)
        try:
            return self._raw_threads[key]
        except KeyError:
            thread = self._raw_threads[key] = self.threads.setdefault(_thread(e), len(self.threads))
            return thread
        except TypeError:  # unhashable ids
            return self.threads.setdefault(_thread(e), len(self.threads))

    def feed(self, events: Iterable[Event]) -> None:
        base, busy = self.base, self.busy
        for e in events:
            cat, name = e.cat, e.name
            if type(cat) is not str:
                continue
            busy_only = False  # the bulk of a trace: a CPU op that is no comms op, step marker or wait
            if cat == "cpu_op":
                busy_only = type(name) is not str or not (name.startswith(_CPU_OP_PREFIXES) or _blocks(name))
            elif cat not in _USED_CATS:
                continue
            if e.ph != "X":
                continue
            ts, dur = e.ts, e.dur
            # the common case inline (float µs well inside range), else the general rule of _ns
            if type(ts) is float and -9e12 < ts < 9e12 and type(dur) is float and 0.0 <= dur < 9e12:
                ts, dur = round(ts * 1000) + base, round(dur * 1000)
                ts = ts if -_LIMIT_NS < ts < _LIMIT_NS else None
            elif type(ts) is int and type(dur) is int and 0 <= dur < 2**50:  # old traces: epoch µs
                ts, dur = ts * 1000 + base, dur * 1000
                ts = ts if -_LIMIT_NS < ts < _LIMIT_NS else None
            else:
                ts, dur = _ns(ts, base), _ns(dur, 0)
            if busy_only:  # only when its thread works (kineto_threads)
                if ts is not None and dur is not None and dur > 0:
                    busy.extend((ts, dur, self._thread_id(e)))
                continue
            if type(name) is not str or ts is None or dur is None or dur < 0:
                self.skipped += 1
                continue
            args = e.args or NO_ARGS
            if cat in _GPU_CATS:
                self._gpu(cat, name, ts, dur, e, args)
            elif cat in _LAUNCH_CATS:
                corr = _int(args.correlation)
                if corr is not None:
                    self.launch[corr] = (ts, _thread(e))
                if _blocks(name):  # a host span: the annotations around it wait, they do not work
                    self._host(cat, name, ts, dur, e, args)
            else:
                self._host(cat, name, ts, dur, e, args)

    def _gpu(self, cat: str, name: str, ts: int, dur: int, e: Event, args: Args) -> None:
        stream = _int(args.stream)
        stream = stream if stream is not None else _int(e.tid)
        stream = stream if stream is not None and -(2**31) <= stream < 2**31 else -1
        if self.gpu_device is None:
            self.gpu_device = _int(args.device) if args.device is not None else _int(e.pid)
        corr = _int(args.correlation)
        kind = self._kind.get(name)
        if kind is None:
            kind = self._kind[name] = classify_kernel(name)
        if cat == "kernel":
            self.kernels += 1
            self.kernel_ns += dur
            if kind is FunctionKind.COLLECTIVE:
                self.nccl.append((ts, dur, name, corr, _int(args.external_id), args))
                return
        else:
            self.memory_ops += 1
        k = self.k
        k["start"].append(ts)
        k["dur"].append(dur)
        k["name"].append(self.intern(name))
        k["stream"].append(stream)
        k["corr"].append(corr if corr is not None and -_LIMIT_NS < corr < _LIMIT_NS else -1)

    def _host(self, cat: str, name: str, ts: int, dur: int, e: Event, args: Args) -> None:
        if name.startswith(GLOO_PREFIX):
            self.gloo.append((ts, dur, name, args, _thread(e)))
            return
        if name.startswith("nccl:") or name == "record_param_comms":
            meta = meta_from_args(args, canonical_op(name) if name.startswith("nccl:") else None)
            ext = _int(args.external_id)
            if ext is not None:
                self.comm_by_ext.setdefault(ext, meta).fill(meta)
            self.comm_by_thread.setdefault(_thread(e), []).append((ts, ts + dur, meta))
        step = _step(name) if name.startswith("ProfilerStep#") else None
        if cat == "cpu_op" and step is None and not _blocks(name):
            return
        name = stable_function_name(name)
        thread = self.threads.setdefault(_thread(e), len(self.threads))
        p = self.p
        p["start"].append(ts)
        p["dur"].append(dur)
        p["name"].append(self.intern(name))
        p["thread"].append(thread)
        p["step"].append(-1 if step is None or step >= _LIMIT_NS else step)

    def resolve_collectives(
        self, world_size: int, pg_sizes: Mapping[str, int], groups: Sequence[ProcessGroup] = ()
    ) -> dict[str, Any]:
        """Metadata for every NCCL kernel: kernel args, then the CPU op by External id, then by launch. A
        trace with no NCCL kernel (a CPU job) has gloo's calls instead (``_gloo_rows``)."""
        for ops in self.comm_by_thread.values():
            ops.sort(key=lambda o: o[0])
        starts = {t: [o[0] for o in ops] for t, ops in self.comm_by_thread.items()}
        rows: list[tuple[int, ...]] = []
        ordinal: dict[str, int] = {}
        for ts, dur, name, corr, ext, args in sorted(self.nccl, key=lambda r: r[0]):
            meta = meta_from_args(args)
            launch = self.launch.get(corr) if corr is not None else None
            if ext is not None and ext != corr:  # old traces reuse the correlation as External id
                meta.fill(self.comm_by_ext.get(ext))
            if launch is not None and launch[1] in starts:
                t_launch, thread = launch
                ops, i = self.comm_by_thread[thread], bisect_right(starts[thread], t_launch)
                for j in range(i - 1, max(i - 17, -1), -1):  # innermost enclosing op first
                    if ops[j][1] >= t_launch:
                        meta.fill(ops[j][2])
            meta.op = meta.op or op_from_kernel(name) or "unknown"
            pg = meta.pg = meta.pg or DEFAULT_PROCESS_GROUP
            meta.group_size = meta.group_size or pg_sizes.get(pg) or world_size
            self.notes.note(meta.op, pg, meta.desc, meta.ranks, meta.peer)
            n = ordinal[pg] = ordinal.get(pg, -1) + 1
            seq = n if meta.seq is None else max(min(meta.seq, _LIMIT_NS), -_LIMIT_NS)
            rows.append(
                (ts, dur, self.intern(name), self.intern(meta.op), self.intern(pg),
                 seq, min(meta.group_size, 2**31 - 1),
                 min(nbytes_of(meta), _LIMIT_NS), launch[0] if launch else ts)
            )  # fmt: skip
        if not self.nccl:
            rows += self._gloo_rows(world_size, pg_sizes, groups)
        return {c: [r[j] for r in rows] for j, c in enumerate(COLUMNS[EventKind.COLLECTIVES])}

    def _gloo_rows(
        self, world_size: int, pg_sizes: Mapping[str, int], groups: Sequence[ProcessGroup]
    ) -> list[tuple[int, ...]]:
        """A CPU (gloo) job's collectives: each ``gloo:*`` annotation spans the call, from when its thread
        takes the work until every peer's data is in, as an NCCL kernel spans it on the GPU. Its group is
        its worker thread's (``gloo_groups``), a send's or receive's the pipeline's; calls whose group cannot
        be told are left out, and counted as skipped, rather than matched with the wrong peers."""
        calls = sorted(self.gloo, key=lambda g: g[0])
        metas = [meta_from_args(args, canonical_op(name.removeprefix(GLOO_PREFIX))) for _, _, name, args, _ in calls]
        p2p = [m.op in P2P_OPS for m in metas]
        worker = ((c[4], nbytes_of(m)) for c, m, q in zip(calls, metas, p2p, strict=True) if not q)
        by_thread, pipeline = gloo_groups(worker, groups) or {}, gloo_p2p_group(groups)
        rows: list[tuple[int, ...]] = []
        ordinal: dict[str, int] = {}
        for (ts, dur, name, _, thread), meta, q in zip(calls, metas, p2p, strict=True):
            pg = meta.pg = meta.pg or (pipeline if q else by_thread.get(thread))
            if pg is None:
                self.skipped += 1
                continue
            meta.group_size = meta.group_size or pg_sizes.get(pg) or world_size
            self.notes.note(meta.op or "unknown", pg, meta.desc, meta.ranks, meta.peer)
            n = ordinal[pg] = ordinal.get(pg, -1) + 1
            rows.append(
                (ts, dur, self.intern(name), self.intern(meta.op or "unknown"), self.intern(pg), n,
                 min(meta.group_size, 2**31 - 1), min(nbytes_of(meta), _LIMIT_NS), ts)
            )  # fmt: skip
        return rows


GLOO_PREFIX = "gloo:"
"""PyTorch's annotation of a gloo call: a collective on a worker thread of its group, a send or receive on
the calling thread (``gloo:all_reduce``, ``gloo:send``)."""


def gloo_groups(calls: Iterable[tuple[Thread, int]], groups: Sequence[ProcessGroup]) -> dict[Thread, str] | None:
    """Each gloo worker thread's process group, from its collectives ((thread, message bytes)), or None
    where the threads do not say.

    Gloo gives each process group worker threads of its own (two by default), started as the group is
    created, and a trace lists its groups (``pg_config``) in creation order. The threads of one group
    carry the same messages, so threads sharing a message size are one group; the groups, ordered by
    their first thread's id, are then, in order, every group that can hold a collective (two ranks or
    more, not described as the pipeline's, whose sends and receives run on the calling thread), or every
    one of those but the default (world) group, which a job often never calls. Any other count is
    ambiguous, and so are groups whose threads interleave or differ in number: two groups sending one
    size, merged.
    """
    sizes: dict[Thread, set[int]] = {}
    for thread, nbytes in calls:
        sizes.setdefault(thread, set()).add(nbytes)
    if len(groups) <= 1:
        return dict.fromkeys(sizes, groups[0].name if groups else DEFAULT_PROCESS_GROUP)
    candidates = [g.name for g in groups if len(g.ranks) >= 2 and role_of_name(g.desc) != PP]
    if len(candidates) == 1:
        return dict.fromkeys(sizes, candidates[0])
    clusters: list[tuple[list[Thread], set[int]]] = []
    for thread, seen in sizes.items():
        joined = [c for c in clusters if c[1] & seen]
        merged = ([thread] + [t for c in joined for t in c[0]], seen.union(*(c[1] for c in joined)))
        clusters = [c for c in clusters if not c[1] & seen] + [merged]
    spans = sorted((min(map(_thread_order, c[0])), max(map(_thread_order, c[0])), c[0]) for c in clusters)
    apart = all(a[1] < b[0] for a, b in zip(spans, spans[1:], strict=False))  # each group's threads together
    if not apart or len({len(threads) for _, _, threads in spans}) > 1:  # and as many to each group
        return None
    ordered = [threads for _, _, threads in spans]
    without_default = candidates[1:] if candidates and candidates[0] == groups[0].name else candidates
    for names in (candidates, without_default):
        if len(ordered) == len(names):
            return {t: pg for threads, pg in zip(ordered, names, strict=True) for t in threads}
    return None


def gloo_p2p_group(groups: Sequence[ProcessGroup]) -> str | None:
    """The group of a gloo send or receive, which runs on the calling thread: the job's only group, else
    the one group described as the pipeline's; None where there is no such group."""
    if len(groups) <= 1:
        return groups[0].name if groups else DEFAULT_PROCESS_GROUP
    pipeline = [g.name for g in groups if role_of_name(g.desc) == PP]
    return pipeline[0] if len(pipeline) == 1 else None


def _thread_order(thread: Thread) -> tuple[int, int]:
    pid, tid = thread
    return (pid if type(pid) is int else -1, tid if type(tid) is int else -1)


@functools.lru_cache(maxsize=8192)
def _blocks(name: str) -> bool:
    """A blocking call (``is_sync_call``: ``cudaStreamSynchronize``, ``aten::item``...), kept as a host span."""
    return is_sync_call(name)


def _thread(e: Event) -> Thread:
    return (_thread_part(e.pid), _thread_part(e.tid))


def _thread_part(value: object) -> int | str | None:
    """A pid or tid as the trace gives it: a number or a name (JSON's), else None."""
    return value if isinstance(value, int | str) and not isinstance(value, bool) else None


def _identity(
    doc: TraceDoc, path: Path, job: str | None, rank: int | None, world_size: int | None
) -> tuple[BatchHeader, dict[str, int], list[ProcessGroup]]:
    """Who the rank is: distributedInfo, then the file name, then the caller; process groups and sizes."""
    info = doc.distributedInfo
    info = info if type(info) is dict else {}
    r = _int(info.get("rank"))
    if r is None:
        m = _RANK_RE.search(path.name)
        r = int(m.group(1)) if m and len(m.group(1)) < 10 else rank
    if r is None or r < 0 or r >= 2**31:
        raise TraceError(f"{path}: no rank (no distributedInfo.rank, no rank-N in the file name)")
    ws = _int(info.get("world_size"))
    ws = max(ws if ws is not None and 0 < ws < 2**31 else (world_size or 0), r + 1)
    pg_sizes: dict[str, int] = {}
    pg_config = info.get("pg_config")
    for pg in pg_config if type(pg_config) is list else ():
        size = _int(pg.get("pg_size")) if type(pg) is dict else None
        if size is not None and 0 < size < 2**31 and type(pg.get("pg_name")) is str:
            pg_sizes[pg["pg_name"]] = size
    host = ""
    top = {"hostname": doc.hostname, "host": doc.host, "host_name": doc.host_name}
    metadata = doc.metadata
    for source in (top, info, metadata if isinstance(metadata, dict) else {}):
        for key in ("hostname", "host", "host_name"):
            if not host and type(source.get(key)) is str:
                host = str(source[key]).strip()
    stem = path.name
    for suffix in (".gz", ".json", ".trace", ".pt"):
        stem = stem.removesuffix(suffix)
    job = _text(job or path.absolute().parent.name or "trace")
    host = _text(host or stem or path.name)
    header = BatchHeader(job=job, rank=r, world_size=ws, producer_id=f"kineto-{job}-{r}", seq=0, host=host)
    return header, pg_sizes, groups_from_pg_config(info)


def parse_trace(
    path: str | Path,
    *,
    job: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    batch_events: int = DEFAULT_BATCH_EVENTS,
    limits: TraceLimits | None = None,
) -> TraceRank:
    """Parse one Kineto trace file into a ``TraceRank``; raise ``TraceError`` if it is not one.

    ``job`` defaults to the parent directory's name; ``rank``/``world_size`` are used only when the
    trace has no ``distributedInfo`` (and, for the rank, no ``rank-N`` in its file name); ``limits``
    bound what the file may cost (``kineto_load.TraceLimits``).
    """
    if batch_events < 1:
        raise ValueError(f"batch_events must be >= 1, got {batch_events}")
    p = Path(path)
    t0 = time.perf_counter()
    doc = load_trace(p, limits)
    header, pg_sizes, configured = _identity(doc, p, job, rank, world_size)
    base = doc.baseTimeNanoseconds
    base_ns = base if type(base) is int and 0 <= base < _LIMIT_NS else None
    n_events = len(doc.traceEvents) + doc.skipped
    ex = _Extractor(base_ns or 0, header.rank)
    ex.skipped = doc.skipped
    ex.feed(doc.traceEvents)
    del doc  # the decoded events are by far the largest object: free them before building batches
    coll = ex.resolve_collectives(header.world_size, pg_sizes, configured)
    if not (ex.k["start"] or ex.p["start"] or coll["start_ns"]):
        raise TraceError(f"{p}: not a Kineto trace (no kernel, memory-op or host-span events)")
    steps = sorted((t, s) for t, s in zip(ex.p["start"], ex.p["step"], strict=True) if s >= 0)
    device = ex.gpu_device if ex.gpu_device is not None and 0 <= ex.gpu_device < 2**31 else 0
    header = replace(header, local_rank=device)
    groups = ex.notes.groups(configured)
    p2p, first_p2p = ex.notes.p2p(groups)
    return TraceRank(
        path=p,
        job=header.job,
        rank=header.rank,
        world_size=header.world_size,
        host=header.host,
        local_rank=device,
        time_base="base_time_ns" if base_ns is not None else "epoch_us",
        steps=tuple(s for _, s in steps),
        events=n_events,
        kernels=ex.kernels,
        kernel_ns=ex.kernel_ns,
        memory_ops=ex.memory_ops,
        collectives=len(coll["start_ns"]),
        host_spans=len(ex.p["start"]),
        skipped_events=ex.skipped,
        parse_s=time.perf_counter() - t0,
        batches=tuple(_batches(header, ex.names, _columns(ex, coll), batch_events)),
        groups=groups,
        p2p=p2p,
        first_p2p=first_p2p,
    )


Cols = dict[str, npt.NDArray[Any]]


def _columns(ex: _Extractor, coll: dict[str, Any]) -> dict[EventKind, Cols]:
    """numpy columns per kind, each sorted by the time the windower assigns events by."""
    k = {c: np.frombuffer(a, dtype=np.int64) if a else np.zeros(0, np.int64) for c, a in ex.k.items()}
    p = {c: np.frombuffer(a, dtype=np.int64) if a else np.zeros(0, np.int64) for c, a in ex.p.items()}
    # A kernel whose launch event was not captured gets its start (an upper bound); none known: no column.
    known = [ex.launch.get(c) for c in ex.k["corr"]]
    launch = [x[0] if x is not None else s for x, s in zip(known, ex.k["start"], strict=True)]
    kernels = {"start_ns": k["start"], "dur_ns": k["dur"], "name_id": k["name"], "stream": k["stream"]}
    kernels["launch_ns"] = np.array(launch if any(known) else [], dtype=np.int64)
    depth = depths(p["start"], p["dur"], p["thread"])
    depth[p["step"] >= 0] = 0
    b = np.frombuffer(ex.busy, dtype=np.int64).reshape(-1, 3) if ex.busy else np.zeros((0, 3), np.int64)
    b_start, b_end, _ = busy_outside_spans(
        b[:, 0], b[:, 0] + b[:, 1], b[:, 2], p["start"], p["start"] + p["dur"], p["thread"]
    )
    python = {
        "start_ns": np.concatenate([p["start"], b_start]),
        "dur_ns": np.concatenate([p["dur"], b_end - b_start]),
        "name_id": np.concatenate([p["name"], np.full(b_start.size, ex.intern(THREAD_BUSY_NAME), dtype=np.int64)]),
        "depth": np.concatenate([depth, np.full(b_start.size, THREAD_BUSY_DEPTH, dtype=np.int32)]),
    }
    out: dict[EventKind, Cols] = {}
    for kind, cols in ((EventKind.KERNELS, kernels), (EventKind.COLLECTIVES, coll)):
        cols = {c: np.asarray(v, dtype=COLUMNS[kind][c]) for c, v in cols.items()}
        t = cols["launch_ns"] if cols["launch_ns"].size else cols["start_ns"]
        order = np.lexsort((cols["start_ns"], t))
        out[kind] = {c: v[order] if v.size else v for c, v in cols.items()}
    order = np.argsort(python["start_ns"], kind="stable")
    out[EventKind.HOST] = {c: v[order].astype(COLUMNS[EventKind.HOST][c]) for c, v in python.items()}
    return out


# Host spans first, then the GPU streams: the windower closes a step on the GPU streams' watermarks, so
# every marker and host span of the file is already there when steps start closing (nothing is late).
_PUBLISH_ORDER = (EventKind.HOST, EventKind.COLLECTIVES, EventKind.KERNELS)


def _batches(header: BatchHeader, names: list[str], columns: dict[EventKind, Cols], size: int) -> Iterator[EventBatch]:
    """Chunks of ``size`` events, each with its own names dictionary; ``seq`` counts from 0."""
    streams = tuple(k.value for k in EventKind if k in columns and columns[k]["start_ns"].size)
    seq = 0
    for kind in _PUBLISH_ORDER:
        cols = columns[kind]
        for lo in range(0, int(cols["start_ns"].size), size):
            chunk = {c: v[lo : lo + size] for c, v in cols.items()}
            id_cols = [c for c in ID_COLUMNS if c in chunk]
            uniq, inverse = np.unique(np.concatenate([chunk[c] for c in id_cols]), return_inverse=True)
            for j, c in enumerate(id_cols):
                chunk[c] = inverse[j * len(chunk[c]) : (j + 1) * len(chunk[c])].astype(np.int32)
            end = int((chunk["start_ns"] + chunk["dur_ns"]).max())
            h = replace(header, seq=seq, streams=streams, sent_ns=end)
            seq += 1
            yield EventBatch(kind=kind, header=h, names=[names[i] for i in uniq.tolist()], columns=chunk)
