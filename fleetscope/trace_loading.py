"""Trace files for ``replay`` and ``analyze``: which files, how they are parsed, and the job's layout.

Why apart from the commands: both read files the same way (one ``LoadOptions``). Files are parsed in
file order, several at once in worker processes when there is enough data for it (each worker holds
one decoded file and sends back its compact batches); tar archives are unpacked into a temporary folder
for the run; then each job's layout is derived once from all its ranks and written into their headers.

One file's failure is that file's: whatever goes wrong while one file is read or parsed (not a trace, a
bound of ``TraceLimits`` passed, an error no check foresaw, memory running out) costs one ``skipped`` line
with its reason, and the other files are analysed. Archives are unpacked member by member: only members
named like traces whose first bytes are JSON (or gzip) are written, within ``max_unpacked_bytes`` for the
run; links, devices and paths leaving the folder are never written.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from fleetscope.producers.kineto import TraceError, TraceLimits, TraceRank, parse_trace
from fleetscope.producers.kineto_load import GZIP_MAGIC, PREFIX_BYTES, check_prefix
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
    return _find(paths, _Unpacking(unpack_into, TraceLimits()) if unpack_into is not None else None)


@dataclass
class _Unpacking:
    """Where archives are unpacked in one run, how many bytes may still be written there, and the
    members refused (each with its reason, reported as a skipped file)."""

    root: Path
    limits: TraceLimits
    left: int = -1
    refused: list[tuple[Path, TraceError]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.left < 0:
            self.left = self.limits.max_unpacked_bytes


def _find(paths: Iterable[str | Path], unpacking: _Unpacking | None) -> list[Path]:
    out: list[Path] = []
    for item in paths:
        p = Path(item)
        if p.is_dir():
            suffixes = TRACE_SUFFIXES + (ARCHIVE_SUFFIXES if unpacking is not None else ())
            found = sorted(f for f in p.rglob("*") if f.is_file() and (f.name.endswith(suffixes) or _inspector_log(f)))
            out += _find(found, unpacking)
        elif unpacking is not None and p.name.endswith(ARCHIVE_SUFFIXES):
            # named after the archive, so a skipped member's line says where it came from
            root = unpacking.root
            dest = root / p.name if not (root / p.name).exists() else root / f"{len(list(root.iterdir()))}-{p.name}"
            out += _unpacked(p, dest, unpacking)
        else:
            out.append(p)
    return out


def _inspector_log(path: Path) -> bool:
    """A folder's ``*.log`` file in the Inspector's format (the plugin names them ``<host>-pid<pid>.log``)."""
    return path.name.endswith(".log") and is_inspector(path)


def is_inspector(path: Path) -> bool:
    """Whether a file is an NCCL Inspector log, by its first line; a file named like a Kineto trace is none."""
    from fleetscope.producers.nccl_inspector import looks_like_inspector

    if path.name.endswith(TRACE_SUFFIXES + ARCHIVE_SUFFIXES):
        return False
    try:
        with open(path, "rb") as f:
            return looks_like_inspector(f.readline(PREFIX_BYTES))
    except OSError:
        return False


def _unpacked(archive: Path, dest: Path, unpacking: _Unpacking) -> list[Path]:
    """The trace members of a tar archive, written into ``dest`` one by one (members keep their
    folders: the job names). A member is written only if it is a regular file named like a trace,
    inside ``dest``, starting like JSON or gzip, and within the bytes the run may still unpack."""
    import tarfile

    out: list[Path] = []
    try:
        with tarfile.open(archive) as tar:
            for member in tar:
                if not member.isfile() or not member.name.endswith(TRACE_SUFFIXES):
                    continue  # as in a folder: only files named like traces are read
                where = dest / member.name
                try:
                    tarfile.data_filter(member, str(dest))
                    if member.size > unpacking.left:
                        cap = unpacking.limits.max_unpacked_bytes
                        raise TraceError(f"{where}: {member.size} bytes, past the {unpacking.left} bytes left "
                                         f"of max_unpacked_bytes ({cap})")  # fmt: skip
                    src = tar.extractfile(member)
                    if src is None:
                        continue
                    _write_member(where, src, dest)
                except tarfile.FilterError as exc:
                    unpacking.refused.append((where, TraceError(f"{where}: refused ({exc})")))
                    continue
                except TraceError as exc:
                    unpacking.refused.append((where, exc))
                    continue
                unpacking.left -= member.size
                out.append(where)
    except (OSError, tarfile.TarError, EOFError) as exc:
        unpacking.refused.append((archive, TraceError(f"{archive}: not a readable tar archive ({exc})")))
    return out


def _write_member(target: Path, src: IO[bytes], dest: Path) -> None:
    """Write one member whose first bytes start a JSON document (or a gzip stream); else refuse it."""
    import shutil

    head = src.read(PREFIX_BYTES)
    if head[:2] != GZIP_MAGIC:
        check_prefix(target, head, complete=len(head) < PREFIX_BYTES)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.resolve().is_relative_to(dest.resolve()):  # the folders are ours: no link can lead out
        raise TraceError(f"{target}: refused (outside the unpack folder)")
    with open(target, "wb") as f:
        f.write(head)
        shutil.copyfileobj(src, f, 4 * 2**20)


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
    limits: TraceLimits = field(default_factory=TraceLimits)
    """What one file, and all archives' members together, may cost (memory, disk)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoadOptions:
        """The options of ``replay``/``analyze``'s command line (``ValueError`` for a bad limit)."""
        defaults = TraceLimits()
        return cls(
            job=args.job,
            tp=getattr(args, "tp", 0),
            pp=getattr(args, "pp", 0),
            workers=getattr(args, "workers", 0),
            progress=Progress(enabled=not args.quiet),
            limits=TraceLimits(
                max_trace_bytes=_mib(getattr(args, "max_trace_mib", None), defaults.max_trace_bytes),
                max_gzip_ratio=getattr(args, "max_gzip_ratio", None) or defaults.max_gzip_ratio,
                max_unpacked_bytes=_mib(getattr(args, "max_unpacked_mib", None), defaults.max_unpacked_bytes),
            ),
        )


