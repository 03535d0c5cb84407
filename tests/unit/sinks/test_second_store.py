"""A second kind of store is its package plus one registration: ``findings`` and ``report`` run on the
in-memory test double of the seam (``tests/memory_store.py``), with no ClickHouse anywhere."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import memory_store
import pytest

from fleetscope.commands.queries import cmd_findings
from fleetscope.config import load_config
from fleetscope.producers import SimulatorConfig, parse_fault, simulate
from fleetscope.report import write_report
from fleetscope.sinks.store import open_store
from fleetscope.streams.offline import OfflinePipeline

SLOW_RANK = 5


def test_findings_and_report_read_a_registered_second_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    memory_store.register(monkeypatch)
    config = load_config(env={}, overrides={"data_dir": str(tmp_path), "store.url": "memory-double://jobs"})
    store = open_store(config.store)
    assert isinstance(store, memory_store.MemoryStore)
    for job, faults in (("slow", (parse_fault(f"slow_gpu:{SLOW_RANK}:1.5"),)), ("healthy", ())):
        pipeline = OfflinePipeline(keep_patterns=True)
        result = pipeline.add_all(simulate(SimulatorConfig(job=job, ranks=8, iterations=12, faults=faults))).finish()
        assert store.write_iterations(result.iterations) == len(result.iterations) > 0
        assert store.write_patterns(pipeline.patterns) > 0
        store.write_findings(result.finding_updates)
        assert store.write_iterations(result.iterations) == 0, "a replay adds nothing"

    cmd_findings(argparse.Namespace(job="slow", json=True), config)
    (lead, *_) = found = json.loads(capsys.readouterr().out)
    assert (lead["rank"], lead["category"], lead["status"]) == (SLOW_RANK, "gpu_slow", "open")
    assert lead["meaning"] and lead["next_checks"]["likely_causes"], "what it means and what to check next"
    cmd_findings(argparse.Namespace(job="healthy", json=True), config)
    assert json.loads(capsys.readouterr().out) == [], "zero findings on the healthy job"

    slow = write_report(store, "slow", tmp_path / "slow.html")
    assert slow.flagged_ranks[0] == SLOW_RANK and len(slow.findings) == len(found)
    assert slow.heatmap.top_outlier("compute")[0] == SLOW_RANK
    assert (slow.first_iteration, slow.iterations, len(slow.ranks)) == (0, slow.last_iteration * 8 + 8, 8)
    assert "job slow" in (tmp_path / "slow.html").read_text(encoding="utf-8")
    healthy = write_report(store, "healthy", tmp_path / "healthy.html")
    assert healthy.findings == [] and "No findings" in (tmp_path / "healthy.html").read_text(encoding="utf-8")
