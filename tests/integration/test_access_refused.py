"""Against a real broker that requires SASL (Tansu with ``--authentication``, no user it knows): the sink
backs off instead of retrying every 50 ms, and librdkafka's own lines are thinned; the sink stops cleanly."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetscope.broker import _port_open, free_port, stop_process, tansu_binary
from fleetscope.sinks import ClickHouseWriter, Sink, SinkConfig, StoreConfig, connect, migrate

pytestmark = pytest.mark.integration

SASL = {
    "security.protocol": "SASL_PLAINTEXT",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": "nobody",
    "sasl.password": "not-a-user",
}


@pytest.fixture()
def authenticating_broker(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    cmd = [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
           "--storage-engine", "memory://tansu/", "--authentication"]  # fmt: skip
    with open(tmp_path / "tansu.log", "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)  # noqa: S603
    deadline = time.monotonic() + 20
    while not _port_open(port):
        assert time.monotonic() < deadline and proc.poll() is None, "authenticating broker did not start"
        time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    stop_process(proc, 5.0, "broker")


def test_a_sink_refused_by_the_broker_backs_off_and_logs_little(
    authenticating_broker: str, chdb_path: Path, database: str, caplog: pytest.LogCaptureFixture
) -> None:
    client = connect(StoreConfig(url=f"chdb://{chdb_path}", database=database))
    migrate(client, database)
    config = SinkConfig(bootstrap_servers=authenticating_broker, topic_prefix="auth", extra=SASL)
    sink = Sink(config, ClickHouseWriter(client, database))
    caplog.set_level(logging.DEBUG, logger="fleetscope.sinks")
    sink.start()
    time.sleep(8.0)
    sink.stop()
    refused = [r for r in caplog.records if r.name == "fleetscope.sinks.sink" and "refused" in r.getMessage()]
    client_lines = [r for r in caplog.records if r.name.endswith(".librdkafka")]
    assert refused, "the refusal is reported"
    assert len(refused) <= 2, [r.getMessage() for r in refused]  # the first, then at the 30 s cap
    assert "SASL authentication" in " ".join(r.getMessage() for r in refused + client_lines)
    assert len(client_lines) <= 4, [r.getMessage() for r in client_lines]  # one line per kind per 30 s
    assert sink.stats["messages"] == 0
