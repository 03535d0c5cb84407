"""The instrumentation the PyTorch hook installs: collectives, DDP buckets, optimizer steps, dataloader.

Why these points: they are where a training step's time goes on the host and where ranks meet, and each is
cheap to time from Python (two clock reads and a deque append). Collectives are timed by wrapping the
``torch.distributed`` functions (with op, process group, group size, nccl-tests message size and a per-group
sequence number, so ranks can be aligned without trusting wall clocks; the flight recorder is told before
the call, so a rank blocked inside one still says which), and the functional collectives that DTensor's
tensor parallelism calls, from the call to their result's ``wait_tensor`` (``FUNCTIONAL_COLLECTIVES``). A
pipeline's blocking ``send``/``recv`` are timed alike, and ``batch_isend_irecv``'s and
torch.distributed.pipelining's batches of operations from the batch's call to each work's completion
(``P2P_FUNCTIONS``, ``install_p2p_patches``); their peers order the stages (``PEERS``).
DDP calls NCCL/Gloo from C++: unless the user registered a comm hook (a user hook that calls
``dist.all_reduce`` is timed by the wrapper), a DDP model's gradient all-reduce is timed from its first
forward: on NCCL by ``timed_allreduce_hook`` (the stock ``allreduce_hook``, timed, one event per bucket); on
any other backend (Gloo) without a comm hook, from the end of the backward pass to the end of DDP's wait
(``_GradientSync``, one event per step), because with any Python comm hook DDP divides the gradients in a
separate pass, a short kernel on a GPU but several per cent of a CPU step (bench/overhead.py).
``FLEETSCOPE_TORCH_DDP_HOOK=auto`` (default) chooses so; ``=1`` forces the comm hook, ``=0`` times no DDP
all-reduce. Host spans come from the global optimizer step hooks, from ``_BaseDataLoaderIter.__next__`` and
from ``gc.callbacks`` (a ``gc.collect`` span per garbage collection of at least ``GC_MIN_PAUSE_NS`` of CPU:
two clock reads per callback, an append per pause).
Every patch is inert while no monitor records, and our own code on it runs under ``Recorder.guard``:
training never sees our exceptions.

Timing caveat: a collective's duration is measured on the host, to the completion of its future for async
calls. For Gloo that is the transfer; for NCCL it is only the enqueue (kernels run later on the GPU): a
profiling window gives the GPU-side NCCL kernel times. Gloo's batched p2p works have no future: they are
timed to their ``wait``, so a send waited for only at the end of a schedule counts the time until then.
"""

from __future__ import annotations

import functools
import gc
import inspect
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Concatenate, ParamSpec, Protocol

import torch
import torch.distributed as dist

from fleetscope.producers.cpu_wait import SpanMark
from fleetscope.producers.flight_recorder import CollectiveEntry
from fleetscope.producers.rank_recorder import Recorder
from fleetscope.schemas import GC_PAUSE, EventKind

if TYPE_CHECKING:
    from torch.distributed._functional_collectives import RANK_TYPES
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data.dataloader import _BaseDataLoaderIter

P = ParamSpec("P")

logger = logging.getLogger(__name__)

