"""A job's own iteration-to-iteration noise, against which a rank's host or arrival excess must stand out.

Peers' spread in one iteration is a poor yardstick on a few ranks (4 peers give a tiny MAD), and on a
shared host CPU contention hits ranks at random: a few milliseconds more in one rank's data loader this
iteration, another rank's the next. A real fault hits the same rank every iteration (or every few). So a
host_slow or straggler signal is kept only when its rank's excess stands out from the job's own noise:

- the noise of a function is the largest iteration-to-iteration jitter among the rank's peers (robust:
  the median of successive differences, which a step change moves once and a spike twice), so a rank's
  own fault never hides itself, and ranks that are all noisy at random vouch for each other's noise;
- a host signal stands out in this iteration when its excess is ``z`` times that noise and larger than
  any rise a peer showed over the history, and the rank stood out so in two separate runs of iterations
  of the history (an intermittent fault hits its own rank only, and comes back; one burst of contention,
  a rank descheduled for a few iterations in a row, does not); a host or straggler signal stands out
  persistently (the rank's median over its last iterations exceeds its peers' by ``level_z`` times that
  noise: a fault about as large as the noise, on the same rank every time), where that usual excess is at
  least half the signal's, or the function is the rank's alone (a steady excess of microseconds vouches
  for no spike of milliseconds). A single late arrival is no evidence: a rank descheduled for a moment on
  a shared host arrives late by as much as the whole iteration;
- a straggler also stands out when it arrived ``last_z`` times its peers' typical jitter later than their
  median, and than each peer on its own, in all but ``last_misses`` of its last ``level_iterations + 1``
  iterations (and by ``level_z`` times it in their median), or arrived after every peer so steadily that
  its lead, summed (``_leads``), passes an alarm: contention makes a random rank late now and
  then, a slow rank is late nearly every time, also when a descheduled peer arrives later still. Arrival
  order alone is weak evidence on a few ranks (one of 4 ranks is last in 7 of 8 iterations by chance once in
  ~2,600 windows: a false straggler every few hundred steps); the margin makes chance negligible. Such a
  rank is a straggler even where no single iteration's peer comparison flagged it (``stragglers``). Never on
  fewer than 4 ranks.

A gpu_slow signal is judged likewise on its rank's compute kernel time against its pipeline stage's ranks
(``gpu_stands_out``): kept where its excess in this iteration is ``z`` times the largest jitter among them or
its recent median is ``level_z`` times above theirs. Work that varies from step to step (sequences of
varying length) makes a different rank of the stage the slowest each time; a slow GPU is slow every time.

A rank whose run-queue wait (``cpu_wait_ns``: each step's time ready to run with no CPU to run on) is
above every peer's by ``level_z`` times their jitter, and by the step's budget, in the median of its last
``level_iterations + 1`` iterations, is ``host_slow`` on ``CPU_WAIT_FUNCTION`` (``contended``): its host's
cores are taken by others. The margin is taken in each iteration, then its median: when the job's own work
grows, every rank's wait grows with it within an iteration or two, and medians of a window that spans the
change land anywhere between the two levels, above every peer's where no single iteration is. Host self
times leave that wait out where the producer measured it (one descheduling inside a short span is no slow
host), so this is where sustained contention is named; a pair of ranks starved together on one core is
named by neither rule (each one's core mate waits as long).

Only jobs of up to ``max_ranks`` ranks are judged so: with more, the peers' spread in one iteration is
itself a reliable yardstick. The job's first ``warmup_iterations`` raise no such signal (ranks start apart);
until a function has ``min_history`` iterations its noise is unknown: signals are kept as the peers judged
them, host ones only where they cost the step (``keep``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from fleetscope.schemas import Category, FunctionKind
from fleetscope.schemas.categories import Noise, judged_against
from fleetscope.schemas.vocabulary import CPU_WAIT_FUNCTION, LAUNCH_WAIT_FUNCTION
from fleetscope.streams.analysis.patterns import process_group_of
from fleetscope.streams.analysis.roles import VICTIM_WAIT_SHARE, late_by_compute, role_codes
from fleetscope.streams.analysis.signals import RankSignal
from fleetscope.streams.analysis.stages import P2P_PREFIXES
from fleetscope.streams.analysis.stats import F64, quiet_nan_warnings
from fleetscope.streams.settings import NoiseConfig

_PYTHON, _COLLECTIVE, _COMPUTE = int(FunctionKind.PYTHON), int(FunctionKind.COLLECTIVE), int(FunctionKind.COMPUTE)
AGAINST_JOB_NOISE = judged_against(Noise.JOB)
"""Categories judged against the job's noise: the host's own work and the arrival it delays."""
(AGAINST_STAGE_COMPUTE_NOISE,) = judged_against(Noise.STAGE_COMPUTE)
"""Judged against its stage's compute noise once known (``gpu_stands_out``), also in the job's warm-up (a GPU
slow from the start is slow in it): work that varies from step to step (sequences of varying length, a
different rank's batch the longest each time) makes a different rank slowest each time, a slow GPU the
same one."""
_JITTER_PER_MEDIAN_STEP = 1.4826 / np.sqrt(2.0)
"""A Gaussian series' standard deviation per median absolute successive difference."""


class JobNoise:
    """Per function, each rank's recent values (host self time, collective time), and the test above."""

    def __init__(self, config: NoiseConfig | None = None) -> None:
        self.config = config or NoiseConfig()
        self._series: dict[str, deque[RankValues | dict[int, float]]] = {}
        """Per host function and collective, each recorded iteration's value per rank (dicts: a state record
        written before ``RankValues``)."""
        self._host: set[str] = set()
        """Host functions seen so far: zero on every rank in iterations where none ran them."""
        self._lateness: dict[int, float] = {}
        """Per rank, its arrival lateness in the latest recorded iteration (the largest over its collectives)."""
        self._ranks = 0
        self._recorded = 0
        self._held: list[RankSignal] = []
        """Host signals that stood out but did not cost their step: judged again on the next one."""
        self._spikes: tuple[int, dict[int, float]] = (-1, {})
        """``_host_spikes`` as of the recorded iteration it was computed for."""
        self._kernels = False
        """Whether some rank ran a compute kernel (a GPU job) in an iteration recorded so far."""
        self._seen_at: dict[str, deque[int]] = {}
        """Per function, the recorded iterations its ``_series`` entries come from (``_sparse``)."""
        self._latest: deque[dict[int, float]] = deque(maxlen=self.config.min_history)
        """Each rank's arrival lateness (``_lateness``) per recent iteration."""
        self._waits: deque[F64] = deque(maxlen=self.config.history_iterations)
        """Per recent iteration, each rank's run-queue wait (ranks in ``_wait_ranks`` order); only a run of
        iterations where every rank of the same set measured it."""
        self._wait_ranks: tuple[int, ...] = ()
        self._wait_roles: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        """Each rank's role code (``roles.role_codes``): a rank with more host work waits longer for a CPU."""
        self._compute: dict[int, deque[dict[int, float]]] = {}
        """Per pipeline stage (-1: no layout), each rank's compute kernel time per recent iteration: the
        ranks of one stage do the same work, those of different stages do not."""
        self._pairs: dict[str, deque[dict[int, float]]] = {}
        """Per process group of two members (pipeline send/recv aside), each one's time in all its collectives
        per recent iteration: ``_pair_stragglers``. The group, not each collective: a partner that arrives
        late is waited for at whichever of the group's calls comes next (FSDP2's first all-gather of a step,
        or one of its buckets' all-reduces), and the group's other calls show nothing."""
        self._groups: dict[str, deque[dict[int, float]]] = {}
        """The same for groups of three or more members, which say whether a rank late in its pair held up
        its larger groups too (``_held_up_groups``)."""
        self._group_function: dict[str, str] = {}
        """Per process group of ``_pairs``, its collective where a member waited longest in the latest
        iteration: what a straggler's finding names."""
        self._p2p: deque[dict[int, float]] = deque(maxlen=self.config.level_iterations + 1)
        """Each rank's time in pipeline send/recv per recent iteration: a rank held up by the stage before it
        waits there (``_pair_stragglers``)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A job's noise saved before warm-up was counted restores as past it (the job was running)."""
        self.__dict__.update(state)
        self.__dict__.setdefault("_recorded", 1 << 30)
        self.__dict__.setdefault("_waits", deque(maxlen=self.config.history_iterations))
        self.__dict__.setdefault("_wait_ranks", ())
        self.__dict__.setdefault("_wait_roles", np.zeros(0, dtype=np.int64))
        self.__dict__.setdefault("_compute", {})
        if "_group_function" not in self.__dict__:  # pairs kept per collective then: start them afresh
            self.__dict__.update(_pairs={}, _groups={}, _group_function={})
        self.__dict__.setdefault("_p2p", deque(maxlen=self.config.level_iterations + 1))
        self.__dict__.setdefault("_spikes", (-1, {}))
        self.__dict__.setdefault("_kernels", True)  # judged as before
        self.__dict__.setdefault("_seen_at", {})
        if any(not isinstance(lateness, dict) for lateness in self._latest):  # saved as each iteration's largest
            self._latest = deque(maxlen=self.config.min_history)

    def record(self, records: Sequence[dict[str, Any]]) -> None:
        """One scored, unprofiled iteration (``read_noise``, then ``apply``)."""
        self.apply(read_noise(records, self.config))

    def apply(self, reading: NoiseReading) -> None:
        """One scored, unprofiled iteration's reading: host functions absent on a rank that reported count as
        zero there (a GC pause only the culprit has); collectives absent are unknown."""
        absent = RankValues(reading.every_rank, np.zeros(len(reading.ranks)))  # a host function no rank ran
        entries = {name: reading.entries.get(name, absent) for name in self._host}
        for function, entry in reading.entries.items():
            entries.setdefault(function, entry)
        self._host |= reading.host
        small, ranks = reading.small, reading.ranks
        self._ranks = max(self._ranks, len(ranks))
        self._record_waits(ranks, reading.waits, reading.roles)
        self._recorded += 1
        for stage, totals in reading.compute.items():
            self._compute.setdefault(stage, deque(maxlen=self.config.history_iterations)).append(totals)
            self._kernels = self._kernels or any(v > 0 for v in totals.values())
        for function, entry in entries.items():
            if function not in self._series:
                self._series[function] = deque(maxlen=self.config.history_iterations)
            # (a state restored from before ``_seen_at`` has series without it)
            self._seen_at.setdefault(function, deque(maxlen=self.config.history_iterations)).append(self._recorded)
            self._series[function].append(entry)
        self._record_groups(reading.calls)
        if small:
            self._p2p.append(reading.p2p)
        self._lateness = {}
        for function, values in reading.seen.items() if small else ():  # only small jobs are judged by it
            if function in self._host or len(values) < 2 or function.startswith(P2P_PREFIXES):
                continue  # a pipeline group's stages send and receive by their own schedules, not as peers
            arrivals = np.fromiter(values.values(), dtype=np.float64, count=len(values))
            for rank, late in zip(values, (_median_of_others(arrivals) - arrivals).tolist(), strict=True):
                self._lateness[rank] = max(self._lateness.get(rank, -np.inf), late)
        self._latest.append(self._lateness)

    def _record_groups(self, calls: dict[str, dict[int, float]]) -> None:
        """Each process group's members' time in all its collectives (``_pairs``, ``_groups``), and the
        collective of each pair where a member waited longest (``_group_function``)."""
        paired: dict[str, dict[int, float]] = {}
        longest: dict[str, tuple[float, str]] = {}
        for function, times in calls.items():
            group = process_group_of(function) or function
            members = paired.setdefault(group, {})
            for rank, t in times.items():
                members[rank] = members.get(rank, 0.0) + t
            wait = max(times.values()) - min(times.values())
            if wait >= longest.get(group, (-1.0, ""))[0]:
                longest[group] = (wait, function)
        for group, members in paired.items():
            if len(members) >= 2:
                kept = self._pairs if len(members) == 2 else self._groups
                kept.setdefault(group, deque(maxlen=self.config.level_iterations + 1)).append(members)
                self._group_function[group] = longest[group][1]

    def late_explains(self, slowdown_ns: float) -> bool:
        """Whether one rank arrived late at its collectives by half the job's slowdown or more in all but one
        of the latest ``min_history`` iterations (jobs of up to ``max_ranks``): the others waited for it, so
        the slowdown is that rank's (a fault, or contention on its host), not the job's own regression, which
        slows every rank alike. The same rank: a job that shares its cores has a different rank descheduled
        each iteration, and that is no rank's fault."""
        if self._ranks > self.config.max_ranks or len(self._latest) < 2:
            return False
        late: dict[int, int] = {}
        for lateness in self._latest:
            for rank, value in lateness.items():
                late[rank] = late.get(rank, 0) + (value >= 0.5 * slowdown_ns)
        return max(late.values(), default=0) >= len(self._latest) - 1

    def forget_arrivals(self) -> None:
        """A profiler window (on some ranks or all) ends the arrival history: its recording and the trace's
        export afterwards slow the ranks unevenly, so arrivals before and after it do not form one run."""
        for function in [f for f in self._series if f not in self._host]:
            del self._series[function]
            self._seen_at.pop(function, None)
        self._pairs.clear()
        self._groups.clear()
        self._p2p.clear()

    def keep(self, signals: Iterable[RankSignal], budget_ns: float) -> list[RankSignal]:
        """The signals, less host_slow and straggler ones whose excess does not stand out from the noise.

        None in the job's warm-up (``warmup_iterations``). Until the noise is known (a function seen for
        fewer than ``min_history`` iterations), a host excess must at least cost the step: the
        peers must wait for it (the rank's arrival lateness at its collectives bounds the time saved) at
        least ``budget_ns``, in this iteration or the next (host work after a step's collectives delays
        the next step's): one that does not yet is held for one iteration and kept then if it does.
        Where no rank runs a kernel (a CPU job), none is kept before its noise is known: its ranks take
        turns on shared cores, so any rank is late by more than the budget in about every other
        iteration."""
        held, self._held = self._held, []
        out: list[RankSignal] = []
        if self._ranks > self.config.max_ranks:
            return list(signals)
        signals = [sig for sig in signals if sig.category != AGAINST_STAGE_COMPUTE_NOISE or self._gpu_kept(sig)]
        if self._recorded <= self.config.warmup_iterations:
            return [sig for sig in signals if sig.category not in AGAINST_JOB_NOISE or sig.rank < 0]
        for sig in signals:
            if sig.category not in AGAINST_JOB_NOISE or sig.rank < 0:
                out.append(sig)
                continue
            verdict = self.stands_out(sig)
            if verdict is None and not self._kernels:
                continue  # a CPU job's lateness is its ranks' turns on shared cores: no cost to tell before the noise
            if verdict is None and sig.category == "host_slow" and not self._costs(sig, budget_ns):
                self._held.append(sig)
            elif verdict is not False:
                out.append(sig)
        keys = {s.key() for s in out}
        out += [s for s in held if s.key() not in keys and self._costs(s, budget_ns)]
        return out

    def _costs(self, sig: RankSignal, budget_ns: float) -> bool:
        """Whether the host excess, bounded by the rank's latest lateness (none measured: unbounded), is
        at least the budget."""
        excess = float(sig.evidence.get("excess_ns", sig.loss_ns))
        return min(excess, self._lateness.get(sig.rank, np.inf)) >= budget_ns

    def stands_out(self, sig: RankSignal) -> bool | None:
        """Whether the signal stands out from the job's noise; None while that noise is unknown."""
        cfg = self.config
        if sig.category == "straggler" and self._sparse(sig.function):
            return False
        x, col = self._matrix(sig.function, sig.rank, lateness=sig.category == "straggler")
        if x is None:
            return None
        noise, excess = _noise(x, col), sig.value - sig.peer_median
        if sig.category == "host_slow":
            spiked = max((v for r, v in self._host_spikes().items() if r != sig.rank), default=0.0)
            bar = max(cfg.z * noise, spiked)
            # above the others' largest chance spike, a rank's two largest are its own one time in 16 (of 4
            # ranks' alike); three, one in 64
            again = 3 if spiked > cfg.z * noise else 2
            # it comes back as spikes of at least half its size: a steady excess just above the bar is no spike
            if excess >= bar and _episodes(x, col, max(bar, excess / 2)) >= again:
                return True
        with quiet_nan_warnings():
            level = np.nanmedian(x[-cfg.level_iterations :], axis=0)
            usual = level[col] - np.nanmedian(np.delete(level, col))
            if usual >= cfg.level_z * noise and (usual >= excess / 2 or _own(x, col)):
                return True
        return sig.category == "straggler" and self._clearly_late(x, col, sig.rank)

    def _sparse(self, function: str) -> bool:
        """Whether a collective ran in fewer than half of the job's recent iterations (a logging all-reduce
        every 10 steps). Its history then spans a long stretch of the job, and a rank that pauses every few
        steps on a schedule (rank 0 saving a checkpoint every 20) is behind every peer in every other entry,
        as if late each time: a real healthy 4-rank job's checkpointing rank was named a straggler at such
        an all-reduce. A rank slow of its own is late at the collectives every iteration runs too; a
        sparse one's lateness says nothing of the rank's history, only of the iterations it ran in."""
        at = self._seen_at.get(function)
        n = self.config.level_iterations + 1
        return at is not None and len(at) >= n and at[-1] - at[-n] + 1 > 2 * n

    def _host_spikes(self) -> dict[int, float]:
        """Per rank, the largest rise above its own median that any of its host functions showed over the
        history (once per recorded iteration). Contention on a shared host delays whatever function is
        running when the rank is descheduled, so its spikes are as large in any function: a rank's spike in
        one function is held to the other ranks' largest in all of them (a real healthy 4-rank trace with
        the Python stack, 176 functions: 2 or 3 chance spikes of 4 ms in one function on one rank, where the
        other ranks' spikes, in other functions, reached 13 ms)."""
        if self._spikes[0] != self._recorded:
            out: dict[int, float] = {}
            for function in self._host:
                series = self._series.get(function)
                if series is None or len(series) < self.config.min_history:
                    continue
                x, ranks = _as_matrix(series)
                with quiet_nan_warnings():
                    rise = np.nanmax(x - np.nanmedian(x, axis=0), axis=0, initial=0.0)
                for rank, value in zip(ranks, rise.tolist(), strict=True):
                    if value > out.get(rank, 0.0):
                        out[rank] = value
            self._spikes = (self._recorded, out)
        return self._spikes[1]

    def _gpu_kept(self, sig: RankSignal) -> bool:
        """A gpu_slow signal stays unless its rank (a host's: every one of its ranks) is known not to stand out."""
        return any(self.gpu_stands_out(rank) is not False for rank in sig.member_ranks())

    def gpu_stands_out(self, rank: int) -> bool | None:
        """Whether the rank's compute time stands out from its stage's noise: its latest excess over its
        stage peers' median is ``z`` times the largest jitter among them, or its median over its last
        ``level_iterations`` iterations exceeds theirs by ``level_z`` times it. None while the noise is
        unknown (fewer than ``min_history`` iterations, or no stage peer)."""
        cfg = self.config
        for series in self._compute.values():
            if rank in series[-1]:
                break
        else:
            return None
        if len(series) < cfg.min_history:
            return None
        x, ranks = _as_matrix(series)
        if len(ranks) < 2 or rank not in ranks:
            return None
        col = ranks.index(rank)
        noise = _noise(x, col)
        with quiet_nan_warnings():
            latest = x[-1, col] - np.nanmedian(np.delete(x[-1], col))
            level = np.nanmedian(x[-cfg.level_iterations :], axis=0)
            above = level[col] - np.nanmedian(np.delete(level, col))
        return bool(latest >= cfg.z * noise or above >= cfg.level_z * noise)

    def stragglers(
        self,
        signals: Sequence[RankSignal],
        budget_ns: float,
        hosts: dict[int, str],
        named: set[int],
        min_gap: float,
        same_work: bool = True,
    ) -> list[RankSignal]:
        """Straggler signals the single iteration missed: ranks clearly late at a collective (``_clearly_late``)
        and late by ``budget_ns`` (median) over their last ``level_iterations + 1`` iterations, where every
        rank does the same work (``same_work``: no layout roles), and ranks late in every one of their
        collective pairs (``_pair_stragglers``, any layout); none that a signal of this iteration names (a
        cause, or the straggler itself) nor ``named`` (a cause found before); each one as ``_own_cause`` says
        (``min_gap``: ``ScoringConfig.min_relative_gap``)."""
        named = named | {s.rank for s in signals}
        out: list[RankSignal] = []
        if not self._past_warmup():
            return out
        for function, series in self._series.items():
            if not same_work or function in self._host or len(series) < self.config.min_history:
                continue
            if self._sparse(function):
                continue
            x, ranks = _as_matrix(series)
            with quiet_nan_warnings():
                late = np.nanmedian(x, axis=1, keepdims=True) - x
            recent = late[-self.config.level_iterations - 1 :]
            if recent.shape[0] <= self.config.level_iterations:
                continue  # not a whole window since the job started or a profiler window ended
            for col, rank in enumerate(ranks):
                if rank in named or not self._clearly_late(late, col, rank) or np.isnan(late[-1, col]):
                    continue
                lateness = float(np.nanmedian(recent[:, col]))
                if lateness < budget_ns:
                    continue  # late, but at no cost worth a finding
                named.add(rank)
                noise = max(_noise(late, col), 1.0)
                last = int(np.count_nonzero(np.argmax(np.nan_to_num(recent, nan=-np.inf), axis=1) == col))
                found = self._own_cause(RankSignal(
                    rank=rank, host=hosts.get(rank, ""), category="straggler", function=function,
                    metric="arrival_lateness_ns", value=float(late[-1, col]), peer_median=0.0,
                    score=lateness / noise, loss_ns=lateness,
                    evidence={"last_arrivals": last, "iterations": int(recent.shape[0]),
                              "median_lateness_ns": lateness, "noise_ns": noise},
                ), [r for r in ranks if r != rank], min_gap)  # fmt: skip
                out += [found] if found is not None else []
        return out + self._pair_stragglers(budget_ns, hosts, named, min_gap)

    def _pair_stragglers(
        self, budget_ns: float, hosts: dict[int, str], named: set[int], min_gap: float
    ) -> list[RankSignal]:
        """Stragglers of layouts whose collective groups are pairs (dp2 x tp2 x pp2), which no comparison
        within one group can name: of two members, one's lateness is the other's wait.

        Across groups it can: the rank that holds the others up arrives last in every one of its pairs,
        while each partner waits in the pair it shares with it (and is late only where it carries that wait
        on: a tensor-parallel partner held up arrives late at its data-parallel all-reduce, and waited at
        the tensor-parallel one; a next stage held up in its recv is late at its data-parallel all-reduce,
        and level with its tensor partner, held up alike). So a rank's pair lateness, per iteration, is the
        least, over its symmetric pairs (pipeline send/recv left out: the stages' schedules differ), of its
        partner's time in the collective less its own, over all its calls of the iteration: the time the
        partner waited for it (not all of it lost where the calls overlap compute, as data-parallel buckets
        do; the cost below is read on it all the same). A rank with pairs of at least two partners, or with
        one in a pipeline (dp2 x pp: a late stage holds up the stages after it, in their recv, and each of
        them is late in its one pair too) where it did not wait in its send/recv (``_pipeline_wait``; of
        several, the one that waited least, and none that another rank late by half as much waited less than:
        ``_held_up_by``), but not where its run-queue waits are measured (a live job on shared cores: one pair
        does not say whose core was busy; a healthy real pipeline by hand had rank 1, its core mate running,
        12.5 ms late in its pair, 8 of them waiting for a CPU, and with those taken off, another healthy run
        still had rank 0 late by 7.6 ms, 3.1 times the pairs' noise), or with one and a larger group
        (dp3 x tp2), where that group waited for it (``_held_up_groups``), is a straggler when that lateness
        is ``last_z`` times the pairs' noise in all but ``last_misses`` of its last ``level_iterations + 1``
        iterations, and ``level_z`` times it and ``budget_ns`` in their median.
        The noise is the median jitter of the pairs' lateness series: a pair's members take turns at random;
        the ranks that wait on a straggler mirror its lateness, so their own series are no yardstick. Jobs of
        up to ``max_ranks`` ranks (``record`` keeps no pairs for more)."""
        cfg = self.config
        window = cfg.level_iterations + 1
        pairs: dict[int, list[tuple[int, str, F64]]] = {}  # rank: (partner, function, lateness per iteration)
        lags: list[F64] = []
        for group, series in self._pairs.items():
            x, ranks = _as_matrix(series)
            if len(series) < window or len(ranks) != 2 or np.isnan(x).any():
                continue
            a, b = ranks
            lags.append(x[:, 1] - x[:, 0])
            function = self._group_function.get(group, group)
            pairs.setdefault(a, []).append((b, function, lags[-1]))
            pairs.setdefault(b, []).append((a, function, -lags[-1]))
        piped = len(self._p2p) == window and any(self._p2p[-1].values())
        partners = {r: {p for p, _, _ in ps} for r, ps in pairs.items()}
        grouped = {r for series in self._groups.values() for r in series[-1]}
        ranks = [r for r in sorted(pairs) if len(partners[r]) >= 2 or piped or r in grouped]
        if len(ranks) < 4:
            return []
        noise = float(np.median(_jitter(np.column_stack(lags))))
        out: list[RankSignal] = []
        piped_waits: dict[int, float] = {}  # one-partner stragglers: their wait in the pipeline
        piped_late: dict[int, tuple[float, float]] = {}  # every one-partner rank: (lateness, wait in the pipeline)
        for rank in ranks:
            late = np.min([lag for _, _, lag in pairs[rank]], axis=0)
            lateness = float(np.median(late))
            if len(partners[rank]) == 1 and piped:
                piped_late[rank] = (lateness, self._pipeline_wait(rank, *partners[rank]))
            if (
                rank in named
                or np.count_nonzero(late >= cfg.last_z * noise) < window - cfg.last_misses
                or lateness < max(cfg.level_z * noise, budget_ns)
            ):
                continue
            if len(partners[rank]) == 1:
                if rank in self._wait_ranks and self._waits:
                    continue  # its host's scheduler, not its pair, decides who is late: below
                wait = self._pipeline_wait(rank, *partners[rank]) if piped else 0.0
                if not wait < VICTIM_WAIT_SHARE * lateness:  # NaN: it has no send/recv to tell
                    continue
                if self._held_up_groups(rank) < VICTIM_WAIT_SHARE * lateness:
                    continue  # its larger groups (tp3) were late with it: they waited, or their ring was slow
                if piped:
                    piped_waits[rank] = wait
            _, function, _ = max(pairs[rank], key=lambda p: float(np.median(p[2])))
            found = self._own_cause(RankSignal(
                rank=rank, host=hosts.get(rank, ""), category="straggler", function=function,
                metric="arrival_lateness_ns", value=float(late[-1]), peer_median=0.0,
                score=lateness / max(noise, 1.0), loss_ns=lateness,
                evidence={"partners": sorted(partners[rank]), "iterations": window,
                          "median_lateness_ns": lateness, "noise_ns": noise},
            ), sorted(partners[rank]), min_gap)  # fmt: skip
            out += [found] if found is not None else []
        if len(piped_waits) > 1:  # one late stage holds up the others a little too: the one that waited least
            least = min(piped_waits, key=piped_waits.__getitem__)
            out = [s for s in out if s.rank not in piped_waits or s.rank == least]
        return [s for s in out if s.rank not in piped_waits or not _held_up_by(s.rank, piped_late)]

    def _own_cause(self, straggler: RankSignal, others: Sequence[int], min_gap: float) -> RankSignal | None:
        """The straggler, or what it is late by where its own records say (medians of the window, against
        ``others``, its partners or peers): ``host_slow`` on ``LAUNCH_WAIT_FUNCTION`` where its GPU waited for
        its host to launch kernels longer by at least half its lateness (a launch-bound rank, as the peer
        comparison names it where a stage has peers enough; dp2 x pp4 has 2); where its compute took longer
        by that much (``roles.late_by_compute``), ``gpu_slow`` on its compute, or None where that is less than
        ``min_gap`` of its stage's (the slowest healthy GPU). A late starter's GPU work is as dense and as
        fast as its peers'."""
        window = self.config.level_iterations + 1
        launch = _excess(self._series.get(LAUNCH_WAIT_FUNCTION, ()), straggler.rank, others, window)
        if launch is not None and launch[0] >= VICTIM_WAIT_SHARE * straggler.loss_ns:
            return replace(
                straggler, category=Category.HOST_SLOW.value, function=LAUNCH_WAIT_FUNCTION, metric="self_ns",
                value=launch[1] + launch[0], peer_median=launch[1],
                evidence={**straggler.evidence, "launch_wait_above_peers_ns": launch[0]},
            )  # fmt: skip
        stage = next((s for s in self._compute.values() if straggler.rank in s[-1]), ())
        compute = _excess(stage, straggler.rank, [r for r in others if r in stage[-1]] if stage else [], window)
        if compute is None:
            return straggler
        cause = late_by_compute(straggler.loss_ns, compute[0], compute[1], min_gap)
        if cause is None:
            return straggler
        if not cause:
            return None
        return replace(
            straggler, category=cause, function="compute", metric="compute_ns", value=compute[1] + compute[0],
            peer_median=compute[1], evidence={**straggler.evidence, "compute_above_peers_ns": compute[0]},
        )  # fmt: skip

    def _held_up_groups(self, rank: int) -> float:
        """How long a rank's collective groups of three or more members waited for it (median of the window):
        the least, over those groups, of the others' median time in the collective less its own (inf where it
        has none, as in dp2 x pp). A rank late in its one pair because it started late held up its tensor
        partners first; one late with its whole group (which waited for another member, or whose ring crosses
        a slower link between hosts) held up no one there."""
        held = np.inf
        for series in self._groups.values():
            waited = []
            for times in series:
                if rank in times:
                    arrivals = np.fromiter(times.values(), dtype=np.float64, count=len(times))
                    waited.append(float((_median_of_others(arrivals) - arrivals)[list(times).index(rank)]))
            if waited:
                held = min(held, float(np.median(waited)))
        return held

    def _pipeline_wait(self, rank: int, partner: int) -> float:
        """How much longer a rank with one pair partner (dp2 x pp) spent in its pipeline send/recv than that
        partner (median of the window; NaN where either has none). A rank held up by the stage before it
        waits there for as long as it is late in its pair: only one that did not can be the straggler."""
        waited = [it.get(rank, np.nan) - it.get(partner, np.nan) for it in self._p2p]
        return float("nan") if np.isnan(waited).any() else float(np.median(waited))

    def _record_waits(self, ranks: list[int], waits: F64, roles: npt.NDArray[np.int64]) -> None:
        """The iteration's run-queue waits, one array in rank order (no per-rank objects: a job may have
        thousands of ranks); a rank that does not measure it, or another set of ranks, restarts the run."""
        order = np.argsort(ranks, kind="stable")
        waits = waits[order]
        key = tuple(ranks[i] for i in order)
        if key != self._wait_ranks or not waits.size or waits.min() < 0:
            self._waits.clear()
            self._wait_ranks = key
            self._wait_roles = roles[order]  # a rank's role stays while its job runs
        if waits.size and waits.min() >= 0:
            self._waits.append(waits)

    def contended(self, budget_ns: float, hosts: dict[int, str], named: set[int]) -> list[RankSignal]:
        """``host_slow`` signals (``CPU_WAIT_FUNCTION``) for the ranks whose run-queue wait stands above every
        peer's (see the module's docstring; on more than ``max_ranks`` ranks, above their median by
        ``level_z`` times the larger of their median jitter and the MAD of their levels) in the median of
        their last ``level_iterations + 1`` iterations (the median of each iteration's margin), by at least
        ``budget_ns``, that ``named`` does not name. Peers are the ranks of the same role, at least 2 of
        them. One numpy pass per role."""
        cfg = self.config
        if len(self._waits) <= cfg.level_iterations or not self._past_warmup():
            return []
        x = np.stack(self._waits)
        recent = x[-cfg.level_iterations - 1 :]
        level = np.median(recent, axis=0)
        jitter = np.median(np.abs(np.diff(x, axis=0)), axis=0) * _JITTER_PER_MEDIAN_STEP
        out: list[RankSignal] = []
        for role in np.unique(self._wait_roles):
            cols = np.flatnonzero(self._wait_roles == role)
            if cols.size < 3:
                continue
            rows = recent[:, cols]
            if cols.size > cfg.max_ranks:
                median = np.full(cols.size, np.median(level[cols]))
                mad = 1.4826 * float(np.median(np.abs(level[cols] - median[0])))
                noise = np.full(cols.size, max(float(np.median(jitter[cols])), mad))
                above = np.median(rows - np.median(rows, axis=1, keepdims=True), axis=0)
            else:
                median = np.array([np.median(np.delete(level[cols], i)) for i in range(cols.size)])
                noise = _largest_of_others(jitter[cols])
                above = np.median(rows - _largest_of_others(rows), axis=0)
            for i in np.flatnonzero(above >= np.maximum(cfg.level_z * noise, budget_ns)).tolist():
                rank = self._wait_ranks[int(cols[i])]
                if rank in named:
                    continue
                out.append(
                    RankSignal(
                        rank=rank, host=hosts.get(rank, ""), category="host_slow", function=CPU_WAIT_FUNCTION,
                        metric="cpu_wait_ns", value=float(level[cols[i]]), peer_median=float(median[i]),
                        score=float(above[i]) / max(float(noise[i]), 1.0),
                        loss_ns=float(level[cols[i]] - median[i]),
                        evidence={"iterations": cfg.level_iterations + 1, "above_peers_ns": float(above[i]),
                                  "noise_ns": float(noise[i])},
                    )
                )  # fmt: skip
        return out

    def _past_warmup(self) -> bool:
        """Whether none of the series' latest ``level_iterations + 1`` iterations is of the job's warm-up."""
        return self._recorded - self.config.warmup_iterations > self.config.level_iterations

    def _clearly_late(self, late: F64, col: int, rank: int = -1) -> bool:
        """Whether rank ``col`` arrived ``last_z`` times the noise (its peers' typical jitter) later than its
        peers' median in all but ``last_misses`` of the last ``level_iterations + 1`` rows of its lateness
        history ``late`` (iterations x ranks), every one of them complete, and by ``level_z`` times that
        noise in the median of those rows; and later by the same margin than each peer, on its own, in as
        many rows.

        Later than each peer, not the latest of all: under heavy contention some peer, a different one each
        time, is descheduled for a moment and arrives later still in one iteration of three or four, and a
        slow rank required to be the latest was named up to 13 iterations late (a real 4-rank job in the
        full suite; simulated: 35-57, against 35-37 now). Each peer on its own still arrives before it
        nearly every time. By the margin against each peer, not merely later: a peer as late as the rank
        passes the margin over the peers' median too (each one's peers' median is an early rank's). 4 ranks
        on 2 cores pair up per core, and the pair on the busier core arrives late together for a dozen
        iterations, one of them a few ms the later 7 times in 8 (two healthy real 4-rank jobs: false
        stragglers at iterations 90 and 212; and one job's first iterations). A rank slow of its own is
        late by the margin beyond its core mate too, which its extra work slows a little as well (the
        recorded 3x-forward jobs: named at 35-38, as before but one, 35 to 36).

        Only on 4 ranks or more: one rank's lateness is the other's earliness on 2, so no statistic of the
        pair says which one is the cause (a healthy 2-rank job on one H100 took turns being last for long
        stretches: 8 such stragglers in 700 steps), and the median of 2 peers is as weak on 3 (chance
        alone then passes once in ~25,000 windows; on 4 ranks once in ~100,000)."""
        window = late[-self.config.level_iterations - 1 :]
        if late.shape[1] < 4 or window.shape[0] <= self.config.level_iterations or np.isnan(window).any():
            return False
        cfg = self.config
        noise = _noise(late, col, among=np.nanmedian)
        peers = np.delete(window, col, axis=1)
        if _leads(window[:, col] - peers.max(axis=1), noise, cfg) or self._late_throughout(late, col, rank):
            return True
        excess = window[:, col] - np.median(peers, axis=1)
        need, margin = window.shape[0] - cfg.last_misses, cfg.last_z * noise
        if np.count_nonzero(excess >= margin) < need:
            return False
        if np.median(excess) < cfg.level_z * noise:
            return False  # late by far, typically
        return bool((np.count_nonzero(window[:, [col]] - peers >= margin, axis=0) >= need).all())

    def _late_throughout(self, late: F64, col: int, rank: int) -> bool:
        """Whether rank ``col`` arrived after each peer, on its own, in all but ``sign_misses`` of the last
        ``sign_iterations`` rows of its lateness history ``late``, all complete: a sign test, which asks
        nothing of the noise's size.

        Why beside the margins: where the ranks' work varies from step to step (sequences of varying length,
        gradient accumulation over them), a different rank is last each time, the peers' jitter is as large
        as a fault that costs a third of the step, and no margin in units of it is passed; a rank sleeping
        20 ms a step in a real 4-rank job of 60 ms steps was named by nothing (now 13-14 iterations after its
        fault, two runs). Such a rank is behind each peer nearly every time all the same. Healthy ranks take
        turns: of 4 alike, one behind each of 3 peers in 11 of 12 iterations by chance is about one window
        in 16,000 (independent turns); pairs starved together on one core are behind each other half the
        time. Real turns are not independent: at 14 of 16, a healthy recorded job had a false straggler; at
        11 of 12, in 22 healthy real jobs (DDP, FSDP2, HSDP, DTensor, varying work) one window passed, in
        one job, and for want of a CPU (below).

        Not where the rank waited for a CPU, above its peers, for half its lateness or more (``rank``, its
        run-queue waits, where measured): other processes on its cores (a real varying-work job beside CPU
        burners, 60 % of its steps waiting for a CPU, had one rank behind each peer 11 times in 12 for it).
        That is its host's contention, which ``contended`` judges, not its own work."""
        rows = late[-self.config.sign_iterations :]
        if rows.shape[0] < self.config.sign_iterations or np.isnan(rows).any():
            return False
        peers = np.delete(rows, col, axis=1)
        behind = np.count_nonzero(rows[:, [col]] > peers, axis=0)
        if (behind < rows.shape[0] - self.config.sign_misses).any():
            return False
        lateness = float(np.median(rows[:, col] - np.median(peers, axis=1)))
        wait = float(np.median(self._cpu_waits_above_peers(rank, self.config.sign_iterations)))
        return wait < VICTIM_WAIT_SHARE * lateness

    def _cpu_waits_above_peers(self, rank: int, iterations: int) -> F64:
        """The rank's run-queue wait above its peers' median in each of its last ``iterations`` (zeros where
        not measured in all of them)."""
        if rank not in self._wait_ranks or len(self._waits) < iterations:
            return np.zeros(iterations)
        waits = np.array(list(self._waits)[-iterations:])
        col = self._wait_ranks.index(rank)
        above: F64 = waits[:, col] - np.median(np.delete(waits, col, axis=1), axis=1)
        return above

    def _matrix(self, function: str, rank: int, lateness: bool) -> tuple[F64 | None, int]:
        """The function's recent values (iterations x ranks; lateness for a collective) and the rank's column."""
        series = self._series.get(function)
        if series is None or len(series) < self.config.min_history:
            return None, -1
        x, ranks = _as_matrix(series)
        if rank not in ranks:
            return None, -1
        if lateness:  # how much less than its peers' median the rank waited
            with quiet_nan_warnings():
                x = np.nanmedian(x, axis=1, keepdims=True) - x
        return x, ranks.index(rank)


def _held_up_by(rank: int, piped: dict[int, tuple[float, float]]) -> bool:
    """Whether another rank of one pair partner, late in its pair by half ``rank``'s lateness or more, waited
    less in its pipeline send/recv than ``rank`` did (``piped``: each such rank's lateness and wait): the late
    replica's ranks are all late in their pairs, and the one that waited least holds up the others, whether or
    not its own lateness passed every test this iteration. A real dp2 x pp2 job's stage-0 rank computing 4x
    made its next stage's rank, which waited for it in its receives, the one named (twice in three runs)."""
    lateness, wait = piped[rank]
    return any(
        other != rank and late >= VICTIM_WAIT_SHARE * lateness and waited < wait
        for other, (late, waited) in piped.items()
    )


def _leads(lead: F64, noise: float, cfg: NoiseConfig) -> bool:
    """Whether a rank's lead over its latest peer (``lead``, per iteration; negative where a peer was later)
    adds up to a sequential alarm (``lead_allowance``, ``lead_cap``, ``lead_alarm``): Page's CUSUM.

    Why beside the count by the margin: 4 ranks on 2 cores take turns on the CPU, and the peers' jitter
    that the margin is measured in grows with it, so a slow rank late behind every peer in each iteration,
    but short of twice that jitter in 3 of 8, was named 11 iterations after its fault (a recorded 3x-forward
    job); the sum names it once its lead has added up, within 6 (tests/data/real_jobs). On 20 recorded
    healthy real jobs no rank's sum passed 4 (two iterations behind every peer by the cap), against 13-16
    for the 3x-forward ranks; a burst of three stays below the alarm; pairs starved together lead nobody
    (each one's core mate is as late)."""
    total = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):  # no jitter at all: any lead counts in full
        steps = np.minimum(lead / noise, cfg.lead_cap) - cfg.lead_allowance
    for step in steps:
        total = max(0.0, total + float(step))
        if total >= cfg.lead_alarm:
            return True
    return False


