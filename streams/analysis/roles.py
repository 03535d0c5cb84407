"""Who is a peer of whom, and who is a cause rather than a victim, from the job's layout.

In a dp x tp x pp job, ranks in different roles do different work: only the first pipeline stage runs
the data loader, stages hold different layers. So ranks are compared only within their pipeline stage
(``peer_group_rows``), and a host function absent on a rank counts as zero only where ranks of the
same role (stage and tensor slot) run it (``role_codes``): a function only some roles call is never
"absent = zero" for the others.

A slow rank makes the ranks that wait on it look late: its tensor-parallel partners and the other
stages of its model replica wait for it, then arrive late at their own data-parallel collectives
(``explain_victims``). The layout (each record's ``tp_rank``/``pp_rank``/``dp_rank``) says who waits on
whom; where it is unknown (-1), every rank is one peer group and nothing is explained away.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fleetscope.streams.analysis.signals import RankSignal
from fleetscope.streams.analysis.stats import I64

CAUSE_CATEGORIES = ("gpu_slow", "host_slow", "link_slow")
"""Rank findings with evidence on the rank itself; a straggler has none (it only arrives late)."""
VICTIM_WAIT_SHARE = 0.5
"""A straggler that waited in other collectives for at least this share of its lateness was held up."""


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


def absent_as_zero(total: np.ndarray, role: I64) -> np.ndarray:
    """Per-iteration totals (NaN = the function is absent on that rank) with an absence read as zero
    only where another rank of the same role runs the function; elsewhere it stays NaN (not compared)."""
    present = ~np.isnan(total)
    n_roles = int(role.max()) + 1 if role.size else 0
    runs = np.zeros((n_roles, total.shape[1]), dtype=bool)
    np.logical_or.at(runs, role, present)
    return np.where(present, total, np.where(runs[role], 0.0, np.nan))


def explain_victims(signals: list[RankSignal], records: Sequence[dict[str, Any]]) -> list[RankSignal]:
    """Drop late arrivals that a cause explains; the cause's evidence lists them (``delays_ranks``).

    1. A straggler in the model replica (``dp_rank``) of a rank with a cause (slow GPU, host, link) is
       held up by it: through the tensor-parallel collectives and the pipeline's p2p, every rank of the
       replica waits for it, then arrives late at its own data-parallel collective.
    2. Among several stragglers of one replica and no cause, those that waited in their other
       collectives (tensor-parallel, p2p) for at least half their lateness were held up; the one
       that did not wait is the cause (kept). If all waited, the one that waited least is kept.
    Without a layout (``dp_rank`` -1) nothing is dropped: there is no way to tell who waits on whom.
    """
    replica = {int(r["rank"]): _coordinate(r, "dp_rank") for r in records}
    causes: dict[int, RankSignal] = {}
    for s in signals:
        if s.category in CAUSE_CATEGORIES and s.rank >= 0 and replica.get(s.rank, -1) >= 0:
            causes.setdefault(replica[s.rank], s)
    late_by_replica: dict[int, list[RankSignal]] = {}
    for s in signals:
        if s.category == "straggler" and replica.get(s.rank, -1) >= 0:
            late_by_replica.setdefault(replica[s.rank], []).append(s)
    dropped: set[int] = set()
    for rep, late in late_by_replica.items():
        cause = causes.get(rep)
        if cause is not None:
            victims = late
        elif len(late) > 1:
            held = [s for s in late if _waited_ns(s) >= VICTIM_WAIT_SHARE * s.loss_ns]
            free = [s for s in late if s not in held]
            if not free:
                least = min(late, key=_waited_ns)
                held = [s for s in late if s is not least]
                free = [least]
            cause = max(free, key=lambda s: s.loss_ns)
            victims = held
        else:
            continue
        for v in victims:
            if v is not cause:
                cause.evidence.setdefault("delays_ranks", []).append(v.rank)
                dropped.add(id(v))
    return [s for s in signals if id(s) not in dropped]


def _waited_ns(sig: RankSignal) -> float:
    return float(sig.evidence.get("waited_ns", 0.0))
