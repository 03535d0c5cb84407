"""Shared fixtures: one real Tansu broker and one chDB directory per test session.

chDB allows a single data directory per process, so tests isolate themselves by database name.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

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
