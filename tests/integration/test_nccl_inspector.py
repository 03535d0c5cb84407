"""``fleetscope inspector`` into the real broker, worker and store: the slow rank of a dp4 x tp2 job's
Inspector files is found, the healthy job gets no finding, and a malformed and a truncated line are
dead-lettered with their reasons while the rest of their file is analysed."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
from harness import isolated_config, read_topic, wait_until

from fleetscope.commands.inspector import cmd_inspector
from fleetscope.producers.inspector_gen import InspectorJobSpec, write_inspector_job
from fleetscope.schemas import Topics
from fleetscope.stack import EmbeddedStack

pytestmark = pytest.mark.integration

SLOW_RANK, ITERATIONS = 5, 10


def test_inspector_files_give_the_slow_ranks_finding_live_and_bad_lines_are_dead_lettered(
    tmp_path: Path, chdb_path: Path, database: str, broker: str
) -> None:
    start_us = (time.time_ns() - 3_600 * 10**9) // 1000
    slow = write_inspector_job(
        InspectorJobSpec(slow_rank=SLOW_RANK, slow_factor=1.3, iterations=ITERATIONS, start_us=start_us, seed=4),
        tmp_path / "ins-slow",
    )
    write_inspector_job(InspectorJobSpec(iterations=ITERATIONS, start_us=start_us, seed=4), tmp_path / "ins-healthy")
    lines = slow[1].read_text().splitlines(keepends=True)
    malformed = lines[0].replace('"id":"0x', '"id":7,"was":"')
    slow[1].write_text("".join(lines[:3]) + malformed + "".join(lines[3:]) + lines[0][:50])
    config = isolated_config("ins", tmp_path, chdb_path, database, broker)
    query = f"SELECT job, rank, category FROM `{database}`.findings FINAL ORDER BY job, rank"
    stored = f"SELECT job, count() FROM `{database}`.iterations GROUP BY job ORDER BY job"
    with EmbeddedStack(config) as stack:
        assert stack.client is not None
        args = argparse.Namespace(
            paths=[str(tmp_path / "ins-slow"), str(tmp_path / "ins-healthy")],
            job=None, once=True, interval_ms=1000, json=True,
        )  # fmt: skip
        assert cmd_inspector(args, stack.config) == 0

        def findings() -> list[tuple[str, int, str]]:
            return [tuple(r) for r in stack.client.query(query).result_rows]

        def both_stored() -> bool:
            rows = dict(stack.client.query(stored).result_rows)
            return min(rows.get("ins-slow", 0), rows.get("ins-healthy", 0)) >= 8 * (ITERATIONS - 2)

        t0 = time.monotonic()
        wait_until(findings, timeout_s=90, interval_s=0.25)
        assert wait_until(both_stored, timeout_s=60, interval_s=0.25)
        time.sleep(1.0)  # the healthy job's last iterations scored too
        found = findings()
        print(f"findings and iterations stored {time.monotonic() - t0:.1f} s after publishing")
        letters = read_topic(broker, [Topics(prefix=stack.config.kafka.topic_prefix).deadletter],
                             until=lambda got: len(got) >= 2, timeout_s=30)  # fmt: skip
    assert found == [("ins-slow", SLOW_RANK, "straggler")]
    headers = sorted(({k: v.decode() for k, v in m.headers() or []} for m in letters), key=lambda h: int(h["line"]))
    assert [(h["file"], h["line"]) for h in headers] == [(str(slow[1]), "4"), (str(slow[1]), str(len(lines) + 2))]
    assert headers[0]["reason"] == "inspector: header.id is '7', not a communicator hash"
    assert headers[1]["reason"].startswith("inspector: no newline at the end (truncated): not JSON")
