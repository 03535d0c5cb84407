"""Blame by what-if: a signal names its subject only where fixing what it points at saves time.

The detectors say what stands out against peers (a kernel, a host function, an arrival, a ring's pace);
the replay (``whatif``) says what each candidate cause costs the iteration. A rank's *credit* is the
largest saving, beyond the top cause, of the causes that cover it: its own work (compute or host, and its
stage's), or its transfers (its rings, its host's NIC). Then:
1. a signal is kept only where its ranks' credit stands out (``stands_out``, the one test of every priced
   category): in this iteration at least ``min_share`` of the budget, and above the job's
   iteration-to-iteration noise now or summed over its last ``window`` iterations. What a rank saved before
   carries none of its signals where it saves nothing now. A rank that only waits for another has no excess
   of its own, saves nothing, and is no culprit, however long it waited; a straggler, whose lateness is all
   its evidence, is one only where its saving at its peers' level is half its lateness
   (``VICTIM_WAIT_SHARE``): the rest it waited, and the rank whose own fix saves the most is the straggler
   instead (``_waited_for``);
2. its ``loss_ns`` becomes its cause's price in this iteration: the replayed saving, fixed alone and no more
   than beyond the top cause (a finding's ``est_loss_ns`` is its mean over the flagged iterations). While
   another cause holds the iteration (a one-off glitch elsewhere), fixing this one saves nothing now,
   whatever it saves beyond it; a stage that holds a glitching rank saves that rank's time alone, not its own;
3. a rank whose stage's fix saves more, on average, than its own belongs to a ``stage_imbalance``: the
   stage is named (from the stage's cause where the stage test named none, where that saves the whole
   budget, as a detector's signal must), not the rank; a stage finding one of whose ranks saves as much is
   that rank's.
A signal the what-if cannot price by a peer claims its own excess (``claims``, ``claims_of``): a rank with no
peer of its role (nothing to bring it to), a ring with no like ring (the same op and bytes in another
process group, ``links.compared_rings``: a flat job's one ring), a rank's link samples
(``links.LINK_SAMPLE_METRICS``), which its rings' pace shows only where like rings set one, and a category
whose evidence is one part of its rank's work (``CategoryInfo.claims_its_excess``: a host function). Its loss
is its excess replayed: what the iteration saves without it, not the excess itself (a slow all-reduce that
the backward overlaps costs only what sticks out of it; an annotation that lasted while its rank waited in a
collective saves nothing), held to the same test. A part of its rank's work (``CLAIMING``) stands out from
the noise of its own savings, not the job's (its excess was judged against its own step-to-step noise
already, and the job's iteration noise is its ranks' whole work varying, which a part of it need not
outgrow); its loss is its lateness (``timelost.bound_by_lateness``), and like a straggler's, where its fix
saves less than half of it (``VICTIM_WAIT_SHARE``), it waited. Its price, where its rank has peers, is its
rank's work brought to theirs, as any rank signal's: the claim spreads its excess over the rank's work in
proportion, where the function's own place in the step (beside the GPU's compute, or not) decides what it
delays. A ring's pace against other rings' is always the what-if's to judge: with no ring moving the same
bytes, there is no pace to bring it to.
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
from fleetscope.streams.analysis.links import LINK_SAMPLE_METRICS, RING_PACE_METRIC, compared_rings
from fleetscope.streams.analysis.replay import CallGraph
from fleetscope.streams.analysis.roles import VICTIM_WAIT_SHARE
from fleetscope.streams.analysis.signals import RankSignal
from fleetscope.streams.analysis.whatif import CLAIMED, Cause, Claim
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
CLAIMING = frozenset(c.value for c, i in REGISTRY.items() if i.claims_its_excess)
"""Categories always judged by their own excess (``CategoryInfo.claims_its_excess``)."""


@dataclass(frozen=True, slots=True)
class Priced:
    """The ranks whose work, and whose transfers, the what-if can bring to a peer's level."""

    work: frozenset[int] = frozenset()
    transfer: frozenset[int] = frozenset()

    def of(self, what: str) -> frozenset[int]:
        return self.work if what == WORK else self.transfer


