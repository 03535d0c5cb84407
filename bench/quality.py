"""Detection quality on a suite of simulated faults, through the same code the stream worker runs.

    python bench/quality.py [--quick] [--workers N] [--json FILE]

Each scenario is a simulated job (fault kind x rank x magnitude x layout x size, plus healthy runs
with realistic noise as negative controls) analysed by ``OfflinePipeline`` (the worker's windower
and differential, without Kafka). ``tg:`` scenarios are Kineto traces of dp x tp x pp, ZeRO and
mixture-of-experts jobs from the independent trace generator (``producers.tracegen``: its own
timing model, host clock skew), analysed by ``fleetscope analyze`` with the layout read from the
traces' process-group metadata, never given. A finding matches an injected fault when their ranks overlap
(host and stage findings cover several ranks); it is a true positive for precision whatever its
category, and category accuracy counts the matches whose category is the expected one. Detection
delay = the iteration at which the finding opened minus the fault's onset.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace

from fleetscope.config import load_config
from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.producers.tracegen import TraceJob, write_traces
from fleetscope.streams.offline import OfflinePipeline
from fleetscope.traces_cli import analyze_traces


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # fault kind, "healthy" or "double"
    ranks: int
    iterations: int
    faults: tuple[str, ...] = ()
    tp: int = 1
    pp: int = 1
    seed: int = 0
    noise: bool = True
    clock_skew_ms: float = 3.0
    magnitude: float = 0.0
    flush_interval_ms: float = 0.0

    def config(self) -> SimulatorConfig:
        extra: dict[str, object] = {}
        if self.noise:  # one-off slow iterations in ~10 % of the job's iterations, checkpoints in 2 %
            extra = {"glitch_rate": min(0.1 / self.ranks, 0.005), "pause_rate": 0.02}
        return SimulatorConfig(
            job=self.name, ranks=self.ranks, iterations=self.iterations, seed=self.seed, tp=self.tp, pp=self.pp,
            faults=tuple(parse_fault(f) for f in self.faults), clock_skew_ms=self.clock_skew_ms,
            layers=8 if self.ranks >= 256 else 12, flush_interval_ms=self.flush_interval_ms, **extra,
        )  # fmt: skip


@dataclass(frozen=True)
class TraceScenario:
    """A job of the independent trace generator, written as Kineto files and analysed from them."""

    name: str
    kind: str  # "tg:<fault>" or "healthy"
    job: TraceJob
    magnitude: float = 0.0

    @property
    def ranks(self) -> int:
        return self.job.world_size

    @property
    def iterations(self) -> int:
        return self.job.steps


@dataclass(frozen=True)
class Expected:
    category: str
    ranks: tuple[int, ...]
    onset: int
    costs: bool = True
    """False for a fault that costs the job nothing (its healthy twin steps as fast): no culprit to name, so
    not expected for recall; a finding on its ranks is not false either."""


TRACE_MAGNITUDES = {
    "slow_stage": 1.25,
    "slow_worker": 2.35,
    "a2a_imbalance": 2.0,
    "host_bound": 1.6,
    "slow_link": 3.0,
    "late_start": 1.15,
}
TRACE_LAYOUTS: tuple[dict[str, object], ...] = (
    {"dp": 4, "pp": 4},
    {"dp": 4, "pp": 4, "names": "mesh"},
    {"dp": 2, "tp": 2, "pp": 4, "names": "none"},
    {"dp": 4, "tp": 2, "pp": 2},
    {"dp": 8, "zero": True},
    {"dp": 8, "ep": 4},
    {"dp": 4, "tp": 2, "pp": 2, "order": ("tp", "pp", "dp")},
    {"dp": 1, "pp": 8},
    {"dp": 2, "pp": 4, "names": "none"},
    {"dp": 8, "tp": 2, "pp": 2},
    {"dp": 8, "ep": 2, "names": "mesh"},
    {"dp": 4, "tp": 2, "pp": 2, "ep": 2},
    {"dp": 4, "pp": 2},  # each stage's data-parallel ring has one equivalent
    {"dp": 3, "tp": 2},  # a tensor pair and a ring of 3 per rank
    {"dp": 2, "tp": 3, "pp": 2, "layers": 8},  # a data-parallel pair and a tensor group of 3 per rank
)


def trace_suite(quick: bool = False) -> list[TraceScenario]:
    """Generated traces: every layout healthy and with one slow worker (a rank in the middle of it), one
    launch-bound rank and one slow link, the pipelined ones with a slow last stage, the expert one with an
    imbalanced all-to-all, and (where a stage has more than one rank) a first-stage rank that starts every
    step late. Launch-bound, slow-link and late-start jobs draw seeds of their own (the others keep theirs)."""
    out: list[TraceScenario] = []
    seed = 100
    for i, layout in enumerate(TRACE_LAYOUTS if not quick else TRACE_LAYOUTS[::2]):
        world = layout["dp"] * layout.get("tp", 1) * layout.get("pp", 1)
        faults = [("healthy", 0), ("slow_worker", (5 * i + 3) % world)]
        if layout.get("pp", 1) > 1:
            faults.append(("slow_stage", 0))
        if layout.get("ep", 1) > 1:
            faults.append(("a2a_imbalance", (3 * i + 2) % world))
        own_seeds = {"host_bound": 300 + i, "slow_link": 400 + i, "late_start": 500 + i}
        faults += [("host_bound", (7 * i + 1) % world), ("slow_link", (3 * i + 1) % world)]
        if layout["dp"] * layout.get("tp", 1) > 1:  # a first-stage rank with peers (a later stage's hides in bubbles)
            faults.append(
                ("late_start", TraceJob(**layout).rank_of(i % layout.get("tp", 1), 0, (i + 1) % layout["dp"]))
            )
        for fault, rank in faults:
            seed += fault not in own_seeds
            job = TraceJob(**layout, fault=fault, fault_rank=rank, seed=own_seeds.get(fault, seed))
            shape = "x".join(f"{d}{layout.get(d, 1)}" for d in ("dp", "tp", "pp", "ep")) + ("-zero" if job.zero else "")
            shape += "" if job.order == ("tp", "dp", "pp") else "-" + "".join(job.order)
            name = f"tg-{fault}-{shape}-{job.names}" + (f"-r{rank}" if rank else "")
            kind = "healthy" if fault == "healthy" else f"tg:{fault}"
            out.append(TraceScenario(name, kind, job, TRACE_MAGNITUDES.get(fault, 0.0)))
    return out


RANK_FAULTS = ("slow_gpu", "slow_link", "pcie_downgrade", "host_slow", "dataloader_stall", "cpu_contention")


def suite(quick: bool = False) -> list[Scenario]:
    """The scenario list: every fault kind across ranks, magnitudes, layouts and sizes."""
    s: list[Scenario] = []
    seed = 0

    def add(
        kind: str, ranks: int, faults: tuple[str, ...], iterations: int = 16, mag: float = 0.0, **kw: object
    ) -> None:
        nonlocal seed
        seed += 1
        spec = "+".join(faults).replace("/", "every").replace(":", "_") or "none"
        name = f"{kind}-{ranks}r-{kw.get('tp', 1)}t{kw.get('pp', 1)}p-{spec}"
        s.append(Scenario(name, kind, ranks, iterations, faults, seed=seed, magnitude=mag, **kw))

    for kind in RANK_FAULTS:
        add(kind, 16, (f"{kind}:5:1.5",), mag=1.5)
        add(kind, 32, (f"{kind}:30:1.3@4",), mag=1.3)
        add(kind, 64, (f"{kind}:17:1.2",), mag=1.2, tp=2, pp=2)
        add(kind, 256, (f"{kind}:200:1.1",), mag=1.1)
        add(kind, 48, (f"{kind}:9:1.4@2/3",), iterations=24, mag=1.4)  # intermittent: every 3rd iteration
        if not quick:
            add(kind, 256, (f"{kind}:57:1.1@3",), mag=1.1)
            add(kind, 512, (f"{kind}:311:1.3",), iterations=12, mag=1.3)
            add(kind, 128, (f"{kind}:64:2.0@6",), mag=2.0, tp=4)
    for ranks, host, mag in ((32, 1, 1.5), (64, 3, 1.3), (256, 7, 1.2)):
        add("net_congestion", ranks, (f"net_congestion:{host}:{mag}",), mag=mag)
    for ranks, pp, stage, mag in ((32, 4, 2, 1.3), (64, 2, 1, 1.2), (128, 4, 3, 1.1)):
        add("stage_imbalance", ranks, (f"stage_imbalance:{stage}:{mag}",), mag=mag, pp=pp)
    for ranks, mag in ((16, 1.2), (64, 1.1), (128, 1.15)):
        add("job_slowdown", ranks, (f"job_slowdown:-:{mag}@30",), iterations=56, mag=mag)
    for ranks, rank in ((16, 3), (64, 40), (256, 130)):
        add("hang", ranks, (f"hang:{rank}@8",), iterations=16)
    for pair in (
        ("slow_gpu:3:1.5", "slow_link:20"),
        ("host_slow:7:1.3", "pcie_downgrade:40:1.5"),
        ("dataloader_stall:1:1.5", "slow_gpu:62:1.3"),
        ("cpu_contention:10:1.5", "slow_link:33:1.3"),
    ):
        add("double", 64, pair)
    for i, (ranks, tp, pp) in enumerate(((16, 1, 1), (32, 1, 1), (64, 2, 2), (64, 1, 4), (128, 4, 1),
                                          (256, 1, 1), (512, 1, 1), (48, 2, 1), (96, 1, 2), (24, 1, 1),
                                          (32, 2, 2), (64, 1, 1), (128, 2, 2), (16, 1, 2), (40, 1, 1),
                                          (80, 2, 1))):  # fmt: skip
        if quick and ranks >= 256:
            continue
        add("healthy", ranks, (), iterations=56 if i % 4 == 0 else 20, tp=tp, pp=pp)
    return s


@dataclass
class Outcome:
    scenario: Scenario | TraceScenario
    findings: list[dict[str, object]]
    expected: list[object]
    rank_iterations: int
    seconds: float
    matches: list[tuple[object, dict[str, object] | None]] = field(default_factory=list)
    false_findings: list[dict[str, object]] = field(default_factory=list)


def _opened_at(updates: list[dict[str, object]]) -> dict[str, int]:
    return {u["finding_id"]: u["iteration_last"] for u in updates if u["status"] == "open"}


_SCORING_PROCESSES = 0
"""``--scoring-processes``: set before the scenario workers fork."""


def run(scenario: Scenario | TraceScenario) -> Outcome:
    t0 = time.perf_counter()
    if isinstance(scenario, TraceScenario):
        out = _run_traces(scenario)
    else:
        cfg = scenario.config()
        result = OfflinePipeline(scoring_processes=_SCORING_PROCESSES).add_all(simulate(cfg)).finish()
        opened = _opened_at(result.finding_updates)
        findings = [dict(f, opened_at=opened.get(f["finding_id"], f["iteration_first"])) for f in result.findings]
        out = Outcome(scenario, findings, list(cfg.expected_findings()), len(result.iterations), 0.0)
    out.seconds = time.perf_counter() - t0
    findings = out.findings
    used: set[str] = set()
    for exp in out.expected:
        want = set(exp.ranks)
        cands = [f for f in findings if set(f["ranks"]) & want and f["finding_id"] not in used]
        cands.sort(key=lambda f: (f["category"] != exp.category, f["opened_at"]))
        match = cands[0] if cands else None
        if match is not None:
            used.add(match["finding_id"])
        out.matches.append((exp, match))
    # Several findings about one fault (e.g. host_slow and its straggler corroboration) are not false.
    out.false_findings = [
        f for f in findings
        if f["finding_id"] not in used and not any(set(f["ranks"]) & set(e.ranks) for e in out.expected)
    ]  # fmt: skip
    return out


FREE_FAULT_SHARE = 0.001
"""A generated fault whose job steps less than this share slower than its healthy twin costs nothing."""


def _analyzed(job: TraceJob) -> object:
    with tempfile.TemporaryDirectory(prefix="fleetscope-quality-") as folder:
        write_traces(job, folder)
        pooled = {"streams.scoring_processes": _SCORING_PROCESSES}
        return analyze_traces([folder], load_config(env={}, overrides=pooled) if _SCORING_PROCESSES else None)


def _step_ms(result: object) -> float:
    """The job's step time: its slowest rank's mean iteration (over a run, the others wait for it)."""
    return float(max(r.mean_iteration_ms for r in result.ranks))


def _run_traces(scenario: TraceScenario) -> Outcome:
    """Write the job's traces, analyse the folder as ``fleetscope analyze`` does; a fault's cost is its job's
    step time against its healthy twin's (the same seed)."""
    job = scenario.job
    result = _analyzed(job)
    opened = _opened_at(result.finding_updates)
    findings = [dict(f, opened_at=opened.get(f["finding_id"], f["iteration_first"])) for f in result.findings]
    expected = []
    if job.fault != "healthy":
        category = job.expected_category  # an expert rank with twice the tokens computes longer: gpu_slow
        if job.world_size == job.pp and job.fault != "host_bound":
            category = "stage_imbalance"  # a rank alone in its stage is its stage: a slow GPU and more work look
            # alike; a launch-bound one's kernels take no longer, its GPU waits for its host (stages._launch_bound)
        twin = _step_ms(_analyzed(replace(job, fault="healthy")))
        costs = _step_ms(result) - twin >= FREE_FAULT_SHARE * twin
        expected.append(Expected(category, job.culprits(), job.fault_step, costs))
    return Outcome(scenario, findings, expected, sum(r.iterations for r in result.ranks), 0.0)


