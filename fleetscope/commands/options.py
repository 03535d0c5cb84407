"""Options several command families share: the configuration group every command has, the simulated job's."""

from __future__ import annotations

import argparse
import signal
import threading
import time
from dataclasses import replace as with_fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetscope.producers import SimulatorConfig


def common() -> argparse.ArgumentParser:
    """The configuration options of every command (a parent parser)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("configuration")
    g.add_argument("--config", metavar="FILE", help="TOML (or JSON) configuration file")
    g.add_argument("--data-dir", help="where the embedded store and logs live (default .fleetscope)")
    g.add_argument("--bootstrap", metavar="HOST:PORT", help="Kafka bootstrap servers (default: embedded broker)")
    g.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    g.add_argument("--debug", action="store_true", help="print the traceback when a command fails")
    return p


def sim_options(p: argparse.ArgumentParser) -> None:
    """The simulated job of ``demo`` and ``simulate``."""
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


def simulator_config(args: argparse.Namespace) -> SimulatorConfig:
    """The simulated job the options describe; its layout (``--tp``/``--pp``) validated with the ranks."""
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


def stop_on_signals() -> threading.Event:
    """An event set by SIGINT or SIGTERM: a long-running command's stop."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for_interrupt() -> None:
    stop_on_signals().wait()
