"""The pieces of crash recovery that need no broker: message horizons, held acks, the idle clock, job state
records, and which iterations a restarted windower may emit."""

from __future__ import annotations

import asyncio
import math
import os
import pickle
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import cramjam
import pytest
from recorded_jobs import recordings

from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.schemas import EventKind, decode
from fleetscope.streams.analysis.differential import JobDifferential, score_records
from fleetscope.streams.analysis.windowing import ClosedIteration
from fleetscope.streams.differential import DifferentialStage
from fleetscope.streams.intake import horizon_ns
from fleetscope.streams.offline import OfflinePipeline
from fleetscope.streams.rebalance import InputClock
from fleetscope.streams.recovery import (
    EARLIEST,
    DifferentialRecovery,
    JobState,
    StateLog,
    UnackedMessages,
    WindowerRecovery,
    dump_job_state,
    load_job_state,
)
from fleetscope.streams.recovery.statelog import chunk_key, chunked, joined
from fleetscope.streams.recovery.windower import dump_emitted

SIM = SimulatorConfig(job="rec", ranks=4, iterations=24, faults=(parse_fault("slow_gpu:2:1.5"),))


def _message(name: str) -> Any:
    return cast(Any, name)


@dataclass(frozen=True)
class _PatternMessage:
    name: str
    value: bytes


def _pattern_message(name: str) -> Any:
    """A pattern record's message, named (its value's length counts against the job's state share)."""
    return _PatternMessage(name, name.encode())


def test_a_batch_horizon_is_its_latest_event_by_the_windowers_filing_time() -> None:
    batches = list(simulate(SimulatorConfig(job="h", ranks=2, iterations=2)))
    column = {
        EventKind.KERNELS: "launch_ns",
        EventKind.COLLECTIVES: "launch_ns",
        EventKind.HOST: "start_ns",
        EventKind.SAMPLES: "t_ns",
    }
    for batch in batches:
        assert horizon_ns(batch) == int(batch[column[batch.kind]].max())


def test_held_messages_come_back_in_horizon_order_and_only_below_the_bound() -> None:
    unacked: UnackedMessages[str] = UnackedMessages()
    for horizon, name in [(30, "c"), (10, "a"), (20, "b"), (EARLIEST, "early")]:
        unacked.keep("job", horizon, _message(name))
    assert unacked.take_harmless("job", 20) == ["early", "a"]
    assert unacked.take_harmless("other", 100) == []
    assert len(unacked) == 2
    unacked.forget(["job"])
    assert len(unacked) == 0 and unacked.take_all("job") == []


def test_the_idle_clock_stands_still_while_an_agent_works(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1_000]
    monkeypatch.setattr(time, "monotonic_ns", lambda: now[0])
    clock = InputClock()
    now[0] += 50
    assert clock.now_ns() == 50
    clock.working()
    clock.working()
    now[0] += 1_000
    clock.waiting()
    assert clock.now_ns() == 50, "one agent still works"
    clock.waiting()
    now[0] += 7
    assert clock.now_ns() == 57


def _rank_iteration(rank: int, step: int, end_ns: int) -> ClosedIteration:
    it = {"job": "j", "rank": rank, "iteration": step, "end_ns": end_ns}
    return ClosedIteration(iteration=it, patterns={"job": "j", "rank": rank, "iteration": step})


def test_a_restarted_windower_emits_only_iterations_after_the_restored_ones_and_acks_what_they_cover() -> None:
    wrec = WindowerRecovery(cast(StateLog, None))
    wrec.emitted[("j", 0)] = (7, 700)
    closed = [_rank_iteration(0, 6, 600), _rank_iteration(0, 8, 800), _rank_iteration(1, 0, 100)]
    assert [(c.iteration["rank"], c.iteration["iteration"]) for c in wrec.fresh(closed)] == [(0, 8), (1, 0)]
    for horizon, name in [(650, "old"), (700, "at-end"), (750, "open")]:
        wrec.unacked.keep(("j", 0), horizon, _message(name))
    assert wrec.release([("j", 0), ("j", 1)]) == ["old"]
    assert wrec.jobs_in_progress() == {"j"}


