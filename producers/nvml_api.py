"""The narrow NVML interface of the sampler: a Protocol, the real pynvml implementation and a fake.

Why: NVML needs a GPU and a driver; the sampler's logic (rates from counter deltas, unsupported fields,
rate switching) is tested against ``FakeNvml`` anywhere, and ``PynvmlApi`` stays a thin translation of
the same calls (``pip install 'fleetscope[nvml]'``; ``import pynvml`` happens only when it is built).
"""

from __future__ import annotations

import queue
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

T = TypeVar("T")

# NVML field ids (nvml.h; pynvml exports the same names).
FI_NVLINK_LINK_COUNT = 91
FI_NVLINK_THROUGHPUT_DATA_TX = 138  # cumulative KiB, scopeId = link
FI_NVLINK_THROUGHPUT_DATA_RX = 139
FI_PCIE_COUNT_TX_BYTES = 197  # cumulative bytes, newer GPUs/drivers only
FI_PCIE_COUNT_RX_BYTES = 198

DEVICE_METRICS = ("sm_clock_mhz", "throttle_reasons", "power_mw", "sm_util_pct", "mem_util_pct")
SLOW_METRICS = (
    "sm_clock_max_mhz",
    "pcie_gen",
    "pcie_gen_max",
    "pcie_width",
    "pcie_width_max",
    "temperature_c",
    "ecc_corrected",
    "ecc_uncorrected",
)
PCIE_FALLBACK = {"pcie_tx_bytes_per_s": "pcie_tx_kbps", "pcie_rx_bytes_per_s": "pcie_rx_kbps"}
_COUNTERS = {  # field id -> (metric, bytes per counter unit)
    FI_NVLINK_THROUGHPUT_DATA_TX: ("nvlink_tx_bytes_per_s", 1024),
    FI_NVLINK_THROUGHPUT_DATA_RX: ("nvlink_rx_bytes_per_s", 1024),
    FI_PCIE_COUNT_TX_BYTES: ("pcie_tx_bytes_per_s", 1),
    FI_PCIE_COUNT_RX_BYTES: ("pcie_rx_bytes_per_s", 1),
}


class NvmlNotSupported(Exception):
    """This GPU or driver does not support the call or field: skip it, do not retry."""


class FieldReading(NamedTuple):
    field_id: int
    scope_id: int
    timestamp_us: int
    value: int | None
    """None when the field could not be read (``supported`` tells whether to try again)."""
    supported: bool = True


