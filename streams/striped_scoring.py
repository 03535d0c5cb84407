"""One job's iterations scored by every worker of the app, through Kafka (``streams.score_across_workers``).

A job's head (the worker that owns its patterns partition) places each rank's record by its head, as with a
pool, but hands each complete iteration to ``KafkaScoring``: it publishes the iteration's messages, in parts,
to ``<prefix>.score-requests``, one job's consecutive iterations on consecutive partitions (the iteration
stripes), so that each stripe's owner scores its share. A worker's ``StripeScorer`` assembles a request's
parts, runs the pool's pure ``score_payloads`` and sends the score to ``<prefix>.scores`` on the job's
patterns partition: co-partitioned, so it reaches the head, whose ordered tracker
(``DifferentialStage.collect``) applies it. Scoring is pure, so a request scored twice (re-delivered after
a scorer's death or a rebalance, or sent again once overdue) gives the same score; the head takes the first
score of each request and ignores the rest. The head's recovery (state records, held messages) is the
stage's own: the state covers only iterations tracked.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from aiokafka.partitioner import DefaultPartitioner

from fleetscope.schemas import SchemaError
from fleetscope.schemas.catalog import SchemaEntry
from fleetscope.schemas.codec import decode_head, schema_id_of
from fleetscope.schemas.signing import MAC_HEADER, Headers, findings_mac, signature_reason
from fleetscope.schemas.topics import job_key
from fleetscope.streams.analysis.differential import DifferentialConfig
from fleetscope.streams.recovery.differential import load_restricted
from fleetscope.streams.scoring import PoolScore, score_payloads

log = logging.getLogger(__name__)

_REQUEST, _SCORE = b"Q", b"S"
"""The first byte of a request's and of a score's frames."""
_FRAME = struct.Struct(">c16s4sII")
"""A frame's head: its kind, the request id, the body's copy (two scorers' copies of one score need not be
the same bytes, so their frames must not mix), the frame's place and how many frames the body has."""
_LENGTH = struct.Struct(">I")
_MAX_ASSEMBLING = 256
"""Bodies assembled at once; past it the oldest is dropped (its head sends the request again when due)."""
_PARTITIONER = DefaultPartitioner()

Payload = bytes | dict[str, Any]
Send = Callable[[int, bytes, bytes], object]
"""Sends one message, (partition, key, value), without waiting (Faust's ``send_soon``)."""


def stripe_of(job: str, ordinal: int, stripes: int) -> int:
    """The requests partition of a job's ``ordinal``-th iteration: consecutive iterations on consecutive
    partitions from a start of the job's own (CRC-32), so a job's stripes, and several jobs, spread evenly."""
    return (zlib.crc32(job.encode()) + ordinal) % stripes


def default_partition(job: str, partitions: int) -> int:
    """The partition Faust's producer picks for a message keyed by ``job`` (the windower's pattern records):
    where a job's score goes before any of its messages was placed."""
    return int(_PARTITIONER(job_key(job), list(range(partitions)), list(range(partitions))))


