"""``fleetscope replay`` and ``fleetscope analyze``: Kineto trace files into the pipeline.

``replay`` publishes every rank's batches to the raw topics, for a running stack (``fleetscope up``) to
analyse. ``analyze`` runs the same windower and differential in-process (``OfflinePipeline``), no Kafka.
Both read files through ``trace_loading`` (one ``LoadOptions``) and keep only compact batches and small
per-rank summaries; a file that cannot be read or parsed costs one ``skipped`` line on stderr (and an
entry of ``skipped`` in ``--json``), not the run.

Exit status: 0 when at least one file was analysed (or replayed), skipped files listed; 1 when none was,
as a run that analysed nothing answered nothing. A script that must have every file checks ``skipped``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fleetscope.config import Config, ConfigError
from fleetscope.producers.kineto import TraceError, TraceLimits, TraceRank
from fleetscope.progress import Progress
from fleetscope.schemas import EventKind
from fleetscope.schemas.fields import as_int
from fleetscope.schemas.layout import JobLayout
from fleetscope.trace_loading import LoadOptions, find_traces, parsed_traces, stderr_skip

__all__ = ["AnalyzeResult", "LoadOptions", "RankSummary", "analyze_traces", "find_traces", "replay_traces"]


@dataclass(frozen=True, kw_only=True)
class RankSummary:
    """What one trace file held (and, after ``analyze``, how its iterations looked)."""

    job: str
    rank: int
    host: str
    path: str
    steps: list[int]
    batches: int
    events: int
    kernels: int
    kernel_ms: float
    collectives: int
    host_spans: int
    skipped_events: int
    iterations: int = 0
    mean_iteration_ms: float = 0.0
    gpu_busy_pct: float = 0.0
    tp_rank: int = -1
    """The rank's coordinates in the job's layout; -1: the dimension is unknown or absent."""
    pp_rank: int = -1
    dp_rank: int = -1
    ep_rank: int = -1

    @classmethod
    def of(cls, trace: TraceRank, layout: JobLayout | None = None) -> RankSummary:
        role = layout.role(trace.rank) if layout is not None else None
        coords = {f"{d}_rank": getattr(role, f"{d}_rank") for d in ("tp", "pp", "dp", "ep")} if role else {}
        return cls(
            **coords,
            job=trace.job,
            rank=trace.rank,
            host=trace.host,
            path=str(trace.path),
            steps=list(trace.steps),
            batches=len(trace.batches),
            events=sum(len(b) for b in trace.batches),
            kernels=trace.kernels,
            kernel_ms=trace.kernel_ns / 1e6,
            collectives=trace.count(EventKind.COLLECTIVES),
            host_spans=trace.host_spans,
            skipped_events=trace.skipped_events,
        )


def replay_traces(
    paths: Sequence[str | Path],
    config: Config,
    options: LoadOptions | None = None,
) -> list[RankSummary]:
    """Publish every trace's batches to the raw topics of ``config``'s broker; one summary per file."""
    from fleetscope.broker import ensure_topics
    from fleetscope.demo import check_delivered
    from fleetscope.producers import Publisher
    from fleetscope.schemas import Topics
    from fleetscope.wiring import bulk_publisher_config

    k = config.kafka
    if not k.bootstrap_servers:
        raise ConfigError(["kafka.bootstrap_servers: replay needs a broker (--bootstrap, e.g. from `fleetscope up`)"])
    options = options or LoadOptions()
    progress = options.progress or Progress(enabled=False)
    ensure_topics(k.admin_settings(), Topics(prefix=k.topic_prefix), k.raw_partitions, k.derived_partitions)
    summaries: list[RankSummary] = []
    layouts: dict[str, JobLayout] = {}
    traces = deque(
        parsed_traces(paths, options, "replay", layouts)
    )  # parsed (the pool forked) before any client thread
    with Publisher(bulk_publisher_config(config)) as publisher:
        while traces:
            trace = traces.popleft()
            for batch in trace.batches:
                publisher.publish(batch)
            summaries.append(RankSummary.of(trace, layouts[trace.job]))
            del trace
        publisher.flush(60.0)
    stats = publisher.stats
    check_delivered(stats, k.bootstrap_servers)
    progress.done(f"replay: {len(summaries)} ranks, {stats.published} batches, {stats.events_published} events")
    return summaries


@dataclass(frozen=True)
class AnalyzeResult:
    findings: list[dict[str, Any]]
    ranks: list[RankSummary]
    explanations: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per job: who arrives last at each collective, who computes longest, signals that did not
    persist, and why no finding could open (``streams.analysis.explain``)."""
    finding_updates: list[dict[str, Any]] = field(default_factory=list)
    """Every open/update/closed record, in emission order (when each finding opened)."""
    skipped: list[dict[str, str]] = field(default_factory=list)
    """Each file not analysed: ``{"path": ..., "reason": ...}`` (the reason is one line)."""
    dumps: list[dict[str, Any]] = field(default_factory=list)
    """Each Flight Recorder dump read (``dump_analysis``); its jobs' hang findings are in ``findings``."""
    dump_verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per job with dumps: the hang verdict's evidence, or why there is none."""