def priced_ranks(records: Sequence[Mapping[str, Any]], roles: npt.NDArray[np.int64], graph: CallGraph) -> Priced:
    """Work: ranks with another rank of their role. Transfers: ranks in a ring the what-if compares with other
    rings (``links.compared_rings``; ``graph``: the call graph of ``records``, in their order)."""
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
    """(``WORK`` or ``TRANSFER``, ranks) -> what a claim (``claims_of``) saves beyond the top cause (and beyond the
    other claims pacing its rings, ``whatif._pacers``)."""
    price: Mapping[tuple[str, int], float] = field(default_factory=dict)
    """(``WORK`` or ``TRANSFER``, rank) -> the largest price of the causes covering it: the lesser of what
    each saves alone and beyond the top cause."""


def claims(sig: RankSignal, priced: Priced) -> bool:
    """Whether a signal is judged by its own claim (``claims_of``) rather than by a peer's level: its category
    claims its excess (``CLAIMING``; priced by its rank's peers where it has any), its ranks have no peer to
    bring them to, or it is a link's samples (a link the timeline cannot see: its rings' pace may stand out
    from no like ring's while it slows them). A ring's pace is always the peers' to judge."""
    what = CREDITED_BY.get(sig.category)
    if what is None or sig.metric == RING_PACE_METRIC:
        return False
    claimed = sig.category in CLAIMING or sig.metric in LINK_SAMPLE_METRICS
    return claimed or not set(sig.member_ranks()) <= priced.of(what)


def claims_of(signals: Sequence[RankSignal], priced: Priced) -> list[Claim]:
    """The excess each signal priced by its own claim (``claims``) claims (its excess as found, before the
    lateness bound of ``timelost``), one per what and ranks (the largest), for ``whatif.what_if`` to replay."""
    out: dict[tuple[str, tuple[int, ...]], float] = {}
    for sig in signals:
        what = CREDITED_BY.get(sig.category, "")
        ranks = tuple(sorted(sig.member_ranks()))
        if not claims(sig, priced):
            continue
        excess = float(sig.evidence.get("excess_ns", sig.loss_ns))  # before any bound: the replay prices it
        out[(what, ranks)] = max(out.get((what, ranks), 0.0), excess)
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
    _entries: dict[tuple[str, Any], deque[tuple[int, float]]] = field(default_factory=dict)
    _iterations: deque[int] = field(default_factory=deque)

    def observe(self, it: int, credits: Credits) -> None:
        self._iterations.append(it)
        while len(self._iterations) > self.window:
            self._iterations.popleft()
        keyed = [*credits.rank.items(), *((("own", r), v) for r, v in credits.own.items()),
                 *((("stage", s), v[0]) for s, v in credits.stage.items()),
                 *((claim_key(w, ranks), v) for (w, ranks), v in credits.claimed.items())]  # fmt: skip
        for key, value in keyed:
            if value > 0:
                self._entries.setdefault(key, deque(maxlen=self.window)).append((it, value))
        oldest = self._iterations[0]
        for key in [k for k, q in self._entries.items() if q[-1][0] < oldest]:
            del self._entries[key]

    def noise(self, key: tuple[str, Any]) -> float:
        """The credit's own noise over the window's iterations (``iteration_noise_ns``; an iteration without it:
        0)."""
        seen = dict(self._entries.get(key, ()))
        return iteration_noise_ns([seen.get(i, 0.0) for i in self._iterations])

    def mean(self, key: tuple[str, Any]) -> float:
        """The credit's mean over the window's iterations (an iteration without it: 0)."""
        q = self._entries.get(key)
        if not q or not self._iterations:
            return 0.0
        oldest = self._iterations[0]
        return sum(v for i, v in q if i >= oldest) / len(self._iterations)


