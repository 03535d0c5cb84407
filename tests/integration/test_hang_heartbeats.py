"""A job whose every rank stopped publishing events is diagnosed from its heartbeats alone, through the
real broker, worker and store: the rank that never entered the collective is named with the group and
sequence number; a healthy job's heartbeats, published late and all at once (a backlog), find nothing."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer
from harness import isolated_config, read_topic

from fleetscope.schemas import Topics, decode, encode
from fleetscope.schemas.topics import job_key
from fleetscope.sinks import current_findings
from fleetscope.stack import EmbeddedStack

pytestmark = pytest.mark.integration

WORLD = 4
S = 10**9


def heartbeat(job: str, rank: int, n: int, sent_ns: int, last_step: int, last_step_ns: int, seq: int,
              inside: bool) -> dict[str, Any]:  # fmt: skip
    return {
        "job": job, "rank": rank, "host": "node0", "world_size": WORLD, "producer_id": f"{job}-{rank}", "seq": n,
        "sent_ns": sent_ns, "last_step": last_step, "last_step_ns": last_step_ns, "in_collective": inside,
        "collective_op": "allreduce", "collective_pg": "0", "collective_group_ranks": list(range(WORLD)),
        "collective_seq": seq, "collective_nbytes": 1 << 20, "collective_entered_ns": last_step_ns + 10**6,
        "profiling": False,
    }  # fmt: skip


def test_a_job_blocked_at_step_150_is_diagnosed_from_heartbeats_and_a_backlog_is_no_hang(
    tmp_path: Path, chdb_path: Path, database: str, broker: str
) -> None:
    tag = uuid.uuid4().hex[:8]
    config = isolated_config("hb", tmp_path, chdb_path, database, broker)
    hung, healthy = f"hung-{tag}", f"healthy-{tag}"
    with EmbeddedStack(config) as stack:
        assert stack.sink is not None and stack.client is not None
        producer = Producer({"bootstrap.servers": broker})
        topic = Topics(prefix=config.kafka.topic_prefix).heartbeats

        def send(record: dict[str, Any]) -> None:
            producer.produce(topic, key=job_key(record["job"]), value=encode("heartbeat", record))

        start = time.time_ns()
        # healthy: 200 steps of 50 ms, heartbeats every 250 ms, all read at once long after
        for n in range(40):
            t = start - 60 * S + n * S // 4
            for r in range(WORLD):
                send(heartbeat(healthy, r, n, t, 5 * n, t - 10**7, 5 * n, inside=False))
        producer.flush(10)
        # hung: every rank completed step 149 at `blocked`; rank 0 never enters allreduce #150
        blocked = time.time_ns()
        stall_at, opened = None, None
        n = 0
        while time.time_ns() - blocked < 40 * S and opened is None:
            now = time.time_ns()
            for r in range(WORLD):
                send(heartbeat(hung, r, n, now, 149, blocked, 149 if r == 0 else 150, inside=r != 0))
            producer.flush(5)
            n += 1
            if stall_at is None and now - blocked >= 10 * S:
                stall_at = now
            found = [f for f in current_findings(stack.client, database, job=hung) if f["category"] == "hang"]
            opened = found[0] if found else None
            time.sleep(0.5)
        assert opened is not None, "no hang within 40 s of the stall"
        assert (opened["rank"], opened["ranks"], opened["status"]) == (0, [0], "open")
        ev = opened["evidence"]
        assert (ev["kind"], ev["group"], ev["seq"], ev["not_entered"], ev["entered"]) == (
            "missing_member", "0", 150, [0], [1, 2, 3],
        )  # fmt: skip
        assert time.time_ns() - blocked < 30 * S  # within 30 s of the stall
        assert current_findings(stack.client, database, job=healthy) == []
        requests = _control_requests(broker, Topics(prefix=config.kafka.topic_prefix).control)
    # the hang asked its job, once, for a profiling window (evidence of where each rank is stuck)
    assert [(r["job"], r["action"]) for r in requests] == [(hung, "profile")]


def _control_requests(broker: str, topic: str, wait_s: float = 5.0) -> list[dict[str, Any]]:
    """Every request on the control topic, once none more came for ``wait_s`` (one that came twice shows)."""
    messages = read_topic(broker, [topic], until=lambda got: bool(got), timeout_s=wait_s + 10, idle_s=wait_s)
    return [decode(m.value())[1] for m in messages]