def _excess(
    series: Iterable[RankValues | dict[int, float]], rank: int, others: Sequence[int], window: int
) -> tuple[float, float] | None:
    """A rank's value above ``others``' median, and that median, each the median over the latest ``window``
    iterations of ``series`` (per iteration, each rank's value; one absent counts as zero); None without
    either."""
    latest = [RankValues.of(it) for it in list(series)[-window:]]
    if not latest or not others:
        return None
    own = float(np.median([it.values_of([rank])[0] for it in latest]))
    peers = float(np.median([np.median(it.values_of(others)) for it in latest]))
    return own - peers, peers


def _largest_of_others(values: F64) -> F64:
    """Per element, the largest of the other elements of its row (the last axis; at least 2)."""
    top = np.sort(values, axis=-1)[..., -2:]
    out: F64 = np.repeat(top[..., 1:], values.shape[-1], axis=-1)
    np.put_along_axis(out, np.argmax(values, axis=-1)[..., None], top[..., :1], axis=-1)
    return out


def _median_of_others(values: F64) -> F64:
    """Per element, the median of the other elements (at least 2): what the others waited for it, also in a
    pair, where the median of both would halve it. A small job's ranks: n x (n - 1) values, sorted."""
    n = values.size
    rest = np.sort(np.broadcast_to(values, (n, n))[~np.eye(n, dtype=bool)].reshape(n, n - 1), axis=1)
    middle = (n - 1) // 2
    median: F64 = rest[:, middle] if n % 2 == 0 else (rest[:, middle - 1] + rest[:, middle]) / 2.0
    return median