def analyze_traces(
    paths: Sequence[str | Path],
    config: Config | None = None,
    options: LoadOptions | None = None,
) -> AnalyzeResult:
    """Window and compare the traces in-process, one file at a time; findings plus per-rank summaries."""
    from fleetscope.dump_analysis import analyze_dumps, split_dumps
    from fleetscope.streams.analysis.explain import JobTally, tally_jobs
    from fleetscope.streams.offline import OfflinePipeline

    s = config.streams if config is not None else None
    pipeline = OfflinePipeline(
        s.windower if s else None,
        s.differential if s else None,
        keep_patterns=True,
        scoring_processes=s.scoring_processes if s else 0,
    )
    lifecycle, scoring = pipeline.differential_config.lifecycle, pipeline.differential_config.scoring
    tallies: dict[str, JobTally] = {}
    options = options or LoadOptions()
    progress = options.progress or Progress(enabled=False)
    skipped: list[dict[str, str]] = []
    report = options.on_skip or stderr_skip("analyze")

    def skip(path: Path, exc: TraceError) -> None:
        skipped.append({"path": str(path), "reason": str(exc).removeprefix(f"{path}: ")})
        report(path, exc)

    options = replace(options, on_skip=skip)
    dump_files, paths = split_dumps(paths)
    dumps = analyze_dumps(dump_files, s.differential if s else None, options.job, skip)
    summaries: list[RankSummary] = []
    seen = 0
    layouts: dict[str, JobLayout] = {}
    for trace in parsed_traces(paths, options, "analyze", layouts) if paths or not dump_files else ():
        for batch in trace.batches:
            pipeline.add(batch)
        pipeline.close_rank(trace.job, trace.rank)
        tally_jobs(pipeline.patterns, tallies, lifecycle.persist_iterations)
        pipeline.patterns.clear()  # the tally keeps what it needs, compactly
        its = pipeline.result.iterations[seen:]
        seen = len(pipeline.result.iterations)
        its = [it for it in its if it.get("job") == trace.job and it.get("rank") == trace.rank]
        duration = sum(as_int(it["duration_ns"]) for it in its)
        busy = sum(as_int(it["gpu_busy_ns"]) for it in its)
        summaries.append(
            replace(
                RankSummary.of(trace, layouts[trace.job]),
                iterations=len(its),
                mean_iteration_ms=duration / len(its) / 1e6 if its else 0.0,
                gpu_busy_pct=100.0 * busy / duration if duration else 0.0,
            )
        )
        del trace
    result = pipeline.finish()
    tally_jobs(pipeline.patterns, tallies, lifecycle.persist_iterations)
    pipeline.patterns.clear()
    progress.done(f"analyze: {len(summaries)} ranks, {len(result.iterations)} rank-iterations")
    summaries.sort(key=lambda r: (r.job, r.rank, r.path))
    with_findings = {f["job"] for f in result.findings}
    explanations = {
        job: {
            "layout": layout_summary(layouts.get(job)),
            "iterations": len(t.iterations),
            "last_arrivals": t.last_arrivals(),
            "longest_compute": t.longest_compute(),
            "unopened_signals": t.unopened_signals(scoring)
            if job not in with_findings and len(t.iterations) < lifecycle.persist_iterations
            else [],
            "reasons": t.reasons(lifecycle.persist_iterations, scoring.min_peers),
            "limits": t.limits(),
        }
        for job, t in sorted(tallies.items())
    }
    findings = dumps.findings + result.findings
    updates = dumps.findings + result.finding_updates
    return AnalyzeResult(findings, summaries, explanations, updates, skipped, dumps.ranks, dumps.verdicts)


