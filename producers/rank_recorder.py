"""The live-job recorder behind the PyTorch hook: events in from hot paths, EventBatches out to Kafka.

Why it looks like this: it runs inside a training process, so the training thread only appends a tuple to a
bounded deque (no lock, no I/O, O(1)); when the deque is full the event is dropped and counted. One background
thread owns the ``Publisher``: every ``flush_interval_ms`` it drains the deque, builds column batches (one
per kind, with the per-batch name dictionary) and publishes them; every ``heartbeat_interval_ms`` it
publishes the rank's ``heartbeat`` (``flight_recorder``), also while the training thread is blocked.
Nothing here imports torch, so it is tested without it. Every piece of our own code that runs on a hook
goes through ``guard``: an exception is counted and logged once, never propagated into the training loop.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from fleetscope.producers.flight_recorder import RankState, heartbeat_record
from fleetscope.producers.publisher import PublisherStats
from fleetscope.schemas import BatchHeader, EventBatch, EventKind, Topics, encode
from fleetscope.schemas.topics import job_key

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PY = 0
_COLL = 1
HOLD_GRACE_NS = 10_000_000_000
"""After a window's planned end, the time its events may take to be read and published before the rank's
silence counts again (reading a GPU window's ~20k events took well under a second on an H100)."""


class BatchPublisher(Protocol):
    """What the recorder needs of ``Publisher`` (tests pass a fake)."""

    def start(self) -> None: ...
    def publish(self, batch: EventBatch) -> bool: ...
    def publish_record(self, topic: str, key: bytes, value: bytes, n_events: int = 0) -> bool: ...
    @property
    def topics(self) -> Topics: ...
    def stop(self, timeout_s: float = 10.0) -> None: ...
    @property
    def stats(self) -> PublisherStats: ...


@dataclass(frozen=True, kw_only=True)
class RankIdentity:
    """Who this process is in its job; read from the torchrun environment."""

    job: str
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    host: str = ""
    cluster: str = ""
    gpu_uuid: str = ""
    tp_rank: int = -1
    """Coordinates in the job's layout (``torch_layout`` fills them from the process groups); -1: unknown."""
    pp_rank: int = -1
    dp_rank: int = -1
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1

    def __post_init__(self) -> None:
        p: list[str] = []
        if not self.job or "/" in self.job:
            p.append(f"job must be non-empty without '/', got {self.job!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            p.append(f"need 0 <= rank < world_size, got rank={self.rank} world_size={self.world_size}")
        if self.local_rank < 0:
            p.append(f"local_rank must be >= 0, got {self.local_rank}")
        if p:
            raise ValueError("invalid rank identity: " + "; ".join(p))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RankIdentity:
        """``FLEETSCOPE_JOB``, else ``TORCHELASTIC_RUN_ID`` (when not torchrun's default "none"), else the
        rendezvous address, else a per-process id; ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
        ``FLEETSCOPE_CLUSTER``; host = ``socket.gethostname()``."""
        e = os.environ if env is None else env
        host = socket.gethostname()
        run_id = e.get("TORCHELASTIC_RUN_ID", "")
        if run_id in ("", "none") and e.get("MASTER_ADDR") and e.get("MASTER_PORT"):
            run_id = f"torchrun-{e['MASTER_ADDR']}-{e['MASTER_PORT']}"  # torchrun's default id is "none"
        job = e.get("FLEETSCOPE_JOB") or (run_id if run_id not in ("", "none") else f"local-{host}-{os.getpid()}")
        return cls(
            job=job.replace("/", "_"),
            rank=int(e.get("RANK", "0")),
            world_size=int(e.get("WORLD_SIZE", "1")),
            local_rank=int(e.get("LOCAL_RANK", "0")),
            host=host,
            cluster=e.get("FLEETSCOPE_CLUSTER", ""),
        )

    def header(self, *, producer_id: str, seq: int, streams: Iterable[str]) -> BatchHeader:
        return BatchHeader(
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            host=self.host,
            cluster=self.cluster,
            gpu_uuid=self.gpu_uuid,
            tp_rank=self.tp_rank,
            pp_rank=self.pp_rank,
            dp_rank=self.dp_rank,
            tp_size=self.tp_size,
            pp_size=self.pp_size,
            dp_size=self.dp_size,
            producer_id=producer_id,
            seq=seq,
            streams=tuple(sorted(set(streams))),
            sent_ns=time.time_ns(),
        )


@dataclass(frozen=True, kw_only=True)
class RecorderConfig:
    """Bounds of the recorder: the queue never grows past ``queue_max_events``."""

    queue_max_events: int = 200_000
    max_pending_batches: int = 256
    flush_interval_ms: int = 500
    heartbeat_interval_ms: int = 1000
    """How often the background thread publishes the rank's heartbeat."""
    max_batch_events: int = 4096
    stop_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        names = ("queue_max_events", "max_pending_batches", "flush_interval_ms", "heartbeat_interval_ms")
        p = [
            f"{name} must be >= 1, got {getattr(self, name)!r}"
            for name in (*names, "max_batch_events")
            if getattr(self, name) < 1
        ]
        if self.stop_timeout_s < 0:
            p.append(f"stop_timeout_s must be >= 0, got {self.stop_timeout_s}")
        if p:
            raise ValueError("invalid recorder config: " + "; ".join(p))


@dataclass(frozen=True, slots=True)
class RecorderStats:
    """Counters since construction (events are spans/collectives; batches are published messages)."""

    recorded: int = 0
    dropped: int = 0
    """Events or batches refused because a bound was reached (never blocks instead)."""
    batches: int = 0
    heartbeats: int = 0
    hook_errors: int = 0
    """Exceptions raised by our own code inside a hook, swallowed."""
    errors_by_site: Mapping[str, int] = field(default_factory=dict)
    publisher: PublisherStats = field(default_factory=PublisherStats)


class Recorder:
    """Bounded, non-blocking event sink for one rank, with a background publishing thread."""

    def __init__(
        self,
        identity: RankIdentity,
        publisher: BatchPublisher,
        config: RecorderConfig | None = None,
        *,
        producer_id: str = "",
        streams: Iterable[str] = (EventKind.HOST.value,),
    ) -> None:
        self.identity = identity
        self.config = config or RecorderConfig()
        self.producer_id = producer_id or f"torch-{identity.host}-{os.getpid()}"
        self._publisher = publisher
        self._events: deque[tuple[Any, ...]] = deque()
        self._batches: deque[Callable[[], list[EventBatch]]] = deque()
        self._streams = set(streams)
        self._host_events_held = False
        self._host_events_held_until_ns: int | None = None
        self._staged: dict[int, list[tuple[Any, ...]]] = {_PY: [], _COLL: []}
        self._seq = 0
        self._recorded = 0
        self._dropped = 0
        self._batches_sent = 0
        self.state = RankState()
        """The flight recorder the hooks write and the heartbeat reads."""
        self._heartbeats = 0
        self._next_beat = 0.0
        self._heartbeat_topic = ""
        self._errors: dict[str, int] = {}
        self._logged: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self._lock = threading.Lock()  # start/stop only, never on a hot path
        self._flush_lock = threading.Lock()  # the thread and a late stop() never build batches together

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the publisher and the background thread; a second call does nothing."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._publisher.start()
            self._heartbeat_topic = self._publisher.topics.heartbeats
            self._thread = threading.Thread(target=self._run, name="fleetscope-recorder", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Publish what is queued, then stop the publisher within ``stop_timeout_s``. Idempotent."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None:
                return
            self._stop.set()
            thread.join(self.config.stop_timeout_s)
            self._host_events_held = False
            self.guard("flush", self._flush)
            self._publisher.stop(self.config.stop_timeout_s)
        s = self.stats
        logger.info(
            "fleetscope recorder stopped: recorded=%d dropped=%d batches=%d hook_errors=%d",
            s.recorded,
            s.dropped,
            s.batches,
            s.hook_errors,
        )

    @property
    def running(self) -> bool:
        return self._thread is not None

    def on_own_thread(self) -> bool:
        """Whether the caller is the recorder's background thread (building batches, publishing)."""
        thread = self._thread
        return thread is not None and thread.ident == threading.get_ident()

    # -- hot paths: O(1), no lock, never raise -------------------------------------------------------
    def python_span(self, name: str, start_ns: int, dur_ns: int, depth: int = 0) -> None:
        """A host-side span (step marker, dataloader.next, optimizer.step, user annotation)."""
        if len(self._events) >= self.config.queue_max_events:
            self._dropped += 1
            return
        self._events.append((_PY, name, start_ns, dur_ns, depth))
        self._recorded += 1

    def collective(
        self,
        name: str,
        op: str,
        group: str,
        seq: int,
        group_size: int,
        nbytes: int,
        start_ns: int,
        dur_ns: int,
    ) -> None:
        """A collective as seen from the host: launched at ``start_ns``, completed ``dur_ns`` later."""
        if len(self._events) >= self.config.queue_max_events:
            self._dropped += 1
            return
        self._events.append((_COLL, name, op, group, seq, group_size, nbytes, start_ns, dur_ns))
        self._recorded += 1

    def submit(self, make_batches: Callable[[], list[EventBatch]]) -> bool:
        """Queue work that builds batches off the training thread (profiler results, NVML samples)."""
        if len(self._batches) >= self.config.max_pending_batches:
            self._dropped += 1
            return False
        self._batches.append(make_batches)
        return True

    def declare(self, kind: EventKind) -> None:
        """Add a kind to the header's ``streams``: the windower then waits for it before closing steps."""
        if kind.value not in self._streams:  # replaced, never mutated: the thread may be reading it
            self._streams = self._streams | {kind.value}

    @property
    def streams(self) -> tuple[str, ...]:
        return tuple(sorted(self._streams))

    def hold_host_events(self, until_ns: int | None = None) -> None:
        """Keep host events back (a profiling window runs) until ``release_host_events`` is submitted after its kernels.

        Why: the window's kernels are known only when the profiler stops; if the step markers went out
        first, the windower would close those steps and drop the kernels as late. Heartbeats say
        ``profiling`` (the rank's silence is no stall) only until ``HOLD_GRACE_NS`` after the window's
        planned end ``until_ns``: a window closes at a step boundary, so a rank blocked for good inside
        one would otherwise look busy profiling forever, and its hang would never be reported.
        """
        self._host_events_held = True
        self._host_events_held_until_ns = until_ns

    def release_host_events(self) -> None:
        self._host_events_held = False

    @property
    def profiling(self) -> bool:
        """Whether host events are held back for a window that may still be running (see ``hold_host_events``)."""
        until = self._host_events_held_until_ns
        return self._host_events_held and (until is None or time.time_ns() < until + HOLD_GRACE_NS)

    def guard(self, site: str, fn: Callable[..., T], *args: object, default: T | None = None) -> T | None:
        """Run our own code on a hook: an exception is counted, logged once, and ``default`` returned."""
        try:
            return fn(*args)
        except Exception as exc:
            self.count_error(site, exc)
            return default

    def count_error(self, site: str, exc: BaseException) -> None:
        self._errors[site] = self._errors.get(site, 0) + 1
        if site not in self._logged:
            self._logged.add(site)
            logger.warning(
                "fleetscope hook %s failed (training goes on; further failures only counted): %r",
                site,
                exc,
                exc_info=exc,
            )

    @property
    def stats(self) -> RecorderStats:
        errors = dict(self._errors)
        return RecorderStats(
            recorded=self._recorded,
            dropped=self._dropped,
            batches=self._batches_sent,
            heartbeats=self._heartbeats,
            hook_errors=sum(errors.values()),
            errors_by_site=errors,
            publisher=self._publisher.stats,
        )

    # -- background thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        flush_s = self.config.flush_interval_ms / 1000
        beat_s = self.config.heartbeat_interval_ms / 1000
        next_flush = time.monotonic() + flush_s
        self.guard("heartbeat", self._beat)
        self._next_beat = time.monotonic() + beat_s
        while not self._stop.wait(max(0.0, min(next_flush, self._next_beat) - time.monotonic())):
            now = time.monotonic()
            if now >= self._next_beat:
                self._next_beat = now + beat_s
                self.guard("heartbeat", self._beat)
            if now >= next_flush:
                next_flush = now + flush_s
                self.guard("flush", self._flush)

    def _beat(self) -> None:
        """Publish the rank's state now (on the recorder's thread; the publisher never blocks)."""
        ident = self.identity
        record = heartbeat_record(
            job=ident.job,
            rank=ident.rank,
            host=ident.host,
            world_size=ident.world_size,
            producer_id=self.producer_id,
            seq=self._heartbeats,
            sent_ns=time.time_ns(),
            state=self.state,
            profiling=self.profiling,
        )
        if self._publisher.publish_record(self._heartbeat_topic, job_key(ident.job), encode("heartbeat", record)):
            self._heartbeats += 1

    def _flush(self) -> None:
        with self._flush_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        while self._batches:
            make = self._batches.popleft()
            for batch in self.guard("build", make) or []:
                self._publish(batch)
        n = len(self._events)
        for _ in range(n):
            event = self._events.popleft()
            self._staged[event[0]].append(event)
        staged = sum(len(v) for v in self._staged.values())
        if self._host_events_held and staged < self.config.queue_max_events:
            return
        for kind, events in self._staged.items():
            self._staged[kind] = []
            for i in range(0, len(events), self.config.max_batch_events):
                chunk = events[i : i + self.config.max_batch_events]
                self._publish(self._python(chunk) if kind == _PY else self._collectives(chunk))

    def _publish(self, batch: EventBatch) -> None:
        if self._publisher.publish(batch):
            self._batches_sent += 1

    def next_header(self) -> BatchHeader:
        """Header for the next batch of this producer; call it on the recorder's thread (a ``submit`` job)."""
        header = self.identity.header(producer_id=self.producer_id, seq=self._seq, streams=self._streams)
        self._seq += 1
        return header

    def _python(self, events: list[tuple[Any, ...]]) -> EventBatch:
        names, ids = _intern([e[1] for e in events])
        return EventBatch(
            kind=EventKind.HOST,
            header=self.next_header(),
            names=names,
            columns={
                "start_ns": np.fromiter((e[2] for e in events), np.int64, len(events)),
                "dur_ns": np.fromiter((e[3] for e in events), np.int64, len(events)),
                "name_id": ids,
                "depth": np.fromiter((e[4] for e in events), np.int32, len(events)),
            },
        )

    def _collectives(self, events: list[tuple[Any, ...]]) -> EventBatch:
        n = len(events)
        names, ids = _intern([s for e in events for s in (e[1], e[2], e[3])])
        start = np.fromiter((e[7] for e in events), np.int64, n)
        return EventBatch(
            kind=EventKind.COLLECTIVES,
            header=self.next_header(),
            names=names,
            columns={
                "start_ns": start,
                "dur_ns": np.fromiter((e[8] for e in events), np.int64, n),
                "name_id": ids[0::3],
                "op_id": ids[1::3],
                "pg_id": ids[2::3],
                "seq": np.fromiter((e[4] for e in events), np.int64, n),
                "group_size": np.fromiter((e[5] for e in events), np.int32, n),
                "nbytes": np.fromiter((e[6] for e in events), np.int64, n),
                "launch_ns": start,
            },
        )


def _intern(values: list[str]) -> tuple[list[str], np.ndarray]:
    """Per-batch string dictionary and the ids into it."""
    table: dict[str, int] = {}
    ids = np.fromiter((table.setdefault(v, len(table)) for v in values), np.int32, len(values))
    return list(table), ids