class NvmlApi(Protocol):
    """The handful of NVML calls the sampler uses."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def device_count(self) -> int: ...
    def handle(self, index: int) -> object: ...
    def uuid(self, handle: object) -> str: ...
    def field_values(self, handle: object, fields: Sequence[tuple[int, int]]) -> list[FieldReading]: ...
    def read(self, handle: object, metric: str) -> float:
        """A scalar of ``DEVICE_METRICS``/``SLOW_METRICS``/``pcie_*_kbps``; raises NvmlNotSupported."""
        ...

    def watch_xid(self, indices: Sequence[int]) -> None: ...
    def wait_xid(self, timeout_ms: int) -> tuple[int, int] | None:
        """Block up to ``timeout_ms`` for an XID event: (device index, xid) or None."""
        ...

    def unwatch_xid(self) -> None: ...


def _import_pynvml() -> types.ModuleType:
    try:
        import pynvml
    except ImportError as exc:
        raise ImportError("the NVML sampler needs nvidia-ml-py: pip install 'fleetscope[nvml]'", name=exc.name) from exc
    return pynvml


class PynvmlApi:
    """``NvmlApi`` over nvidia-ml-py (``import pynvml``); NOT_SUPPORTED errors become ``NvmlNotSupported``."""

    def __init__(self) -> None:
        self.nv = _import_pynvml()
        self._event_set: object = None
        self._index_of: dict[int, int] = {}

    def _call(self, fn: Callable[..., T], *args: object) -> T:
        nv = self.nv
        try:
            return fn(*args)
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound) as exc:
            raise NvmlNotSupported(str(exc)) from exc

    def init(self) -> None:
        self.nv.nvmlInit()

    def shutdown(self) -> None:
        self.nv.nvmlShutdown()

    def device_count(self) -> int:
        return int(self.nv.nvmlDeviceGetCount())

    def handle(self, index: int) -> object:
        return self.nv.nvmlDeviceGetHandleByIndex(index)

    def uuid(self, handle: object) -> str:
        value = self.nv.nvmlDeviceGetUUID(handle)
        return value.decode() if isinstance(value, bytes) else str(value)

    def field_values(self, handle: object, fields: Sequence[tuple[int, int]]) -> list[FieldReading]:
        nv = self.nv
        raw = self._call(nv.nvmlDeviceGetFieldValues, handle, list(fields))
        out = []
        for fv in raw:
            if fv.nvmlReturn != nv.NVML_SUCCESS:
                supported = fv.nvmlReturn != nv.NVML_ERROR_NOT_SUPPORTED
                out.append(FieldReading(fv.fieldId, fv.scopeId, int(fv.timestamp), None, supported))
                continue
            member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}.get(
                fv.valueType, "ullVal"
            )
            value = int(getattr(fv.value, member))
            out.append(FieldReading(fv.fieldId, fv.scopeId, int(fv.timestamp), value))
        return out

    def read(self, handle: object, metric: str) -> float:
        nv = self.nv
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        calls: dict[str, Callable[[], float]] = {
            "sm_clock_mhz": lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM),
            "sm_clock_max_mhz": lambda: nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_SM),
            "throttle_reasons": lambda: (reasons or nv.nvmlDeviceGetCurrentClocksThrottleReasons)(handle),
            "power_mw": lambda: nv.nvmlDeviceGetPowerUsage(handle),
            "temperature_c": lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU),
            "sm_util_pct": lambda: nv.nvmlDeviceGetUtilizationRates(handle).gpu,
            "mem_util_pct": lambda: nv.nvmlDeviceGetUtilizationRates(handle).memory,
            "pcie_gen": lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(handle),
            "pcie_gen_max": lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(handle),
            "pcie_width": lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(handle),
            "pcie_width_max": lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(handle),
            "pcie_tx_kbps": lambda: nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_TX_BYTES),
            "pcie_rx_kbps": lambda: nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_RX_BYTES),
            "ecc_corrected": lambda: nv.nvmlDeviceGetTotalEccErrors(
                handle, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC
            ),
            "ecc_uncorrected": lambda: nv.nvmlDeviceGetTotalEccErrors(
                handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
            ),
        }
        if metric not in calls:
            raise NvmlNotSupported(f"unknown metric {metric!r}")
        return float(self._call(calls[metric]))

    def watch_xid(self, indices: Sequence[int]) -> None:
        nv = self.nv
        self._event_set = self._call(nv.nvmlEventSetCreate)
        for index in indices:
            handle = self.handle(index)
            self._index_of[id(handle)] = index
            self._call(nv.nvmlDeviceRegisterEvents, handle, nv.nvmlEventTypeXidCriticalError, self._event_set)

    def wait_xid(self, timeout_ms: int) -> tuple[int, int] | None:
        nv = self.nv
        try:
            data = nv.nvmlEventSetWait_v2(self._event_set, timeout_ms)
        except nv.NVMLError_Timeout:
            return None
        index = int(nv.nvmlDeviceGetIndex(data.device))
        return index, int(data.eventData)

    def unwatch_xid(self) -> None:
        event_set, self._event_set = self._event_set, None
        if event_set is not None:
            self.nv.nvmlEventSetFree(event_set)


@dataclass
class FakeGpu:
    """One fake GPU: counters grow at fixed rates; what ``unsupported`` names raises NOT_SUPPORTED."""

    uuid: str = "GPU-fake"
    nvlinks: int = 2
    nvlink_kib_per_s: float = 1_000_000.0
    pcie_bytes_per_s: float = 5e9
    metrics: dict[str, float] = field(
        default_factory=lambda: {
            "sm_clock_mhz": 1980.0,
            "sm_clock_max_mhz": 1980.0,
            "throttle_reasons": 0.0,
            "power_mw": 350_000.0,
            "temperature_c": 55.0,
            "sm_util_pct": 90.0,
            "mem_util_pct": 40.0,
            "pcie_gen": 5.0,
            "pcie_gen_max": 5.0,
            "pcie_width": 16.0,
            "pcie_width_max": 16.0,
            "pcie_tx_kbps": 1000.0,
            "pcie_rx_kbps": 2000.0,
            "ecc_corrected": 0.0,
            "ecc_uncorrected": 0.0,
        }
    )
    unsupported: set[str] = field(default_factory=set)
    unsupported_fields: set[int] = field(default_factory=set)


class FakeNvml:
    """``NvmlApi`` for tests: deterministic counters driven by ``clock_us`` (wall clock by default)."""

    def __init__(self, gpus: Sequence[FakeGpu] | None = None, clock_us: Callable[[], int] | None = None) -> None:
        self.gpus = list(gpus) if gpus is not None else [FakeGpu()]
        self.clock_us = clock_us or (lambda: time.time_ns() // 1000)
        self.t0_us = self.clock_us()
        self.calls = 0
        self.initialised = False
        self.xids: queue.Queue[tuple[int, int]] = queue.Queue()

    def init(self) -> None:
        self.initialised = True

    def shutdown(self) -> None:
        self.initialised = False

    def device_count(self) -> int:
        return len(self.gpus)

    def handle(self, index: int) -> object:
        return index

    def _gpu(self, handle: object) -> FakeGpu:
        """The GPU of a handle this API gave out (its index)."""
        if not isinstance(handle, int):
            raise TypeError(f"not a handle of this API: {handle!r}")
        return self.gpus[handle]

    def uuid(self, handle: object) -> str:
        return str(self._gpu(handle).uuid)

    def field_values(self, handle: object, fields: Sequence[tuple[int, int]]) -> list[FieldReading]:
        self.calls += 1
        gpu, now = self._gpu(handle), self.clock_us()
        elapsed_s = (now - self.t0_us) / 1e6
        out = []
        for fid, scope in fields:
            if fid in gpu.unsupported_fields:
                out.append(FieldReading(fid, scope, now, None, False))
            elif fid == FI_NVLINK_LINK_COUNT:
                out.append(FieldReading(fid, scope, now, gpu.nvlinks))
            elif fid in (FI_NVLINK_THROUGHPUT_DATA_TX, FI_NVLINK_THROUGHPUT_DATA_RX):
                out.append(FieldReading(fid, scope, now, int(gpu.nvlink_kib_per_s * elapsed_s)))
            elif fid in (FI_PCIE_COUNT_TX_BYTES, FI_PCIE_COUNT_RX_BYTES):
                out.append(FieldReading(fid, scope, now, int(gpu.pcie_bytes_per_s * elapsed_s)))
            else:
                out.append(FieldReading(fid, scope, now, None, False))
        return out

    def read(self, handle: object, metric: str) -> float:
        self.calls += 1
        gpu = self._gpu(handle)
        if metric in gpu.unsupported or metric not in gpu.metrics:
            raise NvmlNotSupported(metric)
        return float(gpu.metrics[metric])

    def watch_xid(self, indices: Sequence[int]) -> None:
        if any("xid" in self.gpus[i].unsupported for i in indices):
            raise NvmlNotSupported("xid events")

    def wait_xid(self, timeout_ms: int) -> tuple[int, int] | None:
        try:
            return self.xids.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            return None

    def unwatch_xid(self) -> None:
        return None