_RANK_COLUMNS = (
    "job", "rank", "host", "tp_rank", "pp_rank", "dp_rank", "ep_rank", "iterations", "mean_iteration_ms",
    "gpu_busy_pct", "kernels", "collectives", "kernel_ms",
)  # fmt: skip
_COORDINATES = ("tp_rank", "pp_rank", "dp_rank", "ep_rank")
_DUMP_COLUMNS = ("job", "rank", "entries", "in_collective", "collective", "waited_ms")


def layout_summary(layout: JobLayout | None) -> dict[str, Any]:
    """A job's layout as the report shows it: each known dimension's size and where it came from."""
    if layout is None or not layout.known:
        return {"sizes": {}, "sources": {}}
    role = next(iter(layout.roles.values()), None)
    sizes = {d: getattr(role, f"{d}_size") for d in ("dp", "tp", "pp", "ep", "shard")} if role else {}
    return {"sizes": {d: n for d, n in sizes.items() if n > 1}, "sources": dict(layout.sources)}


def cmd_analyze(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.dump_analysis import verdict_lines
    from fleetscope.tables import findings_json, print_findings, print_table

    result = analyze_traces(args.paths, config, _load_options(args))
    if not result.ranks and not result.dumps:
        print("fleetscope analyze: no trace could be parsed", file=sys.stderr)
        return 1
    if args.json:
        findings = findings_json(result.findings)
        ranks = [asdict(r) for r in result.ranks]
        doc = {"findings": findings, "ranks": ranks, "explanations": result.explanations, "skipped": result.skipped}
        if result.dumps:
            doc |= {"flight_dumps": result.dumps, "flight_verdicts": result.dump_verdicts}
        print(json.dumps(doc, indent=2, default=str))
    else:
        print_findings(result.findings, as_json=False)
        if result.dumps:
            print()
            print_table(_DUMP_COLUMNS, [[d[c] for c in _DUMP_COLUMNS] for d in result.dumps])
            for job, verdict in result.dump_verdicts.items():
                print("\n".join(verdict_lines(job, verdict)))
        if result.ranks:
            print()
            # a coordinate column only for the dimensions some job's layout has (size > 1)
            dims = {f"{d}_rank" for ex in result.explanations.values() for d in ex["layout"]["sizes"]}
            columns = [c for c in _RANK_COLUMNS if c not in _COORDINATES or c in dims]
            print_table(columns, [[getattr(r, c) for c in columns] for r in result.ranks])
        for job, ex in result.explanations.items():
            print()
            print("\n".join(explanation_lines(job, ex)))
        if result.skipped:
            analysed = len(result.ranks) + len(result.dumps)
            print(f"\n{len(result.skipped)} file(s) skipped (listed on stderr), {analysed} analysed")
    return 0


def _load_options(args: argparse.Namespace) -> LoadOptions:
    """The command line's options; a bad limit is a configuration error (no traceback)."""
    try:
        return LoadOptions.from_args(args)
    except ValueError as exc:
        raise ConfigError([f"trace limits: {exc}"]) from None


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def explanation_lines(job: str, ex: dict[str, Any]) -> list[str]:
    """What a job's traces show beyond its findings, as text."""
    sizes = ex.get("layout", {}).get("sizes", {})
    shape = "layout " + " x ".join(f"{d}={n}" for d, n in sizes.items()) if sizes else "no layout in its process groups"
    out = [f"{job}: {ex['iterations']} iteration(s), {shape}"]
    if ex["last_arrivals"]:
        out.append("  last to arrive (waits least) at each collective:")
        out += [f"    {_short(a['function']):<48} rank {a['rank']} ({a['iterations']}/{a['of']} iterations)"
                for a in ex["last_arrivals"]]  # fmt: skip
        counts: dict[int, int] = {}
        for a in ex["last_arrivals"]:
            counts[a["rank"]] = counts.get(a["rank"], 0) + 1
        rank = max(counts, key=lambda r: counts[r])
        out.append(f"  most often last: rank {rank}, at {counts[rank]} of {len(ex['last_arrivals'])} collectives")
    for c in ex["longest_compute"]:
        where = "" if c["stage"] < 0 else f" in stage {c['stage']}"
        out.append(f"  computes longest{where}: rank {c['rank']} ({c['iterations']}/{c['of']} iterations), "
                   f"{c['compute_ms']:.3f} ms vs median {c['peer_median_ms']:.3f} ms")  # fmt: skip
    for sig in ex["unopened_signals"]:
        out.append(f"  signal, not a finding: {sig['category']} on {sig['subject']} ({_short(sig['function'])}), "
                   f"{sig['iterations']} iteration(s), up to {sig['est_loss_ms']:.3f} ms lost")  # fmt: skip
    out += [f"  no finding could open: {reason}" for reason in ex["reasons"]]
    out += [f"  cannot judge: {limit}" for limit in ex.get("limits", ())]
    return out


def cmd_replay(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.tables import print_table

    ranks = replay_traces(args.paths, config, _load_options(args))
    if args.json:
        print(json.dumps({"bootstrap_servers": config.kafka.bootstrap_servers, "ranks": [asdict(r) for r in ranks]}))
        return 0 if ranks else 1
    columns = ("job", "rank", "host", "batches", "events", "kernels", "collectives", "host_spans")
    print_table(columns, [[getattr(r, c) for c in columns] for r in ranks])
    return 0 if ranks else 1


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``replay`` and ``analyze`` to the ``fleetscope`` command line."""
    p = sub.add_parser(
        "replay",
        parents=[common],
        help="publish Kineto trace files to the broker",
        description="Publish PyTorch profiler (Kineto) traces, one file per rank, to the raw topics of "
        "the broker given by --bootstrap or the configuration (e.g. the one `fleetscope up` prints). "
        "A directory stands for every *.json and *.json.gz file below it.",
    )
    _trace_options(p)
    p.add_argument("--json", action="store_true", help='print {"bootstrap_servers": ..., "ranks": [...]}')
    p.set_defaults(handler=cmd_replay)
    p = sub.add_parser(
        "analyze",
        parents=[common],
        help="analyse Kineto trace files (and Flight Recorder dumps) in-process (no broker)",
        description="Cut each rank's trace into iterations and compare ranks, with the stream worker's "
        "code but in this process, one file at a time. Prints findings and a per-rank summary. "
        "PyTorch Flight Recorder dumps (pickle or JSON, one per rank, told by their content) give the "
        "hang verdict of the live heartbeats: who never joined a collective, a collective every member "
        "is stuck in, or members disagreeing on op, size or dtype. "
        "A file that cannot be read or parsed is skipped with one line on stderr (and listed in "
        "--json's skipped); the exit status is 0 when at least one file was analysed, 1 when none was.",
    )
    _trace_options(p)
    p.add_argument("--json", action="store_true", help='print {"findings": [...], "ranks": [...]}')
    p.set_defaults(handler=cmd_analyze)


def _trace_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", metavar="DIR_OR_FILE", help="trace files or directories of them")
    p.add_argument("--job", help="job id for every trace (default: each file's directory name)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--tp", type=int, default=0, help="tensor-parallel size (default: from the process groups)")
    p.add_argument("--pp", type=int, default=0, help="pipeline-parallel size (default: from the process groups)")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="files parsed at once (default: one per core from 16 MiB of traces, else 1)",
    )
    limits = TraceLimits()
    p.add_argument(
        "--max-trace-mib",
        type=int,
        help=f"largest trace, in MiB of JSON (a gzip file's expanded size; default {limits.max_trace_bytes >> 20})",
    )
    p.add_argument(
        "--max-gzip-ratio",
        type=int,
        help=f"a gzip trace expands to at most this many times its size (default {limits.max_gzip_ratio})",
    )
    p.add_argument(
        "--max-unpacked-mib",
        type=int,
        help=f"MiB of traces written out of tar archives, all together (default {limits.max_unpacked_bytes >> 20})",
    )
