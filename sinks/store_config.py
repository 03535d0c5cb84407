"""Where the store lives: the store's configuration, importable without the ClickHouse driver.

Kept outside the ``clickhouse`` package (importing it loads the driver) so that loading the program's
configuration (as every training rank's torch hook does) never imports clickhouse-connect or chDB; the URL
scheme names the store's kind (``sinks/store.py::open_store``).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, kw_only=True)
class ClickHouseConfig:
    """Where the store lives. ``chdb://<path>`` (relative to the working directory or absolute) or
    ``chdb://memory`` runs ClickHouse in-process; ``http(s)://host:port`` reaches a server.

    ``flush_rows``/``flush_interval_ms`` are the batching hints for whoever drives a writer. The ``read_*``
    fields bound every read-only session (``fleetscope sql``, the report, the served store's read token), so
    that no read query can hold ``up``'s memory or a core past them: the engine stops the query and says why."""

    url: str = "chdb://.fleetscope/store"
    database: str = "fleetscope"
    username: str = "default"
    password: str = field(default="", repr=False)
    flush_rows: int = 50_000
    flush_interval_ms: int = 500
    read_max_execution_time_s: float = 30.0
    read_max_memory_bytes: int = 1 << 30
    read_max_result_rows: int = 1_000_000
    read_max_result_bytes: int = 256 << 20
    read_max_threads: int = 4

    def __post_init__(self) -> None:
        errors: list[str] = []
        scheme = self.url.split("://", 1)[0] if "://" in self.url else ""
        if scheme not in ("chdb", "http", "https"):
            errors.append(f"url: expected chdb://PATH, chdb://memory or http(s)://HOST:PORT, got {self.url!r}")
        elif scheme == "chdb" and not self.url[len("chdb://") :]:
            errors.append("url: chdb:// needs a path or 'memory'")
        elif scheme != "chdb" and urlsplit(self.url).password:
            errors.append("url: put the password in `password`, not in the URL (URLs get logged)")
        if not _IDENTIFIER.match(self.database):
            errors.append(f"database: {self.database!r} is not an identifier [A-Za-z_][A-Za-z0-9_]*")
        if self.flush_rows <= 0:
            errors.append(f"flush_rows: must be > 0, got {self.flush_rows}")
        if self.flush_interval_ms <= 0:
            errors.append(f"flush_interval_ms: must be > 0, got {self.flush_interval_ms}")
        if not (math.isfinite(self.read_max_execution_time_s) and self.read_max_execution_time_s > 0):
            errors.append(f"read_max_execution_time_s: must be finite and > 0, got {self.read_max_execution_time_s}")
        for name in ("read_max_memory_bytes", "read_max_result_rows", "read_max_result_bytes", "read_max_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                errors.append(f"{name}: must be an integer > 0, got {value!r}")
        if errors:
            raise ValueError("invalid ClickHouseConfig: " + "; ".join(errors))

    @property
    def chdb_path(self) -> str | None:
        """Absolute chDB directory, ``":memory:"`` for chdb://memory, None for a server URL."""
        if not self.url.startswith("chdb://"):
            return None
        location = self.url[len("chdb://") :]
        if location in ("memory", ":memory:"):
            return ":memory:"
        return os.path.realpath(os.path.expanduser(location))


def check_database(database: str) -> str:
    if not _IDENTIFIER.match(database):
        raise ValueError(f"database {database!r} is not an identifier [A-Za-z_][A-Za-z0-9_]*")
    return database
