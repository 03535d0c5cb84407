"""Shared fixtures: one real Tansu broker and one chDB directory per test session, and one finished demo run
that several integration tests read.

chDB allows a single data directory per process, so tests isolate themselves by database name; each test
gets its own topics prefix (harness.isolated_config).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import SlowGpuRun, isolated_config, slow_gpu_run

from fleetscope.broker import TansuBroker


@pytest.fixture(scope="session")
def chdb_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chdb")


@pytest.fixture
def database() -> str:
    return f"t_{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap address of a real Kafka-protocol broker (memory only) for the whole session."""
    b = TansuBroker(log_path=tmp_path_factory.mktemp("broker") / "tansu.log")
    yield b.start()
    b.stop()


@pytest.fixture(scope="session")
def slow_gpu_demo(tmp_path_factory: pytest.TempPathFactory, chdb_path: Path, broker: str) -> SlowGpuRun:
    """The demo of a 16-rank job with one slow GPU, run once for the tests that read its store or alerts."""
    database = f"demo_{uuid.uuid4().hex[:10]}"
    config = isolated_config("sg", tmp_path_factory.mktemp("slow_gpu_demo"), chdb_path, database, broker)
    return slow_gpu_run(config, alert_wait_s=5.0)
