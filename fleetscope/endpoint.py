"""Where a running ``fleetscope up`` can be reached, told through its data directory.

``up`` writes ``<data_dir>/endpoint.json`` (mode 0600: it holds the store's tokens) with its broker
address and the URL of its served store, and removes it on stop. Other commands run on the same data
directory read it: a broker-using command gets the broker, ``sql``/``findings``/``report`` go through the
served store (a local store admits one process at a time) and, with no ``up`` running, open the store directly.
The tokens themselves persist in ``<data_dir>/store-tokens.json`` (0600), so a Grafana datasource keeps
working across restarts.
"""

from __future__ import annotations

import json
import os
import secrets
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fleetscope.config import Config, ConfigError
from fleetscope.errors import StoreLocked
from fleetscope.lifetime import process_exists
from fleetscope.sinks.store import Tokens
from fleetscope.sinks.store_config import StoreConfig

if TYPE_CHECKING:
    from fleetscope.sinks.store import Store

ENDPOINT_FILE = "endpoint.json"
TOKENS_FILE = "store-tokens.json"


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """What a running ``up`` publishes about itself."""

    pid: int
    bootstrap_servers: str
    store_url: str
    database: str
    read_token: str
    write_token: str


def _write_private(path: Path, payload: dict[str, object]) -> None:
    """Write JSON readable by its owner only, atomically (no half-written file is ever read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


def store_tokens(data_dir: str | Path) -> Tokens:
    """The data directory's store tokens, created on first use."""
    path = Path(data_dir) / TOKENS_FILE
    try:
        saved = json.loads(path.read_text())
        return Tokens(read=str(saved["read"]), write=str(saved["write"]))
    except (OSError, ValueError, KeyError, TypeError):
        tokens = Tokens(read=secrets.token_urlsafe(24), write=secrets.token_urlsafe(24))
        _write_private(path, {"read": tokens.read, "write": tokens.write})
        return tokens


def write_endpoint(data_dir: str | Path, endpoint: Endpoint) -> Path:
    path = Path(data_dir) / ENDPOINT_FILE
    _write_private(path, asdict(endpoint))
    return path


def remove_endpoint(data_dir: str | Path) -> None:
    """Remove the endpoint file if it is this process's own."""
    path = Path(data_dir) / ENDPOINT_FILE
    endpoint = _read(path)
    if endpoint is not None and endpoint.pid == os.getpid():
        path.unlink(missing_ok=True)


def _read(path: Path) -> Endpoint | None:
    try:
        return Endpoint(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def running_endpoint(data_dir: str | Path) -> Endpoint | None:
    """The endpoint of the ``up`` running on ``data_dir``, or None (a file left by a dead process is
    ignored: a crash cannot leave the CLI pointing at nothing)."""
    endpoint = _read(Path(data_dir) / ENDPOINT_FILE)
    if endpoint is None or not process_exists(endpoint.pid):
        return None
    return endpoint


def store_answers(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ping", timeout=timeout_s) as response:  # noqa: S310 - our own URL
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def open_store(config: Config, *, write: bool = False, create: bool = False) -> Store:
    """The store a command works on: through the running ``up`` of the data directory when there is one
    (read-only unless ``write``), else the store itself. Never creates an empty store unless ``create``
    (``init``), which also prepares a served store's schema."""
    from fleetscope.sinks.store import open_store as open_store_at

    ch = config.store
    endpoint = running_endpoint(config.data_dir) if ch.on_disk is not None else None
    if endpoint is not None:
        if not store_answers(endpoint.store_url):
            raise ConfigError(
                [
                    f"store: `fleetscope up` (pid {endpoint.pid}) holds the store but its server at "
                    f"{endpoint.store_url} does not answer; retry, or stop that process"
                ]
            )
        return open_store_at(served_store(endpoint, write=write or create), prepare=create)
    path = ch.on_disk
    if not create and path is not None and not Path(path).is_dir():
        raise ConfigError(
            [
                f"store: no store at {path}; run `fleetscope up` or `fleetscope demo` first, "
                "or pass the --data-dir that holds it"
            ]
        )
    ensure_unlocked(config)
    return open_store_at(ch)


def ensure_unlocked(config: Config) -> None:
    """Raise ``StoreLocked``, naming the holder where it is known, when another process has the store."""
    from fleetscope.sinks.store import adapter

    path = config.store.on_disk
    if path is None or not adapter(config.store).held_elsewhere(config.store):
        return
    endpoint = running_endpoint(config.data_dir)
    if endpoint is not None:
        raise StoreLocked(
            f"the store at {path} belongs to `fleetscope up` (pid {endpoint.pid}), which serves it at "
            f"{endpoint.store_url}: stop it first, or use `sql`/`findings`/`report`, which go through it"
        )
    raise StoreLocked(
        f"the store at {path} is open in another process (a local store admits one): stop that `demo` or `sink`, "
        "or run `fleetscope up` here, which serves the store to other commands"
    )


def served_store(endpoint: Endpoint, *, write: bool = False) -> StoreConfig:
    """Where a served store is, as a store configuration: read-only unless ``write`` (the token says)."""
    return StoreConfig(
        url=endpoint.store_url,
        database=endpoint.database,
        username="fleetscope",
        password=endpoint.write_token if write else endpoint.read_token,
    )
