"""The differential's crash recovery: each job's state record, and its pattern messages held until scored.

A job's history (persistence windows, rolling medians, open findings and their versions) grows for as
long as the job runs, so replay cannot rebuild it in bounded time; it is pickled into the job's state
record instead, without the pattern records still waiting for ranks (replay brings those back). The
record is unpickled by a loader that builds nothing but fleetscope's own classes. See ``fleetscope.streams.recovery``.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import cramjam
from faust.types import Message

from fleetscope.schemas.topics import job_key
from fleetscope.streams.analysis.differential import JobDifferential
from fleetscope.streams.recovery.statelog import StateLog
from fleetscope.streams.recovery.unacked import EARLIEST, UnackedMessages

log = logging.getLogger(__name__)

_JOB_STATE_FORMAT = b"\x03"
"""3: format 2's pickle, zstd-compressed (level 1): a 4-rank real job's record 13.2 KB -> 3.8 KB (its numpy
arrays of a few ranks each are mostly pickle framing), 15 MB of float64 durations (a 1,024-rank job's noise
history) to 45 % in 0.06 CPU s (zlib: 49 % in 0.20 s). 2 (still read): uncompressed;
``progress_offset`` counts on ``<prefix>.stalls``. 1 (still read): it counted on the patterns topic, where
stall records travelled before, so it means nothing on the stalls topic and restarts at -1."""
_UNCOMPRESSED = b"\x02"
_PATTERNS_TOPIC_OFFSETS = b"\x01"
_COMPRESSION_LEVEL = 1
"""Level 3 saves 1-4 % more of a record."""


@dataclass(frozen=True)
class JobState:
    """A job's state record: the differential without its waiting pattern records (replay brings them
    back), the offset of the last stall record it applied, and whether it was flushed since."""

    job: JobDifferential
    progress_offset: int
    flushed: bool
    pickled_bytes: int = 0
    """The record's size uncompressed (``load_job_state`` sets it): what its share is counted in, like the
    pattern records' values, so that the share holds compressed as well."""


def pickle_job_state(state: JobState) -> bytes:
    """The record uncompressed (``dump_job_state`` compresses it)."""
    return pickle.dumps(
        {"job": state.job, "progress_offset": state.progress_offset, "flushed": state.flushed}, protocol=5
    )


def dump_job_state(state: JobState, pickled: bytes | None = None) -> bytes:
    """The state record; ``pickled``: ``pickle_job_state(state)``, when the caller has it."""
    body = pickle_job_state(state) if pickled is None else pickled
    return _JOB_STATE_FORMAT + bytes(cramjam.zstd.compress(body, _COMPRESSION_LEVEL))


def load_job_state(data: bytes) -> JobState:
    """Inverse of ``dump_job_state``; ``pickle.UnpicklingError`` for anything but the stage's own classes."""
    fmt = data[:1]
    if fmt not in (_JOB_STATE_FORMAT, _UNCOMPRESSED, _PATTERNS_TOPIC_OFFSETS):
        raise pickle.UnpicklingError(f"unknown job state format {fmt!r}")
    body = data[1:]
    if fmt == _JOB_STATE_FORMAT:
        try:
            body = bytes(cramjam.zstd.decompress(body))
        except cramjam.DecompressionError as exc:
            raise pickle.UnpicklingError(f"job state record does not decompress: {exc}") from exc
    raw = load_restricted(body)
    if not isinstance(raw, dict) or not isinstance(raw.get("job"), JobDifferential):
        raise pickle.UnpicklingError("job state record holds no JobDifferential")
    offset = -1 if fmt == _PATTERNS_TOPIC_OFFSETS else int(raw["progress_offset"])
    return JobState(job=raw["job"], progress_offset=offset, flushed=bool(raw["flushed"]), pickled_bytes=len(body))


