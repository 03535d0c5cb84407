"""The NVML sampler against the fake NVML: rates from counter deltas, unsupported metrics, rate switch,
lifecycle. No GPU here: the real ``PynvmlApi`` is only checked for its missing-library hint."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from fleetscope.producers.nvml import (
    FakeGpu,
    FakeNvml,
    NvmlSampler,
    NvmlSamplerConfig,
    PynvmlApi,
    node_targets,
)
from fleetscope.producers.rank_recorder import RankIdentity
from fleetscope.schemas import EventBatch, EventKind

ME = RankIdentity(job="j", rank=3, world_size=8, local_rank=0, host="h")


class Clock:
    def __init__(self) -> None:
        self.us = 1_800_000_000_000_000

    def __call__(self) -> int:
        return self.us


def samples(batches: list[EventBatch]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for b in batches:
        for mid, value in zip(b["metric_id"], b["value"], strict=True):
            out.setdefault(b.names[mid], []).append(float(value))
    return out


def manual(gpus: list[FakeGpu], **config: float) -> tuple[NvmlSampler, Clock, list[EventBatch]]:
    clock = Clock()
    batches: list[EventBatch] = []
    sampler = NvmlSampler(
        NvmlSamplerConfig(**config), api=FakeNvml(gpus, clock_us=clock), sink=batches.append, targets={0: ME}
    )
    sampler.start(background=False)
    return sampler, clock, batches


def test_link_rates_come_from_counter_deltas_over_the_field_timestamps() -> None:
    sampler, clock, batches = manual([FakeGpu(nvlinks=2, nvlink_kib_per_s=1_000_000, pcie_bytes_per_s=5e9)])
    sampler.sample_once(("link",))  # first reading: no rate yet
    clock.us += 250_000
    sampler.sample_once(("link",))
    clock.us += 500_000
    sampler.sample_once(("link",))
    sampler.flush()
    got = samples(batches)
    assert got["nvlink_tx_bytes_per_s"] == pytest.approx([2 * 1.024e9] * 2, rel=1e-6)  # sum of 2 links
    assert got["nvlink_rx_bytes_per_s.link1"] == pytest.approx([1.024e9] * 2, rel=1e-6)
    assert got["pcie_rx_bytes_per_s"] == pytest.approx([5e9] * 2, rel=1e-6)
    t = batches[0]["t_ns"][batches[0]["metric_id"] == batches[0].names.index("pcie_tx_bytes_per_s")]
    assert np.diff(t).tolist() == [500_000_000]  # sample time = the field's timestamp
    header = batches[0].header
    assert (header.job, header.rank, header.gpu_uuid, header.streams) == ("j", 3, "GPU-fake", ("throughput",))
    assert batches[0].kind is EventKind.SAMPLES and header.seq == 0
    sampler.stop()


def test_a_counter_reset_gives_no_sample_instead_of_a_negative_rate() -> None:
    sampler, clock, batches = manual([FakeGpu(nvlinks=1)])
    clock.us += 1_000_000
    sampler.sample_once(("link",))
    clock.us -= 500_000  # counters go back (driver reload)
    sampler.sample_once(("link",))
    sampler.flush()
    assert all(v >= 0 for vs in samples(batches).values() for v in vs)
    sampler.stop()


def test_unsupported_fields_and_metrics_are_skipped_counted_once_and_never_fatal() -> None:
    gpu = FakeGpu(nvlinks=0, unsupported={"ecc_corrected", "power_mw"}, unsupported_fields={197, 198})
    sampler, clock, batches = manual([gpu])
    for _ in range(3):
        clock.us += 100_000
        sampler.sample_once()
    sampler.flush()
    got = samples(batches)
    assert "ecc_corrected" not in got and "power_mw" not in got
    assert got["ecc_uncorrected"] == [0.0] * 3 and got["sm_clock_mhz"] == [1980.0] * 3
    # no PCIe byte counters: throughput falls back to nvmlDeviceGetPcieThroughput (KB/s)
    assert got["pcie_tx_bytes_per_s"] == [1e6] * 3 and got["pcie_rx_bytes_per_s"] == [2e6] * 3
    assert sampler.stats.unsupported == 4 and sampler.stats.errors == 0
    sampler.stop()


def test_boost_switches_link_sampling_to_the_fast_rate_until_the_window_ends() -> None:
    sampler = NvmlSampler(api=FakeNvml(), sink=lambda b: None, targets={0: ME})
    now = time.time_ns()
    assert sampler.link_interval_ms(now) == 100.0
    sampler.boost(now + 1_000_000_000)
    assert sampler.link_interval_ms(now) == 1.0
    assert sampler.link_interval_ms(now + 1_000_000_001) == 100.0


def test_a_boosted_sampler_reads_the_link_counters_much_more_often() -> None:
    def link_reads(boost: bool) -> int:
        api = FakeNvml()
        cfg = NvmlSamplerConfig(interval_ms=50, fast_interval_ms=2, flush_interval_ms=50, xid=False)
        sampler = NvmlSampler(cfg, api=api, sink=lambda b: None, targets={0: ME})
        if boost:
            sampler.boost(time.time_ns() + 10**10)
        sampler.start()
        time.sleep(0.3)
        sampler.stop()
        return api.calls

    slow, fast = link_reads(False), link_reads(True)
    assert fast > 3 * slow


def test_lifecycle_build_from_defaults_stop_without_start_start_one_batch_stop_twice() -> None:
    idle = NvmlSampler()
    idle.stop()
    idle.stop()
    assert idle.stats.samples == 0

    batches: list[EventBatch] = []
    cfg = NvmlSamplerConfig(flush_interval_ms=20, xid_wait_ms=20)
    api = FakeNvml([FakeGpu(), FakeGpu(uuid="GPU-2")])
    sampler = NvmlSampler(cfg, api=api, sink=batches.append, targets=node_targets("job", 8, 16, "n1"))
    sampler.start()
    sampler.start()  # no-op
    api.xids.put((1, 79))
    deadline = time.monotonic() + 5
    while len({b.header.rank for b in batches}) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    sampler.stop()
    assert not api.initialised
    assert {(b.header.rank, b.header.local_rank, b.header.gpu_uuid) for b in batches} == {
        (8, 0, "GPU-fake"),
        (9, 1, "GPU-2"),
    }
    seqs = [b.header.seq for b in batches if b.header.rank == 8]
    assert seqs == list(range(len(seqs)))
    assert samples([b for b in batches if b.header.rank == 9])["xid"] == [79.0]
    assert sampler.stats.xid_events == 1 and sampler.stats.batches == len(batches)


def test_node_targets_skip_gpus_beyond_the_world() -> None:
    targets = node_targets("job", 6, 8)
    assert targets(1) == RankIdentity(job="job", rank=7, world_size=8, local_rank=1)
    assert targets(2) is None


def test_config_errors_are_reported_together() -> None:
    with pytest.raises(ValueError, match="interval_ms.*fast_interval_ms"):
        NvmlSamplerConfig(interval_ms=0, fast_interval_ms=5)


def test_real_api_without_nvidia_ml_py_gives_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(ImportError, match=r"pip install 'fleetscope\[nvml\]'"):
        PynvmlApi()
    with pytest.raises(ImportError, match="nvml"):
        NvmlSampler().start()
