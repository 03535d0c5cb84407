"""Blame by what-if: a signal names its subject only where fixing what it points at saves time.

The detectors say what stands out against peers (a kernel, a host function, an arrival, a ring's pace);
the replay (``whatif``) says what each candidate cause costs the iteration. A rank's *credit* is the
largest saving, beyond the top cause, of the causes that cover it: its own work (compute or host, and its
stage's), or its transfers (its rings, its host's NIC). Then:
1. a signal is kept only where its ranks' credit, in this iteration or on average over the job's last
   ``window`` iterations, is at least ``min_share`` of the budget: a rank that only waits for another has no
   excess of its own, saves nothing, and is no culprit, however long it waited;
2. its ``loss_ns`` becomes its cause's price in this iteration: the replayed saving, fixed alone and no more
   than beyond the top cause (a finding's ``est_loss_ns`` is its mean over the flagged iterations). While
   another cause holds the iteration (a one-off glitch elsewhere), fixing this one saves nothing now,
   whatever it saves beyond it; a stage that holds a glitching rank saves that rank's time alone, not its own;
3. a rank whose stage's fix saves more, on average, than its own belongs to a ``stage_imbalance``: the
   stage is named (from the stage's cause where the stage test named none), not the rank; a stage finding
   one of whose ranks saves as much is that rank's.
A signal the what-if cannot price by a peer passes with its own evidence: a rank with no peer of its role
(nothing to bring it to), a rank's link samples where its rings have no like ring (the same op and bytes in
another process group, ``whatif.compared_rings``: a flat job's one ring). Its loss is its own excess replayed
(``claims_of``): what the iteration saves without it, not the excess itself (a slow all-reduce that the
backward overlaps costs only what sticks out of it). A ring's pace against other rings'
is always the what-if's to judge: with no ring moving the same bytes, there is no pace to bring it to.
Job-level signals (regression, hang) and iterations without timelines pass unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import Category
from fleetscope.schemas.categories import REGISTRY, Credit
from fleetscope.streams.analysis.links import RING_PACE_METRIC
from fleetscope.streams.analysis.replay import CallGraph
from fleetscope.streams.analysis.signals import RankSignal
from fleetscope.streams.analysis.whatif import CLAIMED, Cause, Claim, compared_rings
from fleetscope.streams.settings import AttributionConfig

WORK, TRANSFER = Credit.WORK.value, Credit.TRANSFER.value
CAUSE_KINDS: Mapping[str, tuple[str, ...]] = {
    WORK: ("rank_compute", "rank_host", "stage_compute"),
    TRANSFER: ("rank_transfer", "group_transfer", "host_transfer"),
}
"""The what-if causes that credit a rank, by what they fix: its own work (whichever part of it: a host thread
starved of a CPU launches late, so its GPU's compute shows the gap too; which part grew is the detectors'
evidence), or its transfers."""
CREDITED_BY: Mapping[str, str] = {
    c: i.credited_by.value for c, i in REGISTRY.items() if i.credited_by is not Credit.NONE
}
"""What credits each category's signal (``CategoryInfo.credited_by``); a category not listed is not priced by
the replay (job-level)."""


@dataclass(frozen=True, slots=True)
class Priced:
    """The ranks whose work, and whose transfers, the what-if can bring to a peer's level."""

    work: frozenset[int] = frozenset()
    transfer: frozenset[int] = frozenset()

    def of(self, what: str) -> frozenset[int]:
        return self.work if what == WORK else self.transfer


def priced_ranks(records: Sequence[Mapping[str, Any]], roles: npt.NDArray[np.int64], graph: CallGraph) -> Priced:
    """Work: ranks with another rank of their role. Transfers: ranks in a ring the what-if compares with other
    rings (``whatif.compared_rings``; ``graph``: the call graph of ``records``, in their order)."""
    ranks = [int(r["rank"]) for r in records]
    _, inverse, counts = np.unique(roles, return_inverse=True, return_counts=True)
    work = frozenset(r for r, k in zip(ranks, inverse.reshape(-1).tolist(), strict=True) if counts[k] >= 2)
    rows = np.unique(graph.row[compared_rings(graph)[graph.instance]]).tolist()
    return Priced(work=work, transfer=frozenset(ranks[i] for i in rows))


