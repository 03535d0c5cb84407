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
import copy
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


def paired(model_name: str, blocks: int, block_steps: int, variant: str) -> dict[str, float]:
    """A cost in one process, robust to a loaded machine: blocks of ``block_steps`` steps alternate between
    two setups (A, B, B, A, ...), so slow drifts of the machine's load cancel out. ``monitor``: the default
    monitoring recording (A) or inert (B) on the same DDP model, the hot-path cost (the background thread
    runs through both, so its cost is shared out); ``ddp_hook``: a DDP model with the timed Python comm
    hook (A) or without one (B), both monitored. Returns the medians' difference per step (wall and CPU,
    in µs) and B's step time."""
    import statistics as st

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fleetscope.producers.torch_hook as fs
    from fleetscope.broker import free_port

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    d_in, hidden, batch = MODELS[model_name]
    torch.manual_seed(0)
    models = [DDP(torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)))]
    if variant == "ddp_hook":  # run with FLEETSCOPE_TORCH_DDP_HOOK=0: only this model gets the comm hook
        from fleetscope.producers.torch_patches import timed_allreduce_hook

        models.append(DDP(torch.nn.Sequential(*(copy.deepcopy(m) for m in models[0].module))))
        models[1].register_comm_hook(models[1].process_group, timed_allreduce_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]
    n = block_steps * batch
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(n, d_in), torch.randn(n, 1)), batch_size=batch
    )
    mon = fs.start()
    if mon is None:
        raise SystemExit("monitoring did not start")
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for b in range(2 * blocks + 4):
        on = b % 4 in (0, 3)
        which = int(on and variant == "ddp_hook")
        model, opt = models[which], opts[which]
        recording = on or variant == "ddp_hook"
        fs._monitor = mon if recording else None  # inert: as in a script without fs.step()
        began, cpu_began = time.perf_counter(), time.process_time()
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if recording:
                fs.step()
        if b >= 4:  # the first quad warms up
            wall, cpu = time.perf_counter() - began, time.process_time() - cpu_began
            times[on].append((wall / block_steps, cpu / block_steps))
    fs._monitor = mon
    s = fs.stats()
    fs.stop()
    dist.destroy_process_group()
    if s is None or s.dropped or s.hook_errors:
        raise SystemExit(f"the integration was not healthy: {s}")
    # each A, B, B, A quad gives one difference, free of a linear drift within it; the median of those
    quads = [
        [(a1[i] + a2[i] - b1[i] - b2[i]) / 2 for i in (0, 1)]
        for a1, a2, b1, b2 in zip(
            times[True][0::2], times[True][1::2], times[False][0::2], times[False][1::2], strict=True
        )
    ]
    return {
        "step_ms": 1e3 * st.median(t[0] for t in times[False]),
        "wall_us": 1e6 * st.median(q[0] for q in quads),
        "cpu_us": 1e6 * st.median(q[1] for q in quads),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500, help="timed steps of the tiny model (wide: / 10)")
    parser.add_argument("--paired", action="store_true", help="in-process on/off blocks (hot-path cost)")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child and args.paired:
        variant, model_name = args.child
        block_steps = {"tiny": 200, "wide": 20, "step50": 4}[model_name]
        print(json.dumps(paired(model_name, 8 * args.rounds, block_steps, variant)))
        return
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
        if args.paired:
            for model_name in MODELS:
                print(f"{model_name}: in-process paired blocks, {8 * args.rounds} of each")
                for variant, ddp_hook in (("monitor", None), ("ddp_hook", "0")):
                    extra = {"FLEETSCOPE_TORCH_DDP_HOOK": ddp_hook} if ddp_hook is not None else {}
                    cmd = [sys.executable, __file__, "--rounds", str(args.rounds), "--paired", "--child", variant]
                    out = subprocess.run([*cmd, model_name], env=env | extra, capture_output=True, text=True)
                    if out.returncode:
                        raise SystemExit(out.stderr)
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    what = "monitoring (default) vs inert" if variant == "monitor" else "Python comm hook vs none"
                    print(
                        f"  {what:30s} wall {r['wall_us']:+8.1f} us/step ({r['wall_us'] / 10 / r['step_ms']:+.2f} %)"
                        f"   CPU {r['cpu_us']:+8.1f} us/step   step {r['step_ms']:.2f} ms"
                    )
            return
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
