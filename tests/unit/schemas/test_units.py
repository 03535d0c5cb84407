"""The one formatting of numbers and subjects (tables, alerts, report)."""

from __future__ import annotations

import math

from fleetscope.schemas import units


def test_durations_read_in_the_unit_of_their_size() -> None:
    assert units.duration(2_127_000) == "2.13 ms"
    assert units.duration(40_574_890) == "40.6 ms"
    assert units.duration(850_000) == "850 µs"
    assert units.duration(8_500) == "8.50 µs"
    assert units.duration(120) == "120 ns"
    assert units.duration(1.5e9) == "1.50 s"
    assert units.duration(-3_000_000) == "-3.00 ms"
    assert units.duration(math.nan) == "-" and units.duration(None) == "-"


def test_metric_values_carry_their_unit() -> None:
    assert units.metric_value("mean_ns", 2.13e6) == "2.13 ms" and units.metric_name("mean_ns") == "mean"
    assert units.metric_value("nvlink_peak_bps", 180e9) == "180.0 GB/s"
    assert units.metric_value("busbw_gbps", 95.5) == "95.5 GB/s"
    assert units.metric_value("pcie_cv", 0.123) == "0.123"
    assert units.metric_value("missing_iterations", 12.0) == "12"


def test_gap_only_with_a_peer_median() -> None:
    assert units.gap(2.13e6, 1.4e6) == "+52%"
    assert units.gap(1.0e6, 0.0) == "" and units.gap(1.0, math.nan) == "" and units.gap(None, 1.0) == ""


def test_subject_names_host_stage_and_job_instead_of_rank_minus_one() -> None:
    base = {"job": "demo", "rank": -1, "ranks": [0, 1, 2, 3], "host": "node001"}
    assert units.subject(base | {"subject": "host:node001"}) == "host node001"
    assert units.subject(base | {"subject": "stage:2"}) == "stage 2"
    assert units.subject(base | {"subject": "job"}) == "job demo"
    assert units.subject(base | {"subject": "rank:7", "rank": 7}) == "rank 7"
    assert units.subject(base) == "ranks 0,1,2,3"  # a v1 record without subject
    assert units.subject({"job": "demo", "rank": 5}) == "rank 5"


def test_gpu_identity_when_known() -> None:
    assert units.gpu({"local_rank": 3, "gpu_uuid": "GPU-1a", "pci_bus_id": "0000:3b:00.0"}) == (
        "GPU 3 (GPU-1a, 0000:3b:00.0)"
    )
    assert units.gpu({"local_rank": 0}) == "GPU 0"
    assert units.gpu({"local_rank": -1, "gpu_uuid": ""}) == ""