def _patterns() -> list[dict[str, Any]]:
    pipeline = OfflinePipeline(keep_patterns=True)
    pipeline.add_all(simulate(SIM))
    for job, rank in list(pipeline.windower.windowers):
        pipeline.close_rank(job, rank)
    return pipeline.patterns


def _comparable(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "emitted_ns"} for r in records]


def test_a_job_restored_from_its_state_record_and_replayed_continues_exactly_like_the_original() -> None:
    records = _patterns()
    cut = len(records) // 2 + 1  # mid-iteration: some records wait for ranks
    original = JobDifferential(SIM.job)
    for rec in records[:cut]:
        original.add(rec)
    record = dump_job_state(JobState(job=original, progress_offset=41, flushed=False))
    restored = load_job_state(record)
    assert restored.progress_offset == 41 and not restored.flushed
    pickled = bytes(cramjam.zstd.decompress(record[1:]))
    assert record[:1] == b"\x03" and load_job_state(b"\x02" + pickled).progress_offset == 41  # uncompressed
    older = load_job_state(b"\x01" + pickled)  # written when stall records shared the patterns topic
    assert older.progress_offset == -1 and older.job.iterations_scored == original.iterations_scored
    replayed = restored.job
    for rec in records[:cut]:  # the replay: scored iterations are skipped, waiting ones come back
        replayed.add(rec)
    assert replayed.scored_upto == original.scored_upto

    a = [u for rec in records[cut:] for u in original.add(rec)] + original.flush()
    b = [u for rec in records[cut:] for u in replayed.add(rec)] + replayed.flush()
    assert any(u["category"] == "gpu_slow" for u in a)
    assert _comparable(a) == _comparable(b)


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("true",))


def test_a_state_record_cannot_name_anything_but_the_stages_own_classes() -> None:
    data = b"\x01" + pickle.dumps({"job": _Evil(), "progress_offset": 0, "flushed": False})
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        load_job_state(data)
    with pytest.raises(pickle.UnpicklingError, match="format"):
        load_job_state(b"\x09whatever")


def test_the_input_clock_stands_still_while_partitions_move():
    import time

    from fleetscope.streams.rebalance import InputClock

    clock = InputClock()
    clock.rebalancing(True)
    clock.rebalancing(True)  # Faust may signal a revocation twice: still one stop
    before = clock.now_ns()
    time.sleep(0.05)
    assert clock.now_ns() == before
    clock.rebalancing(False)
    clock.rebalancing(False)
    time.sleep(0.05)
    assert clock.now_ns() - before >= 40_000_000


def test_a_rank_revoked_while_the_windower_writes_its_state_records_is_skipped_not_a_crash() -> None:
    """A worker resumed after a stall wrote state records while the rebalance revoked some of its ranks
    (their partition forgotten between two writes): it crashed with a KeyError. Partitions are now looked
    up before the first write."""

    class Log:
        def __init__(self) -> None:
            self.writes: list[tuple[int, bytes]] = []

        async def write(self, partition: int, key: bytes, value: bytes) -> None:
            self.writes.append((partition, key))
            wrec.revoke([3])  # the rebalance revokes partition 3 while this write awaits

    log = Log()
    wrec = WindowerRecovery(cast(StateLog, log))
    wrec.place(("j", 0), 1)
    wrec.place(("j", 1), 3)
    emitted = asyncio.run(wrec.record([_rank_iteration(0, 5, 500), _rank_iteration(1, 5, 500)]))
    assert sorted(emitted) == [("j", 0), ("j", 1)] and [p for p, _ in log.writes] == [1, 3]
    assert asyncio.run(wrec.record([_rank_iteration(1, 6, 600)])) == [("j", 1)] and len(log.writes) == 2


def _latest(records: list[tuple[bytes, bytes]], into: dict[bytes, bytes] | None = None) -> dict[bytes, bytes]:
    """What a compacted topic keeps of these records, in order: the latest value of each key."""
    kept = dict(into or {})
    kept.update(records)
    return kept


