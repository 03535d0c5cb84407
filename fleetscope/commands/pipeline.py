"""The pipeline's own processes: ``demo``, ``up``, ``worker``, ``sink`` and ``simulate``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from fleetscope.commands.options import sim_options, simulator_config, stop_on_signals, wait_for_interrupt
from fleetscope.config import Config, ConfigError
from fleetscope.tables import print_findings


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """Add ``demo``, ``up``, ``worker``, ``sink`` and ``simulate``."""
    p = sub.add_parser(
        "demo",
        parents=[common],
        help="run the embedded stack on a simulated job and print findings",
        description="Start the embedded broker, stream worker and ClickHouse store, publish a "
        "simulated data-parallel job (with optional faults), wait until it is analysed, print the "
        "findings and stop everything. The store keeps the results for `sql` and `findings`.",
    )
    sim_options(p)
    p.add_argument("--json", action="store_true", help="print findings as a JSON list")
    p.add_argument("--timeout-s", type=float, default=300.0, help="give up after this long (default: 300)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(handler=cmd_demo)

    p = sub.add_parser(
        "up",
        parents=[common],
        help="run the embedded stack until interrupted",
        description="Start the embedded broker (unless --bootstrap), the ClickHouse sink and a stream "
        "worker; serve the store to other processes; print the broker address for producers; stop on Ctrl-C.",
    )
    p.add_argument("--json", action="store_true", help="print the addresses as one JSON line")
    p.set_defaults(handler=cmd_up)

    p = sub.add_parser(
        "worker",
        parents=[common],
        help="run a stream worker (windower + differential)",
        description="Run the Faust stream worker against the configured broker. Start several for "
        "more throughput: they share one consumer group.",
    )
    p.add_argument("--web-port", type=int, default=6066, help="Faust web port (default: 6066)")
    p.add_argument("--logfile", help="log to this file instead of stderr")
    p.set_defaults(handler=cmd_worker)

    p = sub.add_parser(
        "sink",
        parents=[common],
        help="run the ClickHouse sink until interrupted",
        description="Consume iterations, patterns and findings topics into ClickHouse.",
    )
    p.set_defaults(handler=cmd_sink)

    p = sub.add_parser(
        "simulate",
        parents=[common],
        help="publish a simulated job to a broker",
        description="Publish a simulated job's raw events to the broker given by --bootstrap or the configuration.",
    )
    sim_options(p)
    p.add_argument("--json", action="store_true", help="print what was published as JSON")
    p.set_defaults(handler=cmd_simulate)


def cmd_demo(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.demo import run_demo
    from fleetscope.progress import Progress

    result = run_demo(config, simulator_config(args), Progress(enabled=not args.quiet), timeout_s=args.timeout_s)
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
            wait_for_interrupt()
            return 0
        print(f"fleetscope is up: broker {servers}, store {served} (tokens in {config.data_dir}/endpoint.json)")
        print("a training job publishes with:")
        print(f"  export FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS={servers}")
        print("  fleetscope run -- torchrun --nproc-per-node 8 train.py")
        print("from this folder: fleetscope simulate | sql | findings | report | alerts; Ctrl-C stops")
        sys.stdout.flush()
        wait_for_interrupt()
    return 0


def cmd_worker(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.stack import private_dir, stream_app_config
    from fleetscope.streams.app import run_worker

    if not config.kafka.bootstrap_servers:
        raise ConfigError(["kafka.bootstrap_servers: a worker needs a broker (--bootstrap or configuration)"])
    private_dir(config.data_dir)  # Faust keeps its files under <data_dir>/faust
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
    stop = stop_on_signals()
    store = open_store(config.store, stop=stop)  # the store may come up after the sink: wait, no traceback
    if store is None:
        return 0
    sink = Sink(sink_config(config), store)
    sink.start()
    try:
        stop.wait()
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
    sim = simulator_config(args)
    require_broker({"bootstrap.servers": k.bootstrap_servers, **k.client_settings()})
    n = publish_simulation(config, sim, Progress(enabled=not args.json))
    if args.json:
        print(json.dumps({"job": args.job, "batches": n, "bootstrap_servers": k.bootstrap_servers}))
    else:
        print(f"published {n} batches of job {args.job} to {k.bootstrap_servers}")
    return 0