# torch.distributed function -> (canonical op, parameter holding the nccl-tests message size S, or None)
COLLECTIVES: dict[str, tuple[str, str | None]] = {
    "all_reduce": ("allreduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "all_gather": ("allgather", "tensor_list"),
    "all_gather_into_tensor": ("allgather", "output_tensor"),
    "all_gather_single": ("allgather", "output_tensor"),  # FSDP2's parameter all-gathers (torch >= 2.12)
    "all_gather_coalesced": ("allgather", "output_tensor_lists"),
    "all_reduce_coalesced": ("allreduce", "tensors"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),  # FSDP2's gradient reduce-scatters
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_to_all_single": ("all_to_all", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
    "gather": ("gather", "tensor"),
    "scatter": ("scatter", "tensor"),
    "barrier": ("barrier", None),
}
FUNCTIONAL_COLLECTIVES: dict[str, tuple[str, bool]] = {
    "all_reduce": ("allreduce", False),
    "all_gather_tensor": ("allgather", True),
    "all_gather_single": ("allgather", True),
    "all_gather_tensor_autograd": ("allgather", True),
    "reduce_scatter_tensor": ("reduce_scatter", False),
    "reduce_scatter_single": ("reduce_scatter", False),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", False),
    "all_to_all_single": ("all_to_all", False),
    "all_to_all_single_autograd": ("all_to_all", False),
    "broadcast": ("broadcast", False),
}
"""``torch.distributed._functional_collectives`` function -> (canonical op, whether the nccl-tests message size is
the input's times the group's size: a gather's output). DTensor (PyTorch's tensor and sequence parallelism)
calls these, not ``torch.distributed``'s; they return at launch, and the collective completes at its
``wait_tensor``, which DTensor reaches at the result's first use."""
_DISABLE_DDP_HOOK = "FLEETSCOPE_TORCH_DDP_HOOK"
GC_MIN_PAUSE_NS = 100_000
"""Collections that took less CPU time (most young-generation ones) are not recorded: far below what a
finding needs. CPU time, not wall time: on a busy machine a short collection preempted midway would look
long, and such pauses, random on every rank, are the scheduler's, not the collector's."""


class Instrumented(Protocol):
    """What the patches need of the running monitor."""

    recorder: Recorder

    def on_optimizer_step(self, start_ns: int, end_ns: int, mark: SpanMark | None = None) -> None: ...

    def wait_mark(self) -> SpanMark | None: ...

    def host_span(self, name: str, start_ns: int, end_ns: int, mark: SpanMark | None) -> None: ...

    def span_wait(self, name: str, start_ns: int, wait_ns: int) -> None: ...


_installed = False
_current: Callable[[], Instrumented | None] = lambda: None  # noqa: E731
_group_info: dict[int, tuple[str, int, str, tuple[int, ...]]] = {}
_group_seq: dict[str, itertools.count[int]] = {}
_opt_start: dict[int, tuple[int, SpanMark | None]] = {}
_gc_start_ns = 0
_gc_start_cpu_ns = 0
_ALL_REDUCE: Callable[..., dist.Work] = dist.all_reduce


def install(current: Callable[[], Instrumented | None]) -> None:
    """Install every patch once per process; ``current`` returns the recording monitor or None."""
    global _installed, _current
    _current = current
    if _installed:
        return
    _installed = True
    for site, fn in (
        ("collectives", _patch_collectives),
        ("point-to-point", install_p2p_patches),
        ("functional collectives", _patch_functional_collectives),
        ("optimizer", _patch_optimizer),
        ("dataloader", _patch_dataloader),
        ("ddp", _patch_ddp),
        ("gc", _patch_gc),
    ):
        try:
            fn()
        except Exception as exc:  # a torch version without the hook point: the others still work
            logger.warning("fleetscope: cannot instrument %s: %r", site, exc)


def reset_sequences() -> None:
    """Start every group's sequence at 0 again (a new monitor in the same process)."""
    _group_seq.clear()


# -- collectives -----------------------------------------------------------------------------------------
def _nbytes(value: object) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor):
        return int(value.numel() * value.element_size())
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def _group(group: dist.ProcessGroup | None) -> tuple[str, int, str, tuple[int, ...]]:
    """(name, size, backend, global ranks) of a process group; None is the default group."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    info = _group_info.get(id(pg))
    if info is None:
        name = str(dist.distributed_c10d._get_process_group_name(pg))
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(pg))
        info = _group_info[id(pg)] = (name, int(pg.size()), str(dist.get_backend(pg)), ranks)
    return info


def _process_group(group: object) -> dist.ProcessGroup | None:
    """A call's ``group`` argument: a process group, or None for the default one."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    raise TypeError(f"group {type(group).__name__} is not a process group")


# A collective being called: what the flight recorder shows, and the event's name, group size and group.
_Call = tuple[CollectiveEntry, str, int, str]


