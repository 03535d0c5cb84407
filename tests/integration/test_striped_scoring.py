"""One job's iterations scored by a pool of processes, or by two or three scorers through the real broker
(``streams.score_across_workers``), find, field by field, what one worker scoring alone finds, on four
layouts; and the same through worker processes, one SIGKILLed and one added mid-run.

The first test runs the striped path in this process: the head's ``KafkaScoring`` publishes each complete
iteration to the requests topic, two or three ``StripeScorer``s (each consuming its share of the
partitions, as workers of one group would) score them and publish the scores, and the head reads the scores
topic. The second runs real workers (Faust, the consumer group, the co-partitioned scores topic).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from harness import isolated_config

from fleetscope.broker import ensure_topics
from fleetscope.schemas import Topics
from fleetscope.stack import StreamWorkerProcess
from fleetscope.streams.analysis.differential import DifferentialConfig
from fleetscope.streams.differential import DifferentialStage
from fleetscope.streams.scoring import ScoringPool
from fleetscope.streams.striped_scoring import KafkaScoring, StripeScorer
from tests.integration.test_multi_worker import HANDOVER_TIMING, _assert_as_one_worker
from tests.integration.worker_runs import MOVING_JOB, Outcome, Step, join, kill, run_config, run_pipeline
from tests.unit.streams.test_scoring_pool import JOBS, messages, run

pytestmark = pytest.mark.integration

STRIPES = 6
"""Requests partitions: two and three scorers each get an even share."""
ITERATIONS = 10
"""Enough for each fault's finding to open (persistence), few enough to keep the test quick."""
FRAME_BYTES = 64 * 1024
"""Frames of 64 KiB: an iteration's request (16 ranks, about 200 KB) goes in several."""


class Scorers(threading.Thread):
    """``n`` scorers, the i-th consuming the requests partitions p with p % n == i, and the head's reader of
    the scores topic, pumped from one thread until stopped."""

    def __init__(self, broker: str, topics: Topics, n: int, scoring: KafkaScoring) -> None:
        super().__init__(daemon=True, name="scorers")
        self.topics, self.scoring, self.error = topics, scoring, None
        self.scorers = [StripeScorer(DifferentialConfig(), FRAME_BYTES) for _ in range(n)]
        settings = {"bootstrap.servers": broker, "group.id": "unused", "enable.auto.commit": False}
        self.requests = []
        for i in range(n):
            consumer = Consumer(settings)
            consumer.assign([TopicPartition(topics.score_requests, p, 0) for p in range(STRIPES) if p % n == i])
            self.requests.append(consumer)
        self.scores = Consumer(settings)
        self.scores.assign([TopicPartition(topics.scores, p, 0) for p in range(STRIPES)])
        self.producer = Producer({"bootstrap.servers": broker, "linger.ms": 2})
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                for scorer, consumer in zip(self.scorers, self.requests, strict=True):
                    for m in consumer.consume(200, 0.02):
                        for partition, key, value in scorer.take(m.value(), m.partition()):
                            self.producer.produce(self.topics.scores, value, key, partition)
                self.producer.poll(0)
                for m in self.scores.consume(200, 0.02):
                    self.scoring.receive(m.value())
        except BaseException as exc:  # the test raises it
            self.error = exc
            self.scoring.close()  # the head's waits end

    def stop(self) -> None:
        self.stopping.set()
        self.join(10)
        for consumer in [*self.requests, self.scores]:
            consumer.close()
        if self.error is not None:
            raise self.error


def _striped(broker: str, tmp_path: Path, batch: list[bytes], n: int) -> tuple[list[dict[str, Any]], list[int]]:
    config = isolated_config("stripe", tmp_path, broker=broker)
    topics = Topics(prefix=config.kafka.topic_prefix)
    ensure_topics(config.kafka.admin_settings(), topics, 1, STRIPES)
    producer = Producer({"bootstrap.servers": broker, "linger.ms": 2})

    def send(partition: int, key: bytes, value: bytes) -> None:
        producer.produce(topics.score_requests, value, key, partition)
        producer.poll(0)

    scoring = KafkaScoring(send, STRIPES, FRAME_BYTES, lambda job: 1, resend_after_s=60.0)
    pump = Scorers(broker, topics, n, scoring)
    pump.start()
    try:
        found = run(DifferentialStage(pool=scoring), batch)
    finally:
        producer.flush(10)
        pump.stop()
    return found, [s.scored for s in pump.scorers]


@pytest.fixture(scope="module")
def pool() -> Iterator[ScoringPool]:
    scoring = ScoringPool(3, DifferentialConfig())
    yield scoring
    scoring.close()


@pytest.mark.parametrize("name", list(JOBS))
def test_a_pool_or_two_or_three_scorers_through_the_broker_find_what_one_worker_finds(
    name: str, broker: str, tmp_path: Path, pool: ScoringPool
) -> None:
    """The layouts' messages are made once for the three ways (they cost more than scoring them)."""
    batch = messages(name, ITERATIONS)
    alone = run(DifferentialStage(), batch)
    if "healthy" in name:
        assert alone == []  # no false finding on a healthy job
    else:
        assert any(u["status"] == "open" for u in alone)
    pooled = DifferentialStage(pool=pool)
    assert run(pooled, batch) == alone, "a pool of processes"
    assert not pooled.scoring and not pooled.rejected
    assert pooled.jobs["pool"].scored_upto == ITERATIONS - 1
    for n in (2, 3):
        t0 = time.perf_counter()
        found, scored = _striped(broker, tmp_path / str(n), batch, n)
        print(f"\n{name}: {n} scorers scored {scored} iterations in {time.perf_counter() - t0:.1f} s")
        assert found == alone, f"{n} scorers"
        assert sum(scored) == ITERATIONS and min(scored) > 0  # every scorer had its stripes


def test_a_scorer_killed_and_one_added_mid_run_change_no_finding(
    tmp_path: Path, chdb_path: Path, broker: str, one_worker_run: Outcome
) -> None:
    """Two workers score the job's iterations by stripe; once a third of the job is published one is
    SIGKILLed (its stripes, and perhaps the job's head, move after the session timeout; requests it took and
    never answered are sent again) and a third worker joins: the store holds what one worker stores."""
    config = run_config(
        tmp_path, broker, f"chdb://{chdb_path}", **HANDOVER_TIMING, **{"streams.score_across_workers": True}
    )
    first, second, third = (StreamWorkerProcess(config, name=f"scorer-{i}") for i in (1, 2, 3))
    moved = run_pipeline(config, MOVING_JOB, [first, second], [Step(kill, [second]), Step(join, [third])])
    _assert_as_one_worker(moved, one_worker_run)
    topics, k = Topics(prefix=config.kafka.topic_prefix), config.kafka
    probe = Consumer({**k.admin_settings(), "group.id": "probe"})
    try:
        sent = [
            probe.get_watermark_offsets(TopicPartition(topics.scores, p), 5)[1] for p in range(k.derived_partitions)
        ]
        asked = [
            probe.get_watermark_offsets(TopicPartition(topics.score_requests, p), 5)[1]
            for p in range(k.derived_partitions)
        ]
    finally:
        probe.close()
    counts = [
        re.findall(r"scoring across workers: (.*)", w.log_path.read_text(errors="replace"))[-1:]
        for w in (first, second, third)
    ]
    print(f"\nscore frames per partition {sent}, request frames per stripe {asked}; workers' last counts {counts}")
    assert sum(sent) >= MOVING_JOB.sim.iterations and min(asked) > 0  # scored by stripe, through the topics