def _mib(value: int | None, default: int) -> int:
    """A size given in MiB on the command line, in bytes (``default`` when not given)."""
    return default if value is None else value * 2**20


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


REASON_CHARS = 300
"""A skipped file's reason is one line of at most this many characters, whatever the error said."""


def _parse_one(task: tuple[Path, str | None, int, TraceLimits]) -> TraceRank | TraceError:
    """One file in a worker process: its compact trace, or why it is not one (sent back, not raised).
    Any error on one file is that file's: a check that foresaw it says why, any other error is named."""
    path, job, world_size, limits = task
    try:
        return parse_trace(path, job=job, world_size=world_size, limits=limits)
    except TraceError as exc:
        return exc
    except MemoryError:
        return TraceError(f"{path}: out of memory while parsing it")
    except Exception as exc:  # noqa: BLE001 - one file's failure, whatever it is, costs only that file
        text = (str(exc).strip().splitlines() or [repr(exc)])[0]
        return TraceError(f"{path}: cannot be parsed ({type(exc).__name__}: {text})"[:REASON_CHARS])


def _parsed_files(paths: Iterable[str | Path], options: LoadOptions, verb: str) -> Iterable[TraceRank]:
    """Parse the files in file order, several at once in worker processes when there are cores for it;
    each worker holds one decoded file at a time and sends back only its compact batches."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fleetscope-traces-") as scratch:
        unpacking = _Unpacking(Path(scratch), options.limits)
        files = _find(paths, unpacking)
        on_skip = options.on_skip or stderr_skip(verb)
        for where, exc in unpacking.refused:
            on_skip(where, exc)
        if not files and not unpacking.refused:
            raise ValueError(f"no trace files (*.json, *.json.gz, tar archives) in {', '.join(map(str, paths))}")
        inspector = [f for f in files if is_inspector(f)]
        yield from _parsed_found([f for f in files if f not in inspector], options, verb)
        if inspector:  # a job's Inspector files are read together: a communicator's members span them
            from fleetscope.producers.nccl_inspector import inspector_traces

            traces, refused = inspector_traces(inspector, options.job, options.limits.max_trace_bytes)
            for where, reason in refused:
                on_skip(where, TraceError(reason[:REASON_CHARS]))
            yield from traces


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
    on_skip = options.on_skip or stderr_skip(verb)
    # A trace without distributedInfo or rank-N in its name gets no rank; the file count is its world size.
    tasks = [(path, options.job, len(files), options.limits) for path in files]
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


def stderr_skip(command: str) -> SkipHandler:
    """The default: one line on stderr per skipped file, its reason included."""

    def skip(_path: Path, exc: TraceError) -> None:
        print(f"fleetscope {command}: skipped {exc}", file=sys.stderr)

    return skip
