"""Where the store lives, and which adapter serves each kind of store: importable without any driver.

Kept outside the adapters (importing one loads its driver) so that loading the program's configuration (as
every training rank's torch hook does) imports no store driver. The URL's scheme names the store's kind;
``STORE_KINDS`` is the one registration of an adapter (``sinks/store.py::open_store`` imports it by name).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MiB = 1 << 20


@dataclass(frozen=True)
class StoreKind:
    """One URL scheme's store: the module of its adapter (it defines ``ADAPTER``, a ``StoreAdapter``), and
    whether the URL names a local directory (``scheme://PATH`` or ``scheme://memory``, a store in this
    process) rather than a server (``scheme://HOST:PORT``)."""

    adapter: str
    local: bool


STORE_KINDS: dict[str, StoreKind] = {
    "chdb": StoreKind("fleetscope.sinks.clickhouse", local=True),
    "http": StoreKind("fleetscope.sinks.clickhouse", local=False),
    "https": StoreKind("fleetscope.sinks.clickhouse", local=False),
}
"""URL scheme -> the store kind that serves it: a second store is its package and its line here."""


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else ""


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    """Where the store lives: a URL whose scheme is one of ``STORE_KINDS`` (``chdb://<path>`` relative to
    the working directory or absolute, ``chdb://memory``, ``http(s)://host:port`` by default).

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
        kind = STORE_KINDS.get(_scheme(self.url))
        if kind is None:
            schemes = ", ".join(f"{s}://" for s in STORE_KINDS)
            errors.append(f"url: expected one of {schemes} (chdb://PATH, chdb://memory, http(s)://HOST:PORT), "
                          f"got {self.url!r}")  # fmt: skip
        elif kind.local and not self.url.split("://", 1)[1]:
            errors.append(f"url: {_scheme(self.url)}:// needs a path or 'memory'")
        elif not kind.local and urlsplit(self.url).password:
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
            raise ValueError("invalid StoreConfig: " + "; ".join(errors))

    @property
    def kind(self) -> StoreKind:
        return STORE_KINDS[_scheme(self.url)]

    @property
    def local_path(self) -> str | None:
        """The store's absolute directory when the URL names one, ``":memory:"`` for ``scheme://memory``,
        None for a server URL. A local store is open in one process at a time (``up`` serves it)."""
        if not self.kind.local:
            return None
        location = self.url.split("://", 1)[1]
        if location in ("memory", ":memory:"):
            return ":memory:"
        return os.path.realpath(os.path.expanduser(location))

    @property
    def on_disk(self) -> str | None:
        """``local_path`` when it is a directory (not memory): what another process may hold or serve."""
        path = self.local_path
        return None if path in (None, ":memory:") else path


@dataclass(frozen=True, kw_only=True)
class StoreServerBounds:
    """What one request and the server as a whole may cost. A read token's body is a statement, of which the
    engine parses at most ``max_query_size`` (256 KiB), so 1 MiB raw and decompressed is room enough (a 200 MB
    statement took ``up`` to 4.6 GB before the engine refused it); the write token's bodies may be insert
    batches: 64 MiB raw, 256 MiB decompressed, their statement still under the read cap. 30 s of silence
    closes a connection; 64 connections at once (more are answered 503 at once, never a thread each).
    Defaults that keep ``up`` alive on a laptop."""

    read_body_bytes: int = 1 * MiB
    read_decoded_bytes: int = 1 * MiB
    write_body_bytes: int = 64 * MiB
    write_decoded_bytes: int = 256 * MiB
    idle_timeout_s: float = 30.0
    """A connection that sends nothing for this long (a half-sent request, an idle keep-alive) is closed."""
    max_connections: int = 64

    def __post_init__(self) -> None:
        errors = [
            f"{name} must be >= 1, got {getattr(self, name)}"
            for name in ("read_body_bytes", "read_decoded_bytes", "write_body_bytes", "write_decoded_bytes")
            if getattr(self, name) < 1
        ]
        if not 0 < self.idle_timeout_s <= 3600:  # refuses NaN and infinity too
            errors.append(f"idle_timeout_s must be > 0 and <= 3600, got {self.idle_timeout_s}")
        if not 1 <= self.max_connections <= 4096:
            errors.append(f"max_connections must be between 1 and 4096, got {self.max_connections}")
        if errors:
            raise ValueError("; ".join(errors))

    def caps(self, access: str) -> tuple[int, int]:
        """(raw, decompressed) body caps of a token's access ("read" or "write")."""
        if access == "write":
            return self.write_body_bytes, self.write_decoded_bytes
        return self.read_body_bytes, self.read_decoded_bytes


def check_database(database: str) -> str:
    """``database`` when it is an identifier (the only name a store formats into its statements)."""
    if not _IDENTIFIER.match(database):
        raise ValueError(f"database {database!r} is not an identifier [A-Za-z_][A-Za-z0-9_]*")
    return database