def iteration_noise_ns(iteration_ns: Sequence[float]) -> float:
    """The job's own iteration-to-iteration noise: the median distance of its iterations' times from their
    median (one-off slow iterations, a glitch or a checkpoint, move it by little; consecutive differences
    would count each twice), 0 with fewer than 3 iterations to take it from."""
    if len(iteration_ns) < 3:
        return 0.0
    times = np.asarray(iteration_ns, dtype=np.float64)
    return float(np.median(np.abs(times - np.median(times))))


def stands_out(saving_ns: float, recent_ns: float, floor_ns: float, noise_ns: float, window: int) -> bool:
    """The one test of every priced category: a cause's saving reaches ``floor_ns`` and stands out from the
    job's own iteration-to-iteration noise (``noise_ns``, one iteration's), in this iteration (``saving_ns``)
    or summed over the ``window`` (``recent_ns`` is its mean: a cause that shows every few iterations, or a
    steady one within one iteration's jitter). Persistence is the finding tracker's: it opens a finding whose
    saving stood out in enough iterations of its window, and closes it after enough without."""
    above_noise = saving_ns >= noise_ns or recent_ns * window >= noise_ns
    return above_noise and saving_ns >= floor_ns


def attribute(
    signals: Sequence[RankSignal],
    credits: Credits,
    history: SavingHistory,
    budget_ns: float,
    priced: Priced,
    config: AttributionConfig | None = None,
    noise_ns: float = 0.0,
    hosts: Mapping[int, str] | None = None,
) -> list[RankSignal]:
    """The signals the what-if bears out (``history`` holds this iteration's ``credits`` already), each
    priced by its replayed saving; stages named for the ranks whose stage explains them; a victim's lateness
    given to the rank it waited for (``_waited_for``). ``noise_ns``: the job's iteration-to-iteration noise
    (``iteration_noise_ns``), which a saving must stand out from; ``hosts``: each rank's host."""
    cfg = config or AttributionConfig()
    floor = cfg.min_share * budget_ns
    stage_of = {r: s for s, (_, ranks) in credits.stage.items() for r in ranks}
    out: list[RankSignal] = []
    named_stages: set[int] = set()
    victims: list[RankSignal] = []
    for sig in signals:
        what = CREDITED_BY.get(sig.category)
        members = sig.member_ranks()
        if what is None:
            out.append(sig)
            continue
        found = _saving(sig, what, credits, history, priced)
        if found is None:  # claimed, not replayed: its own evidence
            out.append(sig)
            continue
        now, recent = found
        by_peers = not claims(sig, priced)  # a claim is its ranks' own excess: no stage explains it
        part = sig.category in CLAIMING  # a part of its rank's work: against its own savings' noise
        noise = history.noise(claim_key(what, members)) if part else noise_ns
        if by_peers and sig.category == Category.STAGE_IMBALANCE:
            stage = int(sig.evidence.get("stage", -1))
            now = credits.stage.get(stage, (0.0, ()))[0]
            recent = history.mean(("stage", stage))
            if max((history.mean(("own", r)) for r in members), default=0.0) >= recent:
                continue  # one of its ranks saves as much: that rank's signal names it
            named_stages.add(stage)
        elif by_peers and what == WORK and sig.rank in stage_of:
            stage = stage_of[sig.rank]
            stage_recent = history.mean(("stage", stage))
            if len(credits.stage[stage][1]) > 1 and stage_recent > max(history.mean(("own", sig.rank)), floor):
                named_stages.add(stage)
                continue
        late = by_peers and sig.category == Category.STRAGGLER  # a claim cuts its lateness from its own work
        waited = late or part  # its loss is its lateness: where its fix saves less than half of it, it waited
        if not stands_out(now, recent, floor, noise, cfg.window) or (waited and now < VICTIM_WAIT_SHARE * sig.loss_ns):
            victims += [sig] if late else []  # its lateness is all its evidence: its own fix saves little of it
            continue
        price = now  # a claim's and a stage's saving is their price; a rank's is its causes' price
        by_rank = by_peers or (part and set(members) <= priced.work)  # a part's price: its rank's work's
        if by_rank and sig.category != Category.STAGE_IMBALANCE:
            price = max(credits.price.get((what, r), 0.0) for r in members)
        out.append(replace(sig, loss_ns=price, evidence={**sig.evidence, "replayed_saving_ns": price}))
    out += _waited_for(victims, out, credits, history, budget_ns, noise_ns, cfg.window, hosts or {})
    stated = {int(s.evidence.get("stage", -1)) for s in out if s.category == Category.STAGE_IMBALANCE}
    for stage in sorted(named_stages - stated):
        saving, ranks = credits.stage.get(stage, (0.0, ()))
        if ranks and stands_out(saving, history.mean(("stage", stage)), budget_ns, noise_ns, cfg.window):
            out.append(stage_signal(stage, ranks, saving))
    return out


