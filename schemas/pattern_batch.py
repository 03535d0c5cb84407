"""Pattern batches: one message on the patterns topic for several ranks' pattern records of one job.

The stream framework and the broker cost about the same per message whatever its size, and a rank-iteration's
pattern record is one message: a take's records of a job go together instead, each element exactly the message
the record alone would be, so whoever places, scores or stores a record takes the element unchanged. A lone
record still goes bare (the old contract, which every reader keeps reading).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fleetscope.schemas.codec import SchemaError, decode, decode_head, encode

PATTERNS = "patterns"
PATTERN_BATCH = "pattern_batch"
PATTERN_TOPIC_SUBJECTS = (PATTERNS, PATTERN_BATCH)
"""What the windower writes on the patterns topic: a lone pattern record, or a batch of them."""
_FRAME_BYTES = 5 + 10 + 10 + 10 + 10 + 1
"""A batch's bytes besides its job's and its elements': wire prefix, the job's length, two longs, the array's
block count and its end (each varint at its widest)."""
_ELEMENT_FRAME_BYTES = 10
"""An element's length, a varint at its widest."""


def batch_pattern_messages(job: str, records: Sequence[tuple[int, bytes]], max_bytes: int) -> list[bytes]:
    """The patterns topic's messages for one job's pattern messages, ``(iteration, message)`` in send order:
    consecutive runs of them as batches of at most ``max_bytes`` each (the broker's and the readers' limit).
    A run of one goes bare: a batch of one would only add its frame."""
    fixed = _FRAME_BYTES + len(job.encode())
    out: list[bytes] = []
    run: list[tuple[int, bytes]] = []
    size = fixed
    for item in records:
        grown = size + _ELEMENT_FRAME_BYTES + len(item[1])
        if run and grown > max_bytes:
            out.append(_batch_message(job, run))
            run, grown = [], fixed + _ELEMENT_FRAME_BYTES + len(item[1])
        run.append(item)
        size = grown
    if run:
        out.append(_batch_message(job, run))
    return out


def _batch_message(job: str, run: Sequence[tuple[int, bytes]]) -> bytes:
    if len(run) == 1:
        return run[0][1]
    iterations = [it for it, _ in run]
    record = {"job": job, "iteration_first": min(iterations), "iteration_last": max(iterations)}
    return encode(PATTERN_BATCH, {**record, "records": [message for _, message in run]})


def element_reason(batch: Mapping[str, Any], job: object, iteration: object) -> str | None:
    """Why an element whose head says ``job`` and ``iteration`` is not part of ``batch`` (a decoded batch record),
    or None: each element is of the batch's job and within its iterations, so that the batch's job holds the
    message until its last iteration is scored, and no element reaches another job's state."""
    if job != batch["job"]:
        return f"value: a pattern batch of job {batch['job']!r} holds a record of job {job!r}"
    first, last = int(batch["iteration_first"]), int(batch["iteration_last"])
    if not isinstance(iteration, int) or not first <= iteration <= last:
        return f"value: a pattern batch of iterations {first}-{last} holds a record of iteration {iteration}"
    return None


def pattern_messages(message: bytes) -> Iterator[bytes]:
    """The pattern messages one message of the patterns topic carries: a batch's elements, else the message
    itself (a lone record, or anything else, for the reader to judge); ``SchemaError`` for an undecodable batch.
    For tools reading the topic; the stages check each element (``element_reason``) as they take it."""
    writer, _ = decode_head(message)
    if writer.subject != PATTERN_BATCH:
        yield message
        return
    _, record = decode(message)
    for element in record["records"]:
        if not isinstance(element, bytes):
            raise SchemaError("a pattern batch element is not bytes")
        yield element
