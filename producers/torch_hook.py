"""PyTorch integration: two lines in a training script stream every rank's steps to fleetscope.

```python
import fleetscope.producers.torch_hook as fs

for batch in loader:
    ...
    optimizer.step()
    fs.step()  # one call per training step; the first call starts monitoring
```

(or ``with fs.monitor(): ...`` around the loop, or ``fs.start()``/``fs.stop()``). Zero code changes:
``fleetscope run -- torchrun --nproc-per-node 8 train.py`` injects this module through a ``sitecustomize``
bootstrap and takes step boundaries from ``optimizer.step()`` (see ``torch_bootstrap``).

Who and where come from the environment: ``FLEETSCOPE_JOB`` (else torchrun's ``TORCHELASTIC_RUN_ID``),
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, and the program's configuration
(``FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS`` etc., or a file in ``FLEETSCOPE_CONFIG``).
``FLEETSCOPE_TORCH_HOOK=off`` disables everything;
``FLEETSCOPE_NVML=process|agent|off`` samples this rank's GPU in-process, declares that a node agent does,
or neither (default: in-process when CUDA and nvidia-ml-py are there); ``FLEETSCOPE_CONTROL=off`` stops
following the control topic.

Continuous mode records ``ProfilerStep#N`` step markers, ``dataloader.next`` and ``optimizer.step`` spans,
garbage-collection pauses (``gc.collect``) and every ``torch.distributed`` collective (DDP buckets included);
the recorder's thread publishes a heartbeat (last step, the collective the rank is in) every second, also
while training is blocked. A control request opens a ``torch.profiler`` window on every rank at the same UTC
instant; a ``fleetscope#profiling_window`` span covers it, so the steps it slowed are known as profiled.
Importing this module installs inert patches; nothing records, no thread runs and nothing connects until
monitoring starts. Nothing here may block or crash training.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

try:
    import torch
    import torch.distributed as dist
except ImportError as _exc:  # torch is an optional extra
    raise ImportError(
        "fleetscope's PyTorch integration needs torch: pip install 'fleetscope[torch]'", name=_exc.name
    ) from _exc

from fleetscope.producers import torch_layout, torch_patches
from fleetscope.producers.control import ControlListener, ControlRequest
from fleetscope.producers.cpu_wait import CpuWaitClock, SpanMark, SpanWaits
from fleetscope.producers.publisher import Publisher
from fleetscope.producers.rank_recorder import RankIdentity, Recorder, RecorderConfig, RecorderStats
from fleetscope.producers.torch_profiling import ProfilingWindow, WindowConfig, window_batches
from fleetscope.schemas import CPU_WAIT, PROFILING_WINDOW, SPAN_CPU_WAIT_DEPTH, EventBatch, EventKind, step_marker_name

if TYPE_CHECKING:  # neither is loaded by a rank that does not monitor (nor NVML where it is off)
    from fleetscope.config import Config
    from fleetscope.producers.nvml import NvmlSampler

__all__ = ["Monitor", "monitor", "profile", "span", "start", "stats", "step", "stop"]

logger = logging.getLogger(__name__)

ENV_HOOK = "FLEETSCOPE_TORCH_HOOK"
ENV_NVML = "FLEETSCOPE_NVML"
ENV_CONTROL = "FLEETSCOPE_CONTROL"
_OFF = ("0", "off", "false", "no")


class Monitor:
    """The running integration of one rank: recorder, step boundaries, profiling windows, helpers.

    ``auto_step``: step boundaries come from ``optimizer.step()`` until the script calls ``step()`` itself.
    """

    def __init__(
        self,
        recorder: Recorder,
        *,
        auto_step: bool = False,
        listener: ControlListener | None = None,
        sampler: NvmlSampler | None = None,
    ) -> None:
        self.recorder = recorder
        self.identity = recorder.identity
        self.auto_step = auto_step
        self.step_num = 0
        self._step_start_ns: int | None = None
        self._explicit = False
        self._listener = listener
        self._sampler = sampler
        self._window: ProfilingWindow | None = None
        self._pending: ControlRequest | None = None
        self._layout: torch_layout.LayoutTracker | None = None
        self._cpu_wait = CpuWaitClock()
        """Read at the start and at each boundary, so in the training thread (the file stays bound to it)."""
        self._wait_start: int | None = None
        self._span_waits: SpanWaits | None = None

    def start(self) -> None:
        self.recorder.start()
        if self._sampler is not None:
            self.recorder.guard("nvml_start", self._sampler.start)
        if self._listener is not None:
            self.recorder.guard("control_start", self._listener.start)
        torch_patches.reset_sequences()
        self._layout = self.recorder.guard("layout_start", torch_layout.track, self.recorder)
        self._step_start_ns = time.time_ns()
        self._wait_start = self._cpu_wait.read()
        self._span_waits = SpanWaits(self._cpu_wait)

    def stop(self) -> None:
        if self._window is not None:
            self.recorder.guard("window_stop", self._close_window)
        for part in (self._listener, self._sampler):
            if part is not None:
                self.recorder.guard("stop", part.stop)
        self._cpu_wait.close()
        self.recorder.stop()

    # -- step boundaries (training thread) -----------------------------------------------------------
    def boundary(self, explicit: bool, now_ns: int | None = None) -> None:
        """Close the current step at ``now_ns`` and open the next one."""
        if explicit:
            self._explicit = True
        elif self._explicit or not self.auto_step:
            return
        now = time.time_ns() if now_ns is None else now_ns
        if self._layout is not None:  # groups created after the start (a counter compare per step)
            self.recorder.guard("layout", self._layout.refresh)
        wait = self._cpu_wait.read()
        if self._step_start_ns is not None:
            name = step_marker_name(self.step_num)
            self.recorder.python_span(name, self._step_start_ns, now - self._step_start_ns, 0)
            if wait is not None and self._wait_start is not None:  # the step's run-queue wait (cpu_wait)
                self.recorder.python_span(CPU_WAIT, self._step_start_ns, max(wait - self._wait_start, 0), 0)
            self.recorder.state.step_done(self.step_num, now)
            self.step_num += 1
        self._step_start_ns = now
        self._wait_start = wait
        self._window_tick(now)

    def on_optimizer_step(self, start_ns: int, end_ns: int, mark: SpanMark | None = None) -> None:
        self.host_span("optimizer.step", start_ns, end_ns, mark)
        self.boundary(explicit=False, now_ns=end_ns)

    # -- host spans (training thread) ----------------------------------------------------------------
    def wait_mark(self) -> SpanMark | None:
        """At a host span's start: where its run-queue wait is counted from (None off the training thread)."""
        waits = self._span_waits
        return waits.mark() if waits is not None else None

    def host_span(self, name: str, start_ns: int, end_ns: int, mark: SpanMark | None) -> None:
        """A host span, and the time its thread waited for a CPU in it (``SPAN_CPU_WAIT_DEPTH``), if any."""
        self.recorder.python_span(name, start_ns, end_ns - start_ns, 0)
        if mark is not None and self._span_waits is not None:
            wait = min(self._span_waits.own(mark), end_ns - start_ns)
            if wait > 0:
                self.recorder.python_span(name, start_ns, wait, SPAN_CPU_WAIT_DEPTH)

    def span_wait(self, name: str, start_ns: int, wait_ns: int) -> None:
        """The wait of a host span measured otherwise (a collection's wall time less its CPU time): on the
        training thread it is no longer the enclosing span's own."""
        if wait_ns > 0:
            self.recorder.python_span(name, start_ns, wait_ns, SPAN_CPU_WAIT_DEPTH)
            if self._span_waits is not None:
                self._span_waits.give(wait_ns)

    # -- profiling windows ---------------------------------------------------------------------------
    def request_window(self, request: ControlRequest) -> None:
        """On any thread: open a window at the first step boundary after ``request.start_at_ns``."""
        self._pending = request
        if self._sampler is not None:
            self._sampler.boost(request.end_at_ns)

    def _window_tick(self, now: int) -> None:
        window = self._window
        if window is not None:
            if window.done(now):
                self.recorder.guard("window_stop", self._close_window)
            else:
                self.recorder.guard("window_step", window.step)
            return
        pending = self._pending
        if pending is not None and now >= pending.start_at_ns:
            self._pending = None
            if now < pending.end_at_ns:
                self.recorder.guard("window_start", self._open_window, pending)

    def _open_window(self, request: ControlRequest) -> None:
        if torch.autograd.profiler._is_profiler_enabled:
            logger.warning("a profiler is already running in this process; profiling request skipped")
            return
        self.recorder.hold_host_events(request.end_at_ns)
        try:
            self._window = ProfilingWindow(request.end_at_ns, cuda=torch.cuda.is_available())
        except Exception:
            self.recorder.release_host_events()
            raise
        if torch.cuda.is_available():  # the windower then waits for the window's kernels
            self.recorder.declare(EventKind.KERNELS)
        logger.info("profiling window %s opened at step %d", request.request_id, self.step_num)

    def _close_window(self) -> None:
        window, self._window = self._window, None
        if window is None:
            return
        recorder = self.recorder
        try:
            results = window.stop()
        except Exception:
            recorder.release_host_events()
            raise
        finally:  # the steps it covers ran under the profiler: the windower marks them profiled
            recorder.python_span(PROFILING_WINDOW, window.started_ns, time.time_ns() - window.started_ns, 0)
        config = WindowConfig(max_batch_events=recorder.config.max_batch_events)

        def build() -> list[EventBatch]:
            try:
                events = results.events() if results is not None else []
                return window_batches(events, recorder.next_header, config)
            finally:
                recorder.release_host_events()

        if not recorder.submit(build):
            recorder.release_host_events()
        logger.info("profiling window closed after %d steps", window.steps)


