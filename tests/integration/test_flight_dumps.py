"""Real Flight Recorder dumps of a real hung gloo job (CPU torch records gloo's collectives too): rank 1
never enters the third all-reduce, ranks 0 and 2 dump their recorders while they wait in it, and
``fleetscope analyze`` on the folder names rank 1; the same job's dumps before the hang show none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fleetscope.broker import free_port
from fleetscope.cli import main

pytestmark = pytest.mark.integration

WORLD = 3
# Each rank dumps its recorder as PyTorch's watchdog would at a timeout (``<prefix><rank>``): after two
# all-reduces every rank, then ranks 0 and 2 again while inside the third, which rank 1 never enters.
_JOB = """
import os, sys, time, datetime
import torch, torch.distributed as dist, torch.multiprocessing as mp

def dump(path):
    with open(path, "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace())

def rank_main(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    store = dist.distributed_c10d._get_default_store()  # not a collective: the recorder never sees it
    t = torch.ones(256)
    dist.all_reduce(t)
    dist.all_reduce(t)
    dump(f"{out}/healthy/nccl_trace_rank_{rank}")
    if rank != 1:
        work = dist.all_reduce(t, async_op=True)  # rank 1 never enters it
    time.sleep(4.0)  # past the test's stall threshold (3 s), which no healthy rank descheduled by load reaches
    dump(f"{out}/hung/nccl_trace_rank_{rank}")
    store.add("dumped", 1)
    while store.add("dumped", 0) < world:  # no rank leaves (and fails its peers' wait) before all dumped
        time.sleep(0.05)
    store.add("left", 1)
    while rank == 0 and store.add("left", 0) < world:  # rank 0 holds the store: it leaves last
        time.sleep(0.05)
    os._exit(0)  # the job is hung: no rank waits for the others to leave

if __name__ == "__main__":
    world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    for d in ("healthy", "hung"):
        os.makedirs(f"{out}/{d}", exist_ok=True)
    mp.start_processes(rank_main, args=(world, port, out), nprocs=world, start_method="fork")
"""


def analyze(folder: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert main(["analyze", "--config", str(config), "--json", "--quiet", str(folder)]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_a_real_hung_gloo_jobs_dumps_name_the_rank_that_never_joined(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="64")
    run = subprocess.run([sys.executable, str(script), str(WORLD), str(free_port()), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    config = tmp_path / "fleetscope.toml"
    config.write_text("[streams.differential.job_level]\nhang_min_stall_ms = 3000\n")

    hung = analyze(tmp_path / "hung", config, capsys)
    (finding,) = hung["findings"]
    assert (finding["category"], finding["rank"], finding["ranks"]) == ("hang", 1, [1])
    evidence = json.loads(finding["evidence"])
    assert (evidence["verdict"], evidence["not_entered"], evidence["entered"]) == ("rank never joined", [1], [0, 2])
    assert (evidence["op"], evidence["seq"], evidence["nbytes"]) == ("allreduce", 3, 1024)
    assert evidence["waiting_ns"] >= 0.2e9
    assert [d["rank"] for d in hung["flight_dumps"]] == [0, 1, 2]

    healthy = analyze(tmp_path / "healthy", config, capsys)
    assert healthy["findings"] == [] and healthy["flight_verdicts"]["healthy"]["verdict"] == "no hang"
