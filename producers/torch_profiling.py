"""Profiling windows: torch.profiler on demand, its in-memory results turned into EventBatches.

Why: the continuous mode sees only host spans and host-timed collectives; a window adds the GPU kernels
(with their launch times, so the windower assigns them to the step that launched them), memory copies,
NCCL kernels and the host ops, for a bounded time. The results are read from the profiler's in-memory
Kineto events (``prof.profiler.kineto_results.events()``) on the recorder's thread, never through a JSON
trace file. Only ``torch.profiler`` is touched, and only when a window opens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetscope.schemas import BatchHeader, EventBatch, EventKind, parse_step_marker

logger = logging.getLogger(__name__)

_GPU_ACTIVITIES = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST_ACTIVITIES = ("cpu_op", "user_annotation", "python_function")
_LAUNCH_ACTIVITIES = ("cuda_runtime", "cuda_driver")


def activity_of(event: Any) -> str:
    """The Kineto activity of a profiler event, by name (``kernel``, ``cuda_runtime``, ``cpu_op``, ...).

    ``activity_type()`` exists from torch 2.12 on; torch 2.11 (seen with CUDA 13) has neither it nor
    ``is_python_function``. Then the kind is read from what every release has — the device the event ran on
    and the CUDA runtime/driver calls that launch GPU work (``cudaLaunchKernel``, ``cuLaunchKernel``) — and
    from the annotation flags where the release has them.
    """
    activity_type = getattr(event, "activity_type", None)
    if activity_type is not None:
        return str(activity_type())
    if str(event.device_type()).rsplit(".", 1)[-1] == "CUDA":
        return "kernel"  # kernels, copies and memsets are all GPU activity here
    for flag, activity in (("is_user_annotation", "user_annotation"), ("is_python_function", "python_function")):
        is_kind = getattr(event, flag, None)
        if is_kind is not None and is_kind():
            return activity
    name = event.name()
    if name.startswith(("cuda", "cu")) and "::" not in name:
        return "cuda_runtime"
    return "cpu_op"


@dataclass(frozen=True, kw_only=True)
class WindowConfig:
    max_host_depth: int = 0
    """Host ops nested in more than this many other ops are left out (0: top-level ops only); user
    annotations (``record_function``) are always kept."""
    max_batch_events: int = 4096


def window_batches(
    events: Iterable[Any], next_header: Callable[[], BatchHeader], config: WindowConfig | None = None
) -> list[EventBatch]:
    """Kernels first, then host spans, from a profiler's Kineto events; step markers are left out
    (the hook publishes its own, numbered consistently with the continuous mode)."""
    cfg = config or WindowConfig()
    gpu: list[tuple[str, int, int, int, int]] = []  # name, start, dur, stream, correlation
    host: list[tuple[str, int, int, int, int]] = []  # name, start, dur, thread, is an op
    launch_at: dict[int, int] = {}
    for e in events:
        activity = activity_of(e)
        if activity in _GPU_ACTIVITIES:
            gpu.append((e.name(), e.start_ns(), e.duration_ns(), e.device_resource_id(), e.linked_correlation_id()))
        elif activity in _LAUNCH_ACTIVITIES:
            launch_at[e.correlation_id()] = e.start_ns()
        elif activity in _HOST_ACTIVITIES:
            name = e.name()
            if parse_step_marker(name) is None and not name.startswith("fleetscope"):
                op = int(activity == "cpu_op")
                host.append((name, e.start_ns(), e.duration_ns(), e.start_thread_id(), op))
    out: list[EventBatch] = []
    n = cfg.max_batch_events
    for i in range(0, len(gpu), n):
        out.append(_kernels(gpu[i : i + n], launch_at, next_header))
    op_index = [i for i, h in enumerate(host) if h[4]]
    op_depth = dict(zip(op_index, _depths([host[i] for i in op_index]), strict=True))
    spans = []
    for i, ((name, start, dur, _thread, is_op), depth) in enumerate(zip(host, _depths(host), strict=True)):
        if not is_op or op_depth[i] <= cfg.max_host_depth:
            spans.append((name, start, dur, depth))
    for i in range(0, len(spans), n):
        out.append(_python(spans[i : i + n], next_header))
    return out


def _depths(host: list[tuple[str, int, int, int, int]]) -> list[int]:
    """Nesting depth of each span within its thread (spans of one thread nest or follow each other)."""
    depth = [0] * len(host)
    order = sorted(range(len(host)), key=lambda i: (host[i][3], host[i][1], -host[i][2]))
    stack: list[int] = []  # end times of the open spans
    thread = None
    for i in order:
        _name, start, dur, tid, _ = host[i]
        if tid != thread:
            thread, stack = tid, []
        while stack and stack[-1] <= start:
            stack.pop()
        depth[i] = len(stack)
        stack.append(start + dur)
    return depth


def _intern(values: list[str]) -> tuple[list[str], np.ndarray]:
    table: dict[str, int] = {}
    ids = np.fromiter((table.setdefault(v, len(table)) for v in values), np.int32, len(values))
    return list(table), ids


def _kernels(
    rows: list[tuple[str, int, int, int, int]],
    launch_at: dict[int, int],
    next_header: Callable[[], BatchHeader],
) -> EventBatch:
    names, ids = _intern([r[0] for r in rows])
    start = np.fromiter((r[1] for r in rows), np.int64, len(rows))
    launch = np.fromiter((launch_at.get(r[4], r[1]) for r in rows), np.int64, len(rows))
    return EventBatch(
        kind=EventKind.KERNELS,
        header=next_header(),
        names=names,
        columns={
            "start_ns": start,
            "dur_ns": np.fromiter((r[2] for r in rows), np.int64, len(rows)),
            "name_id": ids,
            "stream": np.fromiter((r[3] for r in rows), np.int32, len(rows)),
            "launch_ns": launch,
        },
    )


def _python(rows: list[tuple[str, int, int, int]], next_header: Callable[[], BatchHeader]) -> EventBatch:
    names, ids = _intern([r[0] for r in rows])
    return EventBatch(
        kind=EventKind.HOST,
        header=next_header(),
        names=names,
        columns={
            "start_ns": np.fromiter((r[1] for r in rows), np.int64, len(rows)),
            "dur_ns": np.fromiter((r[2] for r in rows), np.int64, len(rows)),
            "name_id": ids,
            "depth": np.fromiter((r[3] for r in rows), np.int32, len(rows)),
        },
    )


class ProfilingWindow:
    """One torch.profiler session, opened and closed at step boundaries on the training thread.

    A schedule with one warm-up step keeps the profiler's own start-up out of the recorded steps, and
    the window lasts at least ``min_steps`` steps: the first start of Kineto in a process can take a
    second, longer than a short window.
    """

    def __init__(self, end_at_ns: int, cuda: bool, min_steps: int = 2) -> None:
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
        self.end_at_ns = end_at_ns
        self.min_steps = min_steps
        self.started_ns = time.time_ns()
        self.steps = 0
        self._prof = tp.profile(
            activities=activities,
            schedule=tp.schedule(wait=0, warmup=1, active=1 << 30, repeat=1),
            record_shapes=False,
            with_stack=False,
        )
        self._prof.start()

    def step(self) -> None:
        self.steps += 1
        self._prof.step()

    def done(self, now_ns: int) -> bool:
        return now_ns >= self.end_at_ns and self.steps >= self.min_steps

    def stop(self) -> Any:
        """Stop the profiler; return its Kineto results (None if nothing was recorded).

        Reading ``results.events()`` is left to the caller's background thread: it builds one Python
        object per event.
        """
        self._prof.stop()
        profiler = self._prof.profiler
        return getattr(profiler, "kineto_results", None) if profiler is not None else None
