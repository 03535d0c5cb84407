"""Bad raw input against a real broker and a real Faust worker: every bad message lands in the
dead-letter topic with a reason, the worker stays up, and a valid job sharing the topics is stored."""

from __future__ import annotations

import random
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import Producer
from harness import isolated_config, read_topic, wait_until

from fleetscope.producers import Publisher, SimulatorConfig, simulate
from fleetscope.schemas import (
    EventKind,
    IntakeLimits,
    SchemaError,
    Topics,
    decode_event_batch,
    encode,
    encode_event_batch,
)
from fleetscope.schemas.topics import job_key
from fleetscope.sinks import connect
from fleetscope.stack import EmbeddedStack
from fleetscope.streams.analysis.validation import check_batch
from fleetscope.streams.offline import OfflinePipeline
from fleetscope.wiring import bulk_publisher_config

pytestmark = pytest.mark.integration

BAD_MESSAGES = 60
OVERSIZED = b"\x00\x00\x00\x00\x66" + bytes(1_500_000)
"""Over max_message_bytes (1 MB by default): refused on its length, before any decoding."""
RANKS, ITERATIONS = 2, 4


def _is_bad(message: bytes) -> bool:
    if len(message) > IntakeLimits().max_message_bytes:
        return True
    try:
        return check_batch(decode_event_batch(message), time.time_ns()) is not None
    except SchemaError:
        return True


def _bad_messages(start_ns: int) -> list[bytes]:
    """Implausible batches of every rule plus mutated valid messages that no longer decode or validate."""
    batches = list(simulate(SimulatorConfig(job="dl-bad", ranks=2, iterations=2, start_ns=start_ns)))
    kernels = next(b for b in batches if b.kind is EventKind.KERNELS)
    samples = next(b for b in batches if b.kind is EventKind.SAMPLES)
    future = time.time_ns() + 10 * 86_400 * 10**9
    bad = [
        b"",
        b"\x00\x00\x00\x00\x01",
        encode_event_batch(replace(kernels, header=replace(kernels.header, rank=7))),
        encode_event_batch(replace(kernels, header=replace(kernels.header, world_size=0, rank=0))),
        encode_event_batch(replace(kernels, header=replace(kernels.header, job=""))),
        encode_event_batch(replace(kernels, header=replace(kernels.header, seq=-4))),
        encode_event_batch(replace(kernels, columns={**kernels.columns, "dur_ns": -kernels["dur_ns"]})),
        encode_event_batch(replace(kernels, columns={**kernels.columns, "start_ns": kernels["start_ns"] * 0 + future})),
        # The hardening rules: every clock label checked, non-finite values, size bounds (issue 18).
        encode_event_batch(replace(kernels, header=replace(kernels.header, clock="trace"),
                                   columns={**kernels.columns, "start_ns": kernels["start_ns"] * 0 + 5})),
        encode_event_batch(replace(kernels, columns={**kernels.columns,
                                                     "start_ns": kernels["start_ns"] * 0 + 4_102_444_800 * 10**9})),
        encode_event_batch(replace(samples, columns={**samples.columns, "value": samples["value"] * np.inf})),
        encode_event_batch(replace(samples, columns={**samples.columns, "value": samples["value"] * np.nan})),
        encode_event_batch(replace(kernels, header=replace(kernels.header, job="j" * 100_000))),
        encode_event_batch(replace(kernels, header=replace(kernels.header, host="h" * 1_000))),
        encode_event_batch(replace(kernels, header=replace(kernels.header, world_size=2**31 - 1))),
        encode_event_batch(replace(kernels, names=[n * 2_000 for n in kernels.names])),
        OVERSIZED,
    ]  # fmt: skip
    rng = random.Random(6)
    valid = [encode_event_batch(b) for b in batches]
    while len(bad) < BAD_MESSAGES:
        data = bytearray(rng.choice(valid))
        op = rng.choice(("flip", "truncate", "extend", "random"))
        if op == "flip":
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif op == "truncate":
            del data[rng.randrange(len(data)) :]
        elif op == "extend":
            data += rng.randbytes(rng.randint(1, 32))
        else:
            data = bytearray(rng.randbytes(rng.randint(0, 200)))
        if _is_bad(bytes(data)):
            bad.append(bytes(data))
    return bad


def _dead_letters(bootstrap: str, topic: str, expected: int, timeout_s: float) -> dict[bytes, dict[str, str]]:
    """Key -> headers of every dead letter, read from the start of every partition."""
    messages = read_topic(bootstrap, [topic], until=lambda got: len({m.key() for m in got}) >= expected,
                          timeout_s=timeout_s)  # fmt: skip
    return {m.key(): {k: v.decode() for k, v in m.headers() or []} for m in messages}


