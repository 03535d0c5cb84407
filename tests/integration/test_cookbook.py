"""Every query of docs/sql-cookbook.md runs, read-only as ``fleetscope sql`` runs it, on a store filled by a
demo run (16 ranks, rank 11's GPU 1.5x slow: the session's shared run, copied into a database of its own) plus
a job that slowed down two days ago, and answers right: on the store opened directly and through the HTTP
interface ``fleetscope up`` serves it on, with clickhouse-connect's HTTP client and the read token."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from harness import SLOW_GPU_RANK, SlowGpuRun

from fleetscope.endpoint import Endpoint, served_store
from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.sinks import ClickHouseWriter, connect, migrate, open_store, run_sql
from fleetscope.sinks.clickhouse import TABLES
from fleetscope.sinks.clickhouse.server import StoreServer, Tokens
from fleetscope.streams.offline import OfflinePipeline

pytestmark = pytest.mark.integration

COOKBOOK = Path(__file__).resolve().parents[2] / "docs" / "sql-cookbook.md"
SLOW_RANK = SLOW_GPU_RANK
JOB, ITERATIONS = "it-job", 20
KERNEL = "ampere_bf16_s16816gemm_bf16_64x128_ldg8_f2f_tn"
DAY_NS = 86_400 * 10**9
NOW_NS = time.time_ns()
PARAMS = {
    "job": JOB,
    "rank": str(SLOW_RANK),
    "function": KERNEL,
    "since": datetime.fromtimestamp(NOW_NS / 1e9 - 2 * 86_400, UTC).strftime("%Y-%m-%d %H:%M:%S"),
}


def cookbook() -> list[tuple[str, str]]:
    """(section heading, query) for every ```sql block, in order."""
    out: list[tuple[str, str]] = []
    heading = ""
    for match in re.finditer(r"^## ([^\n]+)$|^```sql\n(.*?)^```", COOKBOOK.read_text(), re.M | re.S):
        if match.group(1):
            heading = match.group(1).strip()
        else:
            out.append((heading, match.group(2)))
    return out


@pytest.fixture(scope="module")
def filled(slow_gpu_demo: SlowGpuRun) -> Iterator[tuple[Any, str]]:
    demo = slow_gpu_demo
    assert (demo.sim.job, demo.sim.ranks, demo.sim.iterations) == (JOB, 16, ITERATIONS)
    assert demo.sim.start_ns > NOW_NS - 2 * 3_600 * 10**9, "the demo ran in the last hours: this week's queries see it"
    assert [(f["rank"], f["category"]) for f in demo.result.findings] == [(SLOW_RANK, "gpu_slow")]
    database = f"cook_{uuid.uuid4().hex[:10]}"
    client = connect(replace(demo.config.store, database=database))
    migrate(client, database)
    for table in TABLES:  # the demo's rows, in a database of this module's own (it adds a job)
        client.command(f"INSERT INTO `{database}`.{table} SELECT * FROM `{demo.config.store.database}`.{table}")
    # A second job, healthy three days ago and with a slow GPU since yesterday (written without Kafka).
    offline = OfflinePipeline(keep_patterns=True)
    offline.add_all(simulate(SimulatorConfig(job="regress", ranks=8, iterations=6, start_ns=NOW_NS - 3 * DAY_NS)))
    slow = SimulatorConfig(
        job="regress", ranks=8, iterations=6, first_step=6, start_ns=NOW_NS - DAY_NS,
        faults=(parse_fault("slow_gpu:2:1.5"),),
    )  # fmt: skip
    done = offline.add_all(simulate(slow)).finish()
    writer = ClickHouseWriter(client, database)
    writer.write_iterations(done.iterations)
    writer.write_patterns(offline.patterns)
    writer.write_findings(done.finding_updates)
    yield client, database


@pytest.fixture(scope="module", params=["direct", "served"])
def store(request: pytest.FixtureRequest, filled: tuple[Any, str], chdb_path: Path) -> Iterator[tuple[Any, str]]:
    client, database = filled
    if request.param == "direct":
        yield client, database
        return
    tokens = Tokens(read="reader-token", write="writer-token")
    server = StoreServer(str(chdb_path), tokens, database=database).start()
    endpoint = Endpoint(
        pid=0, bootstrap_servers="", store_url=server.url, database=database, read_token=tokens.read, write_token="-"
    )
    try:
        served = open_store(served_store(endpoint), prepare=False)  # the read token: nothing is created
        yield served.client, database  # type: ignore[attr-defined]
    finally:
        server.stop()


def run(store: tuple[Any, str], query: str) -> list[dict[str, Any]]:
    client, database = store
    names = set(re.findall(r"\{(\w+):", query))
    columns, rows = run_sql(client, database, query, {n: PARAMS[n] for n in names}, readonly=True)
    return [dict(zip(columns, row, strict=True)) for row in rows]


def test_the_cookbook_has_the_promised_investigations() -> None:
    headings = [h for h, _ in cookbook()]
    assert len(headings) >= 8
    for wanted in ("Top outlier ranks this week", "function history", "Bus bandwidth per host over time",
                   "slowed down after a date"):  # fmt: skip
        assert any(wanted in h for h in headings), wanted


@pytest.mark.parametrize("heading,query", cookbook(), ids=[h.split(".")[0] for h, _ in cookbook()])
def test_every_query_runs_read_only_and_returns_rows(store: tuple[Any, str], heading: str, query: str) -> None:
    assert run(store, query), f"{heading}: no rows"


def test_the_answers_point_at_the_injected_faults(store: tuple[Any, str]) -> None:
    q = dict(cookbook())
    top = run(store, q["1. Top outlier ranks this week"])
    assert (top[0]["job"], top[0]["rank"]) == (JOB, SLOW_RANK), top[:3]
    assert top[0]["worst_gap_pct"] > 40 and top[0]["functions_over_5pct"] >= 8
    assert all(r["worst_gap_pct"] < 10 for r in top if r["rank"] != SLOW_RANK and r["job"] == JOB)

    findings = run(store, q["2. Findings of the week, biggest loss first"])
    assert {(f["job"], f["rank"], f["category"]) for f in findings} == {
        (JOB, SLOW_RANK, "gpu_slow"),
        ("regress", 2, "gpu_slow"),
    }

    history = run(store, q["3. A rank's function history"])
    assert [h["iteration"] for h in history] == list(range(ITERATIONS))
    assert all(0.4 < h["gap"] < 0.6 for h in history), history

    profile = run(store, q["4. What is different about one rank"])
    assert profile[0]["kind"] in ("compute", "collective") and abs(profile[0]["gap"]) > 0.4
    compute = [p for p in profile if p["kind"] == "compute"]
    assert all(p["gap"] > 0.4 for p in compute), "every compute kernel of a slow GPU is slow"

    bandwidth = run(store, q["5. Bus bandwidth per host over time"])
    assert {b["host"] for b in bandwidth} == {"node000", "node001"}
    assert all(b["busbw_gbps"] > 0 and b["nvlink_gbps"] > 0 for b in bandwidth)

    slowed = run(store, q["6. Jobs that slowed down after a date"])
    assert [s["job"] for s in slowed] == ["regress"], f"{JOB} ran only after the date"
    assert slowed[0]["slowdown"] > 0.3 and slowed[0]["after_ms"] > slowed[0]["before_ms"]

    last = run(store, q["7. Who arrives last at the collectives"])
    assert last[0]["rank"] == SLOW_RANK and last[0]["waiting_ms"] < 0.5 * last[1]["waiting_ms"]

    lost = run(store, q["8. Time lost per job and category"])
    assert lost[0]["loss_ms_per_iteration"] > 10 and lost[0]["open"] >= 1

    changes = run(store, q["9. A finding's history"])
    assert changes[0]["status"] == "open" and changes[0]["version"] == 1

    overview = {o["job"]: o for o in run(store, q["10. Iteration time, jitter and idle share per job"])}
    assert overview[JOB]["ranks"] == 16 and overview[JOB]["iterations"] == ITERATIONS
