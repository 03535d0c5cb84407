"""Flight Recorder dumps in ``analyze``: which files are dumps, and the hang verdict they give.

Why apart from trace loading: a dump is told from a Kineto trace by its first bytes, not its name
(PyTorch names them ``<prefix><rank>``, no suffix), and one folder's dumps are one job's ranks, judged
together by the live path's own verdict (``hangs.snapshot_hang`` over ``flight_dumps.dump_heartbeats``)
and reported as the hang finding the live path opens. A dump that cannot be read costs one ``skipped``
line with its reason; the job is judged on the others (a member without a dump is named ``unreported``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleetscope.producers.flight_dumps import (
    HEAD_BYTES,
    RankDump,
    dump_heartbeats,
    is_dump,
    load_dump,
    rank_prefix,
)
from fleetscope.producers.kineto_load import TraceError
from fleetscope.streams.analysis.differential import DifferentialConfig
from fleetscope.trace_loading import ARCHIVE_SUFFIXES, TRACE_SUFFIXES

SkipHandler = Callable[[Path, TraceError], None]


def _head(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(HEAD_BYTES)
    except OSError:
        return b""  # the trace loader says why it cannot be read


def split_dumps(paths: Iterable[str | Path]) -> tuple[list[Path], list[str | Path]]:
    """The dump files among ``paths`` (a directory's files of any name, told by their first bytes) and
    what is left for the trace loader: named files that are not dumps, directories without dumps as
    given, and the trace-named files of directories with dumps."""
    dumps: list[Path] = []
    rest: list[str | Path] = []
    for item in paths:
        p = Path(item)
        if not p.is_dir():
            if p.is_file() and is_dump(_head(p)):
                dumps.append(p)
            else:
                rest.append(item)
            continue
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.endswith((".gz", *ARCHIVE_SUFFIXES)))
        found = {f for f in files if is_dump(_head(f))}
        if not found:
            rest.append(item)
            continue
        # a file named like a dump beside them (its rank's) is one, garbled: read, to say why it is skipped
        prefixes = {_prefix(f) for f in found}
        dumps += [f for f in files if f in found or _prefix(f) in prefixes]
        named = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(TRACE_SUFFIXES + ARCHIVE_SUFFIXES))
        rest += [f for f in named if f not in found and _prefix(f) not in prefixes]
    return dumps, rest


def _prefix(path: Path) -> tuple[Path, str] | None:
    """A dump's folder and name without its rank (``nccl_trace_rank_``); None for a name without one."""
    prefix = rank_prefix(path.name)
    return None if prefix is None else (path.parent, prefix)


@dataclass
class DumpAnalysis:
    findings: list[dict[str, Any]] = field(default_factory=list)
    """One hang finding per job whose dumps show one (the live path's record)."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Per dump read: job, rank, path, entries, and the collective it waits in (or last left)."""
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per job: the verdict's evidence, or ``{"verdict": "no hang", "reason": ...}``."""


def analyze_dumps(
    files: Sequence[Path], config: DifferentialConfig | None, job: str | None, on_skip: SkipHandler
) -> DumpAnalysis:
    """Read the dumps, group them by job (``job`` or each file's directory name), one rank each, and
    judge each job's snapshot; a hang waits at least ``hang_min_stall_ms`` inside a collective."""
    from fleetscope.streams.analysis.findings import FindingTracker
    from fleetscope.streams.analysis.hangs import snapshot_hang

    cfg = config or DifferentialConfig()
    threshold_ns = cfg.job_level.hang_min_stall_ms * 1e6
    jobs: dict[str, dict[int, RankDump]] = {}
    for path in files:
        try:
            dump = load_dump(path)
        except TraceError as exc:
            on_skip(path, exc)
            continue
        ranks = jobs.setdefault(job or path.parent.name or "job", {})
        if dump.rank in ranks:
            on_skip(path, TraceError(f"{path}: rank {dump.rank} already read from {ranks[dump.rank].path}"))
            continue
        ranks[dump.rank] = dump
    out = DumpAnalysis()
    for name, ranks in sorted(jobs.items()):
        latest = dump_heartbeats(list(ranks.values()), name)
        for rank, dump in sorted(ranks.items()):
            hb, waiting = latest[rank], dump.waiting()
            out.ranks.append({
                "job": name, "rank": rank, "path": dump.path, "entries": len(dump.entries),
                "in_collective": waiting is not None, "collective": _call(hb),
                "waited_ms": round((dump.as_of_ns - waiting.created_ns) / 1e6) if waiting else 0,
            })  # fmt: skip
        sig = snapshot_hang(latest, threshold_ns)
        if sig is None:
            waits = sum(1 for hb in latest.values() if hb["in_collective"])
            out.verdicts[name] = {"verdict": "no hang", "reason": _calm(len(latest), waits, threshold_ns)}
            continue
        out.verdicts[name] = dict(sig.evidence, function=sig.function)
        out.findings += FindingTracker(name).emit_now(sig, 0)
    return out


def _call(hb: dict[str, Any]) -> str:
    """``allreduce#0:3`` (op, group, sequence number), or empty before any collective."""
    return f"{hb['collective_op']}#{hb['collective_pg']}:{hb['collective_seq']}" if "collective_op" in hb else ""


def _calm(dumps: int, waits: int, threshold_ns: float) -> str:
    if not waits:
        return f"every entry of the {dumps} dump(s) completed: no rank waits in a collective"
    return f"{waits} rank(s) inside a collective, none for {threshold_ns / 1e9:g} s (hang_min_stall_ms)"


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks)) or "none"


def verdict_lines(job: str, verdict: dict[str, Any]) -> list[str]:
    """A job's Flight Recorder verdict as text: who never joined, who is stuck, what members disagree on."""
    kind = verdict.get("kind")
    head = f"{job}: flight recorder: {verdict['verdict']}"
    if kind is None:
        return [f"{head} ({verdict['reason']})"]
    where = f"{verdict['op']} #{verdict['seq']} of group {verdict['group']}"
    waited = f"{verdict['waiting_ns'] / 1e9:.3f} s"
    if kind == "missing_member":
        out = [f"{head}: rank(s) {_ranks(verdict['not_entered'])} never entered {where}; "
               f"rank(s) {_ranks(verdict['entered'])} wait in it ({waited})"]  # fmt: skip
        if verdict.get("waiting_elsewhere"):
            out.append(f"  held up themselves, in another collective: {_ranks(verdict['waiting_elsewhere'])}")
        if verdict.get("unreported"):
            out.append(f"  no dump read: {_ranks(verdict['unreported'])}")
        return out
    if kind == "desync":
        calls = "; ".join(f"{call} on rank(s) {_ranks(rs)}" for call, rs in verdict["calls"].items())
        return [f"{head} ({', '.join(verdict['mismatch'])}) at {where}: {calls}"]
    return [f"{head}: every member (rank(s) {_ranks(verdict['entered'])}) is inside {where} ({waited})"]
