"""The real GPU paths, end to end: NVML through ``fleetscope agent``, the torch hook on CUDA ranks with a
``fleetscope profile`` window (CUPTI kernels), and the hook's overhead on a real GPU step.

Two halves, because a GPU machine may lack the store engine (and this one the GPU):

``python bench/gpu_live.py capture OUT`` (on a GPU machine) starts the embedded broker, ``fleetscope agent``
and two jobs on ``cuda:0`` — a healthy 2-rank DDP job and one whose rank 1 gets ×1.5 GPU work from step
``--fault-at`` — opens one profiling window in each, times the hook (off / continuous) on a 1-rank NCCL job,
and writes every message the producers published to ``OUT/capture.bin`` and the figures to
``OUT/figures.json``.

``python bench/gpu_live.py ingest OUT`` (anywhere) replays that capture, byte for byte, into the embedded
stack (broker, worker, chDB) and prints what the pipeline made of it: iterations per rank, profiled steps,
kernel and NVML rows, and the findings of each job. Not a test: the figures depend on the GPU and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

HEALTHY, FAULTY = "gpu-healthy", "gpu-slow-rank1"
_FRAME = struct.Struct(">HiI")  # topic length, key length (-1: none), value length

# argv: job kind (ddp|nccl1), steps, mode (off|on), faulty rank, fault step, result file
TRAIN = r"""
import json, os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

kind, mode, out = sys.argv[1], sys.argv[3], sys.argv[6]
steps, faulty, at = (int(sys.argv[i]) for i in (2, 4, 5))
fs = None
if mode == "on":
    import fleetscope.producers.torch_hook as fs
torch.cuda.set_device(0)
dev = torch.device("cuda", 0)
# one GPU: ranks of the 2-rank job share it, so their gradients meet through gloo (which takes CUDA tensors)
dist.init_process_group("nccl" if kind == "nccl1" else "gloo")
rank = dist.get_rank()
torch.manual_seed(0)
WIDTH, LAYERS, BATCH = 1024, 8, 32768
layers = []
for _ in range(LAYERS):
    layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
model = DDP(torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1)).to(dev), device_ids=[0])
extra = torch.nn.Linear(WIDTH, WIDTH).to(dev)  # the fault: more GPU work per step on one rank
opt = torch.optim.SGD(model.parameters(), lr=1e-4)


class Batches(torch.utils.data.Dataset):
    # whole batches, made once and pinned: the loader costs what a real prefetching one costs
    def __init__(self):
        self.x = [torch.randn(BATCH, WIDTH).pin_memory() for _ in range(4)]
        self.y = [torch.randn(BATCH, 1).pin_memory() for _ in range(4)]

    def __len__(self):
        return steps

    def __getitem__(self, i):
        return self.x[i % 4], self.y[i % 4]


if fs is not None:
    fs.start()
times = []
torch.cuda.synchronize()
last = time.perf_counter()
for step, (x, y) in enumerate(torch.utils.data.DataLoader(Batches(), batch_size=None)):
    x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = x
        if rank == faulty and step >= at:
            for _ in range(4):
                h = extra(h)
        loss = torch.nn.functional.mse_loss(model(h).float(), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if fs is not None:
        fs.step()
    if step % 10 == 9:  # a sync every 10 steps, as a logging loop would: per-step GPU time without a per-step stall
        loss.item()
        now = time.perf_counter()
        times.append((now - last) / 10)
        last = now
stats = fs.stats() if fs is not None else None
if fs is not None:
    fs.stop()
dist.destroy_process_group()
with open(out, "w") as f:
    json.dump({"rank": rank, "step_s": times, "stats": repr(stats)}, f)
"""


def _env(servers: str, job: str, rank: int, world: int, port: int, nvml: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS": servers,
            "FLEETSCOPE_JOB": job,
            "FLEETSCOPE_NVML": nvml,  # agent: `fleetscope agent` samples the GPU; process: each rank does
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _run_job(
    servers: str,
    job: str,
    kind: str,
    world: int,
    steps: int,
    mode: str,
    faulty: int,
    at: int,
    work: Path,
    nvml: str = "agent",
) -> list[dict[str, object]]:
    from fleetscope.broker import free_port

    script = work / "train.py"
    script.write_text(TRAIN)
    port = free_port()
    procs, outs = [], []
    for rank in range(world):
        out = work / f"{job}-{mode}-{rank}.json"
        outs.append(out)
        args = [sys.executable, str(script), kind, str(steps), mode, str(faulty), str(at), str(out)]
        log = open(work / f"{job}-{mode}-{rank}.log", "wb")  # noqa: SIM115
        env = _env(servers, job, rank, world, port, nvml)
        procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=log))
    for p in procs:
        p.wait(timeout=600)
    if any(p.returncode for p in procs):
        logs = "\n".join((work / f"{job}-{mode}-{r}.log").read_text()[-3000:] for r in range(world))
        raise RuntimeError(f"{job} failed:\n{logs}")
    return [json.loads(o.read_text()) for o in outs]


def _dump(servers: str, topics: list[str], path: Path) -> dict[str, int]:
    """Every message of ``topics``, in partition order, framed as topic, key, value."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": servers, "group.id": "gpu-live-dump", "enable.auto.commit": False})
    counts: dict[str, int] = {}
    with path.open("wb") as f:
        for topic in topics:
            meta = consumer.list_topics(topic, timeout=10).topics[topic]
            for part in meta.partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, part), timeout=10)
                if high <= low:
                    continue
                consumer.assign([TopicPartition(topic, part, OFFSET_BEGINNING)])
                got = 0
                while got < high - low:
                    msg = consumer.poll(5.0)
                    if msg is None:
                        break
                    if msg.error():
                        continue
                    key, value, name = msg.key(), msg.value() or b"", topic.encode()
                    f.write(_FRAME.pack(len(name), -1 if key is None else len(key), len(value)))
                    f.write(name + (key or b"") + value)
                    got += 1
                counts[topic] = counts.get(topic, 0) + got
    consumer.close()
    return counts