@dataclass(frozen=True, slots=True)
class Credits:
    """One iteration's credits (``credits_of``)."""

    rank: Mapping[tuple[str, int], float]
    """(``WORK`` or ``TRANSFER``, rank) -> its credit; absent: 0."""
    own: Mapping[int, float]
    """Rank -> the credit of its own work alone (its compute and host, not its stage's)."""
    stage: Mapping[int, tuple[float, tuple[int, ...]]]
    """Stage -> the credit of its compute, and its ranks."""
    claimed: Mapping[tuple[str, tuple[int, ...]], float] = field(default_factory=dict)
    """(``WORK`` or ``TRANSFER``, ranks) -> what a claim (``claims_of``) saves beyond the top cause."""
    price: Mapping[tuple[str, int], float] = field(default_factory=dict)
    """(``WORK`` or ``TRANSFER``, rank) -> the largest price of the causes covering it: the lesser of what
    each saves alone and beyond the top cause."""


def claims_of(signals: Sequence[RankSignal], priced: Priced) -> list[Claim]:
    """The excess each signal the what-if cannot price by a peer claims (its loss), one per what and ranks
    (the largest), for ``whatif.what_if`` to replay."""
    out: dict[tuple[str, tuple[int, ...]], float] = {}
    for sig in signals:
        what = CREDITED_BY.get(sig.category)
        ranks = tuple(sorted(sig.member_ranks()))
        if what is None or sig.metric == RING_PACE_METRIC or set(ranks) <= priced.of(what):
            continue
        out[(what, ranks)] = max(out.get((what, ranks), 0.0), sig.loss_ns)
    return [Claim(Credit(what), ranks, excess) for (what, ranks), excess in out.items()]


def credits_of(causes: Iterable[Cause]) -> Credits:
    """Each rank's credit from one iteration's causes: the largest residual saving of those covering it (and
    the largest price)."""
    rank: dict[tuple[str, int], float] = {}
    price: dict[tuple[str, int], float] = {}
    own: dict[int, float] = {}
    stage: dict[int, tuple[float, tuple[int, ...]]] = {}
    claimed: dict[tuple[str, tuple[int, ...]], float] = {}
    by_claim = {kind: what.value for what, kind in CLAIMED.items()}
    for c in causes:
        if c.kind in by_claim:
            claimed[(by_claim[c.kind], tuple(sorted(c.ranks)))] = c.residual_ns
            continue
        what = WORK if c.kind in CAUSE_KINDS[WORK] else TRANSFER
        for r in c.ranks:
            rank[(what, r)] = max(rank.get((what, r), 0.0), c.residual_ns)
            price[(what, r)] = max(price.get((what, r), 0.0), min(c.saving_ns, c.residual_ns))
            if c.kind in ("rank_compute", "rank_host"):
                own[r] = max(own.get(r, 0.0), c.residual_ns)
        if c.kind == "stage_compute":
            stage[c.stage] = (c.residual_ns, c.ranks)
    return Credits(rank, own, stage, claimed, price)


@dataclass
class SavingHistory:
    """Each rank's (and stage's) credits over the job's last iterations, kept sparse: most ranks save nothing."""

    window: int = 8
    _entries: dict[tuple[str, int], deque[tuple[int, float]]] = field(default_factory=dict)
    _iterations: deque[int] = field(default_factory=deque)

    def observe(self, it: int, credits: Credits) -> None:
        self._iterations.append(it)
        while len(self._iterations) > self.window:
            self._iterations.popleft()
        keyed = [*credits.rank.items(), *((("own", r), v) for r, v in credits.own.items()),
                 *((("stage", s), v[0]) for s, v in credits.stage.items())]  # fmt: skip
        for key, value in keyed:
            if value > 0:
                self._entries.setdefault(key, deque(maxlen=self.window)).append((it, value))
        oldest = self._iterations[0]
        for key in [k for k, q in self._entries.items() if q[-1][0] < oldest]:
            del self._entries[key]

    def mean(self, key: tuple[str, int]) -> float:
        """The credit's mean over the window's iterations (an iteration without it: 0)."""
        q = self._entries.get(key)
        if not q or not self._iterations:
            return 0.0
        oldest = self._iterations[0]
        return sum(v for i, v in q if i >= oldest) / len(self._iterations)