@dataclass(frozen=True, slots=True)
class NoiseReading:
    """What one iteration's records tell the job's noise history (``read_noise``): the pass over every
    record's functions, apart from the history, so it can run where the iteration is scored."""

    small: bool
    """Whether the job is small enough to be judged against its noise (``NoiseConfig.max_ranks``)."""
    ranks: list[int]
    """The records' ranks, in their order."""
    every_rank: npt.NDArray[np.int64]
    """The ranks ascending: one array for the entries that have every rank."""
    entries: dict[str, RankValues]
    """Per host function (its self time; 0 on a rank that did not run it) and collective (its mean time),
    the ranks' values; first seen first."""
    seen: dict[str, dict[int, float]]
    """The same as dicts, for small jobs' arrivals (empty for others)."""
    host: set[str]
    """The functions of ``entries`` that are host functions."""
    calls: dict[str, dict[int, float]]
    """Per collective but pipeline send/recv, each rank's time in it (small jobs)."""
    p2p: dict[int, float]
    """Each rank's time in pipeline send/recv (small jobs)."""
    compute: dict[int, dict[int, float]]
    """Per pipeline stage, each rank's compute kernel time (small jobs)."""
    waits: F64
    """Each record's run-queue wait (-1: not measured)."""
    roles: npt.NDArray[np.int64]
    """Each record's role code (``roles.role_codes``)."""