def frames(kind: bytes, request: bytes, pieces: Sequence[bytes], part_bytes: int) -> list[bytes]:
    """The pieces, end to end, cut into message values of at most ``part_bytes`` of them each (a 512-rank
    iteration's request is 24 MB, its score 0.35 MB, where a message is at most about 1 MB); each byte is
    copied once."""
    total = sum(len(p) for p in pieces)
    n = max(1, -(-total // part_bytes))
    out: list[bytes] = []
    copy = os.urandom(4)
    views = [memoryview(p) for p in pieces]
    at, offset = 0, 0
    for i in range(n):
        room, chunk = part_bytes, [memoryview(_FRAME.pack(kind, request, copy, i, n))]
        while room and at < len(views):
            take = views[at][offset : offset + room]
            chunk.append(take)
            room -= len(take)
            offset += len(take)
            if offset == len(views[at]):
                at, offset = at + 1, 0
        out.append(b"".join(chunk))
    return out


def encode_request(job: str, request: bytes, reply: int, payloads: Sequence[Payload], part_bytes: int) -> list[bytes]:
    """An iteration's scoring request as frames: ``request`` its id, ``reply`` the scores partition. Its body
    is a pickled head (the job, the reply partition, each message's size, the records decoded already), its
    length before it, then the messages as they came: they are not pickled, so not copied twice."""
    messages = [p for p in payloads if isinstance(p, bytes)]
    head = pickle.dumps(
        {
            "job": job,
            "reply": reply,
            "sizes": [len(p) if isinstance(p, bytes) else -1 for p in payloads],
            "records": [p for p in payloads if not isinstance(p, bytes)],
        },
        protocol=5,
    )
    return frames(_REQUEST, request, [_LENGTH.pack(len(head)), head, *messages], part_bytes)


def decode_request(body: bytes) -> tuple[str, int, list[Payload]]:
    """(job, reply partition, payloads) of a request's body; ``SchemaError`` with the reason if it is none."""
    if len(body) < _LENGTH.size:
        raise SchemaError("a scoring request is shorter than its head's length")
    (n,) = _LENGTH.unpack_from(body)
    fields = load_body(body[_LENGTH.size : _LENGTH.size + n], "scoring request")
    reply, sizes, records = fields.get("reply"), fields.get("sizes"), fields.get("records")
    if not (isinstance(reply, int) and reply >= 0 and isinstance(sizes, list) and isinstance(records, list)):
        raise SchemaError("a scoring request holds no reply partition, sizes or records")
    at, decoded = _LENGTH.size + n, iter(records)
    payloads: list[Payload] = []
    view = memoryview(body)
    for size in sizes:
        if not isinstance(size, int) or at + max(size, 0) > len(body):
            raise SchemaError("a scoring request's messages are shorter than its sizes say")
        if size < 0:
            record = next(decoded, None)
            if not isinstance(record, dict):
                raise SchemaError("a scoring request has fewer records than its sizes say")
            payloads.append(record)
            continue
        payloads.append(bytes(view[at : at + size]))
        at += size
    return fields["job"], reply, payloads


def encode_score(job: str, request: bytes, score: PoolScore, part_bytes: int) -> list[bytes]:
    """A score as frames."""
    return frames(_SCORE, request, [pickle.dumps({"job": job, "score": score}, protocol=5)], part_bytes)


def frame_head(value: bytes, kind: bytes) -> tuple[bytes, int, int]:
    """(request id, place, frames) of a frame of ``kind``; ``SchemaError`` for anything else."""
    if len(value) < _FRAME.size:
        raise SchemaError(f"a scoring frame has a {_FRAME.size}-byte head, got {len(value)} bytes")
    got, request, _, part, parts = _FRAME.unpack_from(value)
    if got != kind or not 0 <= part < parts:
        raise SchemaError(f"not a {kind!r} scoring frame (kind {got!r}, frame {part} of {parts})")
    return request, part, parts


def load_body(body: bytes, what: str) -> dict[str, Any]:
    """A request's or score's fields; ``SchemaError`` with the reason for anything else."""
    try:
        fields = load_restricted(body)
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as exc:
        raise SchemaError(f"{what} does not unpickle: {exc!r}") from exc
    if not isinstance(fields, dict) or not isinstance(fields.get("job"), str):
        raise SchemaError(f"{what} names no job")
    return fields


@dataclass(slots=True)
class _Assembly:
    partition: int
    frames: dict[int, bytes] = field(default_factory=dict)


class Reassembly:
    """Frames in, whole bodies out, at most ``_MAX_ASSEMBLING`` bodies open at once."""

    def __init__(self, kind: bytes) -> None:
        self._kind = kind
        self._open: OrderedDict[bytes, _Assembly] = OrderedDict()
        self.dropped = 0

    def take(self, value: bytes, partition: int = -1) -> tuple[bytes, bytes] | None:
        """(request id, body) once a body's last frame is in, else None; ``SchemaError`` for no such frame."""
        request, part, parts = frame_head(value, self._kind)
        if parts == 1:
            return request, value[_FRAME.size :]
        body = value[: _FRAME.size - 8]  # the kind, the request id and the copy
        assembly = self._open.pop(body, None) or _Assembly(partition)
        assembly.frames[part] = value[_FRAME.size :]
        if len(assembly.frames) < parts:
            self._open[body] = assembly
            while len(self._open) > _MAX_ASSEMBLING:
                self._open.popitem(last=False)
                self.dropped += 1
            return None
        return request, b"".join(assembly.frames[i] for i in range(parts))

    def forget(self, partitions: set[int]) -> None:
        """Drop bodies half read from these partitions: their next owner reads them again."""
        for body, assembly in list(self._open.items()):
            if assembly.partition in partitions:
                del self._open[body]


def frame_headers(secret: bytes, topic: str, key: bytes, value: bytes) -> list[tuple[str, bytes]]:
    """A frame's headers: its signature with the findings' key (``schemas.signing``), where the worker has one.
    A score decides findings the head then signs, so a frame anyone could write must not reach it."""
    return [(MAC_HEADER, findings_mac(secret, topic, key, value))] if secret else []


def frame_refused(secret: bytes, topic: str, key: bytes | None, value: bytes, headers: Headers) -> str | None:
    """Why a request or score frame is not a worker's (one line), or None: it verifies, or no key is set."""
    return signature_reason(secret, topic, key, value, headers) if secret else None


def writers_of(payloads: Sequence[Payload]) -> dict[int, SchemaEntry]:
    """The writer schemas of the messages, resolved in this process (schema ids never change); an id that
    does not resolve is left out, and ``score_payloads`` rejects its message with the reason."""
    writers: dict[int, SchemaEntry] = {}
    for payload in payloads:
        if not isinstance(payload, bytes):
            continue
        try:
            if schema_id_of(payload) not in writers:
                writer, _ = decode_head(payload)
                writers[writer.schema_id] = writer
        except SchemaError:
            continue
    return writers


@dataclass(slots=True)
class _Request:
    """An iteration out for scoring: its future, what was sent (framed again when overdue: the messages are
    the stage's own, so a pending request holds no copy of them), where, and when it is due."""

    job: str
    future: Future[PoolScore]
    payloads: list[Payload]
    stripe: int
    reply: int
    due: float
    wait_s: float


class KafkaScoring:
    """The head's side: each complete iteration published to its stripe, its score's future done when the
    score comes back (``receive``); a request unanswered for ``resend_after_s`` is sent again, waiting twice as
    long each time (its scorer died after taking it, before its score was sent)."""

    def __init__(
        self,
        send: Send,
        stripes: int,
        part_bytes: int,
        reply_partition: Callable[[str], int],
        resend_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if stripes < 1 or part_bytes < 1 or resend_after_s <= 0:
            raise ValueError(
                f"stripes, part_bytes and resend_after_s must be positive: {stripes}, {part_bytes}, {resend_after_s}"
            )
        self.processes = stripes
        """What the stage's backpressure counts: two iterations in flight per stripe."""
        self._send, self._part_bytes, self._reply = send, part_bytes, reply_partition
        self._resend_after_s, self._clock = resend_after_s, clock
        self._pending: dict[bytes, _Request] = {}
        self._ordinal: dict[str, int] = {}
        self._lock = threading.Lock()
        self._scores = Reassembly(_SCORE)
        self.submitted = 0
        self.resent = 0
        self.duplicates = 0
        """Scores of requests already answered, or no longer wanted (a moved job, an old run): ignored."""

    def submit(self, job: str, payloads: list[Payload], writers: dict[int, SchemaEntry]) -> Future[PoolScore]:
        """Publish one iteration of ``job`` for scoring (``writers``: resolved again by the scorer)."""
        del writers
        request = os.urandom(16)
        with self._lock:
            ordinal = self._ordinal.get(job, 0)
            self._ordinal[job] = ordinal + 1
        future: Future[PoolScore] = Future()
        stripe = stripe_of(job, ordinal, self.processes)
        pending = _Request(job, future, payloads, stripe, self._reply(job), 0.0, self._resend_after_s)
        pending.due = self._clock() + pending.wait_s
        with self._lock:
            self._pending[request] = pending
            self.submitted += 1
        future.add_done_callback(lambda f: self._drop(request) if f.cancelled() else None)
        self._publish(request, pending)
        return future

    def _publish(self, request: bytes, pending: _Request) -> None:
        key = job_key(pending.job)
        for value in encode_request(pending.job, request, pending.reply, pending.payloads, self._part_bytes):
            self._send(pending.stripe, key, value)

    def receive(self, value: bytes) -> bool:
        """Take a score's frame: True where it completed the score of a request still pending here. Frames of
        requests no longer pending (answered already, a moved job, an earlier run) are ignored unread."""
        request, _, _ = frame_head(value, _SCORE)
        with self._lock:
            if request not in self._pending:
                self.duplicates += 1
                return False
        whole = self._scores.take(value)
        if whole is None:
            return False
        fields = load_body(whole[1], "score")
        score = fields.get("score")
        if not isinstance(score, PoolScore):
            raise SchemaError("a score holds no PoolScore")
        with self._lock:
            pending = self._pending.pop(request, None)
        if pending is None or pending.job != fields["job"]:
            self.duplicates += 1
            return False
        try:
            pending.future.set_result(score)
        except InvalidStateError:  # cancelled meanwhile: its job moved
            return False
        return True

    def resend_overdue(self) -> int:
        """Send again the requests whose scores are overdue; how many."""
        now = self._clock()
        with self._lock:
            overdue = [(r, p) for r, p in self._pending.items() if p.due <= now]
            for _, p in overdue:
                p.wait_s *= 2
                p.due = now + p.wait_s
            self.resent += len(overdue)
        for request, p in overdue:
            log.info("a score of job %r is overdue: its request is sent again", p.job)
            self._publish(request, p)
        return len(overdue)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def _drop(self, request: bytes) -> None:
        with self._lock:
            self._pending.pop(request, None)

    def close(self) -> None:
        """Cancel what is still out (the worker stops; its jobs' messages replay elsewhere)."""
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.future.cancel()


class StripeScorer:
    """A worker's scorer of the stripes it owns: request frames in, the frames of each score out, with the
    (partition, key) they go to."""

    def __init__(self, config: DifferentialConfig, part_bytes: int) -> None:
        self._config, self._part_bytes = config, part_bytes
        self._requests = Reassembly(_REQUEST)
        self.scored = 0

    def take(self, value: bytes, partition: int = -1) -> list[tuple[int, bytes, bytes]]:
        """One request frame from requests ``partition``: the score's frames once the request is whole (none
        before). A frame that is no request's raises ``SchemaError`` with the reason."""
        whole = self._requests.take(value, partition)
        if whole is None:
            return []
        request, body = whole
        job, reply, payloads = decode_request(body)
        score = score_payloads(job, payloads, writers_of(payloads), self._config)
        self.scored += 1
        return [(reply, job_key(job), v) for v in encode_score(job, request, score, self._part_bytes)]

    def revoke(self, partitions: set[int]) -> None:
        """Forget the requests half read from revoked partitions: their next owner reads them again."""
        self._requests.forget(partitions)