@pytest.mark.parametrize("size", [0, 1, 6, 7, 8, 20, 21, 100])
def test_a_state_value_over_the_chunk_size_is_read_back_whole(size: int) -> None:
    value = os.urandom(size)
    records = chunked(b"job-a", value, 0, chunk_bytes=7)
    assert all(len(v) <= 7 for k, v in records[:-1]) and records[-1][0] == b"job-a"
    values, slots, broken = joined(_latest(records, {b"job-b": b"\x02plain"}))
    assert values == {b"job-a": value, b"job-b": b"\x02plain"} and slots == {b"job-a": 0} and not broken


def test_a_worker_dying_mid_write_leaves_the_previous_state_whole_and_a_damaged_one_is_left_out() -> None:
    """Generation 2 goes to the slot generation 1's manifest does not name; its chunks without its manifest
    change nothing, its manifest switches over; a chunk lost or altered is no state at all (not garbage)."""
    first, second, third = (os.urandom(30) for _ in range(3))
    topic = _latest(chunked(b"j", first, 0, chunk_bytes=8))
    *chunks, manifest = chunked(b"j", second, 1, chunk_bytes=8)
    topic = _latest(chunks[:2], topic)  # died after two chunks
    assert joined(topic)[0] == {b"j": first}
    topic = _latest([*chunks, manifest], topic)
    assert joined(topic)[:2] == ({b"j": second}, {b"j": 1})
    *chunks, manifest = chunked(b"j", third, 0, chunk_bytes=8)
    assert joined(_latest(chunks[:3], topic))[0] == {b"j": second}
    damaged = dict(topic)
    damaged[chunk_key(b"j", 1, 2)] = b"x" * 8
    assert joined(damaged) == ({}, {}, [b"j"])
    del damaged[chunk_key(b"j", 1, 2)]
    assert joined(damaged) == ({}, {}, [b"j"])
    assert joined(_latest([(b"j", b"\x02small again")], topic))[0] == {b"j": b"\x02small again"}


def test_state_log_writes_big_values_in_alternating_slots_chunks_delivered_before_the_manifest() -> None:
    class Topic:
        def __init__(self) -> None:
            self.sent: list[tuple[bytes, bytes]] = []
            self.pending: list[asyncio.Future[None]] = []

        async def send(self, key: bytes, value: bytes, partition: int) -> asyncio.Future[None]:
            if value.startswith(b"\x00chunked"):  # the manifest: every chunk before it delivered
                assert all(f.done() for f in self.pending)
            self.sent.append((key, value))
            delivered = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(delivered.set_result, None)
            self.pending.append(delivered)
            return delivered

    log = StateLog.__new__(StateLog)
    log.topic, log.chunk_bytes, log.writes, log._slots = Topic(), 10, 0, {}  # type: ignore[assignment]
    values = [os.urandom(25), b"\x02small", os.urandom(11), os.urandom(40)]

    async def write_all() -> None:
        for v in values:
            await log.write(0, b"k", v)

    asyncio.run(write_all())
    sent = log.topic.sent  # type: ignore[attr-defined]
    manifests = [v for k, v in sent if k == b"k" and v.startswith(b"\x00chunked")]
    assert [m[len(b"\x00chunked\x00")] for m in manifests] == [0, 1, 0]  # slots alternate
    topic: dict[bytes, bytes] = {}
    for record, value in zip(_split_at_writes(sent), values, strict=True):
        topic = _latest(record, topic)
        assert joined(topic)[0] == {b"k": value}


def _split_at_writes(sent: list[tuple[bytes, bytes]]) -> list[list[tuple[bytes, bytes]]]:
    """The records of each write: a write ends with its record under the key itself."""
    out: list[list[tuple[bytes, bytes]]] = [[]]
    for key, value in sent:
        out[-1].append((key, value))
        if key == b"k":
            out.append([])
    return out[:-1]


