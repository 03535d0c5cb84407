"""Processes that score a job's iterations while the differential worker reads on.

One job's differential is one partition's work: a 100,000-GPU job at an iteration a second is about 40 cores
of decoding and scoring (docs/scaling.md). An iteration's score is a pure function of its records
(``score_records``); only tracking it needs the job's history, and that is cheap. So the worker places each
rank's record by its head alone (``decode_head``: a few varints), hands each complete iteration's messages
to a process of this pool, which decodes and scores them, and tracks the scores in iteration order
(``JobDifferential.apply``). The findings are those of scoring in the worker; the job's state covers the
iterations tracked, so those still being scored are replayed after a crash.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing.shared_memory import SharedMemory
from typing import Protocol

from fleetscope.lifetime import die_with_parent
from fleetscope.schemas import SchemaError, decode
from fleetscope.schemas.catalog import SchemaEntry
from fleetscope.streams.analysis.differential import DifferentialConfig, IterationScore, ScoringCache, score_records
from fleetscope.streams.analysis.signals import OutlierScorer
from fleetscope.streams.reasons import reason

log = logging.getLogger(__name__)

_MAX_JOBS = 64
"""Jobs whose function index a scoring process keeps (a cache: a job not in it is indexed afresh)."""


@dataclass(frozen=True, slots=True)
class PoolScore:
    """What a scoring process returns for one iteration: its score (None where none of its messages decoded,
    or scoring failed) and each message it could not use, by its place in the iteration, with the reason."""

    score: IterationScore | None
    rejected: list[tuple[int, str]] = field(default_factory=list)


class IterationScoring(Protocol):
    """Where the differential has its complete iterations scored: ``submit`` one, get its score's future."""

    processes: int
    """How many processes score besides the worker (0: the worker itself)."""

    def submit(
        self, job: str, payloads: list[bytes | dict[str, object]], writers: dict[int, SchemaEntry]
    ) -> Future[PoolScore]: ...

    def close(self) -> None: ...


class InlineScoring:
    """A pool of none (``streams.scoring_processes = 0``): each iteration scored in the worker when it is
    handed over, by the same ``score_payloads`` a pool process runs, so the worker has one path."""

    processes = 0

    def __init__(
        self,
        config: DifferentialConfig,
        scorer: OutlierScorer | None = None,
        cache_of: Callable[[str], ScoringCache] | None = None,
    ) -> None:
        self._config = config
        self._scorer = scorer
        """Overrides the scorer ``config`` names (tests, experiments); None: the configured one."""
        self._cache_of = cache_of
        """Each job's scoring cache (its differential's); None: this process's."""
        self.submitted = 0

    def submit(
        self, job: str, payloads: list[bytes | dict[str, object]], writers: dict[int, SchemaEntry]
    ) -> Future[PoolScore]:
        """Score one iteration now; its future is done."""
        self.submitted += 1
        future: Future[PoolScore] = Future()
        cache = self._cache_of(job) if self._cache_of is not None else None
        future.set_result(score_payloads(job, payloads, writers, self._config, self._scorer, cache))
        return future

    def close(self) -> None:
        """Nothing to stop."""