# -- the process-wide monitor ----------------------------------------------------------------------------
_lock = threading.Lock()
_monitor: Monitor | None = None
_disabled = False
_auto = os.environ.get(ENV_HOOK, "").lower() == "auto"


def _current() -> Monitor | None:
    return _monitor


def _build(job: str | None, config: Config | None) -> Monitor | None:
    from fleetscope.config import load_config  # lazily: a rank that never starts monitoring reads no config
    from fleetscope.wiring import control_listener_config, publisher_config

    cfg = config if config is not None else load_config(os.environ.get("FLEETSCOPE_CONFIG") or None)
    k = cfg.kafka
    if not k.bootstrap_servers:
        logger.warning("fleetscope: no broker configured (FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS); not monitoring")
        return None
    identity = RankIdentity.from_env()
    if job:
        identity = replace(identity, job=job)
    publisher = Publisher(publisher_config(cfg, client_id=f"fleetscope-torch-{identity.rank}"))
    streams = {EventKind.HOST.value}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        streams.add(EventKind.COLLECTIVES.value)
    nvml = _nvml_mode()
    if nvml != "off":
        streams.add(EventKind.SAMPLES.value)
    recorder_config = RecorderConfig(heartbeat_interval_ms=cfg.producer.heartbeat_interval_ms)
    recorder = Recorder(identity, publisher, recorder_config, streams=streams)
    sampler = _sampler(identity, recorder) if nvml == "process" else None
    listener = None
    if os.environ.get(ENV_CONTROL, "on").lower() not in _OFF:
        listener_config = control_listener_config(cfg)
        listener = ControlListener(listener_config, identity.job, _on_request)
    return Monitor(recorder, auto_step=_auto, listener=listener, sampler=sampler)


