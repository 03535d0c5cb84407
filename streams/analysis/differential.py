"""The differential stage for one job: gather each iteration's patterns from all ranks, score, track."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from fleetscope.schemas import Category, FunctionKind, categories
from fleetscope.schemas.vocabulary import ITERATION_LESS_CPU_WAIT, LAUNCH_WAIT_FUNCTION
from fleetscope.streams.analysis.attribution import (
    CREDITED_BY,
    Credits,
    Priced,
    SavingHistory,
    attribute,
    claims_of,
    credits_of,
    iteration_noise_ns,
    priced_ranks,
)
from fleetscope.streams.analysis.findings import FindingTracker
from fleetscope.streams.analysis.hangs import diagnose_hang, stall_threshold_ns, stalled_ns
from fleetscope.streams.analysis.joblevel import HangCheck, ProfilerAftermath, RegressionCheck
from fleetscope.streams.analysis.links import SteadyTransfers
from fleetscope.streams.analysis.noise import JobNoise, NoiseReading, read_noise
from fleetscope.streams.analysis.outliers import OutlierScorer, RankSignal, score_iteration
from fleetscope.streams.analysis.peermatrix import FunctionIndex
from fleetscope.streams.analysis.replay import CallGraph, call_graph
from fleetscope.streams.analysis.roles import role_codes
from fleetscope.streams.analysis.signals import scorer_named
from fleetscope.streams.analysis.stages import runs_kernels
from fleetscope.streams.analysis.timeline import timeline_of
from fleetscope.streams.analysis.whatif import Cause, what_if
from fleetscope.streams.settings import DifferentialConfig

_COLLECTIVE = int(FunctionKind.COLLECTIVE)


class JobDifferential:
    """Collects pattern records per iteration and scores each iteration once, in order."""

    def __init__(self, job: str, config: DifferentialConfig | None = None, scorer: OutlierScorer | None = None):
        self.job = job
        self.config = config or DifferentialConfig()
        self.scorer = scorer
        """Overrides the scorer ``config`` names (experiments); None: the configured one."""
        self.tracker = FindingTracker(job, self.config.lifecycle)
        self._pending: dict[int, dict[int, dict[str, Any]]] = {}
        self._world_size = 0
        self._scored_upto = -(2**62)
        self._gathered_upto = self._scored_upto
        """The last iteration taken to be scored (``gather``); ahead of ``scored_upto`` while scored elsewhere."""
        self._regression = RegressionCheck(self.config.job_level)
        self._aftermath = ProfilerAftermath()
        self._transfers = SteadyTransfers()
        self._hang = HangCheck()
        self._hosts: dict[int, str] = {}
        self._missing_run: dict[int, int] = {}
        self._last_seen_ns: OrderedDict[int, int] = OrderedDict()
        """Per rank, the job's newest event time when a record of the rank last came, oldest first."""
        self._newest_ns = 0
        """The newest event time (end of an iteration, on its rank's clock) of any rank of the job."""
        self._first_seen_ns: int | None = None
        self._last_input_ns: dict[int, int] = {}
        """Per rank, the worker's input clock when a record of the rank last came: it stands still while
        partitions move, so a rank whose partition is changing hands is not silent either."""
        self._first_input_ns: int | None = None
        self._unseen: tuple[int, list[int]] = (-1, [])
        self._cache = ScoringCache()
        self.iterations_scored = 0
        self.late_records = 0
        self.skipped_profiled = 0
        """Iterations profiled on some ranks only: not compared across ranks."""
        self._heartbeats: dict[int, dict[str, Any]] = {}
        """Each rank's latest heartbeat (by its own sequence), for the hang diagnosis."""
        self._stalled: set[int] = set()
        self._hang_checked_ns = 0
        self._hang_reported_step = -2
        self._max_step = -1
        """The latest step any rank's heartbeat reported completed."""
        self._iteration_ns: deque[float] = deque(maxlen=20)
        self._noise = JobNoise(self.config.noise)
        self._savings = SavingHistory(self.config.attribution.window)

    @property
    def scoring_cache(self) -> ScoringCache:
        """What scoring the job's iterations keeps from one to the next (a cache, never part of the state)."""
        return self._cache

    @property
    def scored_upto(self) -> int:
        """The last iteration tracked (``apply``); records for it or earlier are late and ignored."""
        return self._scored_upto

    def __getstate__(self) -> dict[str, Any]:
        """Pickled state leaves out the records still waiting for ranks: a replay of their messages brings them back."""
        state = self.__dict__.copy()
        state["_pending"] = {}
        state["_cache"] = ScoringCache()
        state["_gathered_upto"] = self._scored_upto  # iterations still being scored elsewhere: replayed
        clocks = ("_last_seen_ns", "_first_seen_ns", "_unseen", "_newest_ns", "_last_input_ns", "_first_input_ns")
        for clock_field in clocks:  # rebuilt from replay
            del state[clock_field]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """State records written before the function index existed restore with an empty one."""
        self.__dict__.update(state)
        self.__dict__.pop("_functions", None)  # records of format 3 and before kept the function index
        self.__dict__.setdefault("_cache", ScoringCache())
        self.__dict__.setdefault("_gathered_upto", self._scored_upto)
        self.__dict__.setdefault("_last_seen_ns", OrderedDict())
        self.__dict__.setdefault("_first_seen_ns", None)
        self.__dict__.setdefault("_newest_ns", 0)
        self.__dict__.setdefault("_last_input_ns", {})
        self.__dict__.setdefault("_first_input_ns", None)
        self.__dict__.setdefault("_unseen", (-1, []))
        self.__dict__.setdefault("skipped_profiled", 0)
        self.__dict__.setdefault("_heartbeats", {})
        self.__dict__.setdefault("_stalled", set())
        self.__dict__.setdefault("_hang_checked_ns", 0)
        self.__dict__.setdefault("_hang_reported_step", -2)
        self.__dict__.setdefault("_max_step", -1)
        self.__dict__.setdefault("_iteration_ns", deque(maxlen=20))
        self.__dict__.setdefault("_noise", JobNoise(self.config.noise))
        self.__dict__.setdefault("_savings", SavingHistory())
        self.__dict__.setdefault("_aftermath", ProfilerAftermath())
        self.__dict__.setdefault("_transfers", SteadyTransfers())

    def add(self, record: dict[str, Any], now_ns: int | None = None) -> list[dict[str, Any]]:
        """Take one rank's pattern record; return finding records ready to emit.

        ``now_ns`` (the worker's input clock) marks a live stream, where an iteration a silent rank lacks is
        scored without it; without it (offline) an iteration waits for all its ranks."""
        return self._scored(self.gather(record, now_ns))

    def gather(self, record: dict[str, Any], now_ns: int | None = None) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """Take one rank's pattern record (``add``); yield the iterations it made ready to score, in order, each
        with its records, for ``score`` here or ``score_records`` elsewhere and ``apply`` here. Lazy: an
        iteration not yet yielded stays pending."""
        it = int(record["iteration"])
        if now_ns is not None:
            ended = int(record.get("iteration_start_ns", 0)) + int(record.get("iteration_ns", 0))
            self._newest_ns = max(self._newest_ns, ended)
            self._last_seen_ns[int(record["rank"])] = self._newest_ns
            self._last_seen_ns.move_to_end(int(record["rank"]))
            if self._first_seen_ns is None:
                self._first_seen_ns = self._newest_ns
            self._last_input_ns[int(record["rank"])] = now_ns
            if self._first_input_ns is None:
                self._first_input_ns = now_ns
        if it <= self._gathered_upto:
            self.late_records += 1
            return iter(())
        self._world_size = max(self._world_size, int(record["world_size"]))
        self._pending.setdefault(it, {})[int(record["rank"])] = record
        if "gpu_uuid" in record:
            self.tracker.gpus[int(record["rank"])] = (int(record["local_rank"]), str(record["gpu_uuid"]))
        return self._ready(now_ns)

    def add_heartbeat(self, hb: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one rank's heartbeat; return a hang finding when the job stopped progressing (``hangs``).

        Cheap per heartbeat: the whole job is diagnosed only once every rank is stalled on its own clock,
        or, to find silent ranks, at most once per stall threshold of heartbeat time."""
        rank = int(hb["rank"])
        self._world_size = max(self._world_size, int(hb["world_size"]))
        last = self._heartbeats.get(rank)
        if last is not None and last["producer_id"] == hb["producer_id"] and int(last["seq"]) >= int(hb["seq"]):
            return []  # an older heartbeat read late (a replay)
        self._heartbeats[rank] = hb
        cfg = self.config.job_level
        mean = float(np.mean(self._iteration_ns)) if self._iteration_ns else 0.0
        threshold = stall_threshold_ns(mean, cfg.stall_factor, cfg.hang_min_stall_ms)
        if stalled_ns(hb) >= threshold and not hb.get("profiling", False):
            self._stalled.add(rank)
        else:
            self._stalled.discard(rank)
        step = self._max_step = max(self._max_step, int(hb["last_step"]))
        if step > self._hang_reported_step >= -1:
            self._hang_reported_step = -2  # the job moved on since its hang was reported
        sent = int(hb["sent_ns"])
        due = len(self._stalled) >= self._world_size or (
            self._stalled and sent - self._hang_checked_ns >= threshold / 2
        )
        if not due or self._hang_reported_step != -2:
            return []
        self._hang_checked_ns = sent
        sig = diagnose_hang(self._heartbeats, self._world_size, threshold)
        if sig is None:
            return []
        self._hang_reported_step = step
        return self.tracker.emit_now(sig, max(step, 0))

    def add_stall(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """Take one rank's stall/resume report (producers without heartbeats: simulator, replay); return a
        hang finding when the whole job stopped. Jobs with heartbeats are diagnosed from those instead."""
        if self._heartbeats:
            return []
        self._world_size = max(self._world_size, int(record["world_size"]))
        sig = self._hang.observe(record)
        return self.tracker.emit_now(sig, int(record["last_step"])) if sig else []

    def flush(self) -> list[dict[str, Any]]:
        """Score every pending iteration with the ranks it has, then report open findings' state."""
        return self._scored(self.take_pending()) + self.tracker.flush()

    def end(self) -> list[dict[str, Any]]:
        """The job ended (no input for the stage's ``job_end_ms``): score what is pending, then close every
        open finding with reason ``job_ended``. A job that comes back starts its findings afresh."""
        out = self._scored(self.take_pending())
        out += self.tracker.close_all("job_ended")
        self._heartbeats.clear()
        self._stalled.clear()
        self._hang_reported_step = -2
        self._max_step = -1
        return out

    def open_findings(self) -> int:
        """How many of the job's findings are open now."""
        return self.tracker.open_findings()

    def _complete(self, it: int) -> bool:
        return len(self._pending[it]) >= self._world_size

    def take_pending(self) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """Every pending iteration with the ranks it has, in order (``gather``)."""
        for it in sorted(self._pending):
            yield self._take(it)

    def _ready(self, now_ns: int | None = None) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        wait = self.config.missing_rank_wait_iterations
        while self._pending:
            first = min(self._pending)
            if not self._complete(first):
                later_complete = sum(1 for it in self._pending if it > first and self._complete(it))
                # A rank that never reports again leaves every later iteration incomplete: once it has been
                # silent long enough, score without it (it then becomes a hang) rather than stall the job.
                if later_complete < wait and not self._lacks_only_silent_ranks(first, now_ns):
                    break
            yield self._take(first)

    def _lacks_only_silent_ranks(self, it: int, now_ns: int | None) -> bool:
        """Whether every rank missing from ``it`` sent nothing (or never reported) while its peers advanced the
        timeout in event time (a backlog delays the peers too) and the worker's input clock did too (it stands
        still while partitions move: a rank whose windower partition changes hands is late, not silent).
        Called on every record, so it walks only the ranks that reported longest ago (usually none is silent),
        never the whole world."""
        if now_ns is None or self._first_seen_ns is None or self._first_input_ns is None:
            return False
        timeout = self.config.missing_rank_timeout_ms * 1_000_000
        cutoff, input_cutoff = self._newest_ns - timeout, now_ns - timeout
        present = self._pending[it]
        silent_missing = 0
        for rank, seen in self._last_seen_ns.items():
            if seen > cutoff:
                break
            quiet = self._last_input_ns.get(rank, self._first_input_ns) <= input_cutoff
            silent_missing += rank not in present and quiet and not self._alive(rank, it)
        if len(self._last_seen_ns) < self._world_size and self._first_seen_ns <= cutoff:
            if self._first_input_ns > input_cutoff:
                return False
            if self._unseen[0] != len(self._last_seen_ns):
                unseen = [r for r in range(self._world_size) if r not in self._last_seen_ns]
                self._unseen = (len(self._last_seen_ns), unseen)
            silent_missing += sum(1 for r in self._unseen[1] if r not in present)
        return silent_missing >= self._world_size - len(present)

    def _explained(self, regression: RankSignal) -> bool:
        """job_regression is for slowdowns no peer explains: no other finding of the job is open (a
        slow rank slows the whole job, and opens its own finding sooner than the step test confirms)."""
        return self.tracker.open_findings() > int(self.tracker.is_open(regression.key()))

    def _late_rank_explains(self, regression: RankSignal) -> bool:
        """A rank late at its collectives explains the job's slowdown (``JobNoise.late_explains``) unless the
        work outside collectives stepped too, of the rank that did least (``IterationTimes.work_ns``): then
        every rank's own work grew, and on a shared host the ranks it starved of a CPU arrive late. A late
        rank's peers wait for it inside a collective, so their work outside does not grow."""
        return not regression.evidence.get("work_stepped", False) and self._noise.late_explains(regression.loss_ns)

    def _alive(self, rank: int, it: int) -> bool:
        """The rank's heartbeat says it completed step ``it`` or holds its events back in a profiler window:
        its missing records are late, not a rank that stopped."""
        hb = self._heartbeats.get(rank)
        return hb is not None and (bool(hb.get("profiling", False)) or int(hb["last_step"]) >= it)

    def _take(self, it: int) -> tuple[int, list[dict[str, Any]]]:
        self._gathered_upto = it
        self.iterations_scored += 1
        return it, list(self._pending.pop(it).values())

    def _scored(self, ready: Iterable[tuple[int, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for it, records in ready:
            out += self.score(it, records)
        return out

    def score(self, it: int, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Score one iteration here (``score_records``) and track it (``apply``)."""
        self.skip(it)  # a scoring that fails costs this iteration, not the job's later ones
        scorer = self.scorer or scorer_named(self.config.scorer, self.config.scoring)
        return self.apply(it, score_records(records, self.config, scorer, self._cache))

    def skip(self, it: int) -> None:
        """Iteration ``it`` will not be tracked (its scoring failed): the job's state covers it all the same."""
        self._scored_upto = max(self._scored_upto, it)

    def apply(self, it: int, scored: IterationScore) -> list[dict[str, Any]]:
        """Track one iteration's score (``score_records``): its signals judged against the job's history (the
        steady transfers, the noise, the regression test, the findings open), in iteration order."""
        self.skip(it)
        self.tracker.gpus.update(scored.gpus)
        disturbed = self._aftermath.observe(scored.profiled > 0)
        if disturbed:
            self._noise.forget_arrivals()
        if scored.noise is None:  # profiled on some ranks only: not compared across ranks
            self.skipped_profiled += 1
            return self._missing_ranks(it, scored.hosts)
        signals = self._transfers.keep(scored.signals, it)
        blind: tuple[str, ...] = ()
        if disturbed:  # by a window on every rank, or after one: kernels compare, host times and arrivals not
            blind = categories.PROFILER_BLIND
            signals = [s for s in signals if s.category not in blind]
        else:
            self._noise.apply(scored.noise)
        iteration_ns = scored.iteration_ns
        budget = self.config.scoring.min_loss_fraction * iteration_ns
        signals = self._noise.keep(signals, budget)
        hosts = scored.hosts
        self._hosts.update(hosts)
        persistent: list[RankSignal] = []
        if not disturbed:  # a rank whose host's cores others take: its median wait over 8 iterations
            persistent = self._noise.contended(budget, hosts, {s.rank for s in signals if s.category != "straggler"})
            signals = _late_for_a_cause(signals, persistent) + persistent
        credits = None
        if scored.priced is not None:  # the signals judged from history too: priced by the replay
            credits = credits_of(scored.causes)
            self._savings.observe(it, credits)
            signals = self._judged(signals, credits, budget, scored.priced)
        if not disturbed and not signals and self.tracker.open_findings() == self._judged_late_open():
            # no other rank's finding explains a late one (its victims); a straggler found so before (or a rank
            # late by its launch waits or compute, JobNoise._own_cause) is judged again, so that it stays open
            # while it holds. Ranks compare by function where every rank does the same work, and in their
            # collective pairs in any layout.
            gap = self.config.scoring.min_relative_gap
            persistent = self._noise.stragglers(signals, budget, hosts, set(), gap, same_work=scored.same_work)
            signals += self._judged(persistent, credits, budget, scored.priced)
        self._iteration_ns.append(iteration_ns)
        times = scored.times
        regression = self._regression.observe(
            times.own_ns, it, disturbed=disturbed, paced_ns=times.paced_ns, work_ns=times.work_ns
        )
        if regression is not None and times.cpu_wait_ns >= 0:
            regression = replace(regression, metric=ITERATION_LESS_CPU_WAIT, evidence={
                **regression.evidence, "iteration_ns": iteration_ns, "cpu_wait_ns": times.cpu_wait_ns})  # fmt: skip
        if regression is not None and regression.evidence.get("work_stepped") is False and not scored.runs_kernels:
            regression = None  # a CPU job slower in its waits only (runs_kernels)
        late_open: list[RankSignal] = []
        if regression is not None and (self._explained(regression) or self._late_rank_explains(regression)):
            regression = None  # a peer explains the job's slowdown (its finding, or it arrives that late)
        if regression is not None:
            regression = replace(regression, ranks=tuple(sorted(hosts)))
            if self.tracker.is_open(regression.key()):
                signals.append(regression)
            else:  # the step test is its own persistence: open now, not after 3 more flagged iterations
                late_open = [regression]
        kept = {s.key() for s in persistent}
        persistent = [s for s in signals if s.key() in kept]
        out = self.tracker.observe(it, signals, blind)
        for sig in persistent:  # over 8 iterations (mostly last, or waiting for a CPU) is its own persistence
            if not self.tracker.is_open(sig.key()):
                out += self.tracker.emit_now(sig, it)
        if not self.tracker.peers_explain(it):  # a culprit still about to open explains it too
            for sig in late_open:
                out += self.tracker.emit_now(sig, it)
        return out + self._missing_ranks(it, hosts)

    def _judged(
        self, signals: list[RankSignal], credits: Credits | None, budget_ns: float, priced: Priced | None
    ) -> list[RankSignal]:
        """The signals the replay bears out (``attribution.attribute``), before the stragglers are judged: a
        victim's signal, dropped, leaves the late rank it waited for to be found."""
        if credits is None or priced is None:
            return signals
        noise = iteration_noise_ns(self._iteration_ns)
        return attribute(
            signals, credits, self._savings, budget_ns, priced, self.config.attribution, noise, self._hosts
        )

    def _judged_late_open(self) -> int:
        """Open findings that ``JobNoise.stragglers`` keeps open: stragglers, and the ranks it found late by their
        own launch waits or compute (``JobNoise._own_cause``)."""
        return (
            self.tracker.open_findings(Category.STRAGGLER.value)
            + self.tracker.open_findings(Category.HOST_SLOW.value, LAUNCH_WAIT_FUNCTION)
            + self.tracker.open_findings(Category.GPU_SLOW.value, "compute")
        )

    def _missing_ranks(self, it: int, present: dict[int, str]) -> list[dict[str, Any]]:
        """A rank absent from several scored iterations in a row stopped reporting: a hang of its own.
        ``present``: the host of each rank the iteration has."""
        self._hosts.update(present)
        out: list[dict[str, Any]] = []
        for rank in self._hosts:
            run = 0 if rank in present else self._missing_run.get(rank, 0) + 1
            self._missing_run[rank] = run
            if run == self.config.missing_rank_wait_iterations and not self._alive(rank, it):
                sig = RankSignal(
                    rank=rank, host=self._hosts[rank], category="hang", function="progress",
                    metric="missing_iterations", value=float(run), peer_median=0.0, score=float(run),
                    loss_ns=0.0, subject=f"rank:{rank}", evidence={"missing_since_iteration": it - run + 1},
                )  # fmt: skip
                out += self.tracker.emit_now(sig, it)
        return out


def _late_for_a_cause(signals: list[RankSignal], causes: list[RankSignal]) -> list[RankSignal]:
    """The signals less the straggler ones of the ranks ``causes`` name: a late arrival with a cause
    corroborates it (its lateness joins the cause's evidence), as in ``outliers``."""
    named = {s.rank: s for s in causes}
    out = []
    for sig in signals:
        cause = named.get(sig.rank) if sig.category == "straggler" else None
        if cause is None:
            out.append(sig)
        else:
            cause.evidence["arrival_lateness_ns"] = sig.loss_ns
    return out


class IterationTimes(NamedTuple):
    """An iteration's time as the job-level regression test reads it (``iteration_times``)."""

    own_ns: float
    """The median rank's time less its wait for a CPU (``cpu_wait_ns``)."""
    paced_ns: float
    """The shortest of the ranks' times less their own wait: the time less the longest wait, where the
    ranks' steps are one."""
    work_ns: float | None
    """The least of the ranks' times less their wait and their time in collectives (pipeline send/recv too):
    one rank's own extra work is not in it, its peers' wait for it neither, the whole job's extra work is.
    None where not asked for (only a small job's late rank can explain its slowdown: ``JobNoise``)."""
    cpu_wait_ns: float
    """The median wait; -1 where a rank's wait is unknown (then own and paced are the median time)."""


def iteration_times(records: Sequence[dict[str, Any]], work: bool = True) -> IterationTimes:
    """The iteration's times (``work``: with the work outside collectives, a pass over every record's
    functions). Why less the wait: on a shared host the whole job slows when other processes take the CPU;
    that is no regression of the job, and the step test on its time less the wait does not see it. A
    regression of the job's own work (more compute, slower
    I/O or GPU) adds CPU or blocked time to every rank, which stays in. The paced time as well: a
    synchronous step ends when its latest rank arrives, so the ranks that waited for one starved of a CPU
    hold its wait as blocked time in a collective (a pair of ranks starved together on one core: the median
    rank's time less its own wait grows by half their wait; the paced time, the starved ranks', does not).
    The work outside collectives tells a job whose own work grew from one that waits for a late rank."""
    wall = np.array([r["iteration_ns"] for r in records], dtype=np.float64)
    wait = np.array([r.get("cpu_wait_ns", -1) for r in records], dtype=np.float64)
    known = wait.size > 0 and bool((wait >= 0).all())
    less_wait = wall - np.minimum(wait, wall) if known else wall
    least_work = None
    if work:
        blocked = [float(np.sum(np.asarray(r["total_ns"])[np.asarray(r["kind"]) == _COLLECTIVE])) for r in records]
        least_work = float(np.min(np.maximum(less_wait - np.array(blocked), 0.0)))
    if not known:
        return IterationTimes(float(np.median(wall)), float(np.median(wall)), least_work, -1.0)
    return IterationTimes(float(np.median(less_wait)), float(np.min(less_wait)), least_work, float(np.median(wait)))


_NO_TIMES = IterationTimes(0.0, 0.0, None, -1.0)


@dataclass(frozen=True, slots=True)
class IterationScore:
    """One iteration of a job as ``JobDifferential.apply`` tracks it (``score_records``): what its records
    alone say, apart from the job's history."""

    hosts: dict[int, str]
    """Each rank the iteration has, and its host."""
    gpus: dict[int, tuple[int, str]]
    """Each rank's local rank and GPU UUID, where its record names one."""
    profiled: int
    """How many of its ranks a profiler window ran on."""
    signals: list[RankSignal]
    """The ranks' signals against their peers (``outliers.score_iteration``); none where ``noise`` is None."""
    noise: NoiseReading | None
    """What it tells the noise history; None where the iteration is not compared across ranks (a profiler ran
    on some of its ranks only: it slows the ranks it runs on)."""
    iteration_ns: float = 0.0
    """The median rank's iteration time."""
    same_work: bool = True
    """Whether every rank does the same work (one role: ``roles.role_codes``)."""
    times: IterationTimes = _NO_TIMES
    runs_kernels: bool = False
    """Whether some rank ran a compute kernel (``stages.runs_kernels``)."""
    causes: list[Cause] = field(default_factory=list)
    """What fixing each candidate cause would save, top cause first (``whatif.what_if``)."""
    priced: Priced | None = None
    """What the what-if could price (``attribution.priced_ranks``); None where the iteration was not replayed:
    its records carry no timelines, or its detectors raised nothing the replay prices."""


@dataclass(slots=True)
class ScoringCache:
    """What scoring a job's iterations may keep from one to the next, its results unchanged: the function
    names as the scoring's matrices number them, and the last replayed call graph (``call_graph``'s
    ``like``: a job repeats its calls, so the next one is ordered like it). Never part of the job's state."""

    functions: FunctionIndex = field(default_factory=FunctionIndex)
    graph: CallGraph | None = None


def score_records(
    records: Sequence[dict[str, Any]],
    config: DifferentialConfig,
    scorer: OutlierScorer | None = None,
    cache: ScoringCache | None = None,
) -> IterationScore:
    """Score one iteration's records: a pure function of the records (``cache`` changes no result), so a
    job's iterations can be scored anywhere, in any order, and tracked in order (``JobDifferential.apply``).
    ``scorer``: None, the one ``config`` names."""
    hosts = {int(r["rank"]): str(r["host"]) for r in records}
    gpus = {int(r["rank"]): (int(r["local_rank"]), str(r["gpu_uuid"])) for r in records if "gpu_uuid" in r}
    profiled = sum(1 for r in records if r.get("profiled", False))
    if 0 < profiled < len(records):
        return IterationScore(hosts=hosts, gpus=gpus, profiled=profiled, signals=[], noise=None)
    score = scorer or scorer_named(config.scorer, config.scoring)
    roles = role_codes(records)
    iteration_ns = float(np.median([r["iteration_ns"] for r in records]))
    signals = score_iteration(records, config.scoring, score, cache.functions if cache is not None else None)
    # the replay prices suspicions: an iteration whose detectors raised none has nothing to judge
    suspected = any(s.category in CREDITED_BY for s in signals)
    timelines = []  # each read once, for the call graph: up to the first record without one
    for r in records if suspected and len(records) >= 2 else ():
        if (timeline := timeline_of(r)) is None:
            break
        timelines.append(timeline)
    causes, priced = [], None
    if len(timelines) == len(records):
        by_rank = sorted(range(len(records)), key=lambda i: int(records[i]["rank"]))  # arrival order is no input
        ordered = [records[i] for i in by_rank]
        graph = call_graph(ordered, [timelines[i] for i in by_rank], like=cache.graph if cache is not None else None)
        if cache is not None:
            cache.graph = graph
        priced = priced_ranks(ordered, roles[by_rank], graph)
        causes = what_if(ordered, roles[by_rank], graph, claims=claims_of(signals, priced))
    return IterationScore(
        hosts=hosts,
        gpus=gpus,
        profiled=profiled,
        signals=signals,
        noise=read_noise(records, config.noise, roles),
        iteration_ns=iteration_ns,
        same_work=np.unique(roles).size == 1,
        times=iteration_times(records, work=len(records) <= config.noise.max_ranks),
        runs_kernels=runs_kernels(records),
        causes=causes,
        priced=priced,
    )
