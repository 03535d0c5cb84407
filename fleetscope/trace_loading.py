"""Trace files for ``replay`` and ``analyze``: which files, how they are parsed, and the job's layout.

Why apart from the commands: both read files the same way (one ``LoadOptions``). Files are parsed in
file order, several at once in worker processes when there is enough data for it (each worker holds
one decoded file and sends back its compact batches); tar archives are unpacked into a temporary folder
for the run; then each job's layout is derived once from all its ranks and written into their headers.
A file that is not a trace costs one ``skipped`` line, not the run.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fleetscope.producers.kineto import TraceError, TraceRank, parse_trace
from fleetscope.progress import Progress
from fleetscope.schemas.layout import JobLayout

log = logging.getLogger(__name__)

SkipHandler = Callable[[Path, TraceError], None]
TRACE_SUFFIXES = (".json", ".json.gz")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz")
"""Archives of traces (how jobs' profiles are often shared): unpacked into a temporary folder for the run."""


def find_traces(paths: Iterable[str | Path], unpack_into: Path | None = None) -> list[Path]:
    """Files named on the command line as they are; directories expanded (recursively) to their
    ``*.json``/``*.json.gz`` files, sorted, so a rank set is always read in the same order. With
    ``unpack_into``, tar archives (named or in a directory) are unpacked there and their traces found."""
    out: list[Path] = []
    for item in paths:
        p = Path(item)
        if p.is_dir():
            suffixes = TRACE_SUFFIXES + (ARCHIVE_SUFFIXES if unpack_into is not None else ())
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(suffixes))
            out += find_traces(found, unpack_into)
        elif unpack_into is not None and p.name.endswith(ARCHIVE_SUFFIXES):
            # named after the archive, so a skipped member's line says where it came from
            dest = unpack_into / p.name
            out += _unpacked(
                p, dest if not dest.exists() else unpack_into / f"{len(list(unpack_into.iterdir()))}-{p.name}"
            )
        else:
            out.append(p)
    return out


def _unpacked(archive: Path, dest: Path) -> list[Path]:
    """The traces of a tar archive, unpacked into ``dest`` (members keep their folders: the job names)."""
    import tarfile

    try:
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    except (OSError, tarfile.TarError) as exc:
        log.warning("%s: not a readable tar archive (%s)", archive, exc)
        return [archive]  # parsed as a file: skipped with its reason
    return find_traces([dest])


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How ``replay`` and ``analyze`` read trace files (one definition for both commands)."""

    job: str | None = None
    """Job id for every trace (default: each file's directory name)."""
    tp: int = 0
    """Tensor-parallel size; 0: from the process groups."""
    pp: int = 0
    """Pipeline-parallel size; 0: from the process groups."""
    workers: int = 0
    """Processes that parse files at once; 0: one per available core when the files hold at least
    ``POOL_MIN_BYTES``, else one (never more than files)."""
    progress: Progress | None = None
    on_skip: SkipHandler | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoadOptions:
        return cls(
            job=args.job,
            tp=getattr(args, "tp", 0),
            pp=getattr(args, "pp", 0),
            workers=getattr(args, "workers", 0),
            progress=Progress(enabled=not args.quiet),
        )


def parsed_traces(
    paths: Iterable[str | Path], options: LoadOptions, verb: str, layouts: dict[str, JobLayout]
) -> Iterable[TraceRank]:
    """Parse the files (only the compact batches stay), then fill every rank's coordinates from the
    job's layout (its process groups and p2p peers, or the given ``tp``/``pp``), kept in ``layouts``."""
    from fleetscope.producers.trace_layout import job_layouts, with_layout

    traces = deque(_parsed_files(paths, options, verb))
    layouts.update(job_layouts(traces, tp=options.tp, pp=options.pp))
    while traces:
        trace = traces.popleft()
        yield with_layout(trace, layouts[trace.job])
        del trace


def _parse_one(task: tuple[Path, str | None, int]) -> TraceRank | TraceError:
    """One file in a worker process: its compact trace, or why it is not one (sent back, not raised)."""
    path, job, world_size = task
    try:
        return parse_trace(path, job=job, world_size=world_size)
    except TraceError as exc:
        return exc


def _parsed_files(paths: Iterable[str | Path], options: LoadOptions, verb: str) -> Iterable[TraceRank]:
    """Parse the files in file order, several at once in worker processes when there are cores for it;
    each worker holds one decoded file at a time and sends back only its compact batches."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fleetscope-traces-") as scratch:
        files = find_traces(paths, unpack_into=Path(scratch))
        if not files:
            raise ValueError(f"no trace files (*.json, *.json.gz, tar archives) in {', '.join(map(str, paths))}")
        yield from _parsed_found(files, options, verb)


POOL_MIN_BYTES = 16 * 2**20
"""Below this much trace data, starting worker processes costs more than it saves: one process."""


def _auto_workers(files: Sequence[Path]) -> int:
    """One worker per available core for a large set of files, else one (no pool)."""
    size = 0
    for f in files:
        with contextlib.suppress(OSError):
            size += f.stat().st_size
    return len(os.sched_getaffinity(0)) if size >= POOL_MIN_BYTES else 1


def _parsed_found(files: list[Path], options: LoadOptions, verb: str) -> Iterable[TraceRank]:
    progress = options.progress or Progress(enabled=False)
    on_skip = options.on_skip or _stderr_skip(verb)
    # A trace without distributedInfo or rank-N in its name gets no rank; the file count is its world size.
    tasks = [(path, options.job, len(files)) for path in files]
    import multiprocessing

    workers = min(options.workers or _auto_workers(files), len(files))
    if multiprocessing.current_process().daemon:  # a pool's worker (e.g. the quality bench's) has no children
        workers = 1
    with contextlib.ExitStack() as stack:
        results: Iterable[TraceRank | TraceError] = map(_parse_one, tasks)
        if workers > 1:
            from concurrent.futures import ProcessPoolExecutor

            ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
            pool = stack.enter_context(ProcessPoolExecutor(workers, mp_context=ctx))
            results = pool.map(_parse_one, tasks)
        for i, (path, trace) in enumerate(zip(files, results, strict=True)):
            progress.update(f"{verb}: file {i + 1}/{len(files)} {path.name}")
            if isinstance(trace, TraceError):
                on_skip(path, trace)
                continue
            log.debug("%s: %d events parsed in %.3f s", path, trace.events, trace.parse_s)
            yield trace
            del trace


def _stderr_skip(command: str) -> SkipHandler:
    def skip(_path: Path, exc: TraceError) -> None:
        print(f"fleetscope {command}: skipped {exc}", file=sys.stderr)

    return skip