def read_noise(
    records: Sequence[dict[str, Any]], config: NoiseConfig, roles: npt.NDArray[np.int64] | None = None
) -> NoiseReading:
    """The iteration's reading for ``JobNoise.apply``; ``roles``: the records' role codes, if known already."""
    seen: dict[str, dict[int, float]] = {}
    host: set[str] = set()
    calls: dict[str, dict[int, float]] = {}  # per collective: each rank's time in it
    p2p: dict[int, float] = {}
    compute: dict[int, dict[int, float]] = {}
    small = len(records) <= config.max_ranks  # only those jobs are judged against their noise
    for rec in records:
        kinds = np.asarray(rec["kind"])
        if small:
            totals = compute.setdefault(int(rec.get("pp_rank", -1)), {})
            totals[int(rec["rank"])] = float(np.sum(np.asarray(rec["total_ns"])[kinds == _COMPUTE]))
        wanted = np.flatnonzero((kinds == _PYTHON) | (kinds == _COLLECTIVE))
        if not wanted.size:
            continue
        rank, functions = int(rec["rank"]), rec["function"]
        own = rec.get("self_ns")
        if own is None or len(own) != len(functions):  # a producer that predates self times
            own = rec["total_ns"]
        # each column's values picked in one numpy step: no per-entry indexing of the record's columns
        is_host_l = (kinds[wanted] == _PYTHON).tolist()
        own_l = np.asarray(own, dtype=np.float64)[wanted].tolist()
        mean_l = np.asarray(rec["mean_ns"], dtype=np.float64)[wanted].tolist()
        total_l = np.asarray(rec["total_ns"], dtype=np.float64)[wanted].tolist() if small else mean_l
        rows = zip(wanted.tolist(), is_host_l, own_l, mean_l, total_l, strict=True)
        for j, is_host, own_ns, mean_ns, total_ns in rows:
            name = functions[j]
            if is_host:
                host.add(name)
                seen.setdefault(name, {})[rank] = own_ns
            else:
                seen.setdefault(name, {})[rank] = mean_ns
                if small and name.startswith(P2P_PREFIXES):
                    p2p[rank] = p2p.get(rank, 0.0) + total_ns
                elif small:
                    calls.setdefault(name, {})[rank] = total_ns
    waits = np.array([r.get("cpu_wait_ns", -1) for r in records], dtype=np.float64)
    ranks = [int(r["rank"]) for r in records]
    order = np.argsort(ranks, kind="stable")
    every_rank = np.asarray(ranks, dtype=np.int64)[order]
    entries: dict[str, RankValues] = {}
    for function, values in seen.items():
        if function in host:
            entry = RankValues(every_rank, np.array([values.get(r, 0.0) for r in ranks], dtype=np.float64)[order])
        elif len(values) == len(ranks) and list(values) == ranks:  # every rank: the iteration's ranks array
            entry = RankValues(every_rank, np.fromiter(values.values(), np.float64, len(values))[order])
        else:
            entry = RankValues.of(values)
        entries[function] = entry
    return NoiseReading(
        small=small, ranks=ranks, every_rank=every_rank, entries=entries, seen=seen if small else {}, host=host,
        calls=calls, p2p=p2p, compute=compute, waits=waits, roles=role_codes(records) if roles is None else roles,
    )  # fmt: skip