def _read(path: Path) -> Iterator[tuple[str, bytes | None, bytes]]:
    data = path.read_bytes()
    at = 0
    while at < len(data):
        tlen, klen, vlen = _FRAME.unpack_from(data, at)
        at += _FRAME.size
        topic = data[at : at + tlen].decode()
        at += tlen
        key = None if klen < 0 else data[at : at + klen]
        at += max(klen, 0)
        yield topic, key, data[at : at + vlen]
        at += vlen


def _median_step_ms(results: list[dict[str, object]], skip: int = 3) -> float:
    samples = [s for r in results for s in r["step_s"][skip:]]  # type: ignore[index]
    return 1e3 * statistics.median(samples)


def capture(out: Path, steps: int, fault_at: int, rounds: int, window_after_s: float) -> None:
    from fleetscope.broker import TansuBroker, ensure_topics
    from fleetscope.config import load_config
    from fleetscope.producers.control import request_profile
    from fleetscope.schemas import Topics

    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-live-"))
    figures: dict[str, object] = {}
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    figures["gpu"] = smi.stdout.strip()
    with TansuBroker(log_path=work / "broker.log") as broker:
        servers = broker.bootstrap_servers
        config = load_config(env={}, overrides={"kafka.bootstrap_servers": servers})
        topics = Topics(prefix=config.kafka.topic_prefix)
        k = config.kafka
        ensure_topics(k.admin_settings(), topics, k.raw_partitions, k.derived_partitions)
        agents = []
        for job in (HEALTHY, FAULTY):
            env = dict(os.environ, FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS=servers, PYTHONUNBUFFERED="1")
            cmd = [sys.executable, "-m", "fleetscope", "agent", "--job", job, "--world-size", "2"]
            log = open(work / f"agent-{job}.log", "wb")  # noqa: SIM115
            agents.append((job, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)))
        for job, faulty in ((HEALTHY, -1), (FAULTY, 1)):
            began = time.time()
            # the window opens mid-job, for 3 s, on every rank at once
            ask = lambda j=job: request_profile(config, j, 3.0, "gpu-live", start_in_s=2.0)  # noqa: E731
            timer = threading.Timer(window_after_s, ask)
            timer.start()
            results = _run_job(servers, job, "ddp", 2, steps, "on", faulty, fault_at, work)
            timer.cancel()
            figures[job] = {
                "wall_s": round(time.time() - began, 1),
                "median_step_ms_by_rank": [round(_median_step_ms([r]), 2) for r in results],
                "recorder": [r["stats"] for r in results],
            }
            print(job, json.dumps(figures[job]), flush=True)
        for job, proc in agents:
            proc.terminate()
            proc.wait(timeout=20)
            figures[f"agent {job}"] = (work / f"agent-{job}.log").read_text()[-600:]
        # overhead: the same 1-rank NCCL job without and with the hook, alternating, fresh processes
        # "on": NVML by the agent (none runs now); "on_nvml": each rank samples its GPU, the default with pynvml
        modes = {"off": ("off", "agent"), "on": ("on", "agent"), "on_nvml": ("on", "process")}
        runs: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(rounds):
            for name, (mode, nvml) in modes.items():
                res = _run_job(servers, f"gpu-overhead-{name}", "nccl1", 1, 400, mode, -1, 10**9, work, nvml)
                runs[name].append(_median_step_ms(res))
        if rounds:
            off = statistics.median(runs["off"])
            figures["overhead"] = {"step_ms": {m: [round(x, 3) for x in v] for m, v in runs.items()}} | {
                f"{m}_pct": round(100 * (statistics.median(v) - off) / off, 2) for m, v in runs.items() if m != "off"
            }
            print("overhead", json.dumps(figures["overhead"]), flush=True)
        wanted = [*topics.raw_all, topics.heartbeats, topics.control]
        figures["captured"] = _dump(servers, wanted, out / "capture.bin")
    (out / "figures.json").write_text(json.dumps(figures, indent=1))
    with (out / "logs.txt").open("w") as logs:  # every process's own words, for what the figures don't say
        for log in sorted(work.glob("*.log")):
            logs.write(f"==> {log.name}\n{log.read_text(errors='replace')[-20000:]}\n")
    print(json.dumps(figures["captured"]))


