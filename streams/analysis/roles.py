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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetscope.schemas import Category, FunctionKind
from fleetscope.schemas.categories import CAUSES
from fleetscope.schemas.vocabulary import CPU_WAIT_FUNCTION, GC_PAUSE, LAUNCH_WAIT_FUNCTION
from fleetscope.streams.analysis.signals import RankSignal
from fleetscope.streams.analysis.stages import p2p_ns, staged
from fleetscope.streams.analysis.stats import I64

CAUSE_CATEGORIES = CAUSES
"""Rank findings with evidence on the rank itself; a straggler has none (it only arrives late)."""
MEASURED_WAITS = (CPU_WAIT_FUNCTION, LAUNCH_WAIT_FUNCTION)
"""Host functions that measure a wait (the thread's for a CPU, the GPU's for a launch), not an annotation's
length: no slow collective lengthens them."""
_COLLECTIVE = int(FunctionKind.COLLECTIVE)
PLACEMENT_SLACK = 1.5
"""A replica is late at its data-parallel collectives by about the extra transfer time of its rings that cross
hosts, plus the arrival jitter that time adds: up to this multiple of it is its placement."""
VICTIM_WAIT_SHARE = 0.5
"""A straggler that waited in other collectives for at least this share of its lateness was held up."""


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


LATE_IN_ONE_CALL = "late_in_one_call"
"""A straggler's evidence: its lateness gathered in one call of the step (``outliers._step_lateness``)."""


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


