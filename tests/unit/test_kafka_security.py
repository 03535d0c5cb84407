"""Every Kafka client the project creates gets the SASL/TLS settings of ``KafkaSettings``.

The embedded Tansu broker cannot serve a SASL listener here: ``--authentication`` needs users, and creating
one (``tansu user create``) must itself authenticate against the memory store. So each client is built
from a SASL_SSL configuration and what it was given is inspected: confluent-kafka constructors are
recorded as they are called, Faust and aiokafka expose their settings."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from fleetscope import broker as broker_module
from fleetscope.config import Config, load_config, split_secrets
from fleetscope.producers import control as control_module
from fleetscope.producers import torch_hook
from fleetscope.producers.publisher import delivery as publisher_delivery
from fleetscope.sinks import ClickHouseWriter, Sink, StoreConfig, connect
from fleetscope.sinks import alerts as alerts_module
from fleetscope.sinks import sink as sink_module
from fleetscope.stack import EmbeddedStack, StreamWorkerProcess, sink_config, stream_app_config
from fleetscope.streams.app import create_app
from fleetscope.streams.recovery import StateLog
from fleetscope.wiring import bulk_publisher_config, control_listener_config, publisher_config

SECRET = "s3cret-pa55"
SECURE = {
    "kafka.bootstrap_servers": "127.0.0.1:1",
    "kafka.security_protocol": "SASL_SSL",
    "kafka.sasl_mechanism": "SCRAM-SHA-512",
    "kafka.sasl_username": "fleet",
    "kafka.sasl_password": SECRET,
}
LIBRDKAFKA = {
    "security.protocol": "SASL_SSL",
    "sasl.mechanism": "SCRAM-SHA-512",
    "sasl.username": "fleet",
    "sasl.password": SECRET,
}


class Built(Exception):
    """Raised by a recorded constructor once it has its settings: nothing connects anywhere."""


@pytest.fixture()
def config(tmp_path: Any) -> Config:
    return load_config(env={}, overrides={**SECURE, "data_dir": str(tmp_path)})


@pytest.fixture()
def recorded(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any, str], list[dict[str, Any]]]:
    """Replace ``module.name`` (a confluent-kafka class) by a recorder of the settings it is built with."""

    def record(module: Any, name: str, real: bool = False) -> list[dict[str, Any]]:
        calls: list[dict[str, Any]] = []
        cls = getattr(module, name)

        def build(settings: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
            calls.append(dict(settings))
            if real:  # the real client (it connects lazily), so the code goes on to its next client
                return cls(settings, *args, **kwargs)
            raise Built

        monkeypatch.setattr(module, name, build)
        return calls

    return record


def secured(settings: dict[str, Any]) -> bool:
    return all(settings.get(key) == value for key, value in LIBRDKAFKA.items())


def test_publisher_of_every_producing_process_gets_the_settings(config: Config, recorded: Any) -> None:
    """demo, simulate and replay (``bulk_publisher_config``), the agent and the torch hook (``publisher_config``)."""
    for built in (bulk_publisher_config(config), publisher_config(config, client_id="fleetscope-agent")):
        assert secured(built.librdkafka())
    producers = recorded(publisher_delivery, "Producer")
    monitor = torch_hook._build("sec-job", config)  # the torch hook's own path from a Config to its clients
    assert monitor is not None
    with pytest.raises(Built):
        monitor.recorder._publisher.start()  # type: ignore[attr-defined]
    assert len(producers) == 1 and secured(producers[0])
    consumers = recorded(control_module, "Consumer")
    with pytest.raises(Built):
        monitor._listener._run()  # type: ignore[union-attr]
    assert len(consumers) == 1 and secured(consumers[0])


def test_sink_consumer_and_dead_letter_producer_get_the_settings(
    config: Config, recorded: Any, chdb_path: Path, database: str
) -> None:
    consumers = recorded(sink_module, "Consumer", real=True)
    producers = recorded(sink_module, "Producer")
    store = StoreConfig(url=f"chdb://{chdb_path}", database=database)
    sink = Sink(sink_config(config), ClickHouseWriter(connect(store), database))
    with pytest.raises(Built):
        sink._ensure_clients()
    assert len(consumers) == 1 and secured(consumers[0])
    assert len(producers) == 1 and secured(producers[0])
    sink._consumer.close()  # type: ignore[union-attr]


def test_control_producer_and_listener_get_the_settings(config: Config, recorded: Any) -> None:
    producers = recorded(control_module, "Producer")
    with pytest.raises(Built):
        control_module.publish_request(config, control_module.ControlRequest(job="j", duration_s=1.0, start_at_ns=0))
    consumers = recorded(control_module, "Consumer")
    listener = control_module.ControlListener(control_listener_config(config), "j", print)
    with pytest.raises(Built):
        listener._run()
    assert secured(producers[0]) and secured(consumers[0])


def test_alert_follower_gets_the_settings(config: Config, recorded: Any) -> None:
    from fleetscope.commands.alerts import cmd_alerts

    consumers = recorded(alerts_module, "Consumer")
    args = argparse.Namespace(job=None, from_beginning=False, group="", json=True, webhook="")
    with pytest.raises(Built):
        cmd_alerts(args, config)
    assert len(consumers) == 1 and secured(consumers[0])


def test_admin_clients_of_init_replay_and_the_stack_get_the_settings(config: Config, recorded: Any) -> None:
    from fleetscope.commands.deployment import cmd_init
    from fleetscope.traces_cli import replay_traces

    admins = recorded(broker_module, "AdminClient")
    with pytest.raises(Built):
        cmd_init(argparse.Namespace(), config)
    with pytest.raises(Built):
        replay_traces([], config)
    with pytest.raises(Built):
        EmbeddedStack(config, with_worker=False).start()
    assert len(admins) == 3 and all(secured(a) for a in admins)


def test_the_faust_app_and_its_recovery_consumer_get_the_settings(config: Config) -> None:
    app = create_app(stream_app_config(config))
    auth = dict(credentials_to_aiokafka_auth(app.conf.broker_credentials))
    assert auth["security_protocol"] == "SASL_SSL" and auth["sasl_mechanism"] == "SCRAM-SHA-512"
    assert auth["sasl_plain_username"] == "fleet" and auth["sasl_plain_password"] == SECRET
    assert auth["ssl_context"] is not None
    assert dict(app.producer._settings_auth())["sasl_plain_password"] == SECRET

    async def recovery_client() -> Any:
        consumer = StateLog(app, "x.windower-state", 4, config.kafka.bootstrap_servers).consumer()
        return consumer._client

    client = asyncio.run(recovery_client())
    assert client._security_protocol == "SASL_SSL" and client._sasl_mechanism == "SCRAM-SHA-512"
    assert client._sasl_plain_username == "fleet" and client._sasl_plain_password == SECRET
    assert client._ssl_context is not None


def test_plaintext_gives_faust_no_credentials_and_librdkafka_plaintext(tmp_path: Any) -> None:
    plain = load_config(env={}, overrides={"kafka.bootstrap_servers": "127.0.0.1:1", "data_dir": str(tmp_path)})
    assert plain.kafka.faust_credentials() is None
    assert plain.kafka.client_settings() == {"security.protocol": "PLAINTEXT"}


def test_bad_security_settings_are_refused() -> None:
    from fleetscope.config import KafkaSettings

    with pytest.raises(ValueError, match="needs a sasl_mechanism"):
        KafkaSettings(security_protocol="SASL_SSL")
    with pytest.raises(ValueError, match="sasl_mechanism 'GSSAPI'"):
        KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="GSSAPI")


def test_a_worker_gets_its_secrets_from_the_environment_never_from_its_config_file(config: Config) -> None:
    config = config.replace(store=config.store.__class__(url=config.store.url, password="db-secret"))
    settings, env = split_secrets(config)
    assert SECRET not in repr(settings) and "db-secret" not in repr(settings)
    assert env == {"FLEETSCOPE__KAFKA__SASL_PASSWORD": SECRET, "FLEETSCOPE__STORE__PASSWORD": "db-secret"}
    assert load_config(env=env, overrides=_flatten(settings)) == config


def test_the_worker_process_config_file_holds_no_secret(config: Config) -> None:
    worker = StreamWorkerProcess(config)
    with pytest.raises(RuntimeError):  # no broker at 127.0.0.1:1: never ready, stopped after the timeout
        worker.start(ready_timeout_s=0.5)
    text = worker.config_path.read_text()
    assert SECRET not in text and '"sasl_username": "fleet"' in text


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out