class ScoringPool:
    """A pool of scoring processes (``processes``), each with the differential's configuration."""

    def __init__(self, processes: int, config: DifferentialConfig) -> None:
        if processes < 1:
            raise ValueError(f"a scoring pool needs at least one process, got {processes}")
        self.processes = processes
        # forkserver: the worker's threads (Kafka clients) must not be forked with it; its processes start with
        # this module imported, not the worker's main module
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([__name__])
        self._config = config
        self._executor = self._start()
        self.submitted = 0
        self.restarts = 0
        """How often a process died (killed, out of memory) and the pool was started afresh."""
        self._blocks: list[SharedMemory] = []
        """Shared memory blocks free for the next iteration: a fresh block's pages cost more to fault in than
        the copy (48 MB: 41 ms, against 6 ms into pages already mapped)."""
        self._keep = 2 * processes + 2
        self._lock = threading.Lock()
        self._closed = False
        log.info("the differential scores its iterations in %d processes", processes)

    def submit(
        self, job: str, payloads: list[bytes | dict[str, object]], writers: dict[int, SchemaEntry]
    ) -> Future[PoolScore]:
        """Score one iteration of ``job``: its messages (or records decoded already), and the writer schemas
        of the messages by id (resolved here, where the schema registry client is). The messages go in one
        shared memory block, one copy: through the pool's pipe they cost the worker more than placing them."""
        self.submitted += 1
        spans: list[tuple[int, int] | dict[str, object]] = []
        at = 0
        for payload in payloads:
            if isinstance(payload, dict):
                spans.append(payload)
            else:
                spans.append((at, at + len(payload)))
                at += len(payload)
        block = self._block(at)
        try:
            view = _view(block)
            for payload, span in zip(payloads, spans, strict=True):
                if isinstance(span, tuple) and isinstance(payload, bytes):
                    view[span[0] : span[1]] = payload
            view.release()
            try:
                future = self._executor.submit(score_shared, job, block.name, spans, writers)
            except BrokenProcessPool:  # a process died since the last iteration: a fresh pool takes this one
                self._restart()
                future = self._executor.submit(score_shared, job, block.name, spans, writers)
        except BaseException:
            self._free(block)
            raise
        future.add_done_callback(lambda _: self._free(block))
        return future

    def _start(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self.processes, mp_context=self._context, initializer=_configure, initargs=(self._config,)
        )

    def _restart(self) -> None:
        with self._lock:
            if self._closed:
                raise BrokenProcessPool("the scoring pool is closed")
        log.warning("a scoring process died: the pool starts afresh")
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = self._start()
        self.restarts += 1

    def _block(self, size: int) -> SharedMemory:
        with self._lock:
            fits = [b for b in self._blocks if b.size >= size]
            if fits:
                block = min(fits, key=lambda b: b.size)
                self._blocks.remove(block)
                return block
        return SharedMemory(create=True, size=max(size + size // 4, 4096))

    def _free(self, block: SharedMemory) -> None:
        with self._lock:
            if not self._closed and len(self._blocks) < self._keep:
                self._blocks.append(block)
                return
        _release(block)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._closed = True
            blocks, self._blocks = self._blocks, []
        for block in blocks:
            _release(block)


class _Writers:
    """The writer schemas the worker resolved: what decoding in a scoring process reads."""

    def __init__(self, writers: dict[int, SchemaEntry]) -> None:
        self._writers = writers

    def schema_id(self, subject: str) -> int:
        raise SchemaError(f"a scoring process does not encode ({subject})")

    def writer_schema(self, schema_id: int) -> SchemaEntry:
        entry = self._writers.get(schema_id)
        if entry is None:
            raise SchemaError(f"unknown schema id {schema_id}")
        return entry


_config = DifferentialConfig()
_caches: OrderedDict[str, ScoringCache] = OrderedDict()


def _configure(config: DifferentialConfig) -> None:
    """A scoring process's configuration, once at its start; it dies with the worker that owns it."""
    global _config
    die_with_parent()
    _config = config


def _view(block: SharedMemory) -> memoryview:
    if block.buf is None:
        raise ValueError(f"shared memory block {block.name} is closed")
    return memoryview(block.buf)


def _release(block: SharedMemory) -> None:
    block.close()
    block.unlink()


def score_shared(
    job: str, name: str, spans: list[tuple[int, int] | dict[str, object]], writers: dict[int, SchemaEntry]
) -> PoolScore:
    """``score_payloads`` of messages in a shared memory block (``ScoringPool.submit``), in a scoring process."""
    block = SharedMemory(name=name)
    try:
        view = _view(block)
        payloads = [bytes(view[s[0] : s[1]]) if isinstance(s, tuple) else s for s in spans]
        view.release()
    finally:
        block.close()
    return score_payloads(job, payloads, writers)


def score_payloads(
    job: str,
    payloads: list[bytes | dict[str, object]],
    writers: dict[int, SchemaEntry],
    config: DifferentialConfig | None = None,
    scorer: OutlierScorer | None = None,
    cache: ScoringCache | None = None,
) -> PoolScore:
    """Decode and score one iteration (in a scoring process, or the worker: ``InlineScoring``). A message that
    does not decode is left out and returned with its reason; a failure of the analysis costs the iteration,
    reported on its last message. ``config``: None, the process's (``_configure``); ``cache``: None, the
    process's cache of each job's."""
    resolver = _Writers(writers)
    records: list[dict[str, object]] = []
    rejected: list[tuple[int, str]] = []
    for i, payload in enumerate(payloads):
        if isinstance(payload, dict):
            records.append(payload)
            continue
        try:
            subject, record = decode(payload, resolver=resolver)
        except SchemaError as exc:
            rejected.append((i, reason("schema", exc)))
            continue
        records.append(record)
    if not records:
        return PoolScore(None, rejected)
    if cache is None:
        cache = _caches.pop(job, None) or ScoringCache()
        _caches[job] = cache
        while len(_caches) > _MAX_JOBS:
            _caches.popitem(last=False)
    try:
        return PoolScore(score_records(records, config or _config, scorer, cache), rejected)
    except Exception as exc:  # an analysis bug must cost one iteration, not the pool
        log.warning("scoring an iteration of job %r failed: %r", job, exc)
        return PoolScore(None, [*rejected, (len(payloads) - 1, reason("differential", exc))])
