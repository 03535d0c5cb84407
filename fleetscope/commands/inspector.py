"""``fleetscope inspector``: follow NCCL Inspector logs on a node and publish their collectives.

The training job is not touched: NCCL's Inspector plugin writes ``<host>-pid<pid>.log`` files into its
dump folder, and this process reads what they gain (complete lines only: the writer may be mid-line),
turns it into collectives batches (``producers.nccl_inspector``) and publishes them through the shared
``Publisher``, which never blocks. A line that is no Inspector record goes to the dead-letter topic with a
one-line reason and its file and line number, and the rest of the file is kept. With ``--once`` the files
are read to their end once (a last line without its newline is truncated: dead-lettered). No torch here.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fleetscope.config import Config, ConfigError
from fleetscope.producers.nccl_inspector import (
    INSPECTOR_SUFFIX,
    MAX_LINE_BYTES,
    TRUNCATED,
    InspectorJob,
    InspectorOp,
    LineProblem,
    looks_like_inspector,
    parse_line,
)

log = logging.getLogger(__name__)

DeadLetter = Callable[[str, bytes, dict[str, str]], None]
"""(key, the line as read, headers: reason, file, line) -> queued on the dead-letter topic."""
READ_BYTES = 64 << 20
"""What one pass reads of one file at most: a large backlog is taken in steps, memory bounded."""


@dataclass
class _Followed:
    """One file being followed: where its next line starts and what of a line has come so far."""

    path: Path
    job: str
    offset: int = 0
    partial: bytes = b""
    line: int = 0
    seq: int = 0
    """The producer sequence number of the file's next batch."""


@dataclass
class TailStats:
    files: int = 0
    lines: int = 0
    records: int = 0
    batches: int = 0
    dead_lettered: int = 0
    dropped: int = 0
    """Batches or dead letters the queues refused (never waited for)."""


@dataclass
class InspectorTailer:
    """Follows the Inspector files under ``paths``; each ``poll`` publishes what they gained since."""

    paths: Sequence[Path]
    job: str | None
    publish: Callable[[object], bool]
    dead_letter: DeadLetter
    stats: TailStats = field(default_factory=TailStats)
    behind: bool = False
    """A file had more to read than one pass takes: poll again at once."""
    _files: dict[Path, _Followed] = field(default_factory=dict)
    _jobs: dict[str, InspectorJob] = field(default_factory=dict)

    def discover(self) -> None:
        """Files named as they are; a folder's ``*.log`` files whose first line is an Inspector record."""
        for p in self.paths:
            found = [p] if not p.is_dir() else sorted(f for f in p.rglob(f"*{INSPECTOR_SUFFIX}") if f.is_file())
            for f in found:
                if f in self._files or not (f == p or _first_line_is_inspector(f)):
                    continue
                job = self.job or f.absolute().parent.name or "inspector"
                self._files[f] = _Followed(f, job)
                self.stats.files += 1

    def poll(self, final: bool = False) -> int:
        """Read every file's new complete lines (``final``: its end too) and publish them; batches sent."""
        self.discover()
        self.behind = False
        new: dict[str, dict[Path, list[InspectorOp]]] = {}
        for f in self._files.values():
            ops = [op for op in (self._parse(f, line, n) for n, line in self._lines(f, final)) if op is not None]
            if ops:
                new.setdefault(f.job, {})[f.path] = ops
        sent = 0
        for job, by_file in new.items():
            state = self._jobs.setdefault(job, InspectorJob(job))
            for path, ops in by_file.items():
                refused = state.note(str(path), ops)
                for op, reason in refused:
                    self._dead(self._files[path], json.dumps(asdict(op)).encode(), 0, reason)
                bad = {id(op) for op, _ in refused}
                by_file[path] = [op for op in ops if id(op) not in bad]
            ranks = state.ranks()
            layout = state.layout(ranks)
            for path, ops in by_file.items():
                f = self._files[path]
                for batch in state.batches(str(path), ops, layout, ranks, f.seq):
                    f.seq += 1
                    sent += 1
                    if not self.publish(batch):
                        self.stats.dropped += 1
        self.stats.batches += sent
        return sent

    def _lines(self, f: _Followed, final: bool) -> list[tuple[int, bytes]]:
        try:
            with open(f.path, "rb") as fh:
                fh.seek(f.offset)
                data = fh.read(READ_BYTES)
        except OSError as exc:
            log.warning("cannot read %s: %s", f.path, exc)
            return []
        f.offset += len(data)
        self.behind |= len(data) == READ_BYTES
        pieces = (f.partial + data).split(b"\n")
        f.partial = pieces.pop()
        if len(f.partial) > MAX_LINE_BYTES:
            f.line += 1
            self._dead(f, f.partial[:4096], f.line, f"line over {MAX_LINE_BYTES} bytes without its end: dropped")
            f.partial = b""
        out = []
        for line in pieces:
            f.line += 1
            if line.strip():
                out.append((f.line, line))
        if final and f.partial.strip() and len(data) < READ_BYTES:  # the file's end: its last line, unended
            f.line += 1
            out.append((-f.line, f.partial))
            f.partial = b""
        self.stats.lines += len(out)
        return out

    def _parse(self, f: _Followed, line: bytes, n: int) -> InspectorOp | None:
        """The line's operation; None when it is none (dead-lettered). ``n < 0``: line ``-n`` lacks its newline."""
        try:
            op = parse_line(line)
        except LineProblem as exc:
            self._dead(f, line, abs(n), f"{TRUNCATED}{exc}" if n < 0 else str(exc))
            return None
        self.stats.records += 1
        return op

    def _dead(self, f: _Followed, line: bytes, n: int, reason: str) -> None:
        self.stats.dead_lettered += 1
        log.info("%s:%d: %s", f.path, n, reason)
        headers = {"reason": f"inspector: {reason}", "file": str(f.path), "line": str(n)}
        self.dead_letter(f"{f.job}/{f.path.name}", line[:MAX_LINE_BYTES], headers)


