"""Run-to-run diff: what changed per iteration between two runs of a job, by rank role, against each run's noise.

A run is seen through two tables (the store computes them in SQL, ``StepTable`` from pattern records):

- ``RoleIterations``: per role (pipeline stage, tensor slot) and iteration, how many ranks reported and
  their mean iteration time;
- ``FunctionMoments``: per role and function, over a window of iterations, the sum and the sum of squares
  of the time *one rank of the role* spent in the function per iteration (the role's total divided by its
  ranks that iteration), and its calls. An iteration of the window in which the role ran but not the
  function counts as zero: absence is zero only within one role.

Algorithm (``diff_runs``):

1. Each run's steady window (``steady_window``): drop its first ``warmup_iterations``, then the leading
   iterations whose job iteration time lies outside the run's steady band (median +- ``warmup_band`` x
   sigma, sigma = 1.4826 MAD): a warm-up is slower or faster than what follows, never the same.
2. Per series, the mean per iteration over the window (time per iteration, what a step costs) and its
   standard error from the iteration-to-iteration variance (Welch): runs of different lengths compare.
3. A change is listed iff it stands out of both runs' noise, ``|b - a| > z x sqrt(se_a^2 + se_b^2)``, and
   is big enough to matter: at least ``min_relative`` of the larger mean and ``min_share`` of run A's
   iteration time. A run against itself, or against a rerun of the same job, lists nothing.
4. Changes are ranked by ``|b - a|``, the time per iteration gained or lost, largest first.

Assumptions: iterations of one run are exchangeable (no trend inside the window); roles are the layout's
coordinates (-1: unknown), the same in both runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from fleetscope.schemas.fields import as_float, as_int, as_list
from fleetscope.schemas.records import FunctionKind
from fleetscope.streams.analysis.stats import MAD_TO_SIGMA

F64 = npt.NDArray[np.float64]
Role = tuple[int, int]
"""(pp_rank, tp_rank): the pipeline stage and tensor slot; -1 where the dimension is unknown."""


def kind_name(kind: int) -> str:
    """A pattern's ``FunctionKind`` number as the store's ``kind_name`` column writes it."""
    try:
        return FunctionKind(kind).name.lower()
    except ValueError:
        return "unknown"


@dataclass(frozen=True, kw_only=True)
class DiffConfig:
    """How a change must stand out to be listed (see the module's algorithm)."""

    warmup_iterations: int = 0
    """Iterations always dropped at each run's start (a live job's first steps compile and warm caches)."""
    warmup_band: float = 5.0
    """Leading iterations further than this many sigmas from the run's median are its warm-up."""
    z: float = 4.0
    """A change must exceed this many standard errors of the difference of the two means."""
    min_relative: float = 0.05
    """... and this share of the function's larger time per iteration (reruns differ by a percent or two)."""
    min_share: float = 0.002
    """... and this share of run A's iteration time (a microsecond kernel that doubled costs nothing)."""
    iteration_min_relative: float = 0.01
    """The iteration time's own floor: a 1 % slower step is worth the top line."""
    min_iterations: int = 3
    """A run with fewer steady iterations has no noise to judge against."""

    def __post_init__(self) -> None:
        problems = [
            f"{name} must be >= 0, got {getattr(self, name)!r}"
            for name in ("warmup_iterations", "warmup_band", "z", "min_relative", "min_share", "iteration_min_relative")
            if not getattr(self, name) >= 0
        ]
        if self.min_iterations < 2:
            problems.append(f"min_iterations must be >= 2, got {self.min_iterations!r}")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True, slots=True)
class RoleIterations:
    """One role in one iteration: ``ranks`` reported, with a mean iteration time of ``iteration_ns``."""

    role: Role
    iteration: int
    ranks: int
    iteration_ns: float


@dataclass(frozen=True, slots=True)
class FunctionMoments:
    """One role's function over a window: ``present`` iterations had it; ``sum_ns``/``sum_sq_ns`` of the
    per-rank time per iteration; ``calls``: per-rank calls summed over the window."""

    role: Role
    function: str
    kind: str
    present: int
    sum_ns: float
    sum_sq_ns: float
    calls: float


