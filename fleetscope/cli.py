"""``fleetscope`` command line: the parser, the configuration every command gets, and the error report.

The commands themselves live in ``fleetscope/commands/``, one module per family."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from fleetscope.commands import register_all
from fleetscope.commands.deployment import configure_process
from fleetscope.commands.options import common
from fleetscope.config import Config, load_config


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetscope")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetscope",
        description="Find why distributed training jobs are slow: stream per-rank events through Kafka, "
        "compare every rank with its peers, store findings in ClickHouse.",
    )
    parser.add_argument("--version", action="version", version=f"fleetscope {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    register_all(sub, common())
    return parser


BROKER_CLIENT_COMMANDS = frozenset(
    {"simulate", "replay", "alerts", "run", "profile", "agent", "worker", "sink", "init"}
)
"""Commands that publish to or read from a broker: without one configured, they use the broker of the
``up`` running on the data directory."""


def _config(args: argparse.Namespace) -> Config:
    from fleetscope.endpoint import running_endpoint

    overrides: dict[str, Any] = {}
    if args.data_dir:
        overrides["data_dir"] = args.data_dir
    if args.bootstrap:
        overrides["kafka.bootstrap_servers"] = args.bootstrap
    if args.log_level:
        overrides["log_level"] = args.log_level
    config = load_config(args.config, overrides=overrides)
    if not config.kafka.bootstrap_servers and args.command in BROKER_CLIENT_COMMANDS:
        endpoint = running_endpoint(config.data_dir)
        if endpoint is not None:
            overrides["kafka.bootstrap_servers"] = endpoint.bootstrap_servers
            config = load_config(args.config, overrides=overrides)
    return config


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = _config(args)
        logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        configure_process(config, args.command)
        return int(args.handler(args, config))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # every failure: a few lines a person reads; the traceback with --debug
        from fleetscope.errors import describe

        if args.debug:
            traceback.print_exc()
        lines, status = describe(exc, args.command)
        print("\n".join(lines), file=sys.stderr)
        return status


if __name__ == "__main__":
    raise SystemExit(main())
