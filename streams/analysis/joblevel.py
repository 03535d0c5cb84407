"""Job-level checks: a job compared with its own history (regression) and with progress (hang).

Nothing stands out among peers when every rank slows down alike or when the whole job stops, so
these checks do not use peers. Regression: a change-point test of the recent iterations' median
against a baseline learnt after warm-up, adaptive to the job's own noise, so that warm-up, noise and
one-off pauses (checkpoints, GC) do not count and a sustained step does. Hang: every
rank has stopped progressing for ``stall_factor`` mean iterations while its clock (hardware samples,
or processing time) moves on; the rank that stopped first is the culprit. Each rank's stall is
measured on its own clock, so clock skew between hosts does not matter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetscope.streams.analysis.signals import RankSignal
from fleetscope.streams.settings import JobLevelConfig


@dataclass(frozen=True, slots=True)
class StepTest:
    """The change-point test of one segment against the baseline before it."""

    baseline_ns: float
    recent_ns: float
    step: float
    """recent / baseline - 1"""
    threshold: float
    noise_ns: float
    above_baseline: int
    """Iterations of the segment slower than every usual baseline iteration."""
    top_ns: float = np.inf
    """The slowest usual baseline iteration (its slowest eighth left out)."""

    def flagged(self, segment: int) -> bool:
        """A regression: the segment's relative step is past the threshold and all its iterations but one
        are slower than every usual baseline iteration (one slow iteration is no regression)."""
        return self.step >= self.threshold and self.above_baseline >= segment - 1

    def suspect(self, segment: int, min_step: float) -> bool:
        """A step the noise may still hide: the baseline must not learn the segment meanwhile."""
        return self.step >= min_step and self.above_baseline >= segment - 1


def step_test(baseline: Sequence[float], recent: Sequence[float], config: JobLevelConfig) -> StepTest:
    """Whether ``recent`` sits one sustained step above ``baseline`` (pure).

    Levels are medians, so one slow iteration (checkpoint, GC pause) in either moves nothing. The step
    must exceed ``regression_threshold`` and ``noise_z`` standard errors of the two medians, the noise
    being the pooled spread around them (a long baseline leaves out its largest eighth of deviations, so
    checkpoints do not blind the test for ``history_iterations``); and all but one of the segment's
    iterations must be slower than the baseline's slowest (that eighth left out), so a few slow
    iterations among fast ones are no step."""
    b_arr, r_arr = np.asarray(baseline, dtype=np.float64), np.asarray(recent, dtype=np.float64)
    b, m = float(np.median(b_arr)), float(np.median(r_arr))
    spikes = b_arr.size // 8  # a long baseline's slowest eighth (checkpoints, GC) is no noise
    dev = np.concatenate([np.sort(np.abs(b_arr - b))[: b_arr.size - spikes], np.abs(r_arr - m)])
    noise = max(float(np.sqrt(np.sum(dev**2) / max(dev.size - 2, 1))), 0.005 * b)
    stderr = noise * float(np.sqrt(1 / b_arr.size + 1 / r_arr.size))
    threshold = max(config.regression_threshold, config.noise_z * stderr / b) if b > 0 else np.inf
    top = float(np.sort(b_arr)[-1 - spikes])
    return StepTest(
        baseline_ns=b, recent_ns=m, step=m / b - 1 if b > 0 else 0.0, threshold=float(threshold),
        noise_ns=noise, above_baseline=int(np.count_nonzero(r_arr > top)), top_ns=top,
    )  # fmt: skip


class ProfilerAftermath:
    """Which iterations a profiler window disturbs: its own, and twice as many as it lasted after it.

    After a window the ranks export its trace and publish the events it held back, and the pipeline digests
    them: the steps run slower by the tool's doing, and unevenly by rank (each rank's export and backlog
    end at their own time). A real healthy 4-rank job on 2 cores: every step 30-250 % slower for 18
    iterations after a 16-iteration window, a false ``job_regression``; and, in a suite run beside other
    load, one rank late at every all-reduce for 8 iterations a dozen steps after one, a false ``straggler``.
    Twice the window's length is a margin over the first measurement, not a law."""

    def __init__(self) -> None:
        self._window = 0
        """Profiled iterations in a row so far (a window in progress)."""
        self._left = 0
        """Iterations of the latest window's aftermath still to come."""

    def observe(self, profiled: bool) -> bool:
        """One scored iteration, in order (profiled on some ranks or all): whether the window disturbs it."""
        if profiled:
            self._window += 1
            return True
        if self._window:
            self._left, self._window = 2 * self._window, 0
        if self._left:
            self._left -= 1
            return True
        return False


