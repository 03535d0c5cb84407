"""``fleetscope diff`` on the real store (chDB): three simulated runs of one tp2 x pp2 job written by the
sink's writer (a baseline, with 5 more iterations under a profiler window; a rerun with other noise and
length; one with ``forward`` 30 % slower on every rank). The store's two aggregate reads equal the offline
fold of the same records, a job against itself and against its rerun lists nothing, the slowed function is
ranked first, directly, through the HTTP interface ``up`` serves with the read token, and in
``report --against``."""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetscope.cli import main
from fleetscope.config import Config, load_config
from fleetscope.endpoint import Endpoint, served_store
from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.report import collect, render_html
from fleetscope.run_diff import store_steps
from fleetscope.sinks import Store, open_store
from fleetscope.sinks.clickhouse.server import StoreServer, Tokens
from fleetscope.streams.analysis.rundiff import StepTable, diff_runs, run_steps
from fleetscope.streams.offline import OfflinePipeline

pytestmark = pytest.mark.integration

SLOWED = "forward"
FORWARD_SHARE = 31.0 / 232.0
"""``forward`` is about 31 ms of the job's 232 ms healthy iteration: ``host_slow`` adds factor - 1 of the latter."""


def _run(job: str, seed: int, iterations: int, slowed: bool = False) -> tuple[dict[str, Any], StepTable]:
    faults = tuple(parse_fault(f"host_slow:{r}:{1 + 0.3 * FORWARD_SHARE}:{SLOWED}") for r in range(8)) if slowed else ()
    cfg = SimulatorConfig(job=job, ranks=8, tp=2, pp=2, iterations=iterations, seed=seed, faults=faults)
    pipeline = OfflinePipeline(keep_patterns=True)
    done = pipeline.add_all(simulate(cfg)).finish()
    table = StepTable()
    for record in pipeline.patterns:
        table.add(record)
    return {"iterations": done.iterations, "patterns": pipeline.patterns}, table


@pytest.fixture(scope="module")
def runs(chdb_path: Path) -> Iterator[tuple[Config, Store, dict[str, StepTable]]]:
    database = f"diff_{uuid.uuid4().hex[:10]}"
    config = load_config(env={}, overrides={"store.url": f"chdb://{chdb_path}", "store.database": database})
    store = open_store(config.store)
    tables = {}
    for job, seed, iterations, slowed in (("base", 0, 20, False), ("rerun", 1, 26, False), ("slow", 0, 20, True)):
        records, tables[job] = _run(job, seed, iterations, slowed)
        if job == "base":  # then 5 iterations under a profiler window, every function twice as slow: left out
            profiled = [{**r, "iteration": r["iteration"] + 5, "profiled": True,
                         "total_ns": [2 * t for t in r["total_ns"]]} for r in records["patterns"][-40:]]  # fmt: skip
            records["patterns"] = [*records["patterns"], *profiled]
            for r in profiled:
                tables[job].add(r)
        store.write_iterations(records["iterations"])
        assert store.write_patterns(records["patterns"]) > 0
        assert store.write_patterns(records["patterns"][:8]) == 0, "a replay adds no row"
    yield config, store, tables


def test_the_stores_reads_equal_the_offline_fold_of_the_same_records(runs: Any) -> None:
    _, store, tables = runs
    assert max(r[2] for r in store.run_iterations("base")) == 19, "profiled iterations 20-24 are left out"
    stored = store_steps(store, "slow")
    offline = run_steps("slow", tables["slow"].role_iterations(), tables["slow"].moments)
    assert (stored.first_iteration, stored.last_iteration, stored.skipped_warmup) == (1, 19, 1)
    assert stored.role_iterations == offline.role_iterations == {(pp, tp): 19 for pp in (0, 1) for tp in (0, 1)}
    assert [(m.role, m.function, m.kind, m.present) for m in stored.functions] == [
        (m.role, m.function, m.kind, m.present) for m in offline.functions
    ]
    for s, o in zip(stored.functions, offline.functions, strict=True):
        assert math.isclose(s.sum_ns, o.sum_ns, rel_tol=1e-9) and math.isclose(s.sum_sq_ns, o.sum_sq_ns, rel_tol=1e-9)
        assert math.isclose(s.calls, o.calls)


def test_a_job_against_itself_or_its_rerun_lists_nothing_and_the_slowed_function_ranks_first(
    runs: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, store, _ = runs
    base = store_steps(store, "base")
    assert diff_runs(base, base).changes == []
    rerun = diff_runs(base, store_steps(store, "rerun"))
    assert rerun.changes == [] and not rerun.iteration.significant
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"store": {"url": config.store.url, "database": config.store.database}}))
    assert main(["diff", "base", "slow", "--json", "--config", str(cfg)]) == 0
    changes = json.loads(capsys.readouterr().out)["changes"]
    assert [c["function"] for c in changes] == [SLOWED] * 4, changes
    assert all(0.27 < c["relative"] < 0.33 for c in changes)
    assert main(["diff", "base", "no-such-job", "--config", str(cfg)]) == 1
    assert "job 'no-such-job' has no function patterns in the store" in capsys.readouterr().err


def test_the_diff_reads_through_the_served_store_and_in_the_report(runs: Any, chdb_path: Path) -> None:
    config, store, _ = runs
    database = config.store.database
    tokens = Tokens(read="reader-token", write="writer-token")
    server = StoreServer(str(chdb_path), tokens, database=database).start()
    endpoint = Endpoint(
        pid=0, bootstrap_servers="", store_url=server.url, database=database, read_token=tokens.read, write_token="-"
    )
    try:
        served = open_store(served_store(endpoint), prepare=False)  # the read token: what `diff` gets under `up`
        diff = diff_runs(store_steps(served, "base"), store_steps(served, "slow"))
        assert [c.function for c in diff.changes] == [SLOWED] * 4
    finally:
        server.stop()
    data = collect(store, "slow", baseline="base")
    assert data.diff is not None and data.diff.changes[0].function == SLOWED
    page = render_html(data)
    assert "<h2>Changes against job base</h2>" in page and "+30." in page
    assert "Changes against" not in render_html(collect(store, "slow"))
