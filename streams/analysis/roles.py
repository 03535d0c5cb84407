"""Who is a peer of whom, from the job's layout.

In a dp x tp x pp job, ranks in different roles do different work: only the first pipeline stage runs
the data loader, stages hold different layers. So ranks are compared only within their pipeline stage
(``peer_group_rows``), and a host function absent on a rank counts as zero only where ranks of the
same role (stage and tensor slot) run it (``role_codes``): a function only some roles call is never
"absent = zero" for the others. Who is a victim of whom is the replay's to say (``attribution``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fleetscope.schemas import Category
from fleetscope.schemas.vocabulary import GC_PAUSE
from fleetscope.streams.analysis.stats import I64

VICTIM_WAIT_SHARE = 0.5
"""The share of a late rank's lateness that its own excess, or its wait elsewhere, must reach to explain it."""


def late_by_compute(lateness_ns: float, excess_ns: float, compute_ns: float, min_gap: float) -> str | None:
    """What a late rank's own compute time, ``excess_ns`` above its peers' median ``compute_ns``, says of its
    lateness: None where it accounts for less than half of it (``VICTIM_WAIT_SHARE``: its host, a late start,
    a wait); "gpu_slow" where it does and the excess is ``min_gap`` of the median or more (the gap a kernel
    needs to be gpu_slow); "" where it does by less: GPUs of one model differ by a few percent (silicon,
    clocks, cooling), and the slowest of a healthy job arrives last at every collective, by a steady percent
    or two of the step. That is a healthy part, not a finding."""
    if not excess_ns >= VICTIM_WAIT_SHARE * lateness_ns:
        return None
    return Category.GPU_SLOW.value if excess_ns >= min_gap * compute_ns else ""


def _coordinate(rec: dict[str, Any], name: str) -> int:
    return int(rec.get(name, -1))


def peer_group_rows(records: Sequence[dict[str, Any]]) -> list[I64]:
    """Rows of ranks that should behave alike: the same pipeline stage (all ranks when unknown)."""
    groups: dict[int, list[int]] = {}
    for i, rec in enumerate(records):
        groups.setdefault(_coordinate(rec, "pp_rank"), []).append(i)
    return [np.array(rows, dtype=np.int64) for rows in groups.values()]


def role_codes(records: Sequence[dict[str, Any]]) -> I64:
    """One code per record for its role: (pipeline stage, tensor slot); unknown coordinates share one."""
    roles: dict[tuple[int, int], int] = {}
    return np.fromiter(
        (roles.setdefault((_coordinate(r, "pp_rank"), _coordinate(r, "tp_rank")), len(roles)) for r in records),
        dtype=np.int64,
        count=len(records),
    )


def absent_as_zero(total: np.ndarray, role: I64, functions: Sequence[str] = ()) -> np.ndarray:
    """Per-iteration totals (NaN = the function is absent on that rank) with an absence read as zero
    only where another rank of the same role runs the function; elsewhere it stays NaN (not compared).
    A GC pause (``GC_PAUSE`` among the columns' ``functions``) is no role's work: every Python process
    collects, so its absence is zero on every rank (within its slot, a pair is too few to compare)."""
    present = ~np.isnan(total)
    n_roles = int(role.max()) + 1 if role.size else 0
    runs = np.zeros((n_roles, total.shape[1]), dtype=bool)
    np.logical_or.at(runs, role, present)
    anyone = np.array([name == GC_PAUSE for name in functions], dtype=bool) if functions else False
    return np.where(present, total, np.where(runs[role] | anyone, 0.0, np.nan))