def _enter(
    mon: Instrumented, op: str, size_arg: object, group: dist.ProcessGroup | None, peer: int | None = None
) -> _Call:
    """Number the collective in its group and tell the flight recorder the rank is inside it, before the
    real call: a rank blocked in it still says where it is.

    A send or receive (``peer``: the other end's global rank, -1 where unknown) is its pair's, for the
    flight recorder: numbered in the pair's own count (both ends make their calls to each other in one
    order), with the pair as the group's members. Numbered in the process group's count, the group's later
    collectives would carry different numbers on ranks that sent different numbers of times (a middle stage
    sends twice as often as the first). The event keeps the process group, as a profiler trace's does."""
    name, size, backend, ranks = _group(group)
    key = name
    if peer is not None:
        me = dist.get_rank()
        ranks = (min(me, peer), max(me, peer)) if peer >= 0 else (me,)
        key = f"{name}:p2p:{'-'.join(map(str, ranks))}"
    counter = _group_seq.get(key)
    if counter is None:
        counter = _group_seq[key] = itertools.count()
    if size > 1:  # the windower then waits for this rank's collectives before closing a step
        mon.recorder.declare(EventKind.COLLECTIVES)
    entry = CollectiveEntry(op, key, ranks, next(counter), _nbytes(size_arg), time.time_ns())
    mon.recorder.state.enter(entry)
    return entry, f"{backend}:{op}", size, name


def _leave(recorder: Recorder, call: _Call, end_ns: int) -> None:
    entry, event_name, size, group = call
    recorder.state.leave(entry)
    start = entry.entered_ns
    recorder.collective(event_name, entry.op, group, entry.seq, size, entry.nbytes, start, end_ns - start)


def _record_collective(mon: Instrumented, call: _Call, result: object) -> None:
    recorder = mon.recorder
    if result is None:  # synchronous: the call itself is the collective
        _leave(recorder, call, time.time_ns())
        return
    if not isinstance(result, dist.Work):
        raise TypeError(f"an asynchronous collective returned {type(result).__name__}, not a Work")

    def done(_fut: object) -> None:
        recorder.guard("collective_done", _leave, recorder, call, time.time_ns())

    result.get_future().add_done_callback(done)