def test_every_bad_raw_message_is_dead_lettered_while_the_worker_keeps_going(
    broker: str, tmp_path: Path, chdb_path: Path, database: str
) -> None:
    config = isolated_config("dl", tmp_path, chdb_path, database, broker)
    topics = Topics(prefix=config.kafka.topic_prefix)
    start_ns = time.time_ns() - 3_600 * 10**9
    bad = _bad_messages(start_ns)
    keys = [f"bad-{i}".encode() for i in range(len(bad))]
    with EmbeddedStack(config, with_worker=True) as stack:
        producer = Producer({"bootstrap.servers": broker, "linger.ms": 5, "message.max.bytes": 4_000_000})
        raw_topics = topics.raw_all
        for i, (key, value) in enumerate(zip(keys, bad, strict=True)):
            producer.produce(raw_topics[i % len(raw_topics)], value=value, key=key)
        assert producer.flush(10) == 0
        with Publisher(bulk_publisher_config(stack.config)) as publisher:
            for batch in simulate(SimulatorConfig(job="dl-valid", ranks=RANKS, iterations=ITERATIONS,
                                                  start_ns=start_ns)):  # fmt: skip
                assert publisher.publish(batch)
            assert publisher.flush(30.0) == 0

        letters = _dead_letters(broker, topics.deadletter, expected=len(bad), timeout_s=90)
        assert set(letters) == set(keys), f"missing dead letters: {sorted(set(keys) - set(letters))}"
        for key in keys:
            headers = letters[key]
            assert headers["reason"].split(":", 1)[0] in ("schema", "header", "value", "size"), headers
            assert headers["reason"].split(":", 1)[1].strip() and headers["topic"] in raw_topics
            assert headers["offset"].isdigit() and headers["partition"].isdigit()

        client = connect(stack.config.store)

        def stored() -> int:
            return int(client.command(f"SELECT count() FROM `{database}`.iterations WHERE job = 'dl-valid'"))

        wait_until(lambda: stored() >= RANKS * ITERATIONS, timeout_s=90, interval_s=0.5)
        assert stored() == RANKS * ITERATIONS
        for table in ("iterations", "function_patterns"):  # nothing of a rejected message is stored
            assert client.command(f"SELECT count() FROM `{database}`.{table} WHERE job != 'dl-valid'") == 0
        oversized = letters[keys[bad.index(OVERSIZED)]]
        assert oversized["reason"].startswith("size: message of 1500005 bytes")
        assert oversized["truncated_from_bytes"] == "1500005"
        assert stack.worker is not None and stack.worker.alive()
        log = stack.worker.log_path.read_text(errors="replace")
        assert "Traceback" not in log, log[-3000:]


def test_a_pattern_message_the_scoring_processes_cannot_decode_is_dead_lettered_and_its_job_goes_on(
    broker: str, tmp_path: Path, chdb_path: Path, database: str
) -> None:
    """With ``streams.scoring_processes`` the differential reads a pattern message's head only and leaves the
    rest to the process that scores its iteration: a message whose head reads and whose rest does not comes
    back from that process and goes to the dead-letter topic all the same, and its job is scored without it."""
    config = isolated_config("dlpool", tmp_path, chdb_path, database, broker, {"streams.scoring_processes": 2})
    topics = Topics(prefix=config.kafka.topic_prefix)
    pipeline = OfflinePipeline(keep_patterns=True).add_all(
        simulate(SimulatorConfig(job="dl-pool", ranks=4, iterations=6, start_ns=time.time_ns() - 3_600 * 10**9))
    )
    pipeline.finish()
    messages = [encode("patterns", p) for p in pipeline.patterns]
    damaged = len(messages) // 2
    messages[damaged] = messages[damaged][:-30]  # its head whole, its arrays cut
    with EmbeddedStack(config, with_worker=True) as stack:
        producer = Producer({"bootstrap.servers": broker, "linger.ms": 5})
        for message in messages:
            producer.produce(topics.patterns, value=message, key=job_key("dl-pool"))
        assert producer.flush(10) == 0
        # the store's sink reads the patterns topic too, and refuses it as well ("decode: ...")
        letters = read_topic(broker, [topics.deadletter], until=lambda got: len(got) >= 2, timeout_s=90)
        reasons = sorted({k: v.decode() for k, v in m.headers() or []}["reason"].split(":", 1)[0] for m in letters)
        assert reasons == ["decode", "schema"], reasons
        assert all(m.value() == messages[damaged] for m in letters)
        assert stack.worker is not None and stack.worker.alive()
        log = stack.worker.log_path.read_text(errors="replace")
        assert "scores its iterations in 2 processes" in log and "Traceback" not in log, log[-3000:]
