"""NVML sampler: per-GPU link throughput, clocks, throttling and health, published as THROUGHPUT batches.

Why it looks like this: the detector needs link throughput *during* each function's executions (a slow link is
low and steady, congestion fluctuates), so NVLink/PCIe byte counters are read as field values and turned into
rates from counter deltas over the field's own timestamp. Three tiers keep the cost bounded: link counters
every tick (10 Hz, up to 1 kHz while a profiling window runs: ``boost``), clocks/utilisation/power/throttle
bits at the base rate, and slow-moving state (link gen/width, temperature, ECC) once a second. A metric a GPU
does not support is skipped for good and counted, never fatal. XID errors arrive on an NVML event set,
waited on in a thread of its own. Batches go to a ``sink`` callable (``Publisher.publish`` in ``fleetscope
agent``, the torch hook's recorder in-process), one producer per GPU, tagged with the rank using the GPU.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from fleetscope.producers.nvml_api import (
    _COUNTERS,
    DEVICE_METRICS,
    FI_NVLINK_LINK_COUNT,
    FI_NVLINK_THROUGHPUT_DATA_RX,
    FI_NVLINK_THROUGHPUT_DATA_TX,
    FI_PCIE_COUNT_RX_BYTES,
    FI_PCIE_COUNT_TX_BYTES,
    PCIE_FALLBACK,
    SLOW_METRICS,
    FakeGpu,
    FakeNvml,
    FieldReading,
    NvmlApi,
    NvmlNotSupported,
    PynvmlApi,
)
from fleetscope.producers.rank_recorder import RankIdentity
from fleetscope.schemas import EventBatch, EventKind

__all__ = [
    "FakeGpu",
    "FakeNvml",
    "NvmlApi",
    "NvmlNotSupported",
    "NvmlSampler",
    "NvmlSamplerConfig",
    "NvmlStats",
    "PynvmlApi",
    "node_targets",
]

logger = logging.getLogger(__name__)

Targets = Mapping[int, RankIdentity] | Callable[[int], RankIdentity | None]


@dataclass(frozen=True, kw_only=True)
class NvmlSamplerConfig:
    """Sampling rates (periods in ms) and batching."""

    interval_ms: float = 100.0
    """Base period of every fast metric: 10 Hz."""
    fast_interval_ms: float = 1.0
    """Period of the link counters while boosted (a profiling window): 1 kHz."""
    slow_interval_ms: float = 1000.0
    flush_interval_ms: float = 500.0
    max_batch_samples: int = 4096
    per_link: bool = True
    """Also publish ``nvlink_{tx,rx}_bytes_per_s.link<L>`` (outside the link family the patterns pool)."""
    xid: bool = True
    xid_wait_ms: int = 500

    def __post_init__(self) -> None:
        p = [
            f"{name} must be > 0, got {getattr(self, name)!r}"
            for name in ("interval_ms", "fast_interval_ms", "slow_interval_ms", "flush_interval_ms")
            if not getattr(self, name) > 0
        ]
        if self.fast_interval_ms > self.interval_ms:
            p.append("fast_interval_ms must be <= interval_ms")
        if self.max_batch_samples < 1 or self.xid_wait_ms < 1:
            p.append("max_batch_samples and xid_wait_ms must be >= 1")
        if p:
            raise ValueError("invalid NVML sampler config: " + "; ".join(p))


@dataclass(frozen=True, slots=True)
class NvmlStats:
    samples: int = 0
    batches: int = 0
    unsupported: int = 0
    """(GPU, metric or field) pairs found unsupported and skipped from then on."""
    errors: int = 0
    xid_events: int = 0


def node_targets(job: str, first_rank: int, world_size: int, host: str = "") -> Callable[[int], RankIdentity | None]:
    """GPU i of this node serves rank ``first_rank + i`` (torchrun with one process per GPU)."""

    def target(index: int) -> RankIdentity | None:
        rank = first_rank + index
        if rank >= world_size:
            return None
        return RankIdentity(job=job, rank=rank, world_size=world_size, local_rank=index, host=host)

    return target


class _Gpu:
    """Per-GPU sampling state."""

    def __init__(self, index: int, handle: object, identity: RankIdentity, producer_id: str) -> None:
        self.index, self.handle, self.identity, self.producer_id = index, handle, identity, producer_id
        self.fields: list[tuple[int, int]] = []
        self.prev: dict[tuple[int, int], tuple[int, int]] = {}
        self.skip: set[str] = set()
        """NVML reads found unsupported."""
        self.fallback: set[str] = set()
        """PCIe throughput metrics read with nvmlDeviceGetPcieThroughput: no byte counter fields."""
        self.seq = 0
        self.t: list[int] = []
        self.metric: list[str] = []
        self.value: list[float] = []


class NvmlSampler:
    """Samples the node's GPUs in a background thread; ``start``/``stop`` (idempotent) and ``boost``."""

    def __init__(
        self,
        config: NvmlSamplerConfig | None = None,
        *,
        api: NvmlApi | None = None,
        sink: Callable[[EventBatch], object] | None = None,
        targets: Targets | None = None,
        streams: tuple[str, ...] = (EventKind.SAMPLES.value,),
    ) -> None:
        self.config = config or NvmlSamplerConfig()
        self._api = api
        self._sink = sink
        self._targets = targets
        self._streams = streams
        self._gpus: list[_Gpu] = []
        self._lock = threading.Lock()  # sample buffers: sampler thread and XID thread
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._boost_until_ns = 0
        self._counts = dict.fromkeys(NvmlStats.__dataclass_fields__, 0)
        self._logged: set[str] = set()
        self._initialised = False

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        """Initialise NVML, find the GPUs and start sampling. Raises on a missing library or driver.

        ``background=False`` starts no thread: the caller drives ``sample_once`` and ``flush``.
        """
        if self._threads or self._initialised:
            return
        if self._api is None:
            self._api = PynvmlApi()
        api = self._api
        api.init()
        self._initialised = True
        host = socket.gethostname()
        targets = self._targets or _env_targets(api.device_count(), host)
        self._gpus = []
        for index in range(api.device_count()):
            ident = targets.get(index) if isinstance(targets, Mapping) else targets(index)
            if ident is None:
                continue
            handle = api.handle(index)
            try:
                ident = _with_uuid(ident, api.uuid(handle))
            except Exception as exc:
                self._problem("uuid", exc)
            gpu = _Gpu(index, handle, ident, f"nvml-{host}-{os.getpid()}-gpu{index}")
            gpu.fields = self._link_fields(gpu)
            self._gpus.append(gpu)
        self._stop.clear()
        if not background:
            return
        self._threads = [threading.Thread(target=self._run, name="fleetscope-nvml", daemon=True)]
        if self.config.xid and self._gpus:
            self._threads.append(threading.Thread(target=self._run_xid, name="fleetscope-xid", daemon=True))
        for t in self._threads:
            t.start()
        logger.info("NVML sampler started on %d GPU(s)", len(self._gpus))

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the threads, publish what was sampled, shut NVML down. Idempotent; fine before start."""
        threads, self._threads = self._threads, []
        self._stop.set()
        for t in threads:
            t.join(timeout_s)
        if self._initialised and self._api is not None:
            self.flush()
            self._initialised = False
            try:
                self._api.shutdown()
            except Exception as exc:
                self._problem("shutdown", exc)

    def boost(self, until_ns: int) -> None:
        """Sample link counters every ``fast_interval_ms`` until ``until_ns`` (wall clock): a window."""
        self._boost_until_ns = max(self._boost_until_ns, until_ns)

    def link_interval_ms(self, now_ns: int | None = None) -> float:
        now = time.time_ns() if now_ns is None else now_ns
        return self.config.fast_interval_ms if now < self._boost_until_ns else self.config.interval_ms

    @property
    def stats(self) -> NvmlStats:
        with self._lock:
            return NvmlStats(**self._counts)

    # -- sampling ------------------------------------------------------------------------------------
    def sample_once(self, tiers: tuple[str, ...] = ("link", "device", "slow")) -> None:
        """One pass over every GPU (the thread calls it per tier; tests call it directly)."""
        for gpu in self._gpus:
            if "link" in tiers:
                self._sample_links(gpu)
            if "device" in tiers:
                self._sample_metrics(gpu, DEVICE_METRICS + tuple(sorted(gpu.fallback)))
            if "slow" in tiers:
                self._sample_metrics(gpu, SLOW_METRICS)

    def _run(self) -> None:
        now = time.monotonic()
        due = {"link": now, "device": now, "slow": now}
        next_flush = now + self.config.flush_interval_ms / 1000
        while not self._stop.is_set():
            now = time.monotonic()
            periods = {
                "link": self.link_interval_ms() / 1000,
                "device": self.config.interval_ms / 1000,
                "slow": self.config.slow_interval_ms / 1000,
            }
            tiers = tuple(t for t, at in due.items() if now >= at)
            if tiers:
                try:
                    self.sample_once(tiers)
                except Exception as exc:
                    self._problem("sample", exc)
                for t in tiers:  # never try to catch up on missed ticks
                    due[t] = max(due[t] + periods[t], now)
            due["link"] = min(due["link"], now + periods["link"])
            if now >= next_flush:
                self.flush()
                next_flush = now + self.config.flush_interval_ms / 1000
            self._stop.wait(max(0.0, min(*due.values(), next_flush) - time.monotonic()))

    def _link_fields(self, gpu: _Gpu) -> list[tuple[int, int]]:
        fields = [(FI_PCIE_COUNT_TX_BYTES, 0), (FI_PCIE_COUNT_RX_BYTES, 0)]
        try:
            (count,) = self._api_call().field_values(gpu.handle, [(FI_NVLINK_LINK_COUNT, 0)])
            links = count.value or 0
        except Exception as exc:
            self._problem("nvlink_count", exc)
            links = 0
        for link in range(links):
            fields += [(FI_NVLINK_THROUGHPUT_DATA_TX, link), (FI_NVLINK_THROUGHPUT_DATA_RX, link)]
        return fields

    def _sample_links(self, gpu: _Gpu) -> None:
        if not gpu.fields:
            return
        try:
            readings = self._api_call().field_values(gpu.handle, gpu.fields)
        except NvmlNotSupported:
            self._unsupported(gpu, "field_values")
            gpu.fallback.update(PCIE_FALLBACK)
            gpu.fields = []
            return
        except Exception as exc:
            self._problem("field_values", exc)
            return
        totals: dict[str, tuple[int, float]] = {}
        for r in readings:
            self._counter_rate(gpu, r, totals)
        for metric, (t_ns, rate) in totals.items():
            self._add(gpu, t_ns, metric, rate)

    def _counter_rate(self, gpu: _Gpu, r: FieldReading, totals: dict[str, tuple[int, float]]) -> None:
        """Rate from the delta of a cumulative counter over the field's own timestamps; sums links."""
        key = (r.field_id, r.scope_id)
        if r.value is None:
            if not r.supported:
                gpu.fields.remove(key)
                self._unsupported(gpu, f"field{r.field_id}[{r.scope_id}]")
                if r.field_id in (FI_PCIE_COUNT_TX_BYTES, FI_PCIE_COUNT_RX_BYTES):
                    gpu.fallback.add(_COUNTERS[r.field_id][0])
            return
        prev = gpu.prev.get(key)
        gpu.prev[key] = (r.timestamp_us, r.value)
        if prev is None or r.timestamp_us <= prev[0] or r.value < prev[1]:
            return  # first reading, no time passed, or the counter was reset
        metric, unit = _COUNTERS[r.field_id]
        rate = (r.value - prev[1]) * unit / ((r.timestamp_us - prev[0]) / 1e6)
        t_ns = r.timestamp_us * 1000
        t_prev, sum_prev = totals.get(metric, (0, 0.0))
        totals[metric] = (max(t_prev, t_ns), sum_prev + rate)
        nvlink = r.field_id in (FI_NVLINK_THROUGHPUT_DATA_TX, FI_NVLINK_THROUGHPUT_DATA_RX)
        if self.config.per_link and nvlink:
            self._add(gpu, t_ns, f"{metric}.link{r.scope_id}", rate)

    def _sample_metrics(self, gpu: _Gpu, metrics: tuple[str, ...]) -> None:
        api = self._api_call()
        for metric in metrics:
            name = PCIE_FALLBACK.get(metric, metric)
            if name in gpu.skip:
                continue
            try:
                value = api.read(gpu.handle, name)
            except NvmlNotSupported:
                gpu.skip.add(name)
                self._unsupported(gpu, name)
                continue
            except Exception as exc:
                self._problem(name, exc)
                continue
            if name in PCIE_FALLBACK.values():
                value *= 1000.0  # NVML reports KB/s over a 20 ms window
            self._add(gpu, time.time_ns(), metric, value)

    def _run_xid(self) -> None:
        api = self._api_call()
        try:
            api.watch_xid([g.index for g in self._gpus])
        except NvmlNotSupported:
            for gpu in self._gpus:
                self._unsupported(gpu, "xid")
            return
        except Exception as exc:
            self._problem("xid", exc)
            return
        by_index = {g.index: g for g in self._gpus}
        try:
            while not self._stop.is_set():
                try:
                    event = api.wait_xid(self.config.xid_wait_ms)
                except Exception as exc:
                    self._problem("xid_wait", exc)
                    self._stop.wait(1.0)
                    continue
                if event is not None and event[0] in by_index:
                    logger.warning("XID %d on GPU %d", event[1], event[0])
                    with self._lock:
                        self._counts["xid_events"] += 1
                    self._add(by_index[event[0]], time.time_ns(), "xid", float(event[1]))
        finally:
            try:
                api.unwatch_xid()
            except Exception as exc:
                self._problem("xid_free", exc)

    # -- output --------------------------------------------------------------------------------------
    def _add(self, gpu: _Gpu, t_ns: int, metric: str, value: float) -> None:
        with self._lock:
            gpu.t.append(t_ns)
            gpu.metric.append(metric)
            gpu.value.append(value)
            self._counts["samples"] += 1
            full = len(gpu.t) >= self.config.max_batch_samples
        if full:
            self._flush_gpu(gpu)

    def flush(self) -> None:
        """Hand every GPU's buffered samples to the sink."""
        for gpu in self._gpus:
            self._flush_gpu(gpu)

    def _flush_gpu(self, gpu: _Gpu) -> None:
        with self._lock:
            t, metric, value = gpu.t, gpu.metric, gpu.value
            if not t:
                return
            gpu.t, gpu.metric, gpu.value = [], [], []
            seq, gpu.seq = gpu.seq, gpu.seq + 1
        table: dict[str, int] = {}
        ids = np.fromiter((table.setdefault(m, len(table)) for m in metric), np.int32, len(metric))
        header = gpu.identity.header(producer_id=gpu.producer_id, seq=seq, streams=self._streams)
        columns: dict[str, npt.NDArray[np.generic]] = {
            "t_ns": np.asarray(t, np.int64),
            "metric_id": ids,
            "value": np.asarray(value, np.float64),
        }
        batch = EventBatch(kind=EventKind.SAMPLES, header=header, names=list(table), columns=columns)
        if self._sink is None:
            return
        try:
            self._sink(batch)
            with self._lock:
                self._counts["batches"] += 1
        except Exception as exc:
            self._problem("sink", exc)

    # -- problems ------------------------------------------------------------------------------------
    def _api_call(self) -> NvmlApi:
        if self._api is None:
            raise RuntimeError("the NVML sampler is not started")
        return self._api

    def _unsupported(self, gpu: _Gpu, what: str) -> None:
        with self._lock:
            self._counts["unsupported"] += 1
        logger.info("GPU %d does not support %s; skipping it", gpu.index, what)

    def _problem(self, site: str, exc: BaseException) -> None:
        with self._lock:
            self._counts["errors"] += 1
        if site not in self._logged:
            self._logged.add(site)
            logger.warning("NVML %s failed (further failures only counted): %r", site, exc)


def _with_uuid(ident: RankIdentity, uuid: str) -> RankIdentity:
    return replace(ident, gpu_uuid=uuid)


def _env_targets(device_count: int, host: str) -> Callable[[int], RankIdentity | None]:
    """Default: the torchrun environment of this node (GPU i = local rank i)."""
    me = RankIdentity.from_env()
    first = me.rank - me.local_rank
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else first + device_count
    return node_targets(me.job, first, world, host or me.host)
