"""Real 4-rank PyTorch jobs (gloo on CPU, DDP, a map-style DataLoader) through the live loop — torch hook, real
Tansu broker, real Faust worker, real chDB — held to the issue's strict acceptance: a healthy 300-step job
with automatic profiling on and a manual profiling window in the middle gets no finding update at all and
loses no step, and so does the same job laid out as Megatron's tp2 x dp2; a slow data loader, a GC-bound
rank or a rank computing its forward 3 times over, from step 30, is named within 10 iterations and no other
rank is named by any finding of its job (every rank computing its forward 4 times over: a
``job_regression``, and no rank named); a rank blocked forever is named, from heartbeats alone, as the one
that never entered the collective, with its group and sequence number, and in a pipeline, not the next
stage's rank that waits for it in its receive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from recorded_jobs import FAULT_AT, FAULTS, missed_bar, naming_the_fault

from fleetscope.broker import free_port
from fleetscope.config import Config, load_config
from fleetscope.producers.control import request_profile
from fleetscope.schemas import Topics, decode
from fleetscope.stack import EmbeddedStack

pytestmark = [pytest.mark.integration, pytest.mark.alone]

WORLD = 4

# argv: steps, fault (none|dataloader|gc|compute|slowdown|block), faulty rank (slowdown: every rank), fault step
JOB = """
import contextlib, gc, logging, os, random, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import fleetscope.producers.torch_hook as fs

logging.basicConfig(level=logging.WARNING)
logging.getLogger("fleetscope.producers.torch_hook").setLevel(logging.INFO)
steps, fault, faulty, at = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank = dist.get_rank()
mine = rank == faulty
torch.manual_seed(0)
BATCH = 64


class Net(torch.nn.Module):
    # a fixed random projection (most of the forward's compute, none of the backward's), then an MLP; the
    # projection is ~20 % of a step, so that a 3x forward makes the rank late by far more than the
    # few-ms arrival jitter of 4 ranks on 2 cores (at ~10 %, contention hid it for 13 iterations once)
    def __init__(self):
        super().__init__()
        self.projection = torch.randn(2048, 4096) / 45  # no parameter, no buffer: DDP leaves it alone
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4096, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, x):
        with torch.no_grad():
            reps = 3 if fault == "compute" and mine and step >= at else 1
            for _ in range(4 if fault == "slowdown" and step >= at else reps):
                features = torch.tanh(x @ self.projection)
            if layout == "tp2dp2":  # the tensor-parallel pair sums its halves, twice a forward (1 MiB each)
                for _ in range(2):
                    dist.all_reduce(features, group=tp_group)
        return self.mlp(features)


layout = os.environ.get("TOY_LAYOUT", "")
if layout:  # the hook watches the groups the layout makes
    fs.start()