class RankValues:
    """One iteration's value of one function on each rank: ranks ascending and their values, two arrays. What
    a job's noise history keeps per function and iteration: a dict of them cost about 100 bytes a rank,
    1.2 GB for a 10k-rank job with 50 host functions and collectives over 24 iterations, and a state record
    as large; here 8 bytes a rank (the ranks' array is one for all of an iteration's host functions)."""

    __slots__ = ("ranks", "values")

    def __init__(self, ranks: npt.NDArray[np.int64], values: F64) -> None:
        self.ranks = ranks
        self.values = values

    @classmethod
    def of(cls, values: RankValues | dict[int, float]) -> RankValues:
        """The values as ``RankValues`` (a dict by rank is converted; ``RankValues`` pass as they are)."""
        if isinstance(values, RankValues):
            return values
        ranks = np.fromiter(values.keys(), dtype=np.int64, count=len(values))
        order = np.argsort(ranks, kind="stable")
        return cls(ranks[order], np.fromiter(values.values(), dtype=np.float64, count=len(values))[order])

    def values_of(self, ranks: Sequence[int], absent: float = 0.0) -> F64:
        """The values of ``ranks``, in their order; ``absent`` for a rank without one."""
        wanted = np.asarray(ranks, dtype=np.int64)
        if not self.ranks.size:
            return np.full(wanted.size, absent)
        at = np.minimum(np.searchsorted(self.ranks, wanted), self.ranks.size - 1)
        return np.where(self.ranks[at] == wanted, self.values[at], absent)


