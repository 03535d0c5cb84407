"""``fleetscope report`` on a demo store: the injected slow rank stands out in the data behind the heatmap,
and the page is one self-contained file."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import SLOW_GPU_RANK, SlowGpuRun

from fleetscope.cli import main
from fleetscope.config import Config
from fleetscope.report import collect, render_html
from fleetscope.sinks import Store, open_store

pytestmark = pytest.mark.integration

SLOW_RANK = SLOW_GPU_RANK
ITERATIONS = 20
JOB = "it-job"


@pytest.fixture(scope="module")
def demo_store(slow_gpu_demo: SlowGpuRun) -> Iterator[tuple[Config, Store]]:
    """The shared demo run's store: 16 ranks, ``ITERATIONS`` iterations, rank ``SLOW_RANK``'s GPU slow."""
    run = slow_gpu_demo
    assert (run.sim.job, run.sim.ranks, run.sim.iterations) == (JOB, 16, ITERATIONS)
    assert [f["rank"] for f in run.result.findings] == [SLOW_RANK]
    yield run.config, open_store(run.config.store)


def test_the_slow_rank_stands_out_in_the_heatmap_data(demo_store: tuple[Config, Store]) -> None:
    _, store = demo_store
    data = collect(store, JOB)
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
    assert data.iteration_ms.shape == (16, ITERATIONS) and np.isfinite(data.iteration_ms).all()
    assert int(np.nanargmax(np.nanmean(data.compute_ms, axis=1))) == slow
    assert np.isfinite(data.busbw_gbps).all() and (data.busbw_gbps > 0).all()


def test_the_report_is_one_self_contained_page(demo_store: tuple[Config, Store]) -> None:
    _, store = demo_store
    page = render_html(collect(store, JOB))
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 6
    without_ns = page.replace("http://www.w3.org/2000/svg", "")
    for external in ("http://", "https://", " src=", "<link", "<script", "url(", "@import"):
        assert external not in without_ns, external
    assert re.search(rf"<td>open</td><td>rank {SLOW_RANK}</td><td>node001[^<]*GPU-[0-9a-f-]+", page), "the GPU by UUID"
    assert "gpu_slow" in page and "+50%" in page


def test_the_report_leads_with_a_verdict_in_time_per_iteration(demo_store: tuple[Config, Store]) -> None:
    _, store = demo_store
    data = collect(store, JOB)
    page = render_html(data)
    verdict = re.search(r"<p class='verdict'>(.*?)</p>", page)
    assert verdict is not None and page.index("class='verdict'") < page.index("<h2>")
    text = verdict.group(1)
    assert text.startswith(f"Rank {SLOW_RANK} (node001, GPU 3 (GPU-"), text  # the device to drain
    assert "runs its GPU kernels slower than its peers" in text, text
    assert re.search(r"costs the job about [\d.]+ ms per iteration \([\d.]+% of a [\d.]+ ms iteration\)", text), text
    assert "e+0" not in page and "nan" not in page.lower().replace("nanmedian", "")
    assert "No GPU kernels were profiled" not in page


def test_a_job_without_profiled_kernels_gets_a_note_not_empty_panels(demo_store: tuple[Config, Store]) -> None:
    _, store = demo_store
    data = collect(store, JOB)
    heat = data.heatmap
    python_only = [i for i, k in enumerate(heat.kinds) if k in ("python", "collective")]
    unprofiled = replace(
        data,
        heatmap=replace(heat, functions=[heat.functions[i] for i in python_only],
                        kinds=[heat.kinds[i] for i in python_only], gap=heat.gap[python_only],
                        mean_ns=heat.mean_ns[python_only],
                        peer_median_ns=heat.peer_median_ns[python_only]),
        compute_ms=np.zeros_like(data.compute_ms),
        link_gbps=np.full_like(data.link_gbps, np.nan),
    )  # fmt: skip
    page = render_html(unprofiled)
    assert "No GPU kernels were profiled for this job" in page and f"fleetscope profile --job {JOB}" in page
    assert "No NVLink samples" in page
    assert "GPU compute time (ms)" not in page


def test_the_cli_writes_the_report_quickly(demo_store: tuple[Config, Store], tmp_path: Path, capsys: Any) -> None:
    config, _ = demo_store
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"store": {"url": config.store.url, "database": config.store.database}}))
    out = tmp_path / "report.html"
    t0 = time.monotonic()
    assert main(["report", "--job", JOB, "-o", str(out), "--config", str(cfg), "--json"]) == 0
    seconds = time.monotonic() - t0
    summary = json.loads(capsys.readouterr().out)
    assert summary["top_deviation"]["rank"] == SLOW_RANK and summary["findings"] == 1
    assert summary["headline"]["subject"] == f"rank {SLOW_RANK}" and summary["headline"]["category"] == "gpu_slow"
    assert summary["verdict"].startswith(f"Rank {SLOW_RANK} ")
    assert out.stat().st_size > 20_000
    built_s = summary["build_seconds"]
    print(f"report of 16 ranks x {ITERATIONS} iterations: {seconds:.2f} s by the CLI, {built_s:.3f} s to write")
    assert seconds < 10
    assert main(["report", "--job", "no-such-job", "-o", str(tmp_path / "x.html"), "--config", str(cfg)]) == 1