def explain_victims(
    signals: list[RankSignal],
    records: Sequence[dict[str, Any]],
    stages: Sequence[RankSignal] = (),
    links: Sequence[RankSignal] = (),
    placement: Mapping[int, float] | None = None,
) -> list[RankSignal]:
    """Drop the signals of ranks that only wait on a cause; the cause's evidence lists them (``delays_ranks``).

    A rank signal *waited* when the time it waited longer than its peers in its collectives
    (``waited_ns``: tensor-parallel partners, pipeline neighbours) is at least half its loss: its host
    annotations and its late arrivals then come from waiting, not from its own work. A *root* is a rank
    signal that did not wait, or a stage finding. Then:
    1. every straggler of a model replica (``dp_rank``) with a root cause (slow GPU, host, link) is
       held up by it: through the tensor-parallel collectives and the pipeline, every rank of the
       replica waits for it, then arrives late at its own data-parallel collective;
    2. a signal that waited is a victim: of its replica's root, else of the root that shares a
       collective group with it (the same process-group instance; a cause before a straggler), else of
       the job's largest root cause (it waits on the cause through a chain of groups: expert all-to-all,
       then pipeline), else of a slow stage; a host annotation that waited and that nothing explains is
       dropped all the same: it lasted as long as its waits for a partner, which is no work of its rank's
       (the partner, too few to score against its peers, is found against its own history instead);
    2b. a straggler late in one call only (``LATE_IN_ONE_CALL``) is a victim of a root cause that shares
       a collective group with it and lost at least as much: that group ended last, for the cause, and
       the straggler left it late, which no wait per class of collective shows;
    3. without a root cause, a collective group with a slow transfer (``links``: ``score_transfers``)
       holds up the stragglers and waiting ranks of its members' replicas: the group's slower
       collectives make the whole replica late at its data-parallel collectives. Its members' host
       annotations that grew by no more than the link costs are the link too (a host thread throttled
       by a full launch queue lasts as long as its GPU's work, collectives included); the measured
       waits (``MEASURED_WAITS``) are not;
    4. without a root cause, a replica whose rings cross more hosts than their equivalents' (``placement``:
       ``links.placement_costs``, per rank the time its rings lose by it) is late by its layout, not by a
       fault: its stragglers and waiting ranks that lost no more than ``PLACEMENT_SLACK`` times that, and
       its members' host annotations that lost no more than it, are dropped, with no finding to carry them;
    5. among stragglers of one replica that all waited and no root, the one that waited least is kept;
    6. among stragglers of one replica whose root is a straggler, in a pipeline, the one that waited least in
       its send/recv against its stage's ranks is kept (``_pipeline_waits``): a rank that starts its step late
       holds up the stages after it in their recv and the stages before it in their send, so every rank of
       its replica arrives late at its data-parallel collective by as much, while its own late work fills
       the time it would have waited (a dp4 x pp4 job: the late starter 8 ms below its stage's p2p time, the
       ranks it held up 0.6-3.6 ms above, each too little of their p2p time to count as ``waited_ns``).
    Without a layout (``dp_rank`` -1) only a slow stage explains anything: who waits on whom is unknown.
    """
    replica = {int(r["rank"]): _coordinate(r, "dp_rank") for r in records}
    groups = _CollectiveNames(records)

    def rep(s: RankSignal) -> int:
        return replica.get(s.rank, -1) if s.rank >= 0 else -1

    stage = stages[0] if stages else None
    dropped: set[int] = set()

    def blame(victim: RankSignal, cause: RankSignal) -> None:
        if victim is not cause:
            cause.evidence.setdefault("delays_ranks", []).append(victim.rank)
            dropped.add(id(victim))

    def explained(victim: RankSignal, pacer: _Pacer) -> None:
        if pacer.cause is not None:
            blame(victim, pacer.cause)
        else:
            dropped.add(id(victim))

    by_rank, by_replica_pacers = _pacers(links, placement or {}, replica)
    held: dict[int, float] | None = None  # rule 6's waits, read from the records once, where needed
    for s in signals:  # a host annotation that lasts as long as its rank's slower collectives: link or layout
        if s.category != "host_slow" or s.function in MEASURED_WAITS:
            continue
        pacer = next((p for p in by_rank.get(s.rank, ()) if s.loss_ns <= p.cost_ns), None)
        if pacer is not None:
            explained(s, pacer)
    roots: dict[int, RankSignal] = {}
    candidates = [s for s in signals if s.rank >= 0 and not _waited(s) and rep(s) >= 0 and id(s) not in dropped]
    for s in sorted(candidates, key=lambda s: (s.category not in CAUSE_CATEGORIES, -s.loss_ns)):
        if not _late_after_a_cause(s):
            roots.setdefault(rep(s), s)  # a cause first, then the larger loss
    left_late: dict[int, RankSignal] = {}  # rule 2b: a straggler late in one call, by id: its cause
    for s in sorted(candidates, key=lambda s: -s.loss_ns):
        if _late_after_a_cause(s):
            cause = _group_root(s, roots.values(), groups, shared_cause=True)
            if cause is None:
                roots.setdefault(rep(s), s)
            else:
                left_late[id(s)] = cause

    by_replica: dict[int, list[RankSignal]] = {}
    for s in signals:
        if s.rank >= 0:
            by_replica.setdefault(rep(s), []).append(s)
    for r, members in by_replica.items():
        root = roots.get(r) if r >= 0 else None
        caused = root is not None and root.category in CAUSE_CATEGORIES
        for pacer in by_replica_pacers.get(r, ()) if not caused and r >= 0 else ():
            for s in members:
                delayed = s.category == "straggler" or _waited(s)
                if id(s) not in dropped and delayed and s.loss_ns <= pacer.late_ns:
                    explained(s, pacer)
            root = None if root is not None and id(root) in dropped else root
        for s in members:
            if id(s) in dropped:
                continue
            if s is root:
                continue
            if root is not None and (_waited(s) or (s.category == "straggler" and root.category in CAUSE_CATEGORIES)):
                blame(s, root)
            elif _waited(s) and (cause := _group_root(s, roots.values(), groups)) is not None:
                blame(s, cause)
            elif id(s) in left_late:
                blame(s, left_late[id(s)])
            elif _waited(s) and stage is not None and s.rank not in stage.member_ranks():
                blame(s, stage)
            elif _waited(s) and s.category == "host_slow" and s.function not in MEASURED_WAITS:
                dropped.add(id(s))  # an annotation as long as its waits for a partner that nothing names
        late = [s for s in members if s.category == "straggler" and id(s) not in dropped]
        if root is None and r >= 0 and len(late) > 1:
            keep = min(late, key=lambda s: float(s.evidence.get("waited_ns", 0.0)))
            for s in late:
                blame(s, keep)
        elif root is not None and root.category == "straggler" and len(late) > 1:
            held = _pipeline_waits(records) if held is None else held
            if not held:
                continue
            keep = min(late, key=lambda s: held.get(s.rank, np.inf))  # rule 6
            if keep is not root:  # what the root was found to hold up, the one kept holds up
                keep.evidence.setdefault("delays_ranks", []).extend(root.evidence.pop("delays_ranks", []))
            for s in late:
                blame(s, keep)
    return [s for s in signals if id(s) not in dropped]