def attribute(
    signals: Sequence[RankSignal],
    credits: Credits,
    history: SavingHistory,
    budget_ns: float,
    priced: Priced,
    config: AttributionConfig | None = None,
) -> list[RankSignal]:
    """The signals the what-if bears out (``history`` holds this iteration's ``credits`` already), each
    priced by its replayed saving; stages named for the ranks whose stage explains them."""
    cfg = config or AttributionConfig()
    floor = cfg.min_share * budget_ns
    stage_of = {r: s for s, (_, ranks) in credits.stage.items() for r in ranks}
    out: list[RankSignal] = []
    named_stages: set[int] = set()
    for sig in signals:
        what = CREDITED_BY.get(sig.category)
        members = sig.member_ranks()
        ring_pace = sig.metric == RING_PACE_METRIC  # the ring against others: what the replay prices, always
        if what is None or not (ring_pace or set(members) <= priced.of(what)):
            claim = credits.claimed.get((what or "", tuple(sorted(members))))
            priced_sig = None if claim is None else replace(sig, loss_ns=claim, evidence={**sig.evidence,
                                                            "replayed_saving_ns": claim})  # fmt: skip
            out.append(priced_sig or sig)
            continue
        now = max(credits.rank.get((what, r), 0.0) for r in members)
        recent = max(history.mean((what, r)) for r in members)
        if sig.category == Category.STAGE_IMBALANCE:
            stage = int(sig.evidence.get("stage", -1))
            now = credits.stage.get(stage, (0.0, ()))[0]
            recent = history.mean(("stage", stage))
            if max((history.mean(("own", r)) for r in members), default=0.0) >= recent:
                continue  # one of its ranks saves as much: that rank's signal names it
            named_stages.add(stage)
        elif what == WORK and sig.rank in stage_of and sig.category != Category.HOST_SLOW:
            stage = stage_of[sig.rank]
            stage_recent = history.mean(("stage", stage))
            if len(credits.stage[stage][1]) > 1 and stage_recent > max(history.mean(("own", sig.rank)), floor):
                named_stages.add(stage)
                continue
        if max(now, recent) < floor:
            continue
        price = now
        if sig.category != Category.STAGE_IMBALANCE:
            price = max(credits.price.get((what, r), 0.0) for r in members)
        out.append(replace(sig, loss_ns=price, evidence={**sig.evidence, "replayed_saving_ns": price}))
    stated = {int(s.evidence.get("stage", -1)) for s in out if s.category == Category.STAGE_IMBALANCE}
    for stage in sorted(named_stages - stated):
        saving, ranks = credits.stage.get(stage, (0.0, ()))
        if ranks and max(saving, history.mean(("stage", stage))) >= floor:
            out.append(stage_signal(stage, ranks, saving))
    return out


def stage_signal(stage: int, ranks: tuple[int, ...], saving_ns: float) -> RankSignal:
    """A stage's finding from its what-if cause: every rank of the stage computes longer than the stages'."""
    return RankSignal(
        rank=-1, host="", category=Category.STAGE_IMBALANCE.value, function="compute", metric="replayed_saving_ns",
        value=saving_ns, peer_median=0.0, score=1.0, loss_ns=saving_ns,
        evidence={"stage": stage, "stage_ranks": list(ranks), "replayed_saving_ns": saving_ns},
        ranks=tuple(sorted(ranks)), subject=f"stage:{stage}",
    )  # fmt: skip
