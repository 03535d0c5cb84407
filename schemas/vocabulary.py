"""Domain vocabulary shared by every source and stage: kernel classes, step markers, bandwidth factors.

One definition each, so the parser, the simulator and the windower cannot drift apart.
"""

from __future__ import annotations

import functools
import re

# Re-exported: their home is schemas/categories.py, beside their properties.
from fleetscope.schemas.categories import CATEGORIES as CATEGORIES
from fleetscope.schemas.categories import Category as Category
from fleetscope.schemas.records import FunctionKind

STEP_MARKER_PREFIX = "ProfilerStep#"
"""Names starting with it are the profiler's step markers, never host functions."""
MAX_STEP_DIGITS = 18
"""A step number has at most 18 digits: it fits an int64 (the records' Avro long) and parsing it is cheap;
``int()`` of 5,000 digits raises, and a name that raises on every parse poisons every later batch."""
_STEP_RE = re.compile(rf"ProfilerStep#([0-9]{{1,{MAX_STEP_DIGITS}}})")
_NCCL_RE = re.compile(r"^(nccl(Dev)?Kernel_|ncclKernel|nccl:)", re.IGNORECASE)
_MEMORY_RE = re.compile(r"^(Memcpy|Memset|memcpy|memset|\[memory\])|^cudaMemcpy|^cudaMemset")


GC_PAUSE = "gc.collect"
"""Host span of a Python garbage collection (from ``gc.callbacks``): a GC-bound rank is ``host_slow`` on it."""


def step_marker_name(step: int) -> str:
    """The profiler's name of a step's span (``ProfilerStep#<step>``), which ``parse_step_marker`` reads back."""
    return f"ProfilerStep#{step}"


