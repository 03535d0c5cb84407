"""``fleetscope diff A B``: what changed per iteration between two runs, by rank role, against their noise.

Each of A and B is a folder (or file) of trace files when such a path exists, else a job in the store.
Against HolisticTraceAnalysis's ``TraceDiff`` (one rank's trace, or a list of ranks summed, and chosen
iterations, total durations compared as they are): this compares time *per iteration* over each run's
steady window (its warm-up skipped, runs of any length), per rank *role* (pipeline stage, tensor slot:
the last stage's loss kernels are not averaged with the first stage's data loader), lists a change only
when it stands out of both runs' own iteration-to-iteration noise (a run against itself lists nothing),
and reads jobs straight from the store, aggregated there, so it works on a fleet's jobs without their
traces.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fleetscope.config import Config, ConfigError
from fleetscope.streams.analysis.rundiff import DiffConfig, RunDiff, RunSteps, diff_runs


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """Add ``diff``."""
    p = sub.add_parser(
        "diff",
        parents=[common],
        help="what changed per iteration between two runs (jobs in the store or trace folders)",
        description="Compare run B with run A: the iteration time's change, then the functions and kernels "
        "ranked by the time per iteration they gained or lost, per rank role (pipeline stage, tensor slot). "
        "A change is listed only when it stands out of both runs' own iteration-to-iteration noise. A and B "
        "are each a trace folder (or file) when that path exists, else a job id in the store.",
    )
    p.add_argument("a", metavar="A", help="the baseline: a job id in the store, or a trace folder")
    p.add_argument("b", metavar="B", help="the run to compare with it: a job id, or a trace folder")
    p.add_argument("--json", action="store_true", help='print {"a", "b", "iteration", "changes": [...]}')
    p.add_argument("--limit", type=int, default=20, help="changes printed (default 20; --json has all)")
    p.add_argument("--warmup", type=int, default=0, help="iterations always skipped at each run's start")
    p.add_argument("--quiet", action="store_true", help="no progress line while trace folders are read")
    p.set_defaults(handler=cmd_diff)


def cmd_diff(args: argparse.Namespace, config: Config) -> int:
    if args.limit < 1 or args.warmup < 0:
        raise ConfigError(["diff: --limit must be >= 1 and --warmup >= 0"])
    diff = run_diff(args.a, args.b, config, DiffConfig(warmup_iterations=args.warmup), quiet=args.quiet)
    if args.json:
        print(json.dumps(diff.as_dict(), indent=2))
    else:
        from fleetscope.run_diff import diff_lines

        print("\n".join(diff_lines(diff, args.limit)))
    return 0


def run_diff(a: str, b: str, config: Config, diff: DiffConfig | None = None, *, quiet: bool = True) -> RunDiff:
    """Load both runs (a trace path that exists, else a job of the store) and diff them."""
    from fleetscope.progress import Progress
    from fleetscope.run_diff import store_steps, trace_steps
    from fleetscope.trace_loading import LoadOptions

    store = None

    def load(name: str) -> RunSteps:
        nonlocal store
        if Path(name).exists():
            return trace_steps(name, config, LoadOptions(progress=Progress(enabled=not quiet)), diff)
        if store is None:
            from fleetscope.endpoint import open_store

            store = open_store(config)
        return store_steps(store, name, diff)

    return diff_runs(load(a), load(b), diff)