def _pipeline_waits(records: Sequence[dict[str, Any]]) -> dict[int, float]:
    """Per rank, its time in pipeline send/recv less the median of its stage's ranks (``pp_rank``); empty
    where no stages are known or no rank sent or received. A rank held up by a neighbouring stage waits
    there longer than its stage-mates; the one that holds its replica up waits less (a late start fills
    its bubble with its own work)."""
    stage = np.array([_coordinate(r, "pp_rank") for r in records], dtype=np.int64)
    if not staged(stage.tolist()):
        return {}
    p2p = np.array([p2p_ns(r) for r in records], dtype=np.float64)
    if not p2p.any():
        return {}
    median = {s: float(np.median(p2p[stage == s])) for s in np.unique(stage).tolist()}
    return {int(r["rank"]): float(p2p[i] - median[int(stage[i])]) for i, r in enumerate(records)}


@dataclass(frozen=True)
class _Pacer:
    """What makes ranks late with no fault of theirs: a slow link of their rings (``cause``: the finding that
    lists its victims) or their rings' placement (no cause: no finding carries them). ``cost_ns`` is what it
    costs each of its ranks per step; their replica is late by it by up to ``late_ns``."""

    cause: RankSignal | None
    cost_ns: float
    late_ns: float


def _pacers(
    links: Sequence[RankSignal], placement: Mapping[int, float], replica: Mapping[int, int]
) -> tuple[dict[int, list[_Pacer]], dict[int, list[_Pacer]]]:
    """Per rank and per replica, their pacers: the slow link of their rings first (the largest, which holds
    up every rank of a replica it slows, whatever their loss), then their placement (``PLACEMENT_SLACK``)."""
    by_rank: dict[int, list[_Pacer]] = {}
    by_replica: dict[int, list[_Pacer]] = {}
    for link in sorted(links, key=lambda s: -s.loss_ns):
        pacer = _Pacer(link, link.loss_ns, late_ns=float("inf"))
        for member in link.evidence.get("group_ranks", link.ranks):  # a rank's link: every ring it slows
            by_rank.setdefault(member, [pacer])
            by_replica.setdefault(replica.get(member, -1), [pacer])
    placed: dict[int, float] = {}
    for member, cost in placement.items():
        if cost > 0:
            by_rank.setdefault(member, []).append(_Pacer(None, cost, late_ns=PLACEMENT_SLACK * cost))
            placed[replica.get(member, -1)] = max(placed.get(replica.get(member, -1), 0.0), cost)
    for r, cost in placed.items():
        by_replica.setdefault(r, []).append(_Pacer(None, cost, late_ns=PLACEMENT_SLACK * cost))
    return by_rank, by_replica


def _group_root(
    victim: RankSignal, roots: Iterable[RankSignal], groups: _CollectiveNames, shared_cause: bool = False
) -> RankSignal | None:
    """The root that is a member of one of the victim's collective groups (expert all-to-all,
    tensor-parallel, data-parallel: the same pattern names, process-group instance included), a cause
    before a straggler, else the largest root cause; None without any. ``shared_cause``: a cause that
    shares a group with the victim and lost at least as much as it, or None."""
    others = [r for r in roots if r.rank != victim.rank]
    if shared_cause:
        others = [r for r in others if r.category in CAUSE_CATEGORIES and r.loss_ns >= victim.loss_ns]
    if not others:
        return None
    mine = groups.of(victim.rank)
    shared = [c for c in others if mine & groups.of(c.rank)]
    fallback = [] if shared_cause else [c for c in others if c.category in CAUSE_CATEGORIES]
    picked = shared or fallback
    return max(picked, key=lambda c: (c.category in CAUSE_CATEGORIES, c.loss_ns)) if picked else None


class _CollectiveNames:
    """Each rank's collective pattern names (its process-group instances), read from its record once, when
    first asked: a slow rank can have thousands of victims to place, each asking about a few ranks."""

    def __init__(self, records: Sequence[dict[str, Any]]) -> None:
        self._records = {int(rec["rank"]): rec for rec in records}
        self._names: dict[int, set[str]] = {}

    def of(self, rank: int) -> set[str]:
        names = self._names.get(rank)
        if names is None:
            rec = self._records.get(rank)
            names = self._names[rank] = (
                set()
                if rec is None
                else {f for f, k in zip(rec["function"], rec["kind"], strict=True) if k == _COLLECTIVE}
            )
        return names


def _late_after_a_cause(sig: RankSignal) -> bool:
    """A straggler late in one call only: it may have left the collective before it later than its partners
    (a group it shares with a slow rank ends last), which the waits per class of collective cannot show."""
    return sig.category == "straggler" and bool(sig.evidence.get(LATE_IN_ONE_CALL, False))


def _waited(sig: RankSignal) -> bool:
    return float(sig.evidence.get("waited_ns", 0.0)) >= VICTIM_WAIT_SHARE * max(sig.loss_ns, 1.0)