class RegressionCheck:
    """The job's iteration time against a baseline learnt after warm-up: a change-point test for a sustained
    step (``step_test``), confirmed on consecutive segments. Iterations a profiler window disturbs
    (``ProfilerAftermath``) are neither baseline nor segment. While a step holds, or may hold
    (``StepTest.suspect``: a slow iteration can hide it for a segment), the baseline is frozen; when the
    job is back to its baseline for a whole segment, the baseline learns again. Where the iterations have a
    paced time too (``observe``), the step must show in it on the same baseline when it is reported.

    A regression is sustained; an excursion that came back is not one (CPU contention on a shared host
    slows the whole job for a few iterations at a time). So a step must outlast the longest excursion the
    job has come back from: each iteration slower than the baseline's usual slowest extends the current
    excursion, the first one back ends it, and confirmation needs that many more segments."""

    def __init__(self, config: JobLevelConfig) -> None:
        self.config = config
        self._seen = 0
        self._recent: deque[float] = deque(maxlen=config.recent_iterations)
        self._baseline: deque[float] = deque(maxlen=config.history_iterations)
        self._recent_paced: deque[float] = deque(maxlen=config.recent_iterations)
        self._baseline_paced: deque[float] = deque(maxlen=config.history_iterations)
        """The same iterations' paced times (``observe``)."""
        self._recent_work: deque[float] = deque(maxlen=config.recent_iterations)
        self._baseline_work: deque[float] = deque(maxlen=config.history_iterations)
        """The same iterations' work outside collectives (``observe``)."""
        self._hits = 0
        self._clear = 0
        self._suspect = False
        self._onset = -1
        self._iterations: deque[int] = deque(maxlen=config.recent_iterations)
        self._excursion = 0
        self.longest_excursion = 0
        """Iterations of the longest run above the baseline that came back without being a regression."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A check saved before excursions were tracked restores with none seen."""
        self.__dict__.update(state)
        for name in ("_excursion", "longest_excursion"):
            self.__dict__.setdefault(name, 0)
        for name in ("_recent", "_baseline"):  # saved before they were kept: paced as the time, work unknown
            series: deque[float] = self.__dict__[name]
            self.__dict__.setdefault(f"{name}_paced", deque(series, maxlen=series.maxlen))
            self.__dict__.setdefault(f"{name}_work", deque([np.nan] * len(series), maxlen=series.maxlen))

    @property
    def active(self) -> bool:
        """A step was confirmed and the job has not been back to its baseline for a whole segment since."""
        return self._hits >= self.config.confirm_iterations + self.longest_excursion

    def observe(
        self,
        iteration_ns: float,
        iteration: int = -1,
        disturbed: bool = False,
        paced_ns: float | None = None,
        work_ns: float | None = None,
    ) -> RankSignal | None:
        """One iteration's time; one a profiler window ``disturbed`` (``ProfilerAftermath``) is skipped.
        ``paced_ns``, where known, is a second measure of the same iteration that a step must show too: the
        job's time less the CPU wait of its most starved rank, which set the pace. ``work_ns``, where known,
        is the work outside collectives of the rank that did least: whether it stepped as well is in the
        signal's evidence (``work_stepped``; absent where some of the iterations tested lack it). Both:
        ``differential.IterationTimes``."""
        cfg = self.config
        if disturbed:
            return None
        self._seen += 1
        if self._seen <= cfg.warmup_iterations:
            return None
        if len(self._recent) == self._recent.maxlen and self._hits == 0 and not self._suspect:
            self._baseline.append(self._recent[0])
            self._baseline_paced.append(self._recent_paced[0])
            self._baseline_work.append(self._recent_work[0])
        self._recent.append(iteration_ns)
        self._recent_paced.append(iteration_ns if paced_ns is None else paced_ns)
        self._recent_work.append(np.nan if work_ns is None else work_ns)
        self._iterations.append(iteration)
        if len(self._recent) < cfg.recent_iterations or len(self._baseline) < cfg.baseline_min_iterations:
            return None
        test = step_test(self._baseline, self._recent, cfg)
        confirmed = self.active
        if iteration_ns > test.top_ns:
            self._excursion += 1
        elif self._excursion:
            if not confirmed:  # it came back without being a regression: later steps must outlast it
                self.longest_excursion = min(max(self.longest_excursion, self._excursion), cfg.history_iterations)
            self._excursion = 0
        self._suspect = test.suspect(cfg.recent_iterations, cfg.regression_threshold)
        if test.flagged(cfg.recent_iterations):
            if self._hits == 0:
                self._onset = self._iterations[0]
            self._hits, self._clear = self._hits + 1, 0
        elif self.active:
            self._clear += 1
            if self._clear >= cfg.recent_iterations:
                self._hits = self._clear = 0
            return None
        else:
            self._hits = 0
            return None
        if not self.active or not step_test(self._baseline_paced, self._recent_paced, cfg).flagged(len(self._recent)):
            return None
        work: dict[str, Any] = {}
        if not (np.isnan(self._recent_work).any() or np.isnan(self._baseline_work).any()):
            test_work = step_test(self._baseline_work, self._recent_work, cfg)
            work = {"work_slowdown": round(test_work.step, 4), "work_stepped": test_work.flagged(len(self._recent))}
        return RankSignal(
            rank=-1, host="", category="job_regression", function="iteration", metric="iteration_ns",
            value=test.recent_ns, peer_median=test.baseline_ns, score=test.step / test.threshold,
            loss_ns=test.recent_ns - test.baseline_ns, subject="job",
            evidence={"baseline_ns": test.baseline_ns, "recent_median_ns": test.recent_ns,
                      "slowdown": round(test.step, 4), "threshold": round(test.threshold, 4),
                      "noise_ns": test.noise_ns, "onset_iteration": self._onset,
                      "baseline_iterations": len(self._baseline), "window_iterations": cfg.recent_iterations,
                      **work},
        )  # fmt: skip


