"""``fleetscope alerts``: follow findings as they open, update and close; optionally POST them."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from fleetscope.commands.options import stop_on_signals
from fleetscope.config import Config, ConfigError

logger = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """Add ``alerts``."""
    p = sub.add_parser(
        "alerts",
        parents=[common],
        help="follow findings as they open, update and close",
        description="Follow the findings topic and print one line per finding state change (new, "
        "updated, closed; a new finding's line is followed by indented lines saying what it means and what "
        "to check next), or JSON lines with --json; optionally POST each as JSON to a webhook "
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


def cmd_alerts(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.broker import notice_logger
    from fleetscope.sinks.alerts import (
        AlertFollower,
        AlertsConfig,
        WebhookConfig,
        WebhookSender,
        format_alert,
        format_next_checks,
    )
    from fleetscope.sinks.retry import RetryPolicy
    from fleetscope.wiring import findings_key

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

    def on_alert(alert: dict[str, object]) -> None:
        if args.json:
            print(json.dumps(alert, default=str), flush=True)
        else:
            guidance = format_next_checks(alert) if alert["event"] == "new" else []
            print("\n".join([format_alert(alert), *guidance]), flush=True)
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
            findings_key=findings_key(config),
        ),
        on_alert,
        on_ready=lambda: print(
            f"following {follower.topic} on {k.bootstrap_servers}; Ctrl-C stops", file=sys.stderr, flush=True
        ),
    )
    stop = stop_on_signals()
    try:
        follower.run(stop)
    finally:
        if webhook is not None:
            webhook.stop()
            logger.info("webhook: %s", webhook.stats)
    return 0