@dataclass(frozen=True, kw_only=True)
class RunSteps:
    """One run as the diff reads it: its steady window and the functions' moments over it."""

    name: str
    first_iteration: int
    last_iteration: int
    iteration_ns: F64
    """The job's iteration time (mean over its ranks) of every iteration of the window, in order."""
    role_iterations: Mapping[Role, int]
    """Iterations of the window each role ran (the denominators of its functions' means)."""
    functions: Sequence[FunctionMoments]
    skipped_warmup: int = 0


@dataclass(frozen=True, slots=True)
class Change:
    """A series' time per iteration in run A and run B; ``significant``: it passed the listing rule."""

    role: Role
    function: str
    kind: str
    a_ns: float
    b_ns: float
    noise_ns: float
    """Standard error of ``b_ns - a_ns`` from both runs' iteration-to-iteration variance."""
    a_calls: float
    b_calls: float
    significant: bool

    @property
    def delta_ns(self) -> float:
        """B's time less A's."""
        return self.b_ns - self.a_ns

    @property
    def relative(self) -> float:
        """``b / a - 1``; infinite for a function new in B."""
        return self.b_ns / self.a_ns - 1.0 if self.a_ns > 0 else math.inf

    def as_dict(self) -> dict[str, object]:
        return {
            "pp_rank": self.role[0],
            "tp_rank": self.role[1],
            "function": self.function,
            "kind": self.kind,
            "a_ns": round(self.a_ns, 1),
            "b_ns": round(self.b_ns, 1),
            "delta_ns": round(self.delta_ns, 1),
            "relative": round(self.relative, 4) if math.isfinite(self.relative) else None,
            "noise_ns": round(self.noise_ns, 1),
            "a_calls": round(self.a_calls, 2),
            "b_calls": round(self.b_calls, 2),
        }


@dataclass(frozen=True, kw_only=True)
class RunDiff:
    """The iteration time's change on top, then the listed changes, largest first."""

    a: RunSteps
    b: RunSteps
    iteration: Change
    changes: list[Change] = field(default_factory=list)
    unmatched_roles: list[tuple[str, Role]] = field(default_factory=list)
    """("a" or "b", role) of each role only one run has steady iterations of: the layouts differ there, and
    its functions are not compared."""

    def as_dict(self) -> dict[str, object]:
        def run(r: RunSteps) -> dict[str, object]:
            return {
                "name": r.name,
                "iterations": [r.first_iteration, r.last_iteration],
                "steady_iterations": int(r.iteration_ns.size),
                "skipped_warmup": r.skipped_warmup,
                "roles": len(r.role_iterations),
            }

        it = self.iteration
        top = {k: v for k, v in it.as_dict().items() if k not in ("pp_rank", "tp_rank", "function", "kind")}
        top.pop("a_calls"), top.pop("b_calls")
        return {
            "a": run(self.a),
            "b": run(self.b),
            "iteration": {**top, "significant": it.significant},
            "changes": [c.as_dict() for c in self.changes],
            "unmatched_roles": [{"run": run, "pp_rank": r[0], "tp_rank": r[1]} for run, r in self.unmatched_roles],
        }


def steady_window(iteration_ns: Sequence[float] | F64, config: DiffConfig) -> int:
    """Step 1: the index of the run's first steady iteration (the iterations before it are its warm-up),
    given its iteration times in order. At most half of the run is ever called warm-up."""
    x = np.asarray(iteration_ns, dtype=np.float64)
    n = x.size
    skip = min(config.warmup_iterations, n)
    rest = x[skip:]
    if rest.size == 0:
        return skip
    median = float(np.median(rest))
    sigma = MAD_TO_SIGMA * float(np.median(np.abs(rest - median)))
    band = max(config.warmup_band * sigma, 1e-9 * abs(median))
    limit = skip + rest.size // 2
    first = skip
    while first < limit and abs(x[first] - median) > band:
        first += 1
    return first