def _nvml_mode() -> str:
    """off | process (sample this rank's GPU here) | agent (``fleetscope agent`` samples it)."""
    mode = os.environ.get(ENV_NVML, "auto").lower()
    if mode in _OFF:
        return "off"
    if mode in ("process", "agent"):
        return mode
    if mode != "auto":
        logger.warning("fleetscope: %s=%r is not off|process|agent|auto; using auto", ENV_NVML, mode)
    if not torch.cuda.is_available():
        return "off"
    try:
        import pynvml  # noqa: F401
    except ImportError:
        return "off"
    return "process"


def _sampler(identity: RankIdentity, recorder: Recorder) -> NvmlSampler:
    """This rank's GPU sampled in-process; its batches go out through the recorder's thread."""
    from fleetscope.producers.nvml import NvmlSampler, PynvmlApi

    index = torch.cuda.current_device() if torch.cuda.is_available() else identity.local_rank
    streams = recorder.streams

    def sink(batch: EventBatch) -> None:
        recorder.submit(lambda: [batch])

    return NvmlSampler(api=PynvmlApi(), sink=sink, targets={index: identity}, streams=streams)


def _on_request(request: ControlRequest) -> None:
    mon = _monitor
    if mon is not None:
        mon.request_window(request)


def start(*, job: str | None = None, config: Config | None = None) -> Monitor | None:
    """Start monitoring this rank (idempotent). Returns None when disabled or misconfigured; never raises."""
    global _monitor, _disabled
    with _lock:
        if _monitor is not None or _disabled:
            return _monitor
        try:
            mon = _build(job, config)
            if mon is not None:
                mon.start()
        except Exception as exc:
            logger.warning("fleetscope: monitoring disabled: %r", exc, exc_info=exc)
            mon = None
        _disabled = mon is None
        _monitor = mon
        return mon


