"""``fleetscope demo``: the embedded stack plus a simulated job, then the findings it produced."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fleetscope.config import Config
from fleetscope.errors import BrokerUnreachable
from fleetscope.producers import Publisher, PublisherStats, SimulatorConfig, simulate
from fleetscope.progress import Progress
from fleetscope.stack import EmbeddedStack
from fleetscope.wiring import bulk_publisher_config


def check_delivered(stats: PublisherStats, servers: str) -> None:
    """Raise unless every published batch reached the broker: one rule for ``simulate``, ``replay`` and
    ``demo``. Batches still in the on-disk spool go out with the next publisher run of this folder."""
    lost = stats.dropped + stats.failed + stats.spool_dropped
    undelivered = stats.published - stats.delivered - stats.failed - stats.spool_dropped
    if lost or undelivered > 0:
        kept = f"{undelivered} kept in the spool for the next run" if undelivered > 0 else "none kept"
        raise BrokerUnreachable(
            servers, f"{max(undelivered, 0) + lost} of {stats.published} batches undelivered: {lost} lost, {kept}"
        )


def publish_simulation(config: Config, sim: SimulatorConfig, progress: Progress) -> int:
    """Publish a simulated job to the configured broker; return the number of batches published."""
    published = 0
    with Publisher(bulk_publisher_config(config)) as publisher:
        for batch in simulate(sim):
            publisher.publish(batch)
            published += 1
            progress.update(f"publishing: {published} batches")
        publisher.flush(30.0)
    check_delivered(publisher.stats, config.kafka.bootstrap_servers)
    return published


@dataclass(frozen=True)
class DemoResult:
    findings: list[dict[str, object]]
    iterations: int
    batches: int
    seconds: float


def run_demo(config: Config, sim: SimulatorConfig, progress: Progress, timeout_s: float = 300.0) -> DemoResult:
    """Start everything, publish the simulated job, wait until its analysis has settled, stop."""
    t0 = time.monotonic()
    stack = EmbeddedStack(config)
    progress.update("starting broker, ClickHouse store and stream worker", force=True)
    with stack:
        store, sink = stack.store, stack.sink
        if store is None or sink is None:
            raise RuntimeError("the embedded stack started without its store or its sink: nothing to demonstrate")
        store.forget_job(sim.job)
        batches = publish_simulation(stack.config, sim, progress)
        expected = sim.ranks * sim.expected_iterations
        settle_s = (config.streams.job_idle_ms + config.streams.windower.idle_close_ms) / 1000 + 1.5
        deadline = time.monotonic() + timeout_s
        last_change, last_rows = time.monotonic(), -1
        while time.monotonic() < deadline:
            stats = sink.stats
            rows = stats["iterations"]
            total = rows + stats["function_patterns"] + stats["finding_updates"]
            if total != last_rows:
                last_rows, last_change = total, time.monotonic()
            progress.update(f"analysing: {rows}/{expected} rank-iterations, {stats['finding_updates']} finding updates")
            if rows >= expected and time.monotonic() - last_change >= settle_s:
                break
            if stack.worker is not None and not stack.worker.alive():
                raise RuntimeError(f"stream worker died; see {stack.worker.log_path}")
            time.sleep(0.2)
        else:
            raise TimeoutError(f"the job was not analysed within {timeout_s} s ({last_rows} rows stored)")
        findings = store.findings(job=sim.job)
    seconds = time.monotonic() - t0
    progress.done(f"done in {seconds:.1f} s: {expected} rank-iterations, {len(findings)} findings")
    return DemoResult(findings=findings, iterations=expected, batches=batches, seconds=seconds)
