"""Pattern batches on the patterns topic: each element is the lone record's message byte for byte, a batch
never passes the message limit, a run of one goes bare, and readers get the same messages from both."""

from __future__ import annotations

import functools

from fleetscope.producers import SimulatorConfig, simulate
from fleetscope.schemas import CATALOG, decode, encode
from fleetscope.schemas.pattern_batch import PATTERN_BATCH, batch_pattern_messages, element_reason, pattern_messages
from fleetscope.streams.offline import OfflinePipeline

JOB = SimulatorConfig(job="pb", ranks=4, iterations=3)


@functools.cache
def lone_messages() -> tuple[tuple[int, bytes], ...]:
    pipeline = OfflinePipeline(keep_patterns=True).add_all(simulate(JOB))
    pipeline.finish()
    return tuple((int(p["iteration"]), encode("patterns", p)) for p in pipeline.patterns)


def test_a_job_s_records_go_as_one_batch_whose_elements_are_the_lone_messages() -> None:
    records = lone_messages()
    assert len(records) == JOB.ranks * JOB.expected_iterations
    (message,) = batch_pattern_messages(JOB.job, records, 1_000_000)
    subject, batch = decode(message)
    assert subject == PATTERN_BATCH and CATALOG.latest(PATTERN_BATCH).schema_id == 1101
    assert batch["records"] == [m for _, m in records]  # byte for byte: placement and scoring take them unchanged
    iterations = [it for it, _ in records]
    span = (batch["job"], batch["iteration_first"], batch["iteration_last"])
    assert span == (JOB.job, min(iterations), max(iterations))
    assert list(pattern_messages(message)) == [m for _, m in records]
    lone = records[0][1]
    assert list(pattern_messages(lone)) == [lone]  # the old contract reads as itself


def test_batches_split_at_the_message_limit_and_a_run_of_one_goes_bare() -> None:
    records = lone_messages()
    largest = max(len(m) for _, m in records)
    limit = 2 * largest + 200
    messages = batch_pattern_messages(JOB.job, records, limit)
    assert len(messages) > 1 and all(len(m) <= limit for m in messages)
    assert [e for m in messages for e in pattern_messages(m)] == [m for _, m in records]  # all, in order
    assert batch_pattern_messages(JOB.job, records[:1], limit) == [records[0][1]]
    alone = batch_pattern_messages(JOB.job, records[:3], largest // 2)  # each over the limit: each alone, bare
    assert alone == [m for _, m in records[:3]]


def test_an_element_of_another_job_or_outside_the_batch_s_iterations_is_refused() -> None:
    batch = {"job": "a", "iteration_first": 3, "iteration_last": 5}
    assert element_reason(batch, "a", 3) is None and element_reason(batch, "a", 5) is None
    assert element_reason(batch, "b", 4) == "value: a pattern batch of job 'a' holds a record of job 'b'"
    assert element_reason(batch, "a", 6) == "value: a pattern batch of iterations 3-5 holds a record of iteration 6"
