"""``fleetscope`` command line: run the pipeline, simulate jobs, query findings."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fleetscope.config import Config, ConfigError, load_config
from fleetscope.ecosystem_cli import configure_process
from fleetscope.tables import format_cell, print_findings, print_table


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("configuration")
    g.add_argument("--config", metavar="FILE", help="TOML (or JSON) configuration file")
    g.add_argument("--data-dir", help="where the embedded store and logs live (default .fleetscope)")
    g.add_argument("--bootstrap", metavar="HOST:PORT", help="Kafka bootstrap servers (default: embedded broker)")
    g.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    g.add_argument("--debug", action="store_true", help="print the traceback when a command fails")
    return p


def _sim_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulated job")
    g.add_argument("--job", default="demo", help="job id (default: demo)")
    g.add_argument("--ranks", type=int, default=16, help="number of ranks (default: 16)")
    g.add_argument("--iterations", type=int, default=40, help="training iterations (default: 40)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    g.add_argument("--clock-skew-ms", type=float, default=0.0, help="max clock offset between hosts")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default: 1)")
    g.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND:TARGET[:FACTOR][@START][/EVERY]",
        help="inject a fault, repeatable. Kinds: slow_gpu, slow_link, pcie_downgrade, host_slow (GC pauses), "
        "dataloader_stall, cpu_contention (TARGET a rank), net_congestion (a host), stage_imbalance (a pipeline "
        "stage), job_slowdown (TARGET -), hang (a rank, no factor; it stops halfway unless @START). "
        "E.g. slow_gpu:7:1.5, slow_link:12, "
        "host_slow:3, net_congestion:node001:1.5, job_slowdown:-:1.1@30, slow_gpu:5:1.3@10/3 (every 3rd).",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetscope")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = argparse.ArgumentParser(
        prog="fleetscope",
        description="Find why distributed training jobs are slow: stream per-rank events through Kafka, "
        "compare every rank with its peers, store findings in ClickHouse.",
    )
    parser.add_argument("--version", action="version", version=f"fleetscope {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "demo",
        parents=[common],
        help="run the embedded stack on a simulated job and print findings",
        description="Start the embedded broker, stream worker and ClickHouse store, publish a "
        "simulated data-parallel job (with optional faults), wait until it is analysed, print the "
        "findings and stop everything. The store keeps the results for `sql` and `findings`.",
    )
    _sim_options(p)
    p.add_argument("--json", action="store_true", help="print findings as a JSON list")
    p.add_argument("--timeout-s", type=float, default=300.0, help="give up after this long (default: 300)")
    p.add_argument("--quiet", action="store_true", help="no progress line")

    p = sub.add_parser(
        "up",
        parents=[common],
        help="run the embedded stack until interrupted",
        description="Start the embedded broker (unless --bootstrap), the ClickHouse sink and a stream "
        "worker; serve the store to other processes; print the broker address for producers; stop on Ctrl-C.",
    )
    p.add_argument("--json", action="store_true", help="print the addresses as one JSON line")

    p = sub.add_parser(
        "worker",
        parents=[common],
        help="run a stream worker (windower + differential)",
        description="Run the Faust stream worker against the configured broker. Start several for "
        "more throughput: they share one consumer group.",
    )
    p.add_argument("--web-port", type=int, default=6066, help="Faust web port (default: 6066)")
    p.add_argument("--logfile", help="log to this file instead of stderr")

    p = sub.add_parser(
        "sink",
        parents=[common],
        help="run the ClickHouse sink until interrupted",
        description="Consume iterations, patterns and findings topics into ClickHouse.",
    )

    p = sub.add_parser(
        "simulate",
        parents=[common],
        help="publish a simulated job to a broker",
        description="Publish a simulated job's raw events to the broker given by --bootstrap or the configuration.",
    )
    _sim_options(p)
    p.add_argument("--json", action="store_true", help="print what was published as JSON")

    p = sub.add_parser(
        "sql",
        parents=[common],
        help="run a SQL query on the store",
        description="Run a query against the findings store (read-only unless --write). "
        "Use {name:Type} placeholders with --param name=value.",
    )
    p.add_argument("query", help='e.g. "SELECT count() FROM findings"')
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="query parameter")
    p.add_argument("--json", action="store_true", help="print rows as JSON objects")
    p.add_argument("--write", action="store_true", help="allow statements that modify the store")

    p = sub.add_parser(
        "findings",
        parents=[common],
        help="list findings from the store",
        description="List current findings (one row per finding, latest state).",
    )
    p.add_argument("--job", help="only this job")
    p.add_argument("--json", action="store_true", help="print findings as a JSON list")
    for name, parser_ in sub.choices.items():
        parser_.set_defaults(handler=COMMANDS[name])
    for module in EXTENSION_MODULES:
        importlib.import_module(module).register(sub, common)
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


def _simulator_config(args: argparse.Namespace) -> Any:
    """The simulated job the options describe; its layout (``--tp``/``--pp``) validated with the ranks."""
    from dataclasses import replace as with_fields

    from fleetscope.producers import SimulatorConfig, parse_fault

    faults = []
    for spec in args.fault:
        fault = parse_fault(spec)
        if fault.kind == "hang" and "@" not in spec:
            # A rank that hangs before its first iteration leaves nothing to compare: halfway through.
            fault = with_fields(fault, start=args.iterations // 2)
        faults.append(fault)
    return SimulatorConfig(
        job=args.job,
        ranks=args.ranks,
        iterations=args.iterations,
        seed=args.seed,
        faults=tuple(faults),
        clock_skew_ms=args.clock_skew_ms,
        tp=args.tp,
        pp=args.pp,
        # dated now (a minute back), so dashboards' "last hours" show it
        start_ns=time.time_ns() - 60 * 10**9,
    )


def _wait_for_interrupt() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def cmd_demo(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.demo import run_demo
    from fleetscope.progress import Progress

    result = run_demo(config, _simulator_config(args), Progress(enabled=not args.quiet), timeout_s=args.timeout_s)
    print_findings(result.findings, args.json)
    return 0


def cmd_up(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.stack import EmbeddedStack

    with EmbeddedStack(config) as stack:
        servers = stack.config.kafka.bootstrap_servers
        served = stack.store_server.url if stack.store_server is not None else stack.config.store.url
        if args.json:
            endpoint = str(Path(config.data_dir) / "endpoint.json")
            print(json.dumps({"bootstrap_servers": servers, "store_url": served, "endpoint_file": endpoint}))
            sys.stdout.flush()
            _wait_for_interrupt()
            return 0
        print(f"fleetscope is up: broker {servers}, store {served} (tokens in {config.data_dir}/endpoint.json)")
        print("a training job publishes with:")
        print(f"  export FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS={servers}")
        print("  fleetscope run -- torchrun --nproc-per-node 8 train.py")
        print("from this folder: fleetscope simulate | sql | findings | report | alerts; Ctrl-C stops")
        sys.stdout.flush()
        _wait_for_interrupt()
    return 0


def cmd_worker(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.stack import stream_app_config
    from fleetscope.streams.app import run_worker

    if not config.kafka.bootstrap_servers:
        raise ConfigError(["kafka.bootstrap_servers: a worker needs a broker (--bootstrap or configuration)"])
    Path(config.data_dir).mkdir(parents=True, exist_ok=True)  # Faust keeps its files under <data_dir>/faust
    app = stream_app_config(config, args.web_port)
    print(
        f"fleetscope worker: app {app.app_id}, stages {'+'.join(app.stages)}, broker {app.bootstrap_servers}, "
        f"web port {args.web_port}; starting (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    run_worker(app, loglevel=config.log_level.lower(), logfile=args.logfile)
    return 0


def cmd_sink(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.endpoint import ensure_unlocked
    from fleetscope.sinks import Sink, open_store
    from fleetscope.stack import other_store_sinks, sink_config

    if not config.kafka.bootstrap_servers:
        raise ConfigError(["kafka.bootstrap_servers: the sink needs a broker (--bootstrap or configuration)"])
    try:
        others = other_store_sinks(config)
    except Exception as exc:  # the warning is advisory: the sink itself reports an unreachable broker
        logging.getLogger(__name__).debug("could not list consumer groups: %s", exc)
        others = []
    if others:
        print(
            f"fleetscope sink: {len(others)} sink(s) of other stores follow this broker ({', '.join(others)}); "
            f"this one ({sink_config(config).group_id}) writes {config.store.url} and gets every record too",
            file=sys.stderr,
        )
    ensure_unlocked(config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    store = open_store(config.store, stop=stop)  # the store may come up after the sink: wait, no traceback
    if store is None:
        return 0
    sink = Sink(sink_config(config), store)
    sink.start()
    try:
        _wait_for_interrupt()
    finally:
        sink.stop()
        store.close()
    return 0


def cmd_simulate(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.broker import require_broker
    from fleetscope.demo import publish_simulation
    from fleetscope.progress import Progress

    k = config.kafka
    if not k.bootstrap_servers:
        raise ConfigError(["kafka.bootstrap_servers: simulate needs a broker (--bootstrap, or `fleetscope up` here)"])
    sim = _simulator_config(args)
    require_broker({"bootstrap.servers": k.bootstrap_servers, **k.client_settings()})
    n = publish_simulation(config, sim, Progress(enabled=not args.json))
    if args.json:
        print(json.dumps({"job": args.job, "batches": n, "bootstrap_servers": k.bootstrap_servers}))
    else:
        print(f"published {n} batches of job {args.job} to {k.bootstrap_servers}")
    return 0


def cmd_sql(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.endpoint import open_store

    params: dict[str, str] = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError([f"--param {item!r}: expected NAME=VALUE"])
        params[name] = value
    store = open_store(config, write=args.write)
    try:
        columns, rows = store.query(args.query, params or None, readonly=not args.write)
    except PermissionError:
        # Not a read statement by its first word: let the engine parse it, so `SELEC 1` is reported as
        # the syntax error it is rather than as a write attempt.
        from fleetscope.errors import syntax_error_of

        prefix = "EXPLAIN AST "
        try:
            store.query(prefix + args.query, params or None)
        except Exception as exc:
            syntax = syntax_error_of(args.query, exc, prefix)
            if syntax is not None:
                raise syntax from None
        raise
    if args.json:
        print(json.dumps([dict(zip(columns, row, strict=True)) for row in rows], default=str))
    elif len(columns) == 1 and len(rows) == 1:
        print(format_cell(rows[0][0]))
    else:
        print_table(columns, rows)
    return 0


def cmd_findings(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.endpoint import open_store

    print_findings(open_store(config).findings(job=args.job), args.json)
    return 0


COMMANDS = {
    "demo": cmd_demo,
    "up": cmd_up,
    "worker": cmd_worker,
    "sink": cmd_sink,
    "simulate": cmd_simulate,
    "sql": cmd_sql,
    "findings": cmd_findings,
}

# Subcommands defined next to the code they drive: each module has
# ``register(sub, common)``, which adds its parser with ``set_defaults(handler=...)``.
EXTENSION_MODULES: tuple[str, ...] = (
    "fleetscope.traces_cli",
    "fleetscope.live_cli",
    "fleetscope.ecosystem_cli",
)


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