def stop() -> None:
    """Publish what is left and stop (idempotent); ``start`` may be called again afterwards."""
    global _monitor, _disabled
    with _lock:
        mon, _monitor = _monitor, None
        _disabled = False
    if mon is not None:
        try:
            mon.stop()
        except Exception as exc:
            logger.warning("fleetscope: stop failed: %r", exc)


def step() -> None:
    """Mark the end of a training step. The first call starts monitoring: step 0 begins there."""
    mon = _monitor
    if mon is None:
        if _disabled or start() is None or _monitor is None:
            return
        _monitor._explicit = True
        return
    mon.recorder.guard("step", mon.boundary, True)


def _auto_start(_optimizer: object, _args: object, _kwargs: object) -> None:
    """Zero-code mode: the first ``optimizer.step()`` starts monitoring; step 0 begins right after it."""
    if _monitor is None and not _disabled:
        start()


@contextlib.contextmanager
def monitor(*, job: str | None = None, config: Config | None = None) -> Iterator[Monitor | None]:
    """``with fs.monitor(): train()``: start before the loop, flush and stop after it."""
    mon = start(job=job, config=config)
    try:
        yield mon
    finally:
        stop()


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """Time a host-side region of the step (``with fs.span("dataloader.next"): batch = next(it)``)."""
    mon = _monitor
    mark = mon.recorder.guard("span", mon.wait_mark) if mon is not None else None
    begin = time.time_ns()
    try:
        yield
    finally:
        if mon is not None:
            mon.recorder.guard("span", mon.host_span, name, begin, time.time_ns(), mark)


def profile(seconds: float, *, start_at_ns: int | None = None, reason: str = "local") -> None:
    """Open a profiling window on this rank only (the control topic does it for every rank)."""
    mon = _monitor
    if mon is not None:
        at = time.time_ns() if start_at_ns is None else start_at_ns
        mon.request_window(ControlRequest(job=mon.identity.job, duration_s=seconds, start_at_ns=at, reason=reason))


def stats() -> RecorderStats | None:
    """Counters of the running monitor (recorded, dropped, batches, hook errors, publisher)."""
    mon = _monitor
    return mon.recorder.stats if mon is not None else None


def _forget_in_child() -> None:
    """A forked child (a dataloader worker) must not record into the parent's queue."""
    global _monitor, _disabled
    _monitor, _disabled = None, True


if os.environ.get(ENV_HOOK, "on").lower() not in _OFF:
    torch_patches.install(_current)
    if _auto:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(_auto_start)
    os.register_at_fork(after_in_child=_forget_in_child)
    atexit.register(stop)