if layout == "tp2dp2":  # Megatron's groups: tensor pairs {0, 1}, {2, 3}, data {0, 2}, {1, 3}
    tp_group = [dist.new_group(g, group_desc="TENSOR_MODEL_PARALLEL_GROUP") for g in ([0, 1], [2, 3])][rank // 2]
    dp_group = [dist.new_group(g, group_desc="DATA_PARALLEL_GROUP") for g in ([0, 2], [1, 3])][rank % 2]
    for r in range(4):
        dist.new_group([r], group_desc="PIPELINE_MODEL_PARALLEL_GROUP")
    model = DDP(Net(), process_group=dp_group)
elif layout == "fsdp":  # FSDP2: each rank holds a quarter of the MLP, all-gathered for each pass
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Net()
    fully_shard(model.mlp[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
elif layout == "hsdp":  # FSDP2 over a 2 x 2 mesh: shard pairs {0, 1}, {2, 3}, replicated over {0, 2}, {1, 3}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Net()
    fully_shard(model.mlp[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
elif layout == "dtensor":  # PyTorch's tensor parallelism: the MLP split by columns, then rows, over the 4 ranks
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = Net()
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(model.mlp, init_device_mesh("cpu", (dist.get_world_size(),)), plan)
else:
    model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=1e-4)


class Samples(torch.utils.data.Dataset):
    def __len__(self):
        return steps * BATCH

    def __getitem__(self, i):
        step = i // BATCH
        if i % BATCH == 0:
            time.sleep(0.008)  # reading and decoding a batch
            if fault == "dataloader" and mine and step >= at:
                time.sleep(0.030)
        return torch.randn(2048), torch.randn(1)


garbage = [[i] for i in range(150_000)] if fault == "gc" and mine else []
lengths = random.Random(rank)  # each rank's own draw: a different rank has the most rows each step
step = 0
if not layout:
    fs.start()
for step, (x, y) in enumerate(torch.utils.data.DataLoader(Samples(), batch_size=BATCH)):
    if fault == "block" and mine and step == at:
        print("BLOCKED", time.time_ns(), flush=True)
        threading.Event().wait()
    opt.zero_grad()
    if layout == "varying":  # gradient accumulation over 4 micro-batches of 16-64 rows, as many as chance gives
        for micro in range(4):
            n = lengths.randint(16, 64)
            with model.no_sync() if micro < 3 else contextlib.nullcontext():
                torch.nn.functional.mse_loss(model(x[:n]), y[:n]).backward()
    else:
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if fault == "gc" and mine and step >= at:
        gc.collect()
    time.sleep(0.004)  # logging, metrics
    fs.step()
s = fs.stats()
print("STATS", s.recorded, s.dropped, s.hook_errors, s.heartbeats, flush=True)
fs.stop()
dist.destroy_process_group()
"""

# The same argv; a pp 2 x dp 2 job by hand, as Megatron lays it out: data pairs {0, 1}, {2, 3} (one per stage),
# pipeline pairs {0, 2}, {1, 3}; each step 4 micro-batches forward (dist.send/recv of activations), then
# backward (gradients back), then each stage's pair all-reduces its gradients. No fault: a healthy job.
PIPELINE_JOB = """
import sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
import fleetscope.producers.torch_hook as fs

steps, fault, faulty, at = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])  # fault: none|block
torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank = dist.get_rank()
fs.start()
data_group = [dist.new_group(g, group_desc="DATA_PARALLEL_GROUP") for g in ([0, 1], [2, 3])][rank // 2]
for g in ([0, 2], [1, 3]):
    dist.new_group(g, group_desc="PIPELINE_MODEL_PARALLEL_GROUP")
for r in range(4):
    dist.new_group([r], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
stage, peer = rank // 2, rank + 2 if rank < 2 else rank - 2
torch.manual_seed(stage)
MICRO, BATCH, DIM = 4, 32, 1024
layer = torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh(), torch.nn.Linear(DIM, DIM if stage == 0 else 1))
opt = torch.optim.SGD(layer.parameters(), lr=1e-4)
for step in range(steps):
    if fault == "block" and rank == faulty and step == at:
        print("BLOCKED", time.time_ns(), flush=True)
        threading.Event().wait()
    with fs.span("dataloader.next"):
        time.sleep(0.004)
        batches = [torch.randn(BATCH, DIM) for _ in range(MICRO)]
    opt.zero_grad()
    if stage == 0:
        outputs = []
        for x in batches:
            outputs.append(layer(x))
            dist.send(outputs[-1].detach(), dst=peer)
        for h in outputs:
            grad = torch.empty_like(h)
            dist.recv(grad, src=peer)
            h.backward(grad)
    else:
        grads = []
        for _ in batches:
            h = torch.empty(BATCH, DIM)
            dist.recv(h, src=peer)
            h.requires_grad_()
            layer(h).pow(2).mean().backward()
            grads.append(h.grad)
        for grad in grads:
            dist.send(grad, dst=peer)
    for p in layer.parameters():
        dist.all_reduce(p.grad, group=data_group)
    opt.step()
    fs.step()
fs.stop()
dist.destroy_process_group()
"""


@dataclass
class Job:
    name: str
    ranks: list[subprocess.Popen[str]]

    def wait(self, timeout_s: float) -> list[str]:
        outputs = [p.communicate(timeout=timeout_s)[0] for p in self.ranks]
        assert [p.returncode for p in self.ranks] == [0] * WORLD, outputs
        return outputs

    def kill(self) -> list[str]:
        for p in self.ranks:
            if p.poll() is None:
                p.kill()
        return [p.communicate(timeout=30)[0] for p in self.ranks]


@dataclass
class Live:
    stack: EmbeddedStack
    config: Config
    database: str
    script: Path
    env: dict[str, str]

    def launch(
        self,
        fault: str = "none",
        faulty: int = -1,
        steps: int = 80,
        at: int = FAULT_AT,
        layout: str = "",
        script: Path | None = None,
    ) -> Job:
        """``layout``: "tp2dp2" gives the job Megatron's tensor and data-parallel pairs, "fsdp" shards its model
        with FSDP2, "hsdp" shards it in pairs replicated over the pairs (FSDP2 on a 2 x 2 mesh), "dtensor"
        splits it with DTensor's tensor parallelism, "varying" accumulates gradients over micro-batches of
        random lengths, DDP (the job's text; the layout starts the name's id);
        ``script``: another job's text, with the same arguments."""
        name = f"{fault}-{layout}{uuid.uuid4().hex[:6]}"
        port = str(free_port())
        ranks = [
            subprocess.Popen(
                [sys.executable, str(script or self.script), str(steps), fault, str(faulty), str(at)],
                env=self.env
                | {
                    "FLEETSCOPE_JOB": name,
                    "RANK": str(r),
                    "LOCAL_RANK": str(r),
                    "WORLD_SIZE": str(WORLD),
                    "MASTER_PORT": port,
                    "TOY_LAYOUT": layout,
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=self.script.parent,
            )  # fmt: skip
            for r in range(WORLD)
        ]
        return Job(name, ranks)

    def query(self, sql: str, job: str) -> list[tuple[Any, ...]]:
        assert self.stack.client is not None
        rows = self.stack.client.query(sql.format(db=self.database), parameters={"job": job}).result_rows
        return [tuple(r) for r in rows]

    def heartbeats(self, job: str, until: Any, timeout_s: float) -> dict[int, dict[str, Any]]:
        """Each rank's latest heartbeat of ``job``, read from the broker once ``until(latest)`` holds."""
        topic = Topics(prefix=self.config.kafka.topic_prefix).heartbeats
        servers = self.config.kafka.bootstrap_servers
        consumer = Consumer({"bootstrap.servers": servers, "group.id": f"hb-{uuid.uuid4().hex[:8]}"})
        latest: dict[int, dict[str, Any]] = {}
        try:
            partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
            consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and not until(latest):
                for msg in consumer.consume(200, 0.2):
                    if msg.error() is None and msg.key() == job.encode():
                        subject, hb = decode(msg.value() or b"")
                        assert subject == "heartbeat"
                        latest[hb["rank"]] = hb
        finally:
            consumer.close()
        return latest

    def iterations(self, job: str) -> dict[int, int]:
        sql = "SELECT rank, max(iteration) FROM {db}.iterations WHERE job = {{job:String}} GROUP BY rank"
        rows = self.query(sql, job)
        return {int(r): int(n) for r, n in rows}

    def updates(self, job: str) -> list[dict[str, Any]]:
        rows = self.query(
            "SELECT status, category, rank, ranks, function, iteration_first, iteration_last, subject, evidence, "
            "emitted_ns "
            "FROM {db}.finding_updates WHERE job = {{job:String}} ORDER BY emitted_ns",
            job,
        )
        keys = ("status", "category", "rank", "ranks", "function", "iteration_first", "iteration_last", "subject")
        return [dict(zip((*keys, "evidence", "emitted_ns"), r, strict=True)) for r in rows]

    def wait_for(self, job: str, until: Any, timeout_s: float) -> list[dict[str, Any]]:
        """Finding updates of ``job`` once ``until(updates)`` holds, or at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.updates(job)
            if until(found) or time.monotonic() > deadline:
                return found
            assert self.stack.worker is not None and self.stack.worker.alive(), self.stack.worker.log_path
            time.sleep(0.5)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, broker: str, chdb_path: Path) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("real_jobs")
    prefix = f"real{uuid.uuid4().hex[:6]}"
    database = f"t_{uuid.uuid4().hex[:12]}"
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp),
            "kafka.bootstrap_servers": broker,
            "kafka.topic_prefix": prefix,
            "store.url": f"chdb://{chdb_path}",
            "store.database": database,
        },
    )
    script = tmp / "job.py"
    script.write_text(JOB)
    (tmp / "pipeline_job.py").write_text(PIPELINE_JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE")}
    env |= {
        "FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS": broker,
        "FLEETSCOPE__KAFKA__TOPIC_PREFIX": prefix,
        "FLEETSCOPE__DATA_DIR": str(tmp),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    with EmbeddedStack(config) as stack:
        yield Live(stack, config, database, script, env)


def _named(updates: list[dict[str, Any]]) -> set[int]:
    """Every rank any of the updates names (a job-wide finding names all its ranks)."""
    return {int(r) for u in updates for r in (list(u["ranks"]) or [u["rank"]]) if int(r) >= 0}


def _show(updates: list[dict[str, Any]]) -> str:
    keys = ("status", "category", "rank", "ranks", "function", "iteration_first", "iteration_last")
    return "\n".join(" ".join(str(u[k]) for k in keys) for u in updates)


def _wait_for_steps(live: Live, job: str, steps: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while min(live.iterations(job).values() or [0]) < steps and time.monotonic() < deadline:
        time.sleep(0.3)


SETTLE_S = 5.0
"""After a job's last iteration is stored, time for its last patterns to reach the differential's findings."""
HEALTHY_STEPS = 300
WINDOW_AFTER_STEP = 120


def launch_healthy(live: Live, layout: str = "") -> Job:
    """The healthy job: 300 steps, automatic profiling on (the default) and a manual window of 1.5 s asked
    for once every rank is past step 120 (bench/real_jobs.py records the same job)."""
    job = live.launch(steps=HEALTHY_STEPS, layout=layout)
    _wait_for_steps(live, job.name, WINDOW_AFTER_STEP, timeout_s=90)
    request_profile(live.config, job.name, 1.5, "manual, mid-job", start_in_s=0.5)
    return job


def test_a_healthy_job_with_a_profiling_window_in_the_middle_gets_no_finding_and_loses_no_step(live: Live) -> None:
    """Automatic profiling is on (the default) and a manual window opens past step 120: the steps it covers
    are marked on every rank, none is lost, each has its run-queue wait, and the job gets no finding update
    of any status."""
    assert live.config.streams.profiling.auto
    steps = HEALTHY_STEPS
    job = launch_healthy(live)
    outputs = job.wait(timeout_s=150)
    assert all("profiling window" in out and "opened" in out for out in outputs), outputs
    stats = [line.split()[1:] for out in outputs for line in out.splitlines() if line.startswith("STATS")]
    assert [s[1:3] for s in stats] == [["0", "0"]] * WORLD and all(int(s[3]) > 0 for s in stats), stats
    _wait_for_steps(live, job.name, steps - 2, timeout_s=40)
    assert min(live.iterations(job.name).values()) >= steps - 2  # the held-back steps all came
    sql = (
        "SELECT rank, groupArray(iteration) FROM (SELECT rank, iteration FROM {db}.iterations "
        "WHERE job = {{job:String}} AND profiled ORDER BY iteration) GROUP BY rank ORDER BY rank"
    )
    profiled = {int(r): sorted(its) for r, its in live.query(sql, job.name)}
    # every rank marks the steps its windows covered (the manual one, requested past step 120): the same
    # ones, give or take the edges (each rank opens and closes at its own step boundary)
    assert set(profiled) == set(range(WORLD)), profiled
    assert all(len([i for i in its if i >= WINDOW_AFTER_STEP]) >= 2 for its in profiled.values()), profiled
    assert all(len(set(profiled[0]) ^ set(its)) <= 4 for its in profiled.values()), profiled
    # every step's run-queue wait is stored (the hook reads it at each boundary), and is part of the step
    sql = (
        "SELECT count(), countIf(cpu_wait_ns >= 0 AND cpu_wait_ns <= duration_ns), countIf(cpu_wait_ns > 0) "
        "FROM {db}.iterations WHERE job = {{job:String}}"
    )
    [(rows, within, positive)] = live.query(sql, job.name)
    assert rows >= WORLD * (steps - 2) and within == rows and positive > rows // 2, (rows, within, positive)
    found = live.wait_for(job.name, bool, timeout_s=SETTLE_S)
    assert found == [], _show(found) + "\n" + "\n".join(str(u["evidence"]) for u in found if u["status"] == "open")


def test_a_healthy_tp2_dp2_job_gets_its_layout_and_no_finding(live: Live) -> None:
    """The same job as Megatron lays out 4 ranks: tensor pairs that all-reduce activations twice a forward,
    data-parallel pairs that all-reduce gradients. Each rank's coordinates reach the store, and two groups of
    each kind, which the differential compares with each other (``links.score_transfers``), slow and jitter
    alike on the 2 shared cores: no finding."""
    coordinates, found = _run_to_the_end(live, live.launch(steps=120, layout="tp2dp2"), 120)
    assert coordinates == [(0, 0, 0, 0), (1, 1, 0, 0), (2, 0, 1, 0), (3, 1, 1, 0)]
    assert found == [], _show(found) + "\n" + "\n".join(str(u["evidence"]) for u in found if u["status"] == "open")


def _run_to_the_end(live: Live, job: Job, steps: int) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """A job run to its end: each rank's (rank, tp, dp, pp) as stored, and its finding updates."""
    try:
        job.wait(timeout_s=150)
        _wait_for_steps(live, job.name, steps - 2, timeout_s=40)
        found = live.wait_for(job.name, bool, timeout_s=SETTLE_S)
    finally:
        job.kill()
    sql = (
        "SELECT rank, any(tp_rank), any(dp_rank), any(pp_rank) FROM {db}.iterations WHERE job = {{job:String}} "
        "AND iteration > 5 GROUP BY rank ORDER BY rank"
    )
    return live.query(sql, job.name), found


def test_a_healthy_pp2_dp2_job_gets_its_stages_and_no_finding(live: Live) -> None:
    """A pipeline by hand (``PIPELINE_JOB``): activations and gradients sent between the stages, each stage's
    data pair all-reducing its own gradients. Each rank's coordinates reach the store; the two stages'
    all-reduces differ (CPU work beside each stage's own, on 2 shared cores), and are not compared as links
    (``links.ring_groups``): no finding."""
    job = live.launch(steps=80, script=live.script.parent / "pipeline_job.py")
    coordinates, found = _run_to_the_end(live, job, 80)
    assert coordinates == [(0, 0, 0, 0), (1, 0, 1, 0), (2, 0, 0, 1), (3, 0, 1, 1)]
    assert found == [], _show(found) + "\n" + "\n".join(str(u["evidence"]) for u in found if u["status"] == "open")


def test_in_a_pipeline_a_rank_blocked_forever_is_named_not_the_next_stage_waiting_in_its_receive(live: Live) -> None:
    """The pipeline by hand (``PIPELINE_JOB``, dp2 x pp2): rank 1 blocks for good at step 40, outside any
    collective. Its data partner 0 waits for it in their all-reduce, the next stage's rank 3 in its receive
    of rank 1's activations, and rank 3's partner 2 for rank 3 in theirs. Before the hook timed receives,
    rank 3 was in no collective, and the ``hang`` finding named it."""
    at = 40
    job = live.launch("block", 1, steps=at + 40, at=at, script=live.script.parent / "pipeline_job.py")
    try:
        assert job.ranks[1].stdout is not None
        for line in job.ranks[1].stdout:
            if line.startswith("BLOCKED"):
                break
        found = live.wait_for(job.name, lambda us: any(u["category"] == "hang" for u in us), timeout_s=40)
    finally:
        job.kill()
    hangs = [u for u in found if u["category"] == "hang" and u["status"] == "open"]
    assert hangs, _show(found)
    assert (hangs[0]["rank"], list(hangs[0]["ranks"])) == (1, [1]), (_show(found), hangs[0]["evidence"])
    assert _named([u for u in found if u["rank"] >= 0]) == {1}, _show(found)
    evidence = json.loads(hangs[0]["evidence"])
    assert evidence["not_entered"] == [1] and evidence["group"] in {"1", "0:p2p:1-3"}, evidence


FAULT_STEPS = 56


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_faulty_rank_is_named_within_ten_iterations_and_no_other_rank_is(live: Live, fault: str) -> None:
    """The faulty rank (for ``slowdown``, the job: rank -1) is named within 10 iterations and no finding names
    another rank as its culprit. A ``job_regression`` names none (rank -1). The job shares 2 cores with the
    broker, worker and store, which slow every step by 30-100 % for a while (one recorded run: every step
    from 115 to 165 ms from iteration 15 on): every ms of that is the ranks' run-queue wait, which the torch
    hook measures and the regression test leaves out."""
    job = live.launch(fault, FAULTS[fault][0], steps=FAULT_STEPS)
    try:
        job.wait(timeout_s=150)
        _wait_for_steps(live, job.name, FAULT_STEPS - 2, timeout_s=40)
        found = live.wait_for(job.name, lambda us: bool(naming_the_fault(fault, us)), timeout_s=SETTLE_S)
        if naming_the_fault(fault, found):  # and any finding that names another rank meanwhile
            found = live.wait_for(job.name, lambda us: False, timeout_s=SETTLE_S)
    finally:
        job.kill()
    assert missed_bar(fault, found) is None, f"{missed_bar(fault, found)}\n{_show(found)}"


def test_a_rank_blocked_forever_is_named_as_the_one_that_never_entered_the_collective(live: Live) -> None:
    """Rank 0 blocks for good at step 150, outside any collective; the others wait in DDP's gradient
    all-reduce of that step. No rank publishes events any more, none has a GPU: the heartbeats alone give
    the ``hang`` finding (within 30 s), and read from the broker they locate every rank."""
    at = 150
    job = live.launch("block", 0, steps=at + 50, at=at)
    try:
        assert job.ranks[0].stdout is not None
        for line in job.ranks[0].stdout:  # ends when the rank prints it (or exits)
            if line.startswith("BLOCKED"):
                break
        blocked_ns = time.time_ns()
        found = live.wait_for(job.name, lambda us: any(u["category"] == "hang" for u in us), timeout_s=40)

        def settled(latest: dict[int, dict[str, Any]]) -> bool:
            """Every rank's heartbeat since the block, none still saying ``profiling``: an automatic window
            (a job-wide finding before the block asks for one) is claimed until ``HOLD_GRACE_NS`` past its
            planned end, and the hang is reported only after that (``hangs``), so such heartbeats come."""
            return len(latest) == WORLD and all(
                hb["sent_ns"] > blocked_ns + 1e9 and not hb["profiling"] for hb in latest.values()
            )

        latest = live.heartbeats(job.name, settled, timeout_s=20)
    finally:
        job.kill()
    hangs = [u for u in found if u["category"] == "hang" and u["status"] == "open"]
    assert hangs, _show(found)
    hang = hangs[0]
    assert hang["rank"] == 0 and set(hang["ranks"]) <= {0}, (_show(found), hang["evidence"])
    assert not [u for u in found if u["category"] == "hang" and u["rank"] != 0], _show(found)
    # and no finding of the job, before or after, names another culprit (a job-wide one names none: the job
    # shares 2 cores with the pipeline, and one recorded run truly slowed as a whole at iteration 27)
    assert _named([u for u in found if u["rank"] >= 0]) == {0}, _show(found)
    assert hang["emitted_ns"] - blocked_ns <= 30e9, (hang, blocked_ns)
    evidence = json.loads(hang["evidence"])
    assert (evidence["group"], evidence["not_entered"], evidence["entered"]) == ("0", [0], [1, 2, 3]), evidence
    assert evidence["seq"] >= at, evidence  # at least one DDP all-reduce per step: the one of step `at`

    # the flight recorder, as each rank publishes it: the blocked one outside, after the last collective
    # it entered; the others inside the next one of the same group, with the same sequence number
    assert settled(latest), latest
    grad_bytes = 4 * (4096 * 64 + 64 + 64 + 1)
    assert {r: hb["last_step"] for r, hb in latest.items()} == dict.fromkeys(range(WORLD), at - 1)
    assert not latest[0]["in_collective"] and all(latest[r]["in_collective"] for r in (1, 2, 3)), latest
    seq = latest[0]["collective_seq"]
    assert {latest[r]["collective_seq"] for r in (1, 2, 3)} == {seq + 1} == {evidence["seq"]}, latest
    for rank, hb in latest.items():
        assert (hb["collective_op"], hb["collective_pg"], hb["collective_nbytes"]) == ("allreduce", "0", grad_bytes)
        assert hb["collective_group_ranks"] == list(range(WORLD)) and not hb["profiling"]
        if rank == 0:  # it entered its last one during its last step
            assert hb["collective_entered_ns"] < hb["last_step_ns"] < blocked_ns < hb["sent_ns"]
        else:  # they entered the next one after their last step
            assert hb["last_step_ns"] < hb["collective_entered_ns"] < hb["sent_ns"]