def ingest(out: Path, settle_s: float) -> None:
    from confluent_kafka import Producer

    from fleetscope.config import load_config
    from fleetscope.sinks import current_findings
    from fleetscope.stack import EmbeddedStack

    data_dir = Path(tempfile.mkdtemp(prefix="gpu-ingest-"))
    config = load_config(env={}, overrides={"data_dir": str(data_dir), "embedded.serve_store": False})
    with EmbeddedStack(config) as stack:
        k = stack.config.kafka
        producer = Producer({"bootstrap.servers": k.bootstrap_servers, "linger.ms": 20})
        sent = 0
        for topic, key, value in _read(out / "capture.bin"):
            producer.produce(topic, value=value, key=key)
            producer.poll(0)
            sent += 1
        producer.flush(30)
        print(f"replayed {sent} messages")
        client, db = stack.client, stack.config.store.database
        previous, stable_since = -1, time.monotonic()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            n = client.query(f"SELECT count() FROM {db}.iterations").result_rows[0][0]
            if n != previous:
                previous, stable_since = n, time.monotonic()
            elif time.monotonic() - stable_since > settle_s:
                break
            time.sleep(1)
        for job in (HEALTHY, FAULTY):
            rows = client.query(
                f"SELECT rank, count(), countIf(profiled), round(median(duration_ns) / 1e6, 2), any(gpu_uuid) "
                f"FROM {db}.iterations WHERE job = %(j)s GROUP BY rank ORDER BY rank",
                parameters={"j": job},
            ).result_rows
            print(f"{job}: iterations (rank, count, profiled, median ms, GPU) {rows}")
            kinds = client.query(
                f"SELECT kind_name, count(), countIf(pcie_mean_bps > 0 OR nvlink_mean_bps > 0) "
                f"FROM {db}.function_patterns WHERE job = %(j)s GROUP BY kind_name ORDER BY kind_name",
                parameters={"j": job},
            ).result_rows
            print(f"{job}: pattern rows by kind (kind, rows, rows with PCIe/NVLink samples) {kinds}")
            top = client.query(
                f"SELECT function, count(), round(avg(mean_ns) / 1e3, 1) FROM {db}.function_patterns "
                f"WHERE job = %(j)s AND kind_name NOT IN ('python', 'collective') "
                f"GROUP BY function ORDER BY count() DESC LIMIT 5",
                parameters={"j": job},
            ).result_rows
            print(f"{job}: kernels (name, rows, mean µs) {top}")
            for f in current_findings(client, db, job):
                print(
                    f"{job}: finding {f['category']} rank={f['rank']} ranks={f.get('ranks')} "
                    f"status={f['status']} iterations {f['iteration_first']}..{f['iteration_last']}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("capture")
    c.add_argument("out", type=Path)
    c.add_argument("--steps", type=int, default=700)
    c.add_argument("--fault-at", type=int, default=300)
    c.add_argument("--window-after-s", type=float, default=15.0, help="profile request, seconds after launch")
    c.add_argument("--rounds", type=int, default=4, help="overhead rounds (0: none)")
    i = sub.add_parser("ingest")
    i.add_argument("out", type=Path)
    i.add_argument("--settle-s", type=float, default=20.0)
    args = parser.parse_args()
    if args.what == "capture":
        capture(args.out, args.steps, args.fault_at, args.rounds, args.window_after_s)
    else:
        ingest(args.out, args.settle_s)


if __name__ == "__main__":
    main()
