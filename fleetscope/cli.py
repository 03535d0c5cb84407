"""``fleetscope`` command line: the parser, the configuration every command gets, and the error report.

The commands themselves live in ``fleetscope/commands/``, one module per family."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Sequence

from fleetscope import lifetime, redaction
from fleetscope.commands import register_all
from fleetscope.commands.deployment import configure_process
from fleetscope.commands.options import common
from fleetscope.config import Config, load_config, split_secrets
from fleetscope.tables import TerminalText


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
    {"simulate", "replay", "alerts", "run", "profile", "agent", "worker", "sink", "init", "inspector"}
)
"""Commands that publish to or read from a broker: without one configured, they use the broker of the
``up`` running on the data directory."""


def _config(args: argparse.Namespace) -> Config:
    from fleetscope.endpoint import running_endpoint

    overrides: dict[str, object] = {}
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


PRIVATE_UMASK = 0o077
"""Every command runs with this umask, so every file it (and chDB, Tansu, its workers) creates is the user's
alone (0600, folders 0700): the store, the logs, Faust's tables, the outage spool, a report."""

USER_UMASK_COMMANDS = frozenset({"run"})
"""Commands that keep the user's umask: ``run``'s children are the training job, whose files are its own."""


@contextlib.contextmanager
def _private_files(command: str) -> Iterator[None]:
    """``PRIVATE_UMASK`` while the command runs (restored after: ``main`` is also called in-process)."""
    if command in USER_UMASK_COMMANDS:
        yield
        return
    previous = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(previous)


RAW_OUTPUT_COMMANDS = frozenset({"worker"})
"""Commands whose terminal output is not the command's own: the worker's is Faust's (its spinner's cursor
codes, its coloured log levels), and it prints nothing of the store's (its log records pass
``redaction.install``'s rule)."""


@contextlib.contextmanager
def _terminal_output(command: str) -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` through ``TerminalText`` while the command runs (restored after:
    ``main`` is also called in-process): results, errors, skipped files, progress lines."""
    if command in RAW_OUTPUT_COMMANDS or isinstance(sys.stdout, TerminalText):
        yield
        return
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = TerminalText(out), TerminalText(err)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = out, err


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    redaction.install()  # before any record: every log line of the process, every library's, is redacted
    lifetime.watch_parent_from_env()  # a child of `up` (its worker) stops when `up` ends, even by SIGKILL
    with _private_files(args.command), _terminal_output(args.command):
        try:
            config = _config(args)
            for secret in split_secrets(config)[1].values():
                redaction.register_secret(secret)
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
