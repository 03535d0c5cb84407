"""The differential takes pattern batches as it takes lone pattern records: the same findings from either
(and from a topic holding both), and a bad element of a batch is refused alone, with its own message."""

from __future__ import annotations

import functools
from itertools import groupby
from typing import Any

from faust.types import Message

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import decode, encode
from fleetscope.schemas.pattern_batch import batch_pattern_messages
from fleetscope.streams.differential import DifferentialStage
from fleetscope.streams.offline import OfflinePipeline

SLOW = SimulatorConfig(job="pbs", ranks=4, iterations=10, faults=(parse_fault("slow_gpu:2:1.5"),))


@functools.cache
def lone_messages() -> tuple[tuple[int, bytes], ...]:
    pipeline = OfflinePipeline(keep_patterns=True).add_all(simulate(SLOW))
    pipeline.finish()
    return tuple((int(p["iteration"]), encode("patterns", p)) for p in pipeline.patterns)


def source(offset: int, value: bytes) -> Message:
    return Message("t.patterns", 0, offset, 0.0, 0, None, SLOW.job.encode(), value, None)


def updates(messages: list[bytes]) -> tuple[list[dict[str, Any]], int]:
    """Finding updates (less their emission time) and pattern records used, the job flushed at the end."""
    stage, out, used = DifferentialStage(), [], 0
    for offset, message in enumerate(messages):
        taken = stage.take(message, None, source=source(offset, message))
        assert taken.reason is None and not stage.rejected
        out += taken.findings
        used += taken.records
    out += stage.flush(SLOW.job)
    return [{k: v for k, v in u.items() if k != "emitted_ns"} for u in out], used


def test_batches_and_lone_records_give_the_same_findings() -> None:
    records = lone_messages()
    lone, used = updates([m for _, m in records])
    assert used == len(records) and {(u["rank"], u["category"]) for u in lone} == {(2, "gpu_slow")}
    by_iteration = [list(run) for _, run in groupby(records, key=lambda r: r[0])]
    mixed = [m for _, m in by_iteration[0]]  # the topic's older messages, lone, then batches of every rank
    mixed += [b for run in by_iteration[1:] for b in batch_pattern_messages(SLOW.job, run, 1_000_000)]
    assert len(mixed) == SLOW.ranks + len(by_iteration) - 1
    assert updates(mixed) == (lone, len(records))


def test_a_bad_element_is_refused_alone_and_the_rest_of_its_batch_is_used() -> None:
    records = lone_messages()
    first = [m for it, m in records if it == records[0][0]]
    garbage = b"\x00\x00\x00\x00\x07not a pattern record"  # schema id 7: none
    intruder = encode("patterns", {**decode(first[1], fast=False)[1], "job": "intruder"})
    it = records[0][0]
    batch = batch_pattern_messages(SLOW.job, [(it, m) for m in [first[0], garbage, *first[1:], intruder]], 1 << 20)
    assert len(batch) == 1
    stage = DifferentialStage()
    taken = stage.take(batch[0], None, source=source(41, batch[0]))
    assert taken.reason is None and taken.records == SLOW.ranks and taken.iteration == it
    assert [(t.reason or "").split(":")[0] for t in stage.rejected] == ["schema", "value"]
    assert [t.source.value for t in stage.rejected] == [garbage, intruder]  # each element alone
    assert {t.source.offset for t in stage.rejected} == {41} and "intruder" not in stage.jobs  # the batch's place
    assert stage.jobs[SLOW.job].iterations_scored == 1  # every good rank of the iteration arrived

    nothing = batch_pattern_messages(SLOW.job, [(0, garbage), (0, garbage)], 1 << 20)[0]
    whole = DifferentialStage().take(nothing, None, source=source(42, nothing))
    assert whole.reason is not None and whole.reason.startswith("value: no usable record in a pattern batch: schema:")
    assert whole.job == ""  # no job holds it, nor keeps its name
