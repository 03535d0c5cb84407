"""The adversary corpus of the served store's read token, grown from the engine itself: every function of
``system.functions`` and ``system.table_functions`` called with a canary file's path and with a URL to a
local listener, every setting of ``system.settings`` sent in the URL as the canary's path. None may return
the canary's content (in a result or an error), write a file, or reach the listener. Nothing here names an
attack: a function or setting the next chDB adds is tried the day it appears."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fleetscope.sinks import StoreConfig, connect, migrate
from fleetscope.sinks.clickhouse.server import StoreServer, Tokens

pytestmark = pytest.mark.integration

TOKENS = Tokens(read="adv-read", write="adv-write")
FORMATS = ("TabSeparated", "Template", "CustomSeparated", "Protobuf", "CapnProto", "Regexp", "JSONEachRow")
"""Output formats a setting may steer; each setting is tried with one, chosen by its name's hash."""


class Listener:
    """A TCP port on loopback that counts who connects (a function that fetches a URL would)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()


@pytest.fixture(scope="module")
def served(chdb_path: Path) -> Iterator[tuple[StoreServer, str]]:
    database = f"adv_{uuid.uuid4().hex[:10]}"
    migrate(connect(StoreConfig(url=f"chdb://{chdb_path}", database=database)), database)
    server = StoreServer(str(chdb_path), TOKENS, database=database).start()
    yield server, database
    server.stop()


def _ask(server: StoreServer, database: str, query: str, settings: dict[str, str] | None = None) -> bytes:
    """The body of the read token's answer (a result or an error text)."""
    params = {"database": database, "query": query, **(settings or {})}
    request = urllib.request.Request(
        f"{server.url}/?{urllib.parse.urlencode(params)}", headers={"X-ClickHouse-Key": TOKENS.read}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - our own loopback URL
            return bytes(response.read())
    except urllib.error.HTTPError as error:
        return bytes(error.read())


def _rows(server: StoreServer, database: str, query: str) -> list[str]:
    return _ask(server, database, query).decode().splitlines()


def _sample_all(calls: list[tuple[str, dict[str, str]]], server: StoreServer, database: str) -> list[bytes]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda c: _ask(server, database, c[0], c[1]), calls))


def test_no_function_or_setting_reaches_a_file_the_network_or_the_process(
    served: tuple[StoreServer, str], tmp_path: Path
) -> None:
    server, database = served
    canary_text = f"CANARY-{uuid.uuid4().hex}"
    canary = tmp_path / "canary.txt"
    canary.write_text(canary_text + "\n")
    listener = Listener()
    url = f"http://127.0.0.1:{listener.port}/canary"
    functions = _rows(server, database, "SELECT name FROM system.functions ORDER BY name")
    table_functions = _rows(server, database, "SELECT name FROM system.table_functions ORDER BY name")
    settings = _rows(server, database, "SELECT name FROM system.settings ORDER BY name")
    tables_before = _rows(server, database, "SELECT database, name FROM system.tables ORDER BY database, name")
    assert len(functions) > 1000 and len(table_functions) > 30 and len(settings) > 1000
    calls: list[tuple[str, dict[str, str]]] = []
    for name in functions:
        calls += [(f"SELECT `{name}`('{canary}')", {}), (f"SELECT `{name}`('{url}')", {})]
    for name in table_functions:
        for args in (f"'{canary}'", f"'{canary}', 'LineAsString'", f"'{url}'", f"'{url}', 'LineAsString'"):
            calls.append((f"SELECT * FROM `{name}`({args})", {}))
    for name in settings:
        fmt = FORMATS[sum(name.encode()) % len(FORMATS)]
        calls.append(("SELECT 1 AS x", {name: str(canary), "default_format": fmt}))
        calls.append(("SELECT 1 AS x", {name: str(canary), "default_format": "Template"}))
    answers = _sample_all(calls, server, database)
    leaked = [call for call, answer in zip(calls, answers, strict=True) if canary_text.encode() in answer]
    assert leaked == [], f"{len(leaked)} calls returned the canary, e.g. {leaked[:5]}"
    assert listener.connections == 0, "a read-token query reached the network"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["canary.txt"], "a read-token query wrote a file"
    assert _rows(server, database, "SELECT database, name FROM system.tables ORDER BY database, name") == tables_before
    listener.sock.close()