def claim_key(what: str, ranks: Sequence[int]) -> tuple[str, tuple[int, ...]]:
    """A claim's entry in the ``SavingHistory``."""
    return f"claim:{what}", tuple(sorted(ranks))


def _saving(
    sig: RankSignal, what: str, credits: Credits, history: SavingHistory, priced: Priced
) -> tuple[float, float] | None:
    """What fixing the signal's subject saves in this iteration, and on average over the window: its claim's
    replayed saving (``claims``; None where it was not replayed), else its ranks' credit."""
    members = sig.member_ranks()
    if claims(sig, priced):
        key = (what, tuple(sorted(members)))
        if key not in credits.claimed:
            return None
        now, recent = credits.claimed[key], history.mean(claim_key(what, members))
        if sig.metric in LINK_SAMPLE_METRICS:  # its rings' pace against like rings' too, where they have any
            now = max(now, max(credits.rank.get((what, r), 0.0) for r in members))
        return now, recent
    now = max(credits.rank.get((what, r), 0.0) for r in members)
    return now, max(history.mean((what, r)) for r in members)


def _waited_for(
    victims: Sequence[RankSignal],
    kept: Sequence[RankSignal],
    credits: Credits,
    history: SavingHistory,
    budget_ns: float,
    noise_ns: float,
    window: int,
    hosts: Mapping[int, str],
) -> list[RankSignal]:
    """The straggler the victims waited for: the rank whose own work saves the most in this iteration (the
    replay's culprit, ``credits.own``), where that saving stands out, reaches the budget (it has no
    detector's evidence of its own: it must save what a detector's signal must), and neither a kept signal
    nor a victim's own names the rank (a victim's own saving was judged, and found to be a wait). A late
    rank's lateness shows on the ranks that wait for it (they arrive late at the next collective); which of
    them caused it is the replay's to say, not the arrival order's."""
    if not victims or not credits.own:
        return []
    rank, saving = max(credits.own.items(), key=lambda kv: (kv[1], -kv[0]))
    named = {r for s in (*kept, *victims) for r in s.member_ranks()}
    if rank in named or not stands_out(saving, history.mean(("own", rank)), budget_ns, noise_ns, window):
        return []
    first = max(victims, key=lambda s: s.loss_ns)
    evidence = {**first.evidence, "replayed_saving_ns": saving, "waited_by": sorted({s.rank for s in victims})}
    return [replace(first, rank=rank, host=hosts.get(rank, ""), loss_ns=saving, evidence=evidence, ranks=(),
                    subject="")]  # fmt: skip


def stage_signal(stage: int, ranks: tuple[int, ...], saving_ns: float) -> RankSignal:
    """A stage's finding from its what-if cause: every rank of the stage computes longer than the stages'."""
    return RankSignal(
        rank=-1, host="", category=Category.STAGE_IMBALANCE.value, function="compute", metric="replayed_saving_ns",
        value=saving_ns, peer_median=0.0, score=1.0, loss_ns=saving_ns,
        evidence={"stage": stage, "stage_ranks": list(ranks), "replayed_saving_ns": saving_ns},
        ranks=tuple(sorted(ranks)), subject=f"stage:{stage}",
    )  # fmt: skip