def _as_matrix(series: Iterable[RankValues | dict[int, float]]) -> tuple[F64, list[int]]:
    """The series as a matrix (iterations x ranks, ranks ascending; NaN where a rank has no value) and its ranks."""
    rows = [RankValues.of(values) for values in series]
    if not rows:
        return np.zeros((0, 0)), []
    first = rows[0].ranks
    if all(r.ranks is first or np.array_equal(r.ranks, first) for r in rows):
        return np.stack([r.values for r in rows]), first.tolist()
    ranks = np.unique(np.concatenate([r.ranks for r in rows]))
    x = np.full((len(rows), ranks.size), np.nan)
    for i, r in enumerate(rows):
        x[i, np.searchsorted(ranks, r.ranks)] = r.values
    return x, ranks.tolist()


def _own(x: F64, col: int) -> bool:
    """Whether only rank ``col`` ran the function in ``x`` (iterations x ranks; the peers' values all 0 or
    absent): all its time there is its own work, no chance spike on work its peers do too."""
    return not np.nansum(np.abs(np.delete(x, col, axis=1)))


def _episodes(x: F64, col: int, bar: float) -> int:
    """How many separate runs of iterations rank ``col`` spent ``bar`` or more above its peers' median in
    ``x`` (iterations x ranks): an intermittent fault comes back, one burst of contention on a shared host
    does not (a fault that stays is the persistent rule's)."""
    with quiet_nan_warnings():
        excess = x[:, col] - np.nanmedian(np.delete(x, col, axis=1), axis=1)
    spike = np.concatenate(([False], excess >= bar))
    return int(np.count_nonzero(spike[1:] & ~spike[:-1]))


def _noise(x: F64, col: int, among: Callable[[F64], Any] = np.nanmax) -> float:
    """The largest (or, with ``among``, another statistic of the) robust jitter among the other columns
    (ranks) of ``x`` (iterations x ranks)."""
    with quiet_nan_warnings():
        peers = np.delete(_jitter(x), col)
        top = float(among(peers)) if peers.size else np.nan
    return top if np.isfinite(top) else float("inf")


def _jitter(x: F64) -> F64:
    """Each column's robust iteration-to-iteration jitter (x: iterations x series), as a standard deviation."""
    with quiet_nan_warnings():
        jitter: F64 = np.nanmedian(np.abs(np.diff(x, axis=0)), axis=0) * _JITTER_PER_MEDIAN_STEP
    return jitter