def job_iterations(rows: Iterable[RoleIterations]) -> tuple[list[int], F64, dict[Role, list[int]]]:
    """(iterations in order, the job's iteration time of each: mean over all its ranks, the iterations
    each role ran)."""
    weight: dict[int, float] = {}
    total: dict[int, float] = {}
    per_role: dict[Role, list[int]] = {}
    for r in rows:
        weight[r.iteration] = weight.get(r.iteration, 0.0) + r.ranks
        total[r.iteration] = total.get(r.iteration, 0.0) + r.ranks * r.iteration_ns
        per_role.setdefault(r.role, []).append(r.iteration)
    its = sorted(i for i in weight if weight[i] > 0)
    return its, np.array([total[i] / weight[i] for i in its], dtype=np.float64), per_role


def _mean_se(sum_x: float, sum_sq: float, n: int) -> tuple[float, float]:
    """Mean and standard error of the mean of ``n`` values given their sum and sum of squares."""
    mean = sum_x / n
    var = max(sum_sq - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
    return mean, math.sqrt(var / n)


def _judge(a: tuple[float, float], b: tuple[float, float], floor_ns: float, relative: float, z: float) -> bool:
    """Step 3: the difference stands out of the noise and passes both floors."""
    delta = abs(b[0] - a[0])
    noise = math.hypot(a[1], b[1])
    return delta > z * noise and delta >= relative * max(abs(a[0]), abs(b[0])) and delta >= floor_ns and delta > 0


def diff_runs(a: RunSteps, b: RunSteps, config: DiffConfig | None = None) -> RunDiff:
    """Steps 2-4 of the algorithm over two runs' steady windows."""
    cfg = config or DiffConfig()
    for run in (a, b):
        if run.iteration_ns.size < cfg.min_iterations:
            raise ValueError(
                f"run {run.name!r} has {run.iteration_ns.size} steady iteration(s); the diff needs at least "
                f"{cfg.min_iterations} to know its noise"
            )
    ia = _mean_se(float(a.iteration_ns.sum()), float(np.square(a.iteration_ns).sum()), a.iteration_ns.size)
    ib = _mean_se(float(b.iteration_ns.sum()), float(np.square(b.iteration_ns).sum()), b.iteration_ns.size)
    top = Change((-1, -1), "iteration", "iteration", ia[0], ib[0], math.hypot(ia[1], ib[1]), 1.0, 1.0,
                 _judge(ia, ib, 0.0, cfg.iteration_min_relative, cfg.z))  # fmt: skip
    floor_ns = cfg.min_share * ia[0]
    fa = {(m.role, m.function): m for m in a.functions}
    fb = {(m.role, m.function): m for m in b.functions}
    changes: list[Change] = []
    for key in fa.keys() | fb.keys():
        role = key[0]
        na, nb = a.role_iterations.get(role, 0), b.role_iterations.get(role, 0)
        if na < cfg.min_iterations or nb < cfg.min_iterations:
            continue  # a role only one run has is a different layout, not a change of a function
        ma, mb = fa.get(key), fb.get(key)
        sa = _mean_se(ma.sum_ns, ma.sum_sq_ns, na) if ma else (0.0, 0.0)
        sb = _mean_se(mb.sum_ns, mb.sum_sq_ns, nb) if mb else (0.0, 0.0)
        if not _judge(sa, sb, floor_ns, cfg.min_relative, cfg.z):
            continue
        kind = next(m.kind for m in (mb, ma) if m is not None)
        changes.append(Change(role, key[1], kind, sa[0], sb[0], math.hypot(sa[1], sb[1]),
                              ma.calls / na if ma else 0.0, mb.calls / nb if mb else 0.0, True))  # fmt: skip
    changes.sort(key=lambda c: (-abs(c.delta_ns), c.role, c.function))
    steady_a = {r for r, n in a.role_iterations.items() if n >= cfg.min_iterations}
    steady_b = {r for r, n in b.role_iterations.items() if n >= cfg.min_iterations}
    unmatched = [("a", r) for r in sorted(steady_a - steady_b)] + [("b", r) for r in sorted(steady_b - steady_a)]
    return RunDiff(a=a, b=b, iteration=top, changes=changes, unmatched_roles=unmatched)


class StepTable:
    """One run's pattern records folded into per-(role, function, iteration) sums, compactly: what the
    store's two diff reads compute in SQL, for runs read from trace folders or the simulator."""

    def __init__(self) -> None:
        self._ranks: dict[tuple[Role, int], list[float]] = {}
        """(role, iteration) -> [ranks, sum of their iteration times]"""
        self._time: dict[tuple[Role, str, int], list[float]] = {}
        """(role, function, iteration) -> [total ns, calls] over the role's ranks"""
        self._kinds: dict[str, str] = {}
        self._seen: set[tuple[int, int]] = set()

    def add(self, record: Mapping[str, object]) -> None:
        """One rank's pattern record of one iteration; a second record of the same rank and iteration
        (a replay) adds nothing, as the store keeps one per natural key, and one recorded under a profiler
        window is left out (profiling slows what it watches), as the store's reads leave it out."""
        key = (as_int(record["rank"]), as_int(record["iteration"]))
        if key in self._seen or record.get("profiled", False):
            return
        self._seen.add(key)
        role: Role = (as_int(record.get("pp_rank", -1)), as_int(record.get("tp_rank", -1)))
        it = key[1]
        cell = self._ranks.setdefault((role, it), [0.0, 0.0])
        cell[0] += 1
        cell[1] += as_float(record["iteration_ns"])
        columns = (as_list(record[name]) for name in ("function", "kind", "total_ns", "calls"))
        for function, kind, total, calls in zip(*columns, strict=True):
            t = self._time.setdefault((role, str(function), it), [0.0, 0.0])
            t[0] += as_float(total)
            t[1] += as_float(calls)
            self._kinds.setdefault(str(function), kind_name(as_int(kind)))

    def role_iterations(self) -> list[RoleIterations]:
        """Per role and iteration, in order: how many of its ranks reported, and their mean time."""
        return [RoleIterations(role, it, int(n), total / n) for (role, it), (n, total) in sorted(self._ranks.items())]

    def moments(self, first_iteration: int, last_iteration: int) -> list[FunctionMoments]:
        """Per role and function, the moments (count, sum, sum of squares, calls) of its per-rank time over
        the iterations from ``first_iteration`` to ``last_iteration`` (both included)."""
        out: dict[tuple[Role, str], list[float]] = {}
        for (role, function, it), (total, calls) in self._time.items():
            if not first_iteration <= it <= last_iteration:
                continue
            n = self._ranks[(role, it)][0]
            v = total / n
            m = out.setdefault((role, function), [0.0, 0.0, 0.0, 0.0])
            m[0] += 1
            m[1] += v
            m[2] += v * v
            m[3] += calls / n
        kinds = self._kinds
        return [FunctionMoments(r, f, kinds[f], int(m[0]), m[1], m[2], m[3]) for (r, f), m in sorted(out.items())]


def run_steps(
    name: str,
    rows: Sequence[RoleIterations],
    moments: Callable[[int, int], Iterable[FunctionMoments]],
    config: DiffConfig | None = None,
) -> RunSteps:
    """A run's ``RunSteps``: its steady window from ``rows``, then ``moments(first, last)`` (the store's
    read or ``StepTable.moments``) over it."""
    cfg = config or DiffConfig()
    its, job_ns, per_role = job_iterations(rows)
    if not its:
        raise ValueError(f"run {name!r} has no iterations")
    start = steady_window(job_ns, cfg)
    first, last = its[start], its[-1]
    role_its = {role: sum(first <= i <= last for i in rs) for role, rs in per_role.items()}
    return RunSteps(
        name=name,
        first_iteration=first,
        last_iteration=last,
        iteration_ns=job_ns[start:],
        role_iterations=role_its,
        functions=list(moments(first, last)),
        skipped_warmup=start,
    )
