"""What each finding tells a person to run next works on a real store: every category's check, as the
command ``findings`` and ``alerts`` print it, runs verbatim through ``fleetscope sql`` on the shared demo's
store (16 ranks, rank 11's GPU 1.5x slow) and points at the slow rank; ``findings`` and ``report`` show it."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import SLOW_GPU_RANK, SlowGpuRun

from fleetscope.cli import main
from fleetscope.report import collect, render_html
from fleetscope.schemas import Category
from fleetscope.schemas.categories import REGISTRY, next_checks, sql_command
from fleetscope.sinks import open_store

pytestmark = pytest.mark.integration

JOB, RANKS, ITERATIONS = "it-job", 16, 20


@pytest.fixture(scope="module")
def demo(slow_gpu_demo: SlowGpuRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A config file for the demo's store and its one finding (``gpu_slow`` on the slow rank)."""
    run = slow_gpu_demo
    assert (run.sim.job, run.sim.ranks, run.sim.iterations) == (JOB, RANKS, ITERATIONS)
    [finding] = run.result.findings
    assert (finding["rank"], finding["category"]) == (SLOW_GPU_RANK, "gpu_slow")
    cfg = tmp_path_factory.mktemp("next_checks") / "config.json"
    cfg.write_text(json.dumps({"store": {"url": run.config.store.url, "database": run.config.store.database}}))
    yield cfg, finding


def run_printed(command: str, cfg: Path, capsys: Any) -> list[dict[str, Any]]:
    """Run a printed ``fleetscope sql ...`` command as a shell would split it, with --json."""
    argv = shlex.split(command)
    assert argv[:2] == ["fleetscope", "sql"], command
    capsys.readouterr()
    assert main([*argv[1:], "--config", str(cfg), "--json"]) == 0
    rows: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return rows


def test_every_categorys_check_runs_as_printed_and_points_at_the_slow_rank(
    demo: tuple[Path, dict[str, Any]], capsys: Any
) -> None:
    cfg, finding = demo
    rows = run_printed(
        'fleetscope sql "SELECT function FROM function_patterns WHERE job = {job:String} AND kind_name = '
        f"'collective' LIMIT 1\" --param job={JOB}",
        cfg,
        capsys,
    )
    collective = rows[0]["function"]
    answers: dict[Category, list[dict[str, Any]]] = {}
    for category in REGISTRY:
        subject = finding | {"category": category.value}
        if category is Category.LINK_SLOW:
            subject |= {"function": collective}
        answers[category] = run_printed(sql_command(next_checks(subject)["next_checks"]), cfg, capsys)

    kernels = answers[Category.GPU_SLOW]
    assert kernels and all(0.4 < k["gap"] < 0.6 for k in kernels), "every compute kernel of the slow GPU is slow"
    last = answers[Category.STRAGGLER]
    assert (last[0]["rank"], last[0]["named"]) == (SLOW_GPU_RANK, True), "it waits least: it arrives last"
    assert sum(r["named"] for r in last) == 1 and len(last) == RANKS
    for per_rank in (Category.HOST_SLOW, Category.LINK_SLOW, Category.HANG):
        assert sorted(r["rank"] for r in answers[per_rank]) == list(range(RANKS)), per_rank
        assert [r["rank"] for r in answers[per_rank] if r["named"]] == [SLOW_GPU_RANK], per_rank
    assert all(r["busbw_gbps"] > 0 for r in answers[Category.LINK_SLOW])
    assert {r["last_iteration"] for r in answers[Category.HANG]} == {ITERATIONS - 1}, "no rank stopped"
    [stage] = answers[Category.STAGE_IMBALANCE]
    assert stage["ranks"] == RANKS and stage["compute_ms"] > 0
    steps = answers[Category.JOB_REGRESSION]
    assert [s["iteration"] for s in steps] == list(range(ITERATIONS)) and all(s["iteration_ms"] > 0 for s in steps)


def test_findings_and_the_report_say_what_it_means_and_what_to_check(
    demo: tuple[Path, dict[str, Any]], capsys: Any
) -> None:
    cfg, _ = demo
    meaning = REGISTRY[Category.GPU_SLOW].meaning
    capsys.readouterr()
    assert main(["findings", "--job", JOB, "--config", str(cfg)]) == 0
    text = capsys.readouterr().out
    assert f"gpu_slow: {meaning}" in text and "  NVML: sm_clock_mhz, " in text
    printed = next(line for line in text.splitlines() if line.startswith(f"  rank {SLOW_GPU_RANK}: fleetscope sql"))
    assert run_printed(printed.split(": ", 1)[1], cfg, capsys), "the printed command runs"

    assert main(["findings", "--job", JOB, "--config", str(cfg), "--json"]) == 0
    [found] = json.loads(capsys.readouterr().out)
    assert found["meaning"] == meaning
    assert found["next_checks"]["params"] == {"job": JOB, "ranks": f"[{SLOW_GPU_RANK}]"}
    assert "throttle_reasons" in found["next_checks"]["nvml"] and found["next_checks"]["likely_causes"]

    page = render_html(collect(open_store(json_store(cfg)), JOB))
    section = page.split("What the findings mean", 1)[1].split("<h2>", 1)[0]
    assert meaning.replace("'", "&#x27;") in section and "throttle_reasons" in section
    assert f"rank {SLOW_GPU_RANK}" in section and "fleetscope sql" in section


def json_store(cfg: Path) -> Any:
    from fleetscope.config import load_config

    return load_config(path=str(cfg), env={}).store