def summarize(outcomes: list[Outcome]) -> dict[str, object]:
    kinds: dict[str, dict[str, object]] = {}
    for o in outcomes:
        if o.scenario.kind == "healthy":
            continue
        for exp, match in o.matches:
            if not getattr(exp, "costs", True):  # a simulated fault always costs its job
                continue
            k = kinds.setdefault(exp.category if o.scenario.kind == "double" else o.scenario.kind,
                                 {"expected": 0, "detected": 0, "correct": 0, "false": 0, "delays": [],
                                  "detected_10pct": 0, "expected_10pct": 0})  # fmt: skip
            k["expected"] += 1
            if o.scenario.magnitude and o.scenario.magnitude <= 1.1:
                k["expected_10pct"] += 1
            if match is not None:
                k["detected"] += 1
                k["correct"] += match["category"] == exp.category
                k["delays"].append(max(match["opened_at"] - exp.onset, 0))
                if o.scenario.magnitude and o.scenario.magnitude <= 1.1:
                    k["detected_10pct"] += 1
        key = o.scenario.kind if o.scenario.kind != "double" else o.expected[0].category
        kinds.setdefault(key, {"expected": 0, "detected": 0, "correct": 0, "false": 0, "delays": [],
                               "detected_10pct": 0, "expected_10pct": 0})["false"] += len(o.false_findings)  # fmt: skip
    healthy = [o for o in outcomes if o.scenario.kind == "healthy"]
    h_findings = sum(len(o.findings) for o in healthy)
    h_rank_its = sum(o.rank_iterations for o in healthy)
    total = {"expected": 0, "detected": 0, "correct": 0, "false": 0, "delays": [], "detected_10pct": 0,
             "expected_10pct": 0}  # fmt: skip
    for k in kinds.values():
        for f in ("expected", "detected", "correct", "false", "detected_10pct", "expected_10pct"):
            total[f] += k[f]
        total["delays"] += k["delays"]
    return {"kinds": kinds, "overall": total, "healthy_findings": h_findings, "healthy_rank_iterations": h_rank_its,
            "healthy_false_per_1000": 1000 * h_findings / max(h_rank_its, 1)}  # fmt: skip


