"""How numbers and subjects read to a person: the one formatting of tables, alerts and the report.

Durations in ns/µs/ms/s by size, bandwidth in GB/s, gaps as percentages only when a peer median exists
(never ``nan%``), and a finding named by what it is about: a rank, a host, a pipeline stage or the job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from fleetscope.schemas.fields import as_list


def duration(ns: float | None) -> str:
    """2130000 -> "2.13 ms"; 850000 -> "850 µs"; 1.5e9 -> "1.50 s"."""
    if ns is None or not math.isfinite(ns):
        return "-"
    sign, a = ("-" if ns < 0 else ""), abs(ns)
    if a >= 1e9:
        return f"{sign}{a / 1e9:.2f} s"
    if a >= 1e6:
        return f"{sign}{_sig3(a / 1e6)} ms"
    if a >= 1e3:
        return f"{sign}{_sig3(a / 1e3)} µs"
    return f"{sign}{a:.0f} ns"


def bandwidth(bytes_per_s: float | None) -> str:
    """Bytes per second as GB/s (10^9, as NCCL reports bus bandwidth)."""
    if bytes_per_s is None or not math.isfinite(bytes_per_s):
        return "-"
    return f"{bytes_per_s / 1e9:.1f} GB/s"


def _sig3(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def metric_value(metric: str, value: float | None) -> str:
    """A finding's value in its metric's unit, read from the metric's name."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if metric.endswith("_ns"):
        return duration(value)
    if metric.endswith("_bps"):
        return bandwidth(value)
    if metric.endswith("_gbps"):
        return bandwidth(value * 1e9)
    if metric.endswith(("_share", "_fraction")):
        return f"{value:.1%}"
    return f"{value:.3g}"


def metric_name(metric: str) -> str:
    """The metric without its unit suffix, which the value now carries ("mean_ns" -> "mean")."""
    for suffix in ("_ns", "_gbps", "_bps"):
        if metric.endswith(suffix) and len(metric) > len(suffix):
            return metric[: -len(suffix)]
    return metric


def gap(value: float | None, peer_median: float | None) -> str:
    """ "+51%" when there is a peer median to compare with, else ""."""
    if not value or not peer_median or not math.isfinite(value) or not math.isfinite(peer_median):
        return ""
    return f"{value / peer_median - 1:+.0%}"


def subject(finding: Mapping[str, object]) -> str:
    """What a finding is about: "rank 7", "host node001", "stage 2", "job demo" or "ranks 3,4"."""
    kind, _, name = str(finding.get("subject") or "").partition(":")
    if kind in ("rank", "host", "stage") and name:
        return f"{kind} {name}"
    if kind == "job":
        return f"job {finding.get('job', '')}".strip()
    rank = finding.get("rank")
    if isinstance(rank, int) and rank >= 0:
        return f"rank {rank}"
    ranks = as_list(finding.get("ranks"))
    if ranks:
        return "ranks " + ",".join(str(r) for r in ranks[:8]) + ("..." if len(ranks) > 8 else "")
    host = finding.get("host")
    return f"host {host}" if host else f"job {finding.get('job', '')}".strip()


def gpu(finding: Mapping[str, object]) -> str:
    """The GPU a finding is on, when its producer knew: "GPU 3 (GPU-1a2b..., 0000:3b:00.0)", else ""."""
    local = finding.get("local_rank")
    uuid, bus = str(finding.get("gpu_uuid") or ""), str(finding.get("pci_bus_id") or "")
    ids = ", ".join(x for x in (uuid, bus) if x)
    if isinstance(local, int) and local >= 0:
        return f"GPU {local}" + (f" ({ids})" if ids else "")
    return ids
