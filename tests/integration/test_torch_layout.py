"""Real gloo jobs build Megatron- and DeviceMesh-style process groups; every rank's header gets its place."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.integration, pytest.mark.alone]

SCRIPT = r"""
import json, os, sys
import torch.distributed as dist
import torch
import torch.multiprocessing as mp

def run(rank, world, port, style, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from fleetscope.producers import torch_layout
    from fleetscope.producers.rank_recorder import RankIdentity, Recorder

    class Sink:
        def start(self): pass
        def publish(self, batch): return True
        def stop(self, timeout_s=10.0): pass
        stats = None

    recorder = Recorder(RankIdentity(job="j", rank=rank, world_size=world), Sink())
    tracker = torch_layout.track(recorder)  # before the job has made its groups
    before = recorder.next_header().pp_rank
    if style == "megatron":  # dp2 x pp2 x tp2, Megatron order: tp fastest, then dp, then pp
        tp, dp, pp = 2, 2, 2
        for p in range(pp):
            for d in range(dp):
                dist.new_group([p * 4 + d * 2 + t for t in range(tp)], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
        for p in range(pp):
            for t in range(tp):
                dist.new_group([p * 4 + d * 2 + t for d in range(dp)], group_desc="DATA_PARALLEL_GROUP")
        for d in range(dp):
            for t in range(tp):
                dist.new_group([p * 4 + d * 2 + t for p in range(pp)], group_desc="PIPELINE_MODEL_PARALLEL_GROUP")
        dist.new_group([0, 1, 6, 7], group_desc="EMBEDDING_GROUP")
    elif style == "reversed":  # pp=4, stage 0 on the highest rank: activations flow 3 -> 2 -> 1 -> 0
        dist.new_group(list(range(world)), group_desc="PIPELINE_MODEL_PARALLEL_GROUP")
        x = torch.zeros(4)
        if rank < world - 1:
            dist.recv(x, rank + 1)
        if rank > 0:
            dist.send(x, rank - 1)
    else:  # torchtitan-style DeviceMesh pp2 x dp2 and a p2p exchange between the stages
        from torch.distributed.device_mesh import init_device_mesh
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        x = torch.zeros(4)
        if rank < 2:  # Megatron's way: batched P2POps (the patch must keep them valid)
            for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, rank + 2)]):
                req.wait()
        else:
            dist.recv(x, rank - 2)
        peers = sorted(torch_layout.PEERS.edges)
        assert peers == ([(rank, rank + 2)] if rank < 2 else [(rank - 2, rank)]), peers
    tracker.refresh()  # a step boundary after the groups exist
    h = recorder.next_header()
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump({"before": before, "tp": h.tp_rank, "pp": h.pp_rank, "dp": h.dp_rank,
                   "sizes": [h.tp_size, h.pp_size, h.dp_size]}, f)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    world, port, style, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    # fork: the ranks share the parent's imported torch instead of importing it again each (4-8 of them)
    mp.start_processes(run, args=(world, port, style, out), nprocs=world, join=True, start_method="fork")
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(tmp_path: Path, world: int, style: str) -> dict[int, dict]:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE")}
    done = subprocess.run(
        [sys.executable, str(script), str(world), str(_port()), style, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)}


def test_megatron_groups_give_every_rank_its_coordinates(tmp_path: Path) -> None:
    got = _job(tmp_path, 8, "megatron")
    for r, h in got.items():
        assert h["before"] == -1  # no groups yet: the layout is unknown, as without metadata
        assert (h["tp"], h["dp"], h["pp"]) == (r % 2, (r // 2) % 2, r // 4), r
        assert h["sizes"] == [2, 2, 2]


def test_device_mesh_dims_and_p2p_give_stage_and_replica(tmp_path: Path) -> None:
    got = _job(tmp_path, 4, "mesh")
    for r, h in got.items():
        assert (h["pp"], h["dp"], h["tp"]) == (r // 2, r % 2, 0), r
        assert h["sizes"] == [1, 2, 2]


def test_stage_order_follows_the_p2p_direction_when_the_group_lists_it_last_first(tmp_path: Path) -> None:
    got = _job(tmp_path, 4, "reversed")
    assert [got[r]["pp"] for r in range(4)] == [3, 2, 1, 0]
    assert all(h["sizes"] == [1, 4, 1] for h in got.values())
