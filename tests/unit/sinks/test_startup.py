"""The sink's start against a store that is not there yet: retried with the mid-run backoff, no traceback."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from clickhouse_connect.driver.exceptions import OperationalError, ProgrammingError

from fleetscope.broker import free_port
from fleetscope.sinks import ClickHouseConfig
from fleetscope.sinks.startup import MAX_PAUSE_S, backoff_s, open_store, store_unavailable


def test_an_unreachable_server_is_retried_with_backoff_until_stopped(caplog: pytest.LogCaptureFixture) -> None:
    config = ClickHouseConfig(url=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    stop = threading.Event()
    threading.Timer(2.0, stop.set).start()
    caplog.set_level(logging.WARNING, logger="fleetscope.sinks.startup")
    t0 = time.monotonic()
    assert open_store(config, stop) is None
    assert 1.9 < time.monotonic() - t0 < 5.0
    waits = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert 1 <= len(waits) <= 3 and "retrying in 0.5s" in waits[0]  # 0.5 s, then 1 s, ...


def test_the_store_opens_once_it_is_available() -> None:
    calls: list[int] = []

    def attempt(config: ClickHouseConfig) -> object:
        calls.append(1)
        if len(calls) < 3:
            raise OperationalError("connection refused")
        return "client"

    assert open_store(ClickHouseConfig(), threading.Event(), attempt=attempt) == "client"  # type: ignore[arg-type]
    assert len(calls) == 3


def test_configuration_errors_are_not_retried() -> None:
    def attempt(config: ClickHouseConfig) -> object:
        raise ValueError("bad schema")

    with pytest.raises(ValueError, match="bad schema"):
        open_store(ClickHouseConfig(), threading.Event(), attempt=attempt)  # type: ignore[arg-type]


def test_a_locked_chdb_directory_is_waited_for_and_backoff_is_capped() -> None:
    assert store_unavailable(ProgrammingError("Unable to open the chdb engine: Cannot lock file /x/status"))
    assert not store_unavailable(ProgrammingError("Unknown setting"))
    assert [backoff_s(n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0] and backoff_s(50) == MAX_PAUSE_S
