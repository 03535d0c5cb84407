"""Live-job commands: ``run`` (zero-code PyTorch hook), ``profile`` (on-demand window), ``agent`` (NVML)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from fleetscope.config import Config, ConfigError

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "run",
        parents=[common],
        help="run a training command with the PyTorch hook injected (no code change)",
        description="Run CMD (e.g. `torchrun --nproc-per-node 8 train.py` or `python train.py`) with the "
        "fleetscope PyTorch hook injected into every Python process through a sitecustomize bootstrap: "
        "step boundaries come from optimizer.step(), collectives, dataloader and optimizer spans are timed "
        "and published to the configured broker. Exits with CMD's exit status.",
    )
    p.add_argument("--job", help="job id shared by all ranks (default: a new run-... id)")
    p.add_argument(
        "--nvml",
        choices=["auto", "process", "agent", "off"],
        default="auto",
        help="GPU sampling: in each rank (process), by `fleetscope agent` (agent), or off (default: auto)",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")
    p.set_defaults(handler=cmd_run)

    p = sub.add_parser(
        "profile",
        parents=[common],
        help="ask every rank of a running job for a profiling window",
        description="Publish a control request: every rank of JOB opens a torch.profiler window at the same "
        "UTC instant (now + --start-in-s) for --seconds, and NVML sampling speeds up meanwhile.",
    )
    p.add_argument("--job", required=True, help="job id (FLEETSCOPE_JOB / TORCHELASTIC_RUN_ID of the ranks)")
    p.add_argument("--seconds", type=float, default=20.0, help="window length (default: 20)")
    p.add_argument("--start-in-s", type=float, default=5.0, help="common start, from now (default: 5)")
    p.add_argument("--reason", default="", help="why (kept with the request)")
    p.add_argument("--json", action="store_true", help="print the request as JSON")
    p.set_defaults(handler=cmd_profile)

    p = sub.add_parser(
        "agent",
        parents=[common],
        help="sample this node's GPUs with NVML until interrupted",
        description="Publish per-GPU link throughput (NVLink, PCIe), clocks, throttle reasons, link "
        "generation/width, power, temperature, ECC and XID events as throughput batches. GPU i is "
        "tagged with rank --first-rank + i of --job. Follows the control topic to sample at "
        "--fast-interval-ms during profiling windows. Needs nvidia-ml-py (pip install 'fleetscope[nvml]').",
    )
    p.add_argument("--job", default=os.environ.get("FLEETSCOPE_JOB", ""), help="job id (default: $FLEETSCOPE_JOB)")
    p.add_argument("--first-rank", type=int, default=0, help="rank of GPU 0 on this node (default: 0)")
    p.add_argument("--world-size", type=int, default=0, help="ranks in the job (default: first rank + GPUs)")
    p.add_argument("--interval-ms", type=float, default=100.0, help="base sampling period (default: 100)")
    p.add_argument("--fast-interval-ms", type=float, default=1.0, help="period during windows (default: 1)")
    p.set_defaults(handler=cmd_agent)


def _require_broker(config: Config, command: str) -> None:
    if not config.kafka.bootstrap_servers:
        hint = "--bootstrap, the configuration, or the address `fleetscope up` prints"
        raise ConfigError([f"kafka.bootstrap_servers: {command} needs a broker ({hint})"])


def cmd_run(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.producers.torch_bootstrap import bootstrap_env, write_bootstrap

    _require_broker(config, "run")
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise ConfigError(["run: no command given (fleetscope run -- torchrun ... train.py)"])
    job = args.job or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    k = config.kafka
    env = dict(os.environ)
    env |= {
        "FLEETSCOPE_JOB": job,
        "FLEETSCOPE_NVML": args.nvml,
        "FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS": k.bootstrap_servers,
        "FLEETSCOPE__KAFKA__TOPIC_PREFIX": k.topic_prefix,
    }
    if args.config:
        env["FLEETSCOPE_CONFIG"] = str(Path(args.config).resolve())
    with tempfile.TemporaryDirectory(prefix="fleetscope-bootstrap-") as tmp:
        env = bootstrap_env(write_bootstrap(tmp), env)
        log.info("running %s as job %s, publishing to %s", cmd, job, k.bootstrap_servers)
        print(f"fleetscope: job {job} -> {k.bootstrap_servers} (fleetscope profile --job {job} --seconds 20)")
        proc = subprocess.Popen(cmd, env=env)  # noqa: S603 - the user's own command
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # the child got the same SIGINT: let it wind down
                continue


def cmd_profile(args: argparse.Namespace, config: Config) -> int:
    from fleetscope.broker import require_broker
    from fleetscope.producers.control import request_profile

    _require_broker(config, "profile")
    require_broker({"bootstrap.servers": config.kafka.bootstrap_servers, **config.kafka.client_settings()})
    user = os.environ.get("USER", "")
    request = request_profile(
        config, args.job, args.seconds, args.reason, start_in_s=args.start_in_s, requested_by=user
    )
    if args.json:
        print(json.dumps(request.to_record()))
    else:
        start = time.strftime("%H:%M:%S", time.gmtime(request.start_at_ns / 1e9))
        print(
            f"requested a {request.duration_s:g} s profile of job {request.job} "
            f"at {start} UTC (request {request.request_id})"
        )
    silence = _silent_job(config, args.job)
    if silence:
        print(f"fleetscope profile: {silence}: no rank may be listening (is FLEETSCOPE_JOB right?)", file=sys.stderr)
    return 0


RECENT_S = 120.0
"""A job whose ranks reported within this long is taken to be running (and its ranks to listen)."""


def _silent_job(config: Config, job: str) -> str:
    """Why no rank of ``job`` seems to be running, from the store ("" when it is, or when the store cannot
    tell: no store here, or one held by a process that does not serve it)."""
    from fleetscope.endpoint import open_store

    try:
        count, last_ns = open_store(config).job_activity(job)
    except Exception as exc:  # the check is advisory: the request is published either way
        log.debug("could not ask the store about job %s: %s", job, exc)
        return ""
    if not count:
        return f"job {job} has no iteration in the store"
    age_s = time.time() - int(last_ns) / 1e9
    return f"job {job} last reported {age_s:.0f} s ago" if age_s > RECENT_S else ""


def cmd_agent(args: argparse.Namespace, config: Config) -> int:
    import socket

    from fleetscope.producers import Publisher
    from fleetscope.producers.control import ControlListener
    from fleetscope.producers.nvml import NvmlSampler, NvmlSamplerConfig, PynvmlApi, node_targets
    from fleetscope.wiring import control_listener_config, publisher_config

    _require_broker(config, "agent")
    if not args.job:
        raise ConfigError(["agent: --job (or FLEETSCOPE_JOB) is required to tag the samples"])
    try:
        api = PynvmlApi()  # ImportError with the pip hint when nvidia-ml-py is missing
        api.init()
        try:
            gpus = api.device_count()
        finally:
            api.shutdown()
    except Exception as exc:  # no library, no driver, no GPU: a start-up error, said plainly
        raise RuntimeError(f"NVML is not available on this node: {exc}") from exc
    world = args.world_size or args.first_rank + gpus
    targets = node_targets(args.job, args.first_rank, world, socket.gethostname())
    sampler_config = NvmlSamplerConfig(interval_ms=args.interval_ms, fast_interval_ms=args.fast_interval_ms)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    k = config.kafka
    agent_publisher = publisher_config(config, client_id="fleetscope-agent")
    with Publisher(agent_publisher) as publisher:
        sampler = NvmlSampler(sampler_config, api=api, sink=publisher.publish, targets=targets)
        listener = ControlListener(control_listener_config(config), args.job, lambda req: sampler.boost(req.end_at_ns))
        sampler.start()
        listener.start()
        print(f"fleetscope agent: {gpus} GPU(s) of job {args.job} -> {k.bootstrap_servers}; Ctrl-C stops")
        try:
            stop.wait()
        finally:
            listener.stop()
            sampler.stop()
        s = sampler.stats
        print(f"samples={s.samples} batches={s.batches} unsupported={s.unsupported} errors={s.errors}")
    return 0