class HangCheck:
    """A hang is every rank stalled at once; blame the one that stopped first (longest stall)."""

    def __init__(self) -> None:
        self._stalls: dict[int, dict[str, Any]] = {}
        self.reported = False

    def observe(self, record: dict[str, Any]) -> RankSignal | None:
        """One stall or resume report; the hang signal the first time every rank is stalled at once, naming
        the rank stalled longest (the others stopped because they wait for it), else None."""
        rank = int(record["rank"])
        if record["stalled"]:
            self._stalls[rank] = record
        else:
            self._stalls.pop(rank, None)
            self.reported = False
        if self.reported or len(self._stalls) < int(record["world_size"]):
            return None
        self.reported = True
        ages = {r: int(s["stalled_ns"]) for r, s in self._stalls.items()}
        culprit = max(ages, key=lambda r: ages[r])
        rec = self._stalls[culprit]
        others = [a for r, a in ages.items() if r != culprit] or [0]
        top = sorted(ages.items(), key=lambda kv: -kv[1])[:5]
        return RankSignal(
            rank=culprit, host=rec["host"], category="hang", function="progress", metric="stalled_ns",
            value=float(ages[culprit]), peer_median=float(np.median(others)),
            score=float(ages[culprit] / max(rec["mean_iteration_ns"], 1.0)),
            loss_ns=float(ages[culprit]), subject=f"rank:{culprit}",
            evidence={"last_step": rec["last_step"], "stalled_ns_by_rank": {str(r): a for r, a in top},
                      "stopped_first_by_ns": float(ages[culprit] - max(others))},
        )  # fmt: skip
