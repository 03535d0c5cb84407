"""Overhead of the PyTorch integration in continuous mode: steps/s with and without it.

Run: ``python bench/overhead.py [--rounds 3] [--steps 1500]``. Starts an embedded Tansu broker, then trains
the same small DDP model (gloo, world size 1, one CPU thread) in fresh processes, alternating "off" (plain
script) and the "on" modes (``import fleetscope.producers.torch_hook as fs`` + ``fs.step()``, publishing to
the broker), and prints the median steps/s of each, the slowdown ratio and the cost per step in µs. "on" is
the default: on Gloo DDP's gradient all-reduce is timed from the end of the backward pass, without a comm
hook; "on_without_ddp_timing" (``FLEETSCOPE_TORCH_DDP_HOOK=0``) times no DDP all-reduce; "on_with_ddp_hook"
(``=1``, the NCCL default) adds the extra pass over the gradients that a Python DDP comm hook costs on CPU
(DDP fuses the 1/world division into its bucket copy only without a hook). Three model sizes: the
acceptance test's tiny MLP (a step well under a millisecond, the worst case for a fixed per-step cost), a
wider one, and one of about 50 ms a step. Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = {"tiny": (32, 64, 8), "wide": (1024, 2048, 64), "step50": (1024, 4096, 512)}  # in, hidden, batch
# mode -> FLEETSCOPE_TORCH_DDP_HOOK: the default, no DDP bucket timing, and the Python comm hook forced
MODES = {"off": None, "on": None, "on_without_ddp_timing": "0", "on_with_ddp_hook": "1"}


def timed_steps(model_name: str, steps: int) -> int:
    """Timed steps of a model: ``steps`` for the tiny one, fewer for the larger ones."""
    return {"tiny": steps, "wide": max(steps // 10, 50), "step50": max(steps // 50, 30)}[model_name]


def train(mode: str, model_name: str, steps: int, warmup: int) -> tuple[float, float]:
    """One run in this process; returns steps/s over ``steps`` after ``warmup``, and the process's CPU time
    per step in ms (every thread: the recorder's and the publisher's too), which a loaded machine disturbs
    less than the wall clock."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    fs = None
    if mode.startswith("on"):
        import fleetscope.producers.torch_hook as fs
    from fleetscope.broker import free_port

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    d_in, hidden, batch = MODELS[model_name]
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    total = warmup + steps
    data = torch.utils.data.TensorDataset(torch.randn(total * batch, d_in), torch.randn(total * batch, 1))
    if fs is not None:
        fs.start()
    began = cpu_began = 0.0
    for i, (x, y) in enumerate(torch.utils.data.DataLoader(data, batch_size=batch)):
        if i == warmup:
            began, cpu_began = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if fs is not None:
            fs.step()
    rate = steps / (time.perf_counter() - began)
    cpu_ms = 1e3 * (time.process_time() - cpu_began) / steps
    if fs is not None:
        s = fs.stats()
        fs.stop()
        if s is None or s.dropped or s.hook_errors:
            raise SystemExit(f"the integration was not healthy: {s}")
    dist.destroy_process_group()
    return rate, cpu_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500, help="timed steps of the tiny model (wide: / 10)")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, model_name = args.child
        steps = timed_steps(model_name, args.steps)
        rate, cpu_ms = train(mode, model_name, steps, warmup=max(steps // 10, 5))
        print(json.dumps({"steps_per_s": rate, "cpu_ms_per_step": cpu_ms}))
        return

    from fleetscope.broker import TansuBroker, ensure_topics
    from fleetscope.schemas import Topics

    prefix = f"bench{os.getpid()}"
    with TansuBroker() as broker:
        servers = broker.bootstrap_servers
        ensure_topics({"bootstrap.servers": servers}, Topics(prefix=prefix), 4, 4)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE")}
        env |= {
            "FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS": servers,
            "FLEETSCOPE__KAFKA__TOPIC_PREFIX": prefix,
            "FLEETSCOPE_JOB": "bench",
            "OMP_NUM_THREADS": "1",
        }
        for model_name in MODELS:
            rates: dict[str, list[float]] = {mode: [] for mode in MODES}
            cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
            for _ in range(args.rounds):
                for mode, ddp_hook in MODES.items():
                    extra = {"FLEETSCOPE_TORCH_DDP_HOOK": ddp_hook} if ddp_hook is not None else {}
                    cmd = [sys.executable, __file__, "--steps", str(args.steps), "--child", mode, model_name]
                    out = subprocess.run(cmd, env=env | extra, capture_output=True, text=True, check=True).stdout
                    result = json.loads(out.strip().splitlines()[-1])
                    rates[mode].append(result["steps_per_s"])
                    cpu[mode].append(result["cpu_ms_per_step"])
            off, off_cpu = statistics.median(rates["off"]), statistics.median(cpu["off"])
            print(
                f"{model_name}: off {off:.1f} steps/s ({1e3 / off:.2f} ms/step, CPU {off_cpu:.3f} ms/step), "
                f"median of {args.rounds}"
            )
            for mode in list(MODES)[1:]:
                on, on_cpu = statistics.median(rates[mode]), statistics.median(cpu[mode])
                print(
                    f"  {mode:22s} {on:8.1f} steps/s   slowdown {off / on - 1:+.2%}   "
                    f"cost {1e6 * (1 / on - 1 / off):+.1f} us/step   "
                    f"CPU {on_cpu / off_cpu - 1:+.2%} ({1e3 * (on_cpu - off_cpu):+.1f} us/step)   "
                    f"runs {[round(r, 1) for r in rates[mode]]}"
                )
            print(f"  {'off runs':22s} {[round(r, 1) for r in rates['off']]}")


if __name__ == "__main__":
    main()