def test_a_state_record_of_scored_iterations_alone_waits_for_the_interval_and_its_share_a_finding_goes_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scored iterations alone wait for both the interval and the pattern bytes that pay for the record (the
    messages they cover stay held), or for ``stale_s``; a finding opened and a stall record are written at
    once."""

    class Log:
        chunk_bytes = 10**9

        def __init__(self) -> None:
            self.writes = 0

        async def write(self, partition: int, key: bytes, value: bytes) -> None:
            self.writes += 1

    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    by_iteration: dict[int, list[dict[str, Any]]] = {}
    for rec in _patterns():
        by_iteration.setdefault(int(rec["iteration"]), []).append(rec)
    log = Log()
    jobs: dict[str, JobDifferential] = {}
    rec = DifferentialRecovery(cast(StateLog, log), jobs, share=0.1, interval_s=10.0, stale_s=300.0)
    jobs[SIM.job] = JobDifferential(SIM.job)
    rec.place(SIM.job, 0)

    def step(it: int, value_bytes: int = 3) -> list[Any]:
        for r in by_iteration[it]:
            jobs[SIM.job].add(r)
            rec.took(SIM.job, _PatternMessage(f"{it}/{r['rank']}", b"x" * value_bytes), it)
        return asyncio.run(rec.checkpoint([SIM.job]))

    def of(*iterations: int) -> list[str]:
        return [f"{i}/{r}" for i in iterations for r in range(4)]

    def names(messages: list[Any]) -> list[str]:
        return [m.name for m in messages]

    assert names(step(0)) == of(0) and log.writes == 1  # each iteration is scored as its last rank comes (offline)
    now[0] += 1.0
    assert step(1) == [] and log.writes == 1  # neither the interval nor the bytes: it waits, and its messages
    assert names(step(2)) == of(1, 2) and log.writes == 2  # a finding opened: written at once
    assert jobs[SIM.job].open_findings() == 1
    now[0] += 10.5
    assert step(3) == [] and log.writes == 2  # the interval passed, but 12 bytes of patterns pay for no record
    stall = SimpleNamespace(offset=7, name="stall")
    rec.took(SIM.job, cast(Any, stall), None)
    assert names(asyncio.run(rec.checkpoint([SIM.job]))) == ["stall", *of(3)] and log.writes == 3  # at once
    now[0] += 299.0
    assert step(4) == [] and log.writes == 3
    now[0] += 1.0
    assert names(step(5)) == of(4, 5) and log.writes == 4  # stale: written whatever the share
    now[0] += 1.0
    assert step(6, 10**6) == [] and log.writes == 4  # paid for, within the interval
    now[0] += 10.0
    assert names(step(7)) == of(6, 7) and log.writes == 5  # paid for, and the interval passed
    assert jobs[SIM.job].open_findings() == 1


class _SizedLog:
    """A state log that keeps every record written, in order."""

    chunk_bytes = 10**9

    def __init__(self) -> None:
        self.records: list[bytes] = []

    async def write(self, partition: int, key: bytes, value: bytes) -> None:
        self.records.append(value)


@pytest.mark.parametrize("name", ["compute-rank1-539cba", "none-9eb062"])
def test_state_records_stay_within_their_share_of_the_pattern_bytes_and_a_crash_changes_no_finding(name: str) -> None:
    """Real jobs (tests/data/real_jobs: a faulty one of 56 iterations, a healthy one of 300), a checkpoint after
    every message: the state bytes (uncompressed, as the pattern records' values) are at most ``share`` of the
    pattern bytes beyond the records written at once (the first, a finding opened or closed, which is
    written at the checkpoint that saw it); over 300 iterations, all of them, and over half of it (records
    keep coming). A worker that crashes after any message and restarts from its last record, replaying the
    messages still held, emits the findings the original emitted after that record, field by field."""
    values = next(r for r in recordings() if r.path.name == f"{name}.bin.gz").messages()
    job = str(decode(values[0])[1]["job"])
    share = 0.1
    log = _SizedLog()
    stage = DifferentialStage()
    rec = DifferentialRecovery(cast(StateLog, log), stage.jobs, share=share, interval_s=0.0, stale_s=math.inf)
    rec.place(job, 0)
    updates: list[dict[str, Any]] = []
    released: set[int] = set()
    crash_at: dict[int, tuple[bytes, int, list[int]]] = {}
    crashes = {len(values) * k // 8 + 1 for k in (3, 5, 7)}
    pattern_bytes, opened, covered, at_once = 0, 0, 0, 0
    for i, value in enumerate(values):
        taken = stage.take(value, None)
        assert taken.reason is None and taken.iteration is not None, taken.reason
        pattern_bytes += len(value)
        updates += taken.findings + stage.collect()
        rec.took(job, cast(Any, SimpleNamespace(value=value, offset=i)), taken.iteration)
        writes = len(log.records)
        released |= {m.offset for m in asyncio.run(rec.checkpoint([job]))}
        if len(log.records) > writes:
            covered = len(updates)  # the updates emitted before the record: it covers them
        if stage.jobs[job].open_findings() != opened or i == 0:  # a finding opened or closed: written at once
            opened = stage.jobs[job].open_findings()
            assert len(log.records) == writes + 1, i
            at_once += load_job_state(log.records[-1]).pickled_bytes
        if i in crashes:
            crash_at[i] = (log.records[-1], covered, [j for j in range(i + 1) if j not in released])
    state_bytes = sum(load_job_state(r).pickled_bytes for r in log.records)  # uncompressed, as the patterns
    assert state_bytes - at_once <= share * pattern_bytes, (state_bytes, at_once, pattern_bytes, len(log.records))
    if len(values) > 1000:  # a long run: within the share, records written at once and all, and they keep coming
        assert share / 2 < state_bytes / pattern_bytes <= share, (state_bytes, pattern_bytes, len(log.records))
    assert sum(len(r) for r in log.records) < state_bytes / 2  # compressed
    assert any(u["status"] == "open" and u["rank"] == 1 for u in updates) == name.startswith("compute")
    updates += stage.flush(job)
    for i, (record, emitted, held) in crash_at.items():
        restarted = DifferentialStage()
        restarted.jobs[job] = load_job_state(record).job
        again: list[dict[str, Any]] = []
        for j in [*held, *range(i + 1, len(values))]:  # the replay: the messages held, then the rest
            again += restarted.take(values[j], None).findings + restarted.collect()
        again += restarted.flush(job)
        assert _comparable(again) == _comparable(updates[emitted:]), i


def test_an_iteration_tracked_after_it_was_taken_to_score_is_written_before_its_messages_are_released() -> None:
    """With scoring processes an iteration is taken to score (gathered) at one checkpoint and tracked at a
    later one: the record written at the first does not cover it, so its messages wait for the second."""

    class Log:
        chunk_bytes = 10**9

        def __init__(self) -> None:
            self.records: list[bytes] = []

        async def write(self, partition: int, key: bytes, value: bytes) -> None:
            self.records.append(value)

    log = Log()
    jobs: dict[str, JobDifferential] = {SIM.job: JobDifferential(SIM.job)}
    rec = DifferentialRecovery(cast(StateLog, log), jobs, interval_s=0.0, stale_s=0.0)  # every record due
    rec.place(SIM.job, 0)
    jd = jobs[SIM.job]
    ready: list[tuple[int, list[dict[str, Any]]]] = []
    for r in [p for p in _patterns() if int(p["iteration"]) == 0]:
        ready += jd.gather(r)
        rec.took(SIM.job, _pattern_message(f"0/{r['rank']}"), 0)
    assert [it for it, _ in ready] == [0] and jd.scored_upto < 0
    assert asyncio.run(rec.checkpoint([SIM.job])) == [] and len(log.records) == 1  # taken, not tracked: held
    jd.apply(0, score_records(ready[0][1], jd.config))
    released = asyncio.run(rec.checkpoint([SIM.job]))
    assert released == [_pattern_message(f"0/{r}") for r in range(4)] and len(log.records) == 2
    assert load_job_state(log.records[-1]).job.scored_upto == 0


def test_a_windower_state_record_is_17_bytes_the_json_ones_still_load_and_a_bad_one_is_skipped() -> None:
    """The job and rank come from the record's key; a record written as JSON before still loads; one of
    neither format leaves its rank to start afresh (logged), the others restored."""

    class Log:
        async def read(self, partitions: Any) -> dict[int, dict[bytes, bytes]]:
            old = b'{"job": "j/x", "rank": 1, "step": 4, "end_ns": 400}'
            return {2: {b"j/x/0": dump_emitted(7, 700), b"j/x/1": old, b"j/x/2": b"\x01short"}}

    assert len(dump_emitted(7, 700)) == 17
    wrec = WindowerRecovery(cast(StateLog, Log()))
    asyncio.run(wrec.load([2]))
    assert wrec.emitted == {("j/x", 0): (7, 700), ("j/x", 1): (4, 400)} and wrec.restored == 2
