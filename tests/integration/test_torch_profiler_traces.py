"""Real torch.profiler traces of real 4-rank gloo jobs through ``fleetscope analyze``: a CPU job's trace has
no NCCL kernel, its collectives are the ``gloo:*`` annotations of its process groups' worker threads.

A healthy data-parallel job and a healthy tp 2 x dp 2 job get no finding; a rank that sleeps 20 ms after
each step from step 10 is named, and no other rank. Before gloo calls were read, the sleeping rank's job got
only a ``job_regression`` naming no rank, and reading them with a wrong group (worker threads grouped by
thread id alone) gave the healthy tp 2 x dp 2 job a false ``link_slow``; with the stack recorded, every rank
of the healthy job was ``host_slow`` on a function named with its own process's object address.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from fleetscope.broker import free_port
from fleetscope.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.alone]

WORLD = 4
STEPS = 60
FAULT_STEP = 10
JOB = """
import os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

steps, layout, faulty, out, stack = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
fault_step = int(sys.argv[6])
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
tp = None
if layout == "tp2dp2":  # every rank creates every group, in one order: Megatron's tensor pairs, then data pairs
    tps = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp, model = tps[rank // 2], DDP(net, process_group=dps[rank % 2])
else:
    model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
schedule = torch.profiler.schedule(wait=1, warmup=1, active=steps - 2)
trace = lambda p: p.export_chrome_trace(os.path.join(out, f"rank{rank}.json"))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                            on_trace_ready=trace, record_shapes=True, with_stack=stack) as prof:
    for step in range(steps):
        h = model(torch.randn(64, 256))
        if tp is not None:  # the tensor-parallel pair all-reduces its activations
            a = h.detach().clone()
            dist.all_reduce(a, group=tp)
            h = h + 0 * a
        loss = torch.nn.functional.cross_entropy(h, torch.randint(0, 10, (64,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == faulty and step >= fault_step:
            time.sleep(0.02)
        prof.step()
dist.destroy_process_group()
"""


def profile_job(tmp: Path, layout: str, faulty: int, stack: bool) -> Path:
    """Run the job on ``WORLD`` gloo processes; the folder of its ranks' traces. ``stack``: the profiler's
    ``with_stack``, whose Python functions' names carry their objects' addresses, which differ by process."""
    script, out = tmp / "job.py", tmp / f"{layout}-{faulty}"
    script.write_text(JOB)
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE")}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(WORLD)}
    env["OMP_NUM_THREADS"] = "1"
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(STEPS), layout, str(faulty), str(out), str(int(stack)),
                          str(FAULT_STEP)],
                         env=env | {"RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(WORLD)
    ]  # fmt: skip
    outputs = [p.communicate(timeout=240)[0] for p in ranks]
    assert all(p.returncode == 0 for p in ranks), outputs
    return out


def analyze(folder: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    capsys.readouterr()
    assert main(["analyze", "--quiet", "--json", str(folder)]) == 0
    return json.loads(capsys.readouterr().out)


def job_steps_ms(folder: Path) -> dict[int, float]:
    """Each step's time as the profiler recorded it (``ProfilerStep#N``), the slowest rank's: the job's pace,
    read from the traces without fleetscope."""
    steps: dict[int, float] = {}
    for trace in folder.glob("rank*.json"):
        for event in json.loads(trace.read_text())["traceEvents"]:
            if str(event.get("name", "")).startswith("ProfilerStep#"):
                step = int(event["name"].removeprefix("ProfilerStep#"))
                steps[step] = max(steps.get(step, 0.0), event["dur"] / 1e3)
    return steps


def rank_findings(folder: Path, findings: list[dict[str, object]], since: int = 0) -> list[dict[str, object]]:
    """The findings that name a rank. A ``job_regression`` names none; it is allowed only where the job's own
    steps, as the profiler recorded them, did slow by half at its onset against the steps from ``since`` (a
    fault's first step: the sleeping rank's slowdown is the rank's, never the job's): the 4 ranks share 2
    cores, and a CI machine's other load has slowed a healthy job's last 15 steps 1.9-fold. That is the
    job's time, told truly; a run-queue wait to tell it from the job's own regression is what the hook
    measures and a trace lacks (README, ``job_regression``)."""
    regressions = [f for f in findings if f["category"] == "job_regression"]
    steps = job_steps_ms(folder) if regressions else {}  # 4 traces of 11 MB with the stack: read only if needed
    for f in regressions:
        onset = int(json.loads(str(f["evidence"]))["onset_iteration"])
        before = [ms for s, ms in steps.items() if since <= s < onset]
        after = [ms for s, ms in steps.items() if onset <= s <= int(str(f["iteration_last"]))]
        assert before and after and statistics.median(after) >= 1.5 * statistics.median(before), (f, steps)
    return [f for f in findings if f["category"] != "job_regression"]


@pytest.mark.parametrize(("layout", "stack"), [("dp4", True), ("tp2dp2", False)])
def test_a_healthy_gloo_jobs_profiler_traces_get_no_finding(
    layout: str, stack: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = profile_job(tmp_path, layout, -1, stack)
    got = analyze(folder, capsys)
    ranks = got["ranks"]
    assert isinstance(ranks, list) and len(ranks) == WORLD
    assert all(r["collectives"] > 0 for r in ranks), ranks  # the gloo calls are read
    findings = got["findings"]
    assert isinstance(findings, list)
    assert rank_findings(folder, findings) == []


@pytest.mark.parametrize(
    ("layout", "faulty", "stack", "named"),
    [("tp2dp2", 3, False, ("straggler", 3, "nccl:")), ("dp4", 1, True, ("host_slow", 1, "<built-in function sleep>"))],
)
def test_a_gloo_rank_that_sleeps_after_each_step_is_named_and_no_other(
    layout: str,
    faulty: int,
    stack: bool,
    named: tuple[str, int, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without the stack, the sleep is time between collectives: the rank arrives late. With it, the sleep is
    a Python function of its own, on that rank only: host time."""
    folder = profile_job(tmp_path, layout, faulty, stack)
    got = analyze(folder, capsys)
    findings = got["findings"]
    assert isinstance(findings, list)
    findings = rank_findings(folder, findings, since=FAULT_STEP)
    assert {(f["category"], f["rank"]) for f in findings} == {named[:2]}, findings
    assert all(f["function"].startswith(named[2]) for f in findings), findings