def _first_line_is_inspector(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return looks_like_inspector(fh.readline(MAX_LINE_BYTES))
    except OSError:
        return False


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "inspector",
        parents=[common],
        help="follow NCCL Inspector logs and publish their collectives",
        description="Follow the NCCL Inspector plugin's output (NCCL_INSPECTOR_DUMP_DIR: one "
        "<host>-pid<pid>.log per process) and publish each rank's collectives to the broker, the job's "
        "layout from the communicators' membership. No change to the training job. A folder stands for "
        "its *.log files in Inspector format; a bad line goes to the dead-letter topic with its reason.",
    )
    p.add_argument("paths", nargs="+", metavar="DIR_OR_FILE", help="Inspector dump folders or files")
    p.add_argument("--job", help="job id (default: each file's folder name, e.g. nccl-inspector-<slurm job>)")
    p.add_argument("--once", action="store_true", help="read the files to their end once, then stop")
    p.add_argument("--interval-ms", type=int, default=1000, help="how often the files are read (default: 1000)")
    p.add_argument("--json", action="store_true", help="print the counts as JSON at the end")
    p.set_defaults(handler=cmd_inspector)


def cmd_inspector(args: argparse.Namespace, config: Config) -> int:
    from confluent_kafka import Producer

    from fleetscope.broker import ensure_topics
    from fleetscope.producers import Publisher
    from fleetscope.schemas import Topics
    from fleetscope.wiring import bulk_publisher_config

    k = config.kafka
    if not k.bootstrap_servers:
        raise ConfigError(["kafka.bootstrap_servers: inspector needs a broker (--bootstrap, or `fleetscope up`)"])
    if args.interval_ms < 1:
        raise ConfigError([f"--interval-ms: {args.interval_ms} < 1"])
    topics = Topics(prefix=k.topic_prefix)
    ensure_topics(k.admin_settings(), topics, k.raw_partitions, k.derived_partitions)
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    letters = Producer({
        "bootstrap.servers": k.bootstrap_servers, **k.client_settings(), "linger.ms": 50,
        "client.id": "fleetscope-inspector-deadletter", "queue.buffering.max.messages": 10_000,
    })  # fmt: skip

    def dead_letter(key: str, value: bytes, headers: dict[str, str]) -> None:
        try:
            letters.produce(topics.deadletter, value=value, key=key.encode(), headers=list(headers.items()))
        except BufferError:  # never wait: a full queue drops the letter (counted)
            tailer.stats.dropped += 1
        letters.poll(0)

    with Publisher(bulk_publisher_config(config)) as publisher:
        tailer = InspectorTailer([Path(p) for p in args.paths], args.job, publisher.publish, dead_letter)
        tailer.poll(final=args.once)
        while tailer.behind or not (args.once or stop.wait(args.interval_ms / 1000)):
            tailer.poll(final=args.once)
        publisher.flush(30.0)
    letters.flush(10.0)
    s = tailer.stats
    if args.json:
        print(json.dumps(asdict(s)))
    else:
        print(f"fleetscope inspector: {s.files} file(s), {s.records} record(s) in {s.batches} batch(es) -> "
              f"{k.bootstrap_servers}; {s.dead_lettered} line(s) dead-lettered, {s.dropped} dropped")  # fmt: skip
    return 0 if s.files else 1
