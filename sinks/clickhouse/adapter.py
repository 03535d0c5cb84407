"""``ADAPTER``: the ClickHouse store kind behind the seam (``sinks/store.py::StoreAdapter``), registered for
``chdb://`` and ``http(s)://`` in ``store_config.STORE_KINDS``; and chDB's lock on a store directory."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from fleetscope.sinks.clickhouse import messages
from fleetscope.sinks.clickhouse.client import store_unavailable
from fleetscope.sinks.clickhouse.store import open_clickhouse
from fleetscope.sinks.store import Refusal, ServedStore, Store, Tokens
from fleetscope.sinks.store_config import StoreConfig, StoreServerBounds


def _this_process_opened(path: Path) -> bool:
    """Whether this process has ``path`` open (its own chDB engine holds the lock then)."""
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        return False
    target = str(path.resolve())
    for fd in fds.iterdir():
        try:
            if os.readlink(fd) == target:
                return True
        except OSError:
            continue
    return False


def store_locked(path: str) -> bool:
    """True when another process holds the chDB store's lock (ClickHouse flocks ``<path>/status``)."""
    status = Path(path) / "status"
    if _this_process_opened(status):
        return False
    try:
        fd = os.open(status, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


class ClickHouseAdapter:
    """chDB in-process (a directory, or memory) or a ClickHouse server."""

    def open(self, config: StoreConfig, *, prepare: bool) -> Store:
        return open_clickhouse(config, prepare=prepare)

    def unavailable(self, exc: BaseException) -> bool:
        return store_unavailable(exc)

    def held_elsewhere(self, config: StoreConfig) -> bool:
        path = config.on_disk
        return path is not None and store_locked(path)

    def serve(self, config: StoreConfig, tokens: Tokens, *, port: int, bounds: StoreServerBounds) -> ServedStore:
        from fleetscope.sinks.clickhouse.server import StoreServer

        path = config.on_disk
        if path is None:
            raise ValueError(f"store {config.url}: only a chDB directory is served, not a server or memory")
        return StoreServer(path, tokens, database=config.database, port=port, bounds=bounds, config=config).start()

    def refusal(self, exc: BaseException) -> Refusal | None:
        return messages.refusal(exc)


ADAPTER = ClickHouseAdapter()