def _row(name: str, k: dict[str, object]) -> str:
    tp = k["detected"]
    precision = tp / (tp + k["false"]) if tp + k["false"] else float("nan")
    recall = tp / k["expected"] if k["expected"] else float("nan")
    accuracy = k["correct"] / tp if tp else float("nan")
    delay = statistics.median(k["delays"]) if k["delays"] else float("nan")
    r10 = f"{k['detected_10pct']}/{k['expected_10pct']}" if k["expected_10pct"] else "-"
    return (f"{name:<18} {k['expected']:>5} {precision:>9.3f} {recall:>7.3f} {accuracy:>9.3f} "
            f"{delay:>11.1f} {r10:>10}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller suite (no 512-rank runs)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", help="also write per-scenario outcomes to this file")
    ap.add_argument("--only", action="append", default=[], help="only scenarios whose name has this (repeatable)")
    ap.add_argument(
        "--scoring-processes", type=int, default=0, help="score each job's iterations in this many processes"
    )
    ap.add_argument(
        "--flush-interval-ms",
        type=float,
        default=0.0,
        help="batches cut as the real producers flush (500 ms); 0: one batch per rank-iteration",
    )
    args = ap.parse_args(argv)
    global _SCORING_PROCESSES
    _SCORING_PROCESSES = args.scoring_processes
    scenarios: list[Scenario | TraceScenario] = [
        replace(sc, flush_interval_ms=args.flush_interval_ms) for sc in suite(args.quick)
    ]
    scenarios += trace_suite(args.quick)
    if args.only:
        scenarios = [sc for sc in scenarios if any(part in sc.name for part in args.only)]
    t0 = time.perf_counter()
    outcomes: list[Outcome] = []
    # not a multiprocessing.Pool: its daemonic processes may not start scoring processes of their own
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("fork")) as pool:
        largest_first = sorted(scenarios, key=lambda s: -s.ranks * s.iterations)
        for i, done in enumerate(as_completed([pool.submit(run, sc) for sc in largest_first])):
            o = done.result()
            outcomes.append(o)
            got = ", ".join(f"{f['category']}@{f['ranks'][:4]}" for f in o.findings) or "-"
            print(
                f"[{i + 1:>3}/{len(scenarios)}] {o.scenario.name:<60} {o.seconds:6.1f}s  {got}",
                file=sys.stderr,
            )
    s = summarize(outcomes)
    print(f"\n{len(scenarios)} scenarios ({sum(1 for x in scenarios if x.kind == 'healthy')} healthy), "
          f"{time.perf_counter() - t0:.0f} s\n")  # fmt: skip
    print(f"{'fault kind':<18} {'n':>5} {'precision':>9} {'recall':>7} {'category':>9} {'delay (it)':>11} "
          f"{'recall@10%':>10}")  # fmt: skip
    for name in sorted(s["kinds"]):
        print(_row(name, s["kinds"][name]))
    print(_row("OVERALL", s["overall"]))
    print(f"\nhealthy runs: {s['healthy_findings']} findings in {s['healthy_rank_iterations']} rank-iterations "
          f"= {s['healthy_false_per_1000']:.3f} false findings per 1,000 rank-iterations")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            rows = [
                {"scenario": o.scenario.name, "findings": o.findings, "false": o.false_findings,
                 "matched": [m is not None for _, m in o.matches]}
                for o in outcomes
            ]  # fmt: skip
            json.dump(rows, f, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
