"""``fleetscope init`` and the per-process set-up a deployment needs (schema registry, metrics).

``configure_process`` runs before every command: with ``kafka.registry_url`` set, every encode/decode of
the process goes through the schema registry; long-running commands serve Prometheus metrics on
``metrics_port``.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import TYPE_CHECKING

from fleetscope.config import Config, ConfigError

if TYPE_CHECKING:  # the registry client is imported only where a registry is configured
    from fleetscope.schemas.registry import RegistryResolver

logger = logging.getLogger(__name__)

METRICS_COMMANDS = frozenset({"worker", "sink", "agent"})
"""Long-running processes that serve /metrics when ``metrics_port`` is set."""


def _registry(config: Config) -> RegistryResolver:
    from fleetscope.schemas.registry import registry_resolver

    k = config.kafka
    return registry_resolver(
        k.registry_url,
        topic_prefix=k.topic_prefix,
        username=k.registry_username,
        password=k.registry_password,
    )


def configure_process(config: Config, command: str) -> None:
    """Install the schema-registry resolver and start the metrics endpoint, as the configuration says."""
    if config.kafka.registry_url:
        from fleetscope.schemas.codec import use_resolver

        use_resolver(_registry(config))
        logger.info("schema ids come from the registry at %s", config.kafka.registry_url)
    if config.metrics_port and command in METRICS_COMMANDS:
        from fleetscope import telemetry

        telemetry.serve(config.metrics_port, host=config.metrics_host)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """Add ``init``."""
    p = sub.add_parser(
        "init",
        parents=[common],
        help="create topics, register schemas and create tables (idempotent)",
        description="Prepare a distributed deployment before its workers start: create every pipeline "
        "topic with the configured partition counts, register the Avro schemas when a schema registry is "
        "configured, and create the ClickHouse database and tables. Safe to run again.",
    )
    p.add_argument("--json", action="store_true", help="print what was prepared as JSON")
    p.set_defaults(handler=cmd_init)


def cmd_init(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.broker import ensure_topics
    from fleetscope.endpoint import open_store
    from fleetscope.schemas import Topics

    k = config.kafka
    if not k.bootstrap_servers:
        raise ConfigError(["kafka.bootstrap_servers: init needs a broker (--bootstrap or configuration)"])
    topics = Topics(prefix=k.topic_prefix)
    ensure_topics(
        k.admin_settings(),
        topics,
        k.raw_partitions,
        k.derived_partitions,
    )
    names = [*topics.raw_all, *topics.derived_all]
    ids = _registry(config).register_catalog() if k.registry_url else {}
    ch = config.store
    open_store(config, create=True).close()  # through `up`'s server (write token) when `up` holds it
    if args.json:
        print(json.dumps({"topics": names, "schemas": dict(sorted(ids.items())), "database": ch.database}))
        return 0
    print(f"topics ready: {', '.join(names)}")
    if ids:
        print("schemas registered: " + ", ".join(f"{s}={i}" for s, i in sorted(ids.items())))
    print(f"store ready: database {ch.database}")
    return 0