def _wrap_collective(fname: str, orig: Callable[..., object]) -> Callable[..., object]:
    op, size_param = COLLECTIVES[fname]
    params = list(inspect.signature(orig).parameters)
    gi = params.index("group")
    si = params.index(size_param) if size_param else -1

    @functools.wraps(orig)
    def wrapper(*args: object, **kwargs: object) -> object:
        mon = _current()
        if mon is None:
            return orig(*args, **kwargs)
        size_arg = _argument(args, kwargs, size_param, si) if size_param else None
        call = mon.recorder.guard("collective", _enter, mon, op, size_arg, _argument(args, kwargs, "group", gi))
        return _timed(mon, call, _record_collective, orig, args, kwargs)

    wrapper.__fleetscope_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def _argument(args: tuple[object, ...], kwargs: dict[str, object], name: str, index: int) -> object:
    """A call's argument, by keyword or at its position; None where it was left to its default."""
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _timed(
    mon: Instrumented,
    call: _Call | None,
    done: Callable[[Instrumented, _Call, object], None],
    orig: Callable[..., object],
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> object:
    """Run the collective; hand its result to ``done``, or, where it raised, tell the flight recorder the rank
    is out of it."""
    try:
        result = orig(*args, **kwargs)
    except BaseException:
        if call is not None:
            mon.recorder.state.leave(call[0])
        raise
    if call is not None:
        mon.recorder.guard("collective", done, mon, call, result)
    return result


def _patch_collectives() -> None:
    global _ALL_REDUCE
    _ALL_REDUCE = getattr(dist.all_reduce, "__fleetscope_original__", dist.all_reduce)
    for fname in COLLECTIVES:
        orig = getattr(dist, fname, None)
        if orig is None or hasattr(orig, "__fleetscope_original__"):
            continue
        setattr(dist, fname, _wrap_collective(fname, orig))


# -- point-to-point: pipeline stages' sends and receives ------------------------------------------------
P2P_FUNCTIONS: dict[str, tuple[str, str, str]] = {
    "send": ("send", "dst", "group_dst"),
    "recv": ("recv", "src", "group_src"),
}
"""The blocking p2p calls: op, peer parameter (a global rank), peer parameter within ``group``. ``isend`` and
``irecv`` stay unwrapped: ``P2POp`` and ``batch_isend_irecv`` know them by identity; their batches are timed
through ``batch_isend_irecv``."""
_MAX_PEERS = 64
_MAX_PENDING_WORKS = 256


class P2PPeers:
    """The peers of this rank's point-to-point calls (global ranks) and whether it sent first: the layout
    orders the pipeline stages by them (``torch_layout``)."""

    def __init__(self) -> None:
        self.edges: dict[tuple[int, int], None] = {}
        self.first: str = ""
        self.first_peer = -1

    def note(self, op: str, me: int, peer: int) -> None:
        if len(self.edges) < _MAX_PEERS and peer != me:
            self.edges[(me, peer) if op == "send" else (peer, me)] = None
        if not self.first:
            self.first, self.first_peer = op, peer


PEERS = P2PPeers()
_PIPELINING = "torch.distributed.pipelining.schedules"
_batching = threading.local()
"""``inside``: a wrapped batch of p2p operations is being issued on this thread."""
_pending_works: dict[int, tuple[dist.Work, list[_Call]]] = {}
"""Batched p2p works of a backend whose works have no future (Gloo), by id, until they are waited for."""


def _global_peer(peer: object, group_peer: object, group: object) -> int:
    """The other end as a global rank (given as one, or as a rank within ``group``); -1 where unknown
    (``recv`` from any source)."""
    if isinstance(peer, int):
        return peer
    if isinstance(group_peer, int):
        return _group(_process_group(group))[3][group_peer]
    return -1


def _wrap_p2p(fname: str, orig: Callable[..., object]) -> Callable[..., object]:
    op, peer_param, group_peer_param = P2P_FUNCTIONS[fname]
    params = list(inspect.signature(orig).parameters)
    pi, gi = params.index(peer_param), params.index("group")
    gpi = params.index(group_peer_param) if group_peer_param in params else -1

    @functools.wraps(orig)
    def wrapper(*args: object, **kwargs: object) -> object:
        mon = _current()
        group = _argument(args, kwargs, "group", gi)
        peer = _argument(args, kwargs, peer_param, pi)
        group_peer = _argument(args, kwargs, group_peer_param, gpi) if gpi >= 0 else None
        call = None
        try:
            where = _global_peer(peer, group_peer, group)
            if where >= 0:
                PEERS.note(op, dist.get_rank(), where)
            if mon is not None:
                call = mon.recorder.guard("collective", _enter, mon, op, _argument(args, kwargs, "tensor", 0),
                                          group, where)  # fmt: skip
        except Exception:  # noqa: S110 - bookkeeping must never fail the training call
            pass
        if mon is None:
            return orig(*args, **kwargs)
        return _timed(mon, call, _returned, orig, args, kwargs)

    wrapper.__fleetscope_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def _returned(mon: Instrumented, call: _Call, _result: object) -> None:
    """A blocking call completed on its return (``recv`` returns the sender's rank, not a work)."""
    _leave(mon.recorder, call, time.time_ns())


def _wrap_batch(orig: Callable[..., object]) -> Callable[..., object]:
    """``batch_isend_irecv`` (Megatron's 1F1B p2p): each ``P2POp`` names its op and global peer; each is
    timed from the batch's call to its work's completion (its future; on Gloo, which has none, the return
    of its ``wait``)."""

    @functools.wraps(orig)
    def wrapper(p2p_op_list: Iterable[dist.P2POp], *args: object, **kwargs: object) -> object:
        if getattr(_batching, "inside", False):  # pipelining's batch calls batch_isend_irecv: counted once
            return orig(p2p_op_list, *args, **kwargs)
        mon = _current()
        calls: list[_Call] = []
        try:
            me = dist.get_rank()
            for p in list(p2p_op_list):
                name = getattr(getattr(p, "op", None), "__name__", "")
                if not isinstance(p.peer, int) or name not in ("isend", "irecv"):
                    continue
                op = "send" if name == "isend" else "recv"
                PEERS.note(op, me, p.peer)
                if mon is not None:
                    calls.append(_enter(mon, op, p.tensor, p.group, p.peer))
        except Exception:  # the batch is timed whole or not at all
            if mon is not None:
                for call in calls:
                    mon.recorder.state.leave(call[0])
            calls = []
        _batching.inside = True
        try:
            works = orig(p2p_op_list, *args, **kwargs)
        finally:
            _batching.inside = False
        if mon is not None and calls:
            mon.recorder.guard("collective", _batch_launched, mon, calls, works)
        return works

    wrapper.__fleetscope_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def _batch_launched(mon: Instrumented, calls: list[_Call], works: Iterable[dist.Work] | None) -> None:
    """Pair each call with its work (one work for a coalesced batch: all its calls end with it)."""
    works = list(works or ())
    if not works:  # completed already
        for call in calls:
            _leave(mon.recorder, call, time.time_ns())
        return
    per_work = [[c] for c in calls] if len(works) == len(calls) else [[]] * (len(works) - 1) + [calls]
    for work, mine in zip(works, per_work, strict=True):
        if not mine:
            continue
        try:
            future = work.get_future()
        except Exception:  # Gloo: no future ("not implemented"); timed when waited for
            if len(_pending_works) >= _MAX_PENDING_WORKS:  # never waited for: forget the oldest
                _, stale = _pending_works.pop(next(iter(_pending_works)))
                for call in stale:
                    mon.recorder.state.leave(call[0])
            _pending_works[id(work)] = (work, mine)
            continue
        future.add_done_callback(functools.partial(_works_done, mon.recorder, mine))


def _works_done(recorder: Recorder, calls: list[_Call], _fut: object = None) -> None:
    now = time.time_ns()
    for call in calls:
        recorder.guard("collective_done", _leave, recorder, call, now)


def _wrap_work_wait(orig: Callable[..., object]) -> Callable[..., object]:
    @functools.wraps(orig)
    def wait(self: object, *args: object, **kwargs: object) -> object:
        out = orig(self, *args, **kwargs)
        if _pending_works:
            pending = _pending_works.pop(id(self), None)
            mon = _current()
            if pending is not None and mon is not None:
                _works_done(mon.recorder, pending[1])
        return out

    wait.__fleetscope_original__ = orig  # type: ignore[attr-defined]
    return wait


def install_p2p_patches() -> None:
    """Wrap ``dist.send/recv/batch_isend_irecv`` (their peers, and their times while a monitor records),
    ``Work.wait`` (Gloo's batched works) and, where the job imported torch.distributed.pipelining, its
    ``_batch_p2p``: it issues a batch of sends alone, or of receives alone, with ``isend``/``irecv`` themselves,
    and only sends and receives all timed tell a stage held up from one that is late (an untimed wait makes
    the stage that waited look late in the stead of the one it waited for); idempotent."""
    for fname in P2P_FUNCTIONS:
        orig = getattr(dist, fname, None)
        if orig is not None and not hasattr(orig, "__fleetscope_original__"):
            setattr(dist, fname, _wrap_p2p(fname, orig))
    batch = getattr(dist, "batch_isend_irecv", None)
    if batch is not None and not hasattr(batch, "__fleetscope_original__"):
        setattr(dist, "batch_isend_irecv", _wrap_batch(batch))  # noqa: B010 - typed apart from the original
    work = getattr(dist, "Work", None)
    if work is not None and not hasattr(work.wait, "__fleetscope_original__"):
        work.wait = _wrap_work_wait(work.wait)
    schedules = sys.modules.get(_PIPELINING)  # torch.distributed.pipelining, where the job imported it already
    pipelined = getattr(schedules, "_batch_p2p", None)
    if schedules is not None and pipelined is not None and not hasattr(pipelined, "__fleetscope_original__"):
        schedules._batch_p2p = _wrap_batch(pipelined)  # type: ignore[attr-defined]


# -- functional collectives (DTensor) --------------------------------------------------------------------
_functional = threading.local()
"""``inside``: a wrapped functional collective is running on this thread (one calls another: counted once)."""
_awaited: dict[int, _Call] = {}
"""Launched functional collectives by their result's storage (a view of the result, which DTensor waits for
as often as the result itself, shares it), until its ``wait_tensor``."""


def _functional_group(group: RANK_TYPES) -> dist.ProcessGroup:
    """The process group of a functional collective's ``group`` (a group, its name, ranks or a mesh)."""
    from torch.distributed import _functional_collectives as funcol

    resolved = funcol._resolve_group(group)
    return (
        resolved if isinstance(resolved, dist.ProcessGroup) else dist.distributed_c10d._resolve_process_group(resolved)
    )


def _enter_functional(mon: Instrumented, op: str, tensor: object, gathers: bool, group: RANK_TYPES) -> _Call:
    pg = _functional_group(group)
    return _enter(mon, op, _nbytes(tensor) * (int(pg.size()) if gathers else 1), pg)


def _launched(mon: Instrumented, call: _Call, result: object) -> None:
    """Record the collective now if it completed, else when its tensor is waited for (or forget it, with the
    flight recorder's entry, if the tensor dies unwaited)."""
    elem = getattr(result, "elem", None)
    key = _storage(elem) if elem is not None and not getattr(result, "completed", True) else 0
    if not key:
        _leave(mon.recorder, call, time.time_ns())
        return
    _awaited[key] = call
    weakref.finalize(elem, _forget, key, mon.recorder)  # its views keep it alive until they die too


def _compiling() -> bool:
    return bool(torch.compiler.is_compiling())


def _storage(tensor: object) -> int:
    """The address of a tensor's storage (0 for an empty one)."""
    return int(tensor.untyped_storage().data_ptr()) if isinstance(tensor, torch.Tensor) else 0


def _forget(key: int, recorder: Recorder) -> None:
    call = _awaited.pop(key, None)
    if call is not None:
        recorder.state.leave(call[0])


def _wrap_functional(fname: str, orig: Callable[..., object]) -> Callable[..., object]:
    op, gathers = FUNCTIONAL_COLLECTIVES[fname]
    params = list(inspect.signature(orig).parameters)
    gi = params.index("group")

    @functools.wraps(orig)
    def wrapper(*args: object, **kwargs: object) -> object:
        if _compiling():  # torch.compile traces the original, as it knows it
            return orig(*args, **kwargs)
        mon = _current()
        if mon is None or getattr(_functional, "inside", False):
            return orig(*args, **kwargs)
        group, tensor = _argument(args, kwargs, "group", gi), _argument(args, kwargs, "self", 0)
        call = mon.recorder.guard("collective", _enter_functional, mon, op, tensor, gathers, group)
        _functional.inside = True
        try:
            return _timed(mon, call, _launched, orig, args, kwargs)
        finally:
            _functional.inside = False

    wrapper.__fleetscope_original__ = orig  # type: ignore[attr-defined]
    return wrapper


def _wrap_wait(orig: Callable[..., object]) -> Callable[..., object]:
    @functools.wraps(orig)
    def wait_tensor(tensor: object) -> object:
        out = orig(tensor)
        if _compiling():
            return out
        call = _awaited.pop(_storage(tensor), None) if _awaited else None
        mon = _current()
        if call is not None and mon is not None:
            mon.recorder.guard("collective_done", _leave, mon.recorder, call, time.time_ns())
        return out

    wait_tensor.__fleetscope_original__ = orig  # type: ignore[attr-defined]
    return wait_tensor


def _patch_functional_collectives() -> None:
    """Module attributes: the module's own calls to them (``AsyncCollectiveTensor.wait``) go through them too."""
    from torch.distributed import _functional_collectives as funcol

    for fname in FUNCTIONAL_COLLECTIVES:
        orig = getattr(funcol, fname, None)
        if orig is None or hasattr(orig, "__fleetscope_original__"):
            continue
        setattr(funcol, fname, _wrap_functional(fname, orig))
    if not hasattr(funcol.wait_tensor, "__fleetscope_original__"):
        funcol.wait_tensor = _wrap_wait(funcol.wait_tensor)


# -- DDP -------------------------------------------------------------------------------------------------
def _patch_ddp() -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    orig_init = DDP.__init__
    if hasattr(orig_init, "__fleetscope_original__"):
        return

    setattr(DDP, "__init__", _hooked_ddp_init(orig_init))  # noqa: B010 - a method, typed by its wrapper


def _hooked_ddp_init(
    orig_init: Callable[Concatenate[DistributedDataParallel, P], None],
) -> Callable[Concatenate[DistributedDataParallel, P], None]:
    @functools.wraps(orig_init)
    def __init__(self: DistributedDataParallel, *args: P.args, **kwargs: P.kwargs) -> None:
        orig_init(self, *args, **kwargs)
        if os.environ.get(_DISABLE_DDP_HOOK, "auto") not in ("0", "off", "false"):
            setattr(self, "_fleetscope_pre", self.register_forward_pre_hook(_ddp_first_forward))  # noqa: B010

    __init__.__fleetscope_original__ = orig_init  # type: ignore[attr-defined]
    return __init__


def _ddp_first_forward(module: DistributedDataParallel, _inputs: object) -> None:
    """At the first forward: time the gradient all-reduce, unless the user has a comm hook (then a
    ``dist.all_reduce`` in it is timed by the wrapper). NCCL (or ``=1``): the stock allreduce hook, timed;
    otherwise the whole synchronisation from the end of the backward pass (``_GradientSync``)."""
    handle = getattr(module, "_fleetscope_pre", None)
    if handle is not None:
        handle.remove()
        setattr(module, "_fleetscope_pre", None)  # noqa: B010 - nn.Module types its attributes as tensors
    if module._comm_hooks:
        return
    if os.environ.get(_DISABLE_DDP_HOOK, "auto") == "auto" and not _is_nccl(module.process_group):
        module.register_forward_hook(_ddp_forward)  # even before a monitor records: it times only while one does
        return
    try:
        module.register_comm_hook(module.process_group, timed_allreduce_hook)
    except Exception as exc:  # e.g. a builtin comm hook is already registered
        logger.warning("fleetscope: DDP gradient buckets are not timed: %r", exc)


def _ddp_forward(module: DistributedDataParallel, _inputs: object, output: object) -> None:
    """After a DDP forward that will synchronise gradients: time that synchronisation in its backward."""
    mon = _current()
    if mon is not None and torch.is_grad_enabled():
        mon.recorder.guard("ddp", _GradientSync.arm, mon, module, output)


class _GradientSync:
    """DDP's gradient all-reduce on one backward pass, timed without a comm hook.

    Why: with any comm hook DDP no longer folds the 1/world division into its bucket copy, and the extra
    pass over the gradients costs a CPU step several per cent. Without one, the backward pass launches the
    buckets' all-reduces and DDP's final autograd callback waits for them. A hook on the forward's outputs
    queues ``arrived`` at the start of the backward pass, so it runs when the pass's computation is done
    (the last bucket launched: this rank's arrival) and before DDP's callback, queued later; ``arrived``
    queues ``synced``, which runs after DDP's wait. One event per step: launched at arrival, done when every
    bucket is reduced; meanwhile the flight recorder says the rank is inside it. Costs a few Python calls
    per step, no pass over the gradients.
    """

    __slots__ = ("call", "mon", "module")

    def __init__(self, mon: Instrumented, module: DistributedDataParallel) -> None:
        self.mon, self.module = mon, module
        self.call: _Call | None = None

    @staticmethod
    def arm(mon: Instrumented, module: DistributedDataParallel, output: object) -> None:
        if not module.require_backward_grad_sync:  # under ``no_sync()``: this backward reduces nothing
            return
        tensors = [t for t in _tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return
        sync = _GradientSync(mon, module)
        if len(tensors) == 1:
            tensors[0].register_hook(sync.backward_started)
        else:
            torch.autograd.graph.register_multi_grad_hook(tensors, sync.backward_started, mode="any")

    def backward_started(self, _grad: object) -> None:
        self.mon.recorder.guard("ddp", _queue_callback, self.arrived)

    def arrived(self) -> None:
        self.mon.recorder.guard("ddp", self._arrive)

    def _arrive(self) -> None:
        nbytes = getattr(self.module, "_fleetscope_grad_bytes", None)
        if nbytes is None:
            nbytes = sum(p.numel() * p.element_size() for p in self.module.parameters() if p.requires_grad)
            setattr(self.module, "_fleetscope_grad_bytes", nbytes)  # noqa: B010
        self.call = _enter(self.mon, "allreduce", nbytes, self.module.process_group)
        _queue_callback(self.synced)

    def synced(self) -> None:
        if self.call is not None:
            self.mon.recorder.guard("collective_done", _leave, self.mon.recorder, self.call, time.time_ns())


def _queue_callback(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def _tree_leaves(output: object) -> list[object]:
    if isinstance(output, torch.Tensor):
        return [output]
    from torch.utils._pytree import tree_leaves

    return list(tree_leaves(output))


def _is_nccl(process_group: dist.ProcessGroup | None) -> bool:
    try:
        import torch.distributed as dist

        return str(dist.get_backend(process_group)).lower() == "nccl"
    except Exception:  # an unusual group: time nothing rather than guess
        return False


def timed_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's stock ``allreduce_hook`` (average = divide, then sum), timed in the completion callback it
    needs anyway: one Python callback per bucket, not two."""
    group = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
    tensor = bucket.buffer()
    tensor.div_(group.size())
    mon = _current()
    if mon is None:
        return _ALL_REDUCE(tensor, group=group, async_op=True).get_future().then(lambda f: f.value()[0])
    call = mon.recorder.guard("collective", _enter, mon, "allreduce", tensor, group)
    fut = _ALL_REDUCE(tensor, group=group, async_op=True).get_future()
    recorder = mon.recorder

    def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        if call is not None:
            recorder.guard("collective_done", _leave, recorder, call, time.time_ns())
        return f.value()[0]

    return fut.then(done)


# DDP checks the annotations against the real classes; this module's are strings (PEP 563).
timed_allreduce_hook.__annotations__ = {
    "process_group": dist.ProcessGroup,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


# -- optimizer and dataloader ----------------------------------------------------------------------------
def _patch_optimizer() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def pre(optimizer: object, _args: object, _kwargs: object) -> None:
        mon = _current()
        if mon is not None:
            mark = mon.recorder.guard("optimizer", mon.wait_mark)
            _opt_start[id(optimizer)] = (time.time_ns(), mark)

    def post(optimizer: object, _args: object, _kwargs: object) -> None:
        mon = _current()
        if mon is None:
            return
        end = time.time_ns()
        start, mark = _opt_start.pop(id(optimizer), (end, None))
        mon.recorder.guard("optimizer", mon.on_optimizer_step, start, end, mark)

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)


def _patch_dataloader() -> None:
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    orig = _BaseDataLoaderIter.__next__
    if hasattr(orig, "__fleetscope_original__"):
        return

    @functools.wraps(orig)
    def __next__(self: _BaseDataLoaderIter) -> object:
        mon = _current()
        if mon is None:
            return orig(self)
        mark = mon.recorder.guard("dataloader", mon.wait_mark)
        start = time.time_ns()
        item = orig(self)
        end = time.time_ns()
        mon.recorder.guard("dataloader", mon.host_span, "dataloader.next", start, end, mark)
        return item

    __next__.__fleetscope_original__ = orig  # type: ignore[attr-defined]
    _BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]


def _patch_gc() -> None:
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def _on_gc(phase: str, _info: dict[str, int]) -> None:
    """A collection holds the GIL from "start" to "stop": no other thread's collection comes in between."""
    global _gc_start_ns, _gc_start_cpu_ns
    if phase == "start":
        _gc_start_ns, _gc_start_cpu_ns = time.time_ns(), time.thread_time_ns()
        return
    mon = _current()
    cpu = time.thread_time_ns() - _gc_start_cpu_ns
    if mon is None or not _gc_start_ns or cpu < GC_MIN_PAUSE_NS:
        return
    if not mon.recorder.on_own_thread():  # our own thread's allocations are no pause of the training's
        wall = time.time_ns() - _gc_start_ns
        mon.recorder.guard("gc", mon.recorder.python_span, GC_PAUSE, _gc_start_ns, wall, 0)
        # a collection holds the GIL and never sleeps: what its wall time has beyond its CPU time it waited
        mon.recorder.guard("gc", mon.span_wait, GC_PAUSE, _gc_start_ns, wall - cpu)
