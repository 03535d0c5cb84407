"""The store's start (``open_store``) against a store that is not there yet: retried with the mid-run
backoff, no traceback."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from clickhouse_connect.driver.exceptions import OperationalError, ProgrammingError

from fleetscope.broker import free_port
from fleetscope.sinks import StoreConfig, clickhouse
from fleetscope.sinks.clickhouse import store_unavailable
from fleetscope.sinks.retry import MAX_PAUSE_S, backoff_s
from fleetscope.sinks.store import open_store


def test_an_unreachable_server_is_retried_with_backoff_until_stopped(caplog: pytest.LogCaptureFixture) -> None:
    config = StoreConfig(url=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    stop = threading.Event()
    threading.Timer(2.0, stop.set).start()
    caplog.set_level(logging.WARNING, logger="fleetscope.sinks.store")
    t0 = time.monotonic()
    assert open_store(config, stop=stop) is None
    assert 1.9 < time.monotonic() - t0 < 5.0
    waits = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert 1 <= len(waits) <= 3 and "retrying in 0.5s" in waits[0]  # 0.5 s, then 1 s, ...


def test_without_stop_an_unreachable_store_raises_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(OperationalError):
        open_store(StoreConfig(url=f"http://127.0.0.1:{free_port()}"))
    assert time.monotonic() - t0 < 5.0


def test_the_store_opens_once_it_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def attempt(config: StoreConfig, *, prepare: bool) -> object:
        calls.append(1)
        if len(calls) < 3:
            raise OperationalError("connection refused")
        return "store"

    monkeypatch.setattr(clickhouse.ADAPTER, "open", attempt)
    assert open_store(StoreConfig(), stop=threading.Event()) == "store"
    assert len(calls) == 3


def test_configuration_errors_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    def attempt(config: StoreConfig, *, prepare: bool) -> object:
        raise ValueError("bad schema")

    monkeypatch.setattr(clickhouse.ADAPTER, "open", attempt)
    with pytest.raises(ValueError, match="bad schema"):
        open_store(StoreConfig(), stop=threading.Event())


def test_a_locked_chdb_directory_is_waited_for_and_backoff_is_capped() -> None:
    assert store_unavailable(ProgrammingError("Unable to open the chdb engine: Cannot lock file /x/status"))
    assert not store_unavailable(ProgrammingError("Unknown setting"))
    assert [backoff_s(n) for n in (1, 2, 3)] == [0.5, 1.0, 2.0] and backoff_s(50) == MAX_PAUSE_S


def test_the_url_scheme_names_the_store_kind_and_an_unknown_one_is_refused_in_one_line() -> None:
    local, served = StoreConfig(url="chdb://memory"), StoreConfig(url="http://127.0.0.1:8123")
    assert (local.local_path, local.on_disk, served.local_path) == (":memory:", None, None)
    assert local.kind.adapter == served.kind.adapter == "fleetscope.sinks.clickhouse"
    with pytest.raises(ValueError, match=r"^invalid StoreConfig: url: expected one of chdb://, http://, https:// "):
        StoreConfig(url="sqlite:///tmp/store.db")