def parse_step_marker(name: str) -> int | None:
    """``ProfilerStep#12`` -> 12; any other name -> None, never an exception: the digits are bounded
    (``MAX_STEP_DIGITS``) before ``int`` sees them, so a name costs only its own event."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def is_step_marker_name(name: str) -> bool:
    """A name in the profiler's step-marker space (``STEP_MARKER_PREFIX``), well formed or not: one that
    does not parse is a broken marker, dropped, never a host function of its own."""
    return name.startswith(STEP_MARKER_PREFIX)


def classify_kernel(name: str) -> FunctionKind:
    """Class of a GPU activity by name: NCCL (``ncclKernel_*``/``ncclDevKernel_*``), memory op, compute."""
    if _NCCL_RE.match(name):
        return FunctionKind.COLLECTIVE
    if _MEMORY_RE.match(name):
        return FunctionKind.MEMORY
    return FunctionKind.COMPUTE


_OP_ALIASES = {
    "allreduce": "allreduce",
    "all_reduce": "allreduce",
    "allgather": "allgather",
    "all_gather": "allgather",
    "_allgather_base": "allgather",
    "all_gather_into_tensor": "allgather",
    "reduce_scatter": "reduce_scatter",
    "reducescatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all": "all_to_all",
    "alltoall": "all_to_all",
    "all_to_allv": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "send": "send",
    "recv": "recv",
    "sendrecv": "send",
}


def normalize_collective(op: str) -> str:
    """Canonical collective name for the many spellings of PyTorch/NCCL/Kineto."""
    return _OP_ALIASES.get(op.strip().lower(), op.strip().lower())


def bus_bandwidth_factor(op: str, group_size: int) -> float:
    """nccl-tests busbw = algbw x factor, S being the full message size (see nccl-tests PERFORMANCE.md)."""
    n = max(int(group_size), 1)
    canon = normalize_collective(op)
    if canon == "allreduce":
        return 2.0 * (n - 1) / n
    if canon in ("allgather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0


def host_phase(name: str) -> str | None:
    """``"dataloader"`` / ``"optimizer"`` for the host calls that delimit a training iteration.

    Matches the producer API's names and PyTorch's own annotations
    (``enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__``, ``Optimizer.step#AdamW.step``).
    """
    if name == "dataloader.next" or ("DataLoader" in name and "__next__" in name):
        return "dataloader"
    if name == "optimizer.step" or name.startswith("Optimizer.step#"):
        return "optimizer"
    return None


PROFILING_WINDOW = "fleetscope#profiling_window"
"""Host span a producer publishes over each profiler window: iterations it overlaps are ``profiled``."""


def is_profiling_window(name: str) -> bool:
    """Whether a host span marks a profiler window (not a host function: never scored)."""
    return name == PROFILING_WINDOW


CPU_WAIT = "fleetscope#cpu_wait"
"""Host span a producer publishes at each step boundary: it starts with the step, and its length is the time
the training thread waited for a CPU during the step (run-queue wait), not an interval of work; the
iteration's ``cpu_wait_ns``."""


def is_cpu_wait(name: str) -> bool:
    """Whether a host span carries a step's run-queue wait (not a host function: never scored)."""
    return name == CPU_WAIT


RING_COLLECTIVES = ("allreduce", "allgather", "reduce_scatter")
"""Collectives whose every member moves its share at the pace of the ring's slowest link, so the same call on
equivalent groups moves the same bytes in the same time. Not all-to-all (its traffic follows the routing: an
expert's extra tokens are its own work), not p2p (one direction, one pair)."""

CPU_WAIT_FUNCTION = "cpu_wait"
"""The ``function`` of a ``host_slow`` finding on a rank that waits longer than every peer for a CPU in each
step (its run-queue wait): its host's cores are taken by others. Its metric is ``cpu_wait_ns``."""

LAUNCH_WAIT_FUNCTION = "gpu_launch_wait"
"""A host function the windower adds to a rank's iteration where its kernels carry launch times: the time
its GPU sat idle, after the step's first kernel, until a kernel its host had not launched yet (launched
after the GPU went idle). A launch-bound rank (its CPU slower than its GPU: Python, CPU contention) starves
its GPU this way; a rank whose GPU is slow never does (its host runs ahead), and waiting ranks wait inside
their collectives' kernels, not in gaps. Compared like any host function, so it is ``host_slow``."""

OTHER_FUNCTIONS = "fleetscope#other"
"""The one pattern row that sums a rank-iteration's functions past its caps (``max_functions``, their
names' characters): its calls and times, under kind ``MEMORY``, which no peer comparison scores. Also the
name a rank's windower files names under once its name table is full."""

ITERATION_LESS_CPU_WAIT = "iteration_less_cpu_wait_ns"
"""``job_regression``'s metric where every rank measured its run-queue wait: the steps' time less it."""


_SYNC_RE = re.compile(
    r"^(cuda(Stream|Device|Event|Ctx)Synchronize|cudaStreamWaitEvent|cuStreamSynchronize|cuCtxSynchronize"
    r"|cuEventSynchronize|cudaStreamQuery|aten::item|aten::_local_scalar_dense|c10d::wait|ProcessGroupNCCL::wait"
    r"|torch\.cuda\.synchronize|torch\.distributed\.barrier|c10d::barrier|aten::equal)$"
    r"|\.item(\(\))?$|(^|[.:])(wait|synchronize|barrier)(\(\))?$"
)


def is_sync_call(name: str) -> bool:
    """A host call that blocks until the GPU or the peers are done (``cudaStreamSynchronize``, ``.item()``,
    a collective's ``wait``): its time is waiting, not work, so it is never a rank's own host time."""
    return _SYNC_RE.search(name) is not None


_ADDRESS_RE = re.compile(r" at 0x[0-9a-fA-F]+(?=>)")


@functools.lru_cache(maxsize=65536)
def stable_function_name(name: str) -> str:
    """A host function's name as every rank writes it. Python's repr of a built-in method carries its
    object's address (``<built-in method get of dict object at 0x7f9d3c370800>``, the names of
    ``torch.profiler``'s ``with_stack`` events), which differs by process: left in, every rank has functions
    no peer has, each an outlier of its own."""
    return _ADDRESS_RE.sub("", name) if " at 0x" in name else name
