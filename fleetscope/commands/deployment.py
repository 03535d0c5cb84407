"""``fleetscope report``, ``alerts`` and ``init``, plus the per-process set-up the deployment needs.

``configure_process`` runs before every command: with ``kafka.registry_url`` set, every encode/decode of
the process goes through the schema registry; long-running commands serve Prometheus metrics on
``metrics_port``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

from fleetscope.config import Config, ConfigError

logger = logging.getLogger(__name__)

METRICS_COMMANDS = frozenset({"worker", "sink", "agent"})
"""Long-running processes that serve /metrics when ``metrics_port`` is set."""


def _registry(config: Config) -> Any:
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


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the ``report``, ``alerts`` and ``init`` subcommands."""
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

    p = sub.add_parser(
        "report",
        parents=[common],
        help="write a self-contained HTML report of one job",
        description="Query the store and write one HTML file (inline SVG, no external assets) with the "
        "job's findings, a rank x function deviation heatmap, iteration and compute time per rank, and "
        "collective bandwidth per rank.",
    )
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("-o", "--output", default="report.html", help="output file (default: report.html)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of a sentence")
    p.set_defaults(handler=cmd_report)

    p = sub.add_parser(
        "alerts",
        parents=[common],
        help="follow findings as they open, update and close",
        description="Follow the findings topic and print one line per finding state change (new, "
        "updated, closed), or JSON lines with --json; optionally POST each as JSON to a webhook "
        "(bounded retries with jitter; failures are logged, never fatal). Runs until Ctrl-C.",
    )
    p.add_argument("--job", help="only this job")
    p.add_argument("--webhook", metavar="URL", help="POST every alert as JSON to this http(s) URL")
    p.add_argument("--webhook-timeout-s", type=float, default=5.0, help="per attempt (default: 5)")
    p.add_argument("--webhook-attempts", type=int, default=4, help="attempts per alert (default: 4)")
    p.add_argument("--from-beginning", action="store_true", help="replay the topic's findings first")
    p.add_argument("--group", default="", help="consumer group: resume after a restart (default: none, follow live)")
    p.add_argument("--json", action="store_true", help="print JSON lines")
    p.set_defaults(handler=cmd_alerts)


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


def cmd_report(args: argparse.Namespace, config: Config) -> int:
    from fleetscope import verdict
    from fleetscope.endpoint import open_store
    from fleetscope.report import write_report
    from fleetscope.schemas import units

    store = open_store(config)
    t0 = time.monotonic()
    data = write_report(store, args.job, args.output)
    seconds = time.monotonic() - t0
    rank, function, gap = data.heatmap.top_outlier()
    lead = verdict.headline(data.findings)
    summary = {
        "path": args.output,
        "job": args.job,
        "ranks": len(data.ranks),
        "iterations": [data.first_iteration, data.last_iteration],
        "findings": len(data.findings),
        "open_findings": sum(f["status"] != "closed" for f in data.findings),
        "verdict": verdict.sentence(data.findings, data.median_iteration_ns),
        "headline": None
        if lead is None
        else {
            "subject": units.subject(lead),
            "category": lead["category"],
            "function": lead["function"],
            "est_loss_ns": lead["est_loss_ns"],
            "gpu": units.gpu(lead),
        },
        "top_deviation": {"rank": rank, "function": function, "gap": round(gap, 4)},
        "build_seconds": round(seconds, 3),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        if lead is None:
            head = f"no findings; largest deviation: rank {rank} {function} {gap:+.0%}"
        else:
            loss = units.duration(lead["est_loss_ns"])
            head = f"headline: {units.subject(lead)} {lead['category']}, {loss} per iteration"
        print(
            f"wrote {args.output} in {seconds:.2f} s: job {args.job}, {len(data.ranks)} ranks, "
            f"{len(data.findings)} findings; {head}"
        )
    return 0


def cmd_alerts(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.broker import notice_logger
    from fleetscope.sinks.alerts import (
        AlertFollower,
        AlertsConfig,
        WebhookConfig,
        WebhookSender,
        format_alert,
    )
    from fleetscope.sinks.retry import RetryPolicy

    k = config.kafka
    if not k.bootstrap_servers:
        raise ConfigError(["kafka.bootstrap_servers: alerts needs a broker (--bootstrap or configuration)"])
    webhook = None
    if args.webhook:
        webhook = WebhookSender(
            WebhookConfig(
                url=args.webhook,
                timeout_s=args.webhook_timeout_s,
                retry=RetryPolicy(max_attempts=max(1, args.webhook_attempts), initial_backoff_ms=250),
            )
        )
        webhook.start()

    def on_alert(alert: dict[str, Any]) -> None:
        line = json.dumps(alert, default=str) if args.json else format_alert(alert)
        print(line, flush=True)
        if webhook is not None:
            webhook.submit(alert)

    # librdkafka logs through this logger: one line per 30 s while the broker is away, not 20 a second
    extra: dict[str, Any] = {**k.client_settings(), "logger": notice_logger("alerts", k.bootstrap_servers)}
    follower = AlertFollower(
        AlertsConfig(
            bootstrap_servers=k.bootstrap_servers,
            topic_prefix=k.topic_prefix,
            job=args.job,
            from_beginning=args.from_beginning,
            group_id=args.group,
            session_timeout_ms=k.session_timeout_ms,
            extra=extra,
        ),
        on_alert,
        on_ready=lambda: print(
            f"following {follower.topic} on {k.bootstrap_servers}; Ctrl-C stops", file=sys.stderr, flush=True
        ),
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        follower.run(stop)
    finally:
        if webhook is not None:
            webhook.stop()
            logger.info("webhook: %s", webhook.stats)
    return 0
