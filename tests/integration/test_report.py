"""``fleetscope report`` on a demo store: the injected slow rank stands out in the data behind the heatmap,
and the page is one self-contained file."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fleetscope.cli import main
from fleetscope.config import Config, load_config
from fleetscope.demo import run_demo
from fleetscope.producers import SimulatorConfig, parse_fault
from fleetscope.progress import Progress
from fleetscope.report import collect, render_html
from fleetscope.sinks import connect

pytestmark = pytest.mark.integration

SLOW_RANK = 11


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory: pytest.TempPathFactory, chdb_path: Path) -> Iterator[tuple[Config, Any]]:
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path_factory.mktemp("report")),
            "store.url": f"chdb://{chdb_path}",
            "store.database": f"rep_{uuid.uuid4().hex[:10]}",
            "kafka.topic_prefix": f"rp{uuid.uuid4().hex[:6]}",
        },
    )
    sim = SimulatorConfig(job="rep", ranks=16, iterations=12, faults=(parse_fault(f"slow_gpu:{SLOW_RANK}:1.5"),))
    result = run_demo(config, sim, Progress(enabled=False), timeout_s=120)
    assert [f["rank"] for f in result.findings] == [SLOW_RANK]
    yield config, connect(config.store)


def test_the_slow_rank_stands_out_in_the_heatmap_data(demo_store: tuple[Config, Any]) -> None:
    config, client = demo_store
    data = collect(client, config.store.database, "rep")
    heat = data.heatmap
    assert heat.ranks == list(range(16)) and heat.gap.shape == (len(heat.functions), 16)
    assert heat.top_outlier("compute")[0] == SLOW_RANK
    slow = heat.ranks.index(SLOW_RANK)
    compute = [i for i, k in enumerate(heat.kinds) if k == "compute"]
    assert len(compute) >= 8
    for i in compute:
        assert int(np.nanargmax(heat.gap[i])) == slow, heat.functions[i]
        assert 0.4 < heat.gap[i, slow] < 0.6
        others = np.delete(heat.gap[i], slow)
        assert np.nanmax(np.abs(others)) < 0.05, "healthy ranks sit at the peer median"
    collectives = [i for i, k in enumerate(heat.kinds) if k == "collective"]
    assert collectives and all(heat.gap[i, slow] < -0.5 for i in collectives), "it arrives last, never waits"
    assert data.flagged_ranks == [SLOW_RANK]
    assert data.iteration_ms.shape == (16, 12) and np.isfinite(data.iteration_ms).all()
    assert int(np.nanargmax(np.nanmean(data.compute_ms, axis=1))) == slow
    assert np.isfinite(data.busbw_gbps).all() and (data.busbw_gbps > 0).all()


def test_the_report_is_one_self_contained_page(demo_store: tuple[Config, Any]) -> None:
    config, client = demo_store
    page = render_html(collect(client, config.store.database, "rep"))
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 6
    without_ns = page.replace("http://www.w3.org/2000/svg", "")
    for external in ("http://", "https://", " src=", "<link", "<script", "url(", "@import"):
        assert external not in without_ns, external
    assert re.search(rf"<td>open</td><td>{SLOW_RANK}</td><td>node001</td>", page)
    assert "gpu_slow" in page and "+50%" in page


def test_the_cli_writes_the_report_quickly(demo_store: tuple[Config, Any], tmp_path: Path, capsys: Any) -> None:
    config, _ = demo_store
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"store": {"url": config.store.url, "database": config.store.database}}))
    out = tmp_path / "report.html"
    t0 = time.monotonic()
    assert main(["report", "--job", "rep", "-o", str(out), "--config", str(cfg), "--json"]) == 0
    seconds = time.monotonic() - t0
    summary = json.loads(capsys.readouterr().out)
    assert summary["top_deviation"]["rank"] == SLOW_RANK and summary["findings"] == 1
    assert out.stat().st_size > 20_000
    print(f"report of 16 ranks x 12 iterations: {seconds:.2f} s by the CLI, {summary['seconds']:.3f} s to write")
    assert seconds < 10
    assert main(["report", "--job", "no-such-job", "-o", str(tmp_path / "x.html"), "--config", str(cfg)]) == 1
