"""Acceptance: a 2-process PyTorch job (CPU, gloo, DDP) with the integration enabled reaches ClickHouse.

Both ways of enabling it run on one embedded stack (real Tansu broker, real Faust worker, real chDB): the
two-line integration (``import ... as fs`` + ``fs.step()``) and the zero-code path
(``fleetscope run -- torchrun ...`` on a script that never mentions fleetscope).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fleetscope.broker import free_port
from fleetscope.config import load_config
from fleetscope.stack import EmbeddedStack

pytestmark = [pytest.mark.integration, pytest.mark.alone]

STEPS = 32

_MODEL = """
import sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

steps = int(sys.argv[1])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(steps * 8, 32), torch.randn(steps * 8, 1))
"""
TWO_LINES = (
    "import fleetscope.producers.torch_hook as fs\n"
    + _MODEL
    + """
fs.start()  # optional: without it, the first fs.step() starts monitoring and step 0 is the second step
for x, y in torch.utils.data.DataLoader(data, batch_size=8):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    fs.step()
    time.sleep(0.005)
s = fs.stats()
print("STATS", s.recorded, s.dropped, s.hook_errors, flush=True)
dist.destroy_process_group()
"""
)
PLAIN = (
    _MODEL
    + """
for x, y in torch.utils.data.DataLoader(data, batch_size=8):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.005)
dist.destroy_process_group()
"""
)


def _rows_by_rank(stack: EmbeddedStack, database: str, job: str) -> dict[int, int]:
    assert stack.client is not None
    rows = stack.client.query(
        f"SELECT rank, uniqExact(iteration) FROM {database}.iterations WHERE job = {{job:String}} GROUP BY rank",
        parameters={"job": job},
    ).result_rows
    return {int(r): int(n) for r, n in rows}


def _wait_rows(stack: EmbeddedStack, database: str, job: str, want: int, timeout_s: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout_s
    rows: dict[int, int] = {}
    while time.monotonic() < deadline:
        rows = _rows_by_rank(stack, database, job)
        if len(rows) == 2 and min(rows.values()) >= want:
            return rows
        assert stack.worker is not None and stack.worker.alive(), f"worker died; see {stack.worker.log_path}"
        time.sleep(0.3)
    return rows


def test_two_rank_cpu_training_reaches_clickhouse_both_ways(
    tmp_path: Path, broker: str, chdb_path: Path, database: str
) -> None:
    prefix = f"torch{uuid.uuid4().hex[:6]}"
    config = load_config(
        env={},
        overrides={
            "data_dir": str(tmp_path),
            "kafka.bootstrap_servers": broker,
            "kafka.topic_prefix": prefix,
            "store.url": f"chdb://{chdb_path}",
            "store.database": database,
        },
    )
    (tmp_path / "two_lines.py").write_text(TWO_LINES)
    (tmp_path / "plain.py").write_text(PLAIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE")}
    env["FLEETSCOPE_TORCH_DDP_HOOK"] = "1"  # the comm-hook path (NCCL's default); test_real_jobs runs gloo's
    env |= {
        "FLEETSCOPE__KAFKA__BOOTSTRAP_SERVERS": broker,
        "FLEETSCOPE__KAFKA__TOPIC_PREFIX": prefix,
        "FLEETSCOPE_CONTROL": "on",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    with EmbeddedStack(config) as stack:
        # 1. Two lines in the script: one process per rank, torchrun-style environment.
        port = str(free_port())
        ranks = [
            subprocess.Popen(
                [sys.executable, str(tmp_path / "two_lines.py"), str(STEPS)],
                env=env
                | {
                    "FLEETSCOPE_JOB": "two-lines",
                    "RANK": str(r),
                    "LOCAL_RANK": str(r),
                    "WORLD_SIZE": "2",
                    "MASTER_PORT": port,
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=tmp_path,
            )  # fmt: skip
            for r in range(2)
        ]
        outputs = [p.communicate(timeout=120)[0] for p in ranks]
        assert [p.returncode for p in ranks] == [0, 0], outputs
        stats = [line.split()[1:] for out in outputs for line in out.splitlines() if line.startswith("STATS")]
        # per step: marker, dataloader.next, optimizer.step and one DDP bucket all-reduce
        assert [s[1:] for s in stats] == [["0", "0"], ["0", "0"]] and all(int(s[0]) >= 4 * STEPS for s in stats)

        # 2. Zero code change: `fleetscope run -- torchrun ...` on a script without fleetscope.
        run = subprocess.run(
            [sys.executable, "-m", "fleetscope", "run", "--job", "zero-code", "--nvml", "off", "--",
             sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
             str(tmp_path / "plain.py"), str(STEPS)],
            env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr

        two = _wait_rows(stack, database, "two-lines", STEPS, timeout_s=40)
        zero = _wait_rows(stack, database, "zero-code", STEPS - 1, timeout_s=40)
        assert stack.sink is not None and stack.sink.stats["iterations"] >= 4 * (STEPS - 1)

    assert two == {0: STEPS, 1: STEPS}, two
    # auto mode: the first optimizer.step() starts monitoring, so step 0 is the second training step
    assert zero == {0: STEPS - 1, 1: STEPS - 1}, zero