_ALLOWED_GLOBALS = frozenset(
    {
        ("collections", "deque"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.numeric", "_frombuffer"),
    }
)


class _StateUnpickler(pickle.Unpickler):
    """Builds only fleetscope's own classes and a few containers: a state topic is no path to run code."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module.startswith("fleetscope."):
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        raise pickle.UnpicklingError(f"state record refers to {module}.{name}, which it may not")


def load_restricted(body: bytes) -> object:
    """Unpickle a record of the stage's own topics (state records, scoring requests and scores): fleetscope's
    classes and a few containers only, so such a topic is no path to run code."""
    return _StateUnpickler(io.BytesIO(body)).load()


def record_due(credit: float, last_bytes: int, since_s: float, interval_s: float, stale_s: float) -> bool:
    """Whether a state record that only scored iterations would change is written now: ``interval_s`` after
    the last record (a 1,024-rank job's record is 15 MB and 0.1 CPU s to pickle and compress, in the one
    process that tracks the job), once the job's credit (``share`` of the pattern bytes it took, less the
    state bytes written) covers the last record twice: once for the next record, once held for a record
    that must go at once (a finding opened or closed, a stall record, the flush at the job's end), so that
    over a run state bytes stay within ``share`` of the pattern bytes; and in any case ``stale_s`` after the
    last record (a job whose patterns come slowly: the messages a record covers are held until it is
    written, and must still be on the broker for a crash to replay them)."""
    if since_s < interval_s:
        return False
    return credit >= 2 * last_bytes or since_s >= stale_s


class DifferentialRecovery:
    """The differential's jobs, their pattern messages held until scored, and their state records."""

    def __init__(
        self,
        log: StateLog,
        jobs: dict[str, JobDifferential],
        share: float = 0.1,
        interval_s: float = 10.0,
        stale_s: float = 300.0,
    ) -> None:
        self.log = log
        self.jobs = jobs
        """The stage's jobs: restored ones are put there, revoked ones taken out."""
        self.share = share
        """State bytes written per pattern byte taken, at most, over a job's run (``record_due``): at a thousand
        ranks and 300 functions a record is megabytes, so a record per scored iteration would be 15 MB/s of
        state per job at one iteration a second; a 4-rank job's is 4 KB against its 2 KB of patterns an
        iteration. The messages of iterations not yet covered stay held, so a crash replays the larger of
        2/share records' worth of patterns and ``interval_s`` of them."""
        self.interval_s = interval_s
        """The least time between two records that only scored iterations would change."""
        self.stale_s = stale_s
        """The most time between two records while the job scores iterations."""
        self._credit: dict[str, float] = {}
        """Per job: ``share`` of the pattern bytes taken less the state bytes written (uncompressed, as the
        pattern records' values are counted), since its restore."""
        self._last_bytes: dict[str, int] = {}
        """Per job: the size of its last state record uncompressed (the next one's estimate)."""
        self._written_at: dict[str, float] = {}
        """Per job: when its last state record was written or read (monotonic seconds)."""
        self.unacked: UnackedMessages[str] = UnackedMessages()
        self.restored = 0
        self.unreadable = 0
        self._partition: dict[str, int] = {}
        self._progress_offset: dict[str, int] = {}
        self._flushed: dict[str, bool] = {}
        self._written: dict[str, tuple[int, int, int, bool, int]] = {}
        self._loaded: set[int] = set()

    async def load(self, partitions: Collection[int]) -> list[str]:
        """Restore the jobs of partitions not loaded yet; return those not flushed since their record."""
        missing = set(partitions) - self._loaded
        if not missing:
            return []
        unflushed: list[str] = []
        for p, records in (await self.log.read(missing)).items():
            for key, value in records.items():
                try:
                    state = load_job_state(value)
                except (pickle.UnpicklingError, AttributeError, EOFError, ValueError, TypeError) as exc:
                    self.unreadable += 1
                    log.error("state record of job %r is unreadable (%s); the job starts afresh", key, exc)
                    continue
                job = state.job.job
                self.jobs[job] = state.job
                self._partition[job] = p
                self._progress_offset[job] = state.progress_offset
                self._flushed[job] = state.flushed
                self._written[job] = self._mark(job)
                self._last_bytes[job], self._written_at[job] = state.pickled_bytes, time.monotonic()
                self._credit[job] = 0.0
                self.restored += 1
                log.info(
                    "restored job %r from its state record: scored up to iteration %d, %d open findings%s",
                    job,
                    state.job.scored_upto,
                    state.job.open_findings(),
                    "" if state.flushed else ", not flushed",
                )
                if not state.flushed:
                    unflushed.append(job)
        self._loaded |= missing
        return unflushed

    def place(self, job: str, partition: int) -> None:
        """The job's source partition (where its state record goes)."""
        self._partition[job] = partition

    def partition_of(self, job: str) -> int | None:
        """The job's source partition, once one of its messages was placed (``place``)."""
        return self._partition.get(job)

    def replayed_stall(self, job: str, offset: int) -> bool:
        """A stall record the job's state record applied already (re-read after a restart)."""
        return offset <= self._progress_offset.get(job, -1)

    def took(self, job: str, message: Message, iteration: int | None) -> None:
        """``message`` was applied to ``job``: a pattern record of ``iteration`` (held until it is scored) or,
        with None, a stall record (held until the next state record)."""
        self._flushed[job] = False
        horizon = EARLIEST
        if iteration is None:
            self._progress_offset[job] = max(self._progress_offset.get(job, -1), message.offset)
        else:
            horizon = iteration
            self._credit[job] = self._credit.get(job, 0.0) + self.share * len(message.value or b"")
        self.unacked.keep(job, horizon, message)

    def skipped(self, job: str, message: Message) -> None:
        """``message`` was not applied (a replayed stall record): ack it with the job's next release."""
        self.unacked.keep(job, EARLIEST, message)

    def flushed(self, job: str) -> None:
        self._flushed[job] = True

    async def checkpoint(self, jobs: Iterable[str]) -> list[Message]:
        """Write the state record of every job that changed, then release the messages records cover."""
        out: list[Message] = []
        for job in jobs:
            jd = self.jobs.get(job)
            if jd is None:
                continue
            mark = self._mark(job)
            written = self._written.get(job)
            if mark == written:
                out += self.unacked.take_harmless(job, jd.scored_upto + 1)
                continue
            if written is not None and mark[2:] == written[2:]:  # only iterations scored since the last record
                since_s = time.monotonic() - self._written_at.get(job, 0.0)
                credit, last = self._credit.get(job, 0.0), self._last_bytes.get(job, 0)
                if not record_due(credit, last, since_s, self.interval_s, self.stale_s):
                    continue  # they wait for a later record, and so do their messages
            state = JobState(job=jd, progress_offset=mark[2], flushed=mark[3])
            pickled = pickle_job_state(state)
            await self.log.write(self._partition[job], job_key(job), dump_job_state(state, pickled))
            self._written[job] = mark
            self._last_bytes[job], self._written_at[job] = len(pickled), time.monotonic()
            self._credit[job] = self._credit.get(job, 0.0) - len(pickled)
            out += self.unacked.take_harmless(job, jd.scored_upto + 1)
        return out

    def revoke(self, partitions: Collection[int]) -> list[str]:
        """Forget the jobs of revoked partitions; return them."""
        jobs = [j for j, p in self._partition.items() if p in partitions]
        self.unacked.forget(jobs)
        for job in jobs:
            tables = (self.jobs, self._partition, self._progress_offset, self._flushed, self._written)
            for table in (*tables, self._credit, self._last_bytes, self._written_at):
                table.pop(job, None)
        self._loaded -= set(partitions)
        return jobs

    def _mark(self, job: str) -> tuple[int, int, int, bool, int]:
        """What a state record must follow: iterations taken to score and tracked (apart with scoring
        processes, which track an iteration later), stall records, flushes and open findings (a hang opened
        from heartbeats, findings closed when the job ended)."""
        return (
            self.jobs[job].iterations_scored,
            self.jobs[job].scored_upto,
            self._progress_offset.get(job, -1),
            self._flushed.get(job, False),
            self.jobs[job].open_findings(),
        )
