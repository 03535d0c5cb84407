"""Two runs into ``RunSteps`` for the run-to-run diff (``streams.analysis.rundiff``), and the diff as text.

A run is a job in the store (two aggregate reads through the ``Store`` seam: rows per role and iteration,
then one row per role and function over the steady window) or a folder of trace files (parsed by
``trace_loading`` and windowed by the offline stages ``analyze`` runs, folded into a ``StepTable``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from fleetscope.schemas import units
from fleetscope.streams.analysis.rundiff import (
    Change,
    DiffConfig,
    FunctionMoments,
    RoleIterations,
    RunDiff,
    RunSteps,
    StepTable,
    run_steps,
)

if TYPE_CHECKING:
    from fleetscope.config import Config
    from fleetscope.sinks.store import Store
    from fleetscope.trace_loading import LoadOptions


def store_steps(store: Store, job: str, config: DiffConfig | None = None) -> RunSteps:
    """Job ``job`` of the store as the diff reads it (``ValueError`` when the store has none of its rows)."""
    rows = [RoleIterations((pp, tp), it, n, ns) for pp, tp, it, n, ns in store.run_iterations(job)]
    if not rows:
        raise ValueError(f"job {job!r} has no function patterns in the store (and no folder of that name exists)")

    def moments(first: int, last: int) -> list[FunctionMoments]:
        return [FunctionMoments((pp, tp), fn, kind, n, s1, s2, c)
                for pp, tp, fn, kind, n, s1, s2, c in store.function_moments(job, first, last)]  # fmt: skip

    return run_steps(job, rows, moments, config)


def trace_steps(
    path: str | Path, config: Config | None = None, options: LoadOptions | None = None, diff: DiffConfig | None = None
) -> RunSteps:
    """The trace files under ``path`` as one run (every file one rank of it, whatever its job id), windowed
    by the offline stages ``analyze`` runs (``ValueError`` when no file gave an iteration)."""
    from dataclasses import replace

    from fleetscope.schemas.layout import JobLayout
    from fleetscope.streams.offline import OfflinePipeline
    from fleetscope.trace_loading import LoadOptions, parsed_traces

    name = str(path)
    s = config.streams if config is not None else None
    pipeline = OfflinePipeline(s.windower if s else None, s.differential if s else None, keep_patterns=True)
    table = StepTable()
    options = replace(options or LoadOptions(), job="run")
    layouts: dict[str, JobLayout] = {}
    for trace in parsed_traces([path], options, "diff", layouts):
        for batch in trace.batches:
            pipeline.add(batch)
        pipeline.close_rank(trace.job, trace.rank)
        for record in pipeline.patterns:
            table.add(record)
        pipeline.patterns.clear()
        del trace
    pipeline.finish()
    for record in pipeline.patterns:
        table.add(record)
    rows = table.role_iterations()
    if not rows:
        raise ValueError(f"{name}: no trace file there gave an iteration")
    return run_steps(name, rows, table.moments, diff)


def role_label(role: tuple[int, int], dims: tuple[bool, bool]) -> str:
    """``stage 1 tp 0``, the dimensions ``dims`` says vary in the job; ``all ranks`` when neither does."""
    parts = [f"{d} {v}" for d, v, shown in zip(("stage", "tp"), role, dims, strict=True) if shown and v >= 0]
    return " ".join(parts) or "all ranks"


def varying_dims(diff: RunDiff) -> tuple[bool, bool]:
    """Whether the stage, the tensor slot, takes more than one value among both runs' roles."""
    roles = set(diff.a.role_iterations) | set(diff.b.role_iterations)
    return len({r[0] for r in roles}) > 1, len({r[1] for r in roles}) > 1


def _relative(c: Change) -> str:
    return "new" if not math.isfinite(c.relative) else f"{c.relative:+.1%}"


def iteration_line(diff: RunDiff) -> str:
    """The top line: the job's iteration time A -> B, and whether it changed beyond both runs' noise."""
    it = diff.iteration
    verdict = "changed" if it.significant else "within both runs' noise"
    return (
        f"iteration time: {units.duration(it.a_ns)} -> {units.duration(it.b_ns)} "
        f"({'+' if it.delta_ns >= 0 else '-'}{units.duration(abs(it.delta_ns))}, {_relative(it)}), {verdict}"
    )


def diff_lines(diff: RunDiff, limit: int = 20) -> list[str]:
    """The diff as a person reads it: the iteration time on top, then each listed change, largest first."""
    a, b = diff.a, diff.b
    out = [
        f"A {a.name}: {a.iteration_ns.size} steady iterations ({a.first_iteration}-{a.last_iteration}"
        f"{f', {a.skipped_warmup} warm-up skipped' if a.skipped_warmup else ''})",
        f"B {b.name}: {b.iteration_ns.size} steady iterations ({b.first_iteration}-{b.last_iteration}"
        f"{f', {b.skipped_warmup} warm-up skipped' if b.skipped_warmup else ''})",
        iteration_line(diff),
    ]
    if diff.unmatched_roles:
        dims = varying_dims(diff)
        only = ", ".join(f"{role_label(r, dims)} (only in {run.upper()})" for run, r in diff.unmatched_roles)
        out.append(f"roles not compared, the layouts differ: {only}")
    if not diff.changes:
        out.append("no function or kernel changed beyond both runs' iteration-to-iteration noise")
        return out
    dims = varying_dims(diff)
    out.append(f"{len(diff.changes)} change(s) per iteration, per rank of each role, largest first:")
    width = max(len(role_label(c.role, dims)) for c in diff.changes[:limit])
    for c in diff.changes[:limit]:
        delta = ("+" if c.delta_ns >= 0 else "-") + units.duration(abs(c.delta_ns))
        calls = f", calls {c.a_calls:g} -> {c.b_calls:g}" if round(c.a_calls, 2) != round(c.b_calls, 2) else ""
        out.append(
            f"  {role_label(c.role, dims):<{width}}  {delta:>10} {_relative(c):>7}  "
            f"{c.function} ({c.kind}): {units.duration(c.a_ns)} -> {units.duration(c.b_ns)}{calls}"
        )
    if len(diff.changes) > limit:
        out.append(f"  ... {len(diff.changes) - limit} more (--limit, or --json for all)")
    return out
