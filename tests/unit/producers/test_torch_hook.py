"""The PyTorch hook's promises to training code: bounded, never blocking, never raising; torch optional."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fleetscope.producers.flight_recorder import CollectiveEntry
from fleetscope.producers.publisher import PublisherStats
from fleetscope.producers.rank_recorder import HOLD_GRACE_NS, RankIdentity, Recorder, RecorderConfig
from fleetscope.schemas import (
    CPU_WAIT,
    GC_PAUSE,
    SPAN_CPU_WAIT_DEPTH,
    BatchHeader,
    EventBatch,
    EventKind,
    Topics,
    decode,
    is_profiling_window,
    parse_step_marker,
)

ME = RankIdentity(job="job", rank=1, world_size=2, host="h")


class FakePublisher:
    """Collects batches; ``gate`` (when given) blocks every publish until it is set."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.batches: list[EventBatch] = []
        self.records: list[tuple[str, bytes, bytes]] = []
        self.started = self.stopped = False

    def start(self) -> None:
        self.started = True

    def publish(self, batch: EventBatch) -> bool:
        if self.gate is not None:
            self.gate.wait()
        self.batches.append(batch)
        return True

    def publish_record(self, topic: str, key: bytes, value: bytes, n_events: int = 0) -> bool:
        self.records.append((topic, key, value))
        return True

    @property
    def topics(self) -> Topics:
        return Topics(prefix="t")

    def heartbeats(self) -> list[dict[str, object]]:
        assert {(t, k) for t, k, _ in self.records} <= {("t.heartbeats", b"job")}
        decoded = [decode(v) for _, _, v in self.records]
        assert {subject for subject, _ in decoded} <= {"heartbeat"}
        return [record for _, record in decoded]

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stopped = True

    @property
    def stats(self) -> PublisherStats:
        return PublisherStats(published=len(self.batches))


def _python(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE")}
    return subprocess.run([sys.executable, "-c", script], env=clean | env, capture_output=True, text=True, timeout=60)


def test_importing_the_producers_never_imports_torch() -> None:
    run = _python(
        "import sys, fleetscope.producers, fleetscope.producers.nvml, fleetscope.producers.control, "
        "fleetscope.producers.rank_recorder, fleetscope.producers.torch_bootstrap; "
        "print('torch' in sys.modules)"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "False"


def test_a_missing_torch_gives_the_install_hint() -> None:
    run = _python(
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import fleetscope.producers.torch_hook\nexcept ImportError as e:\n    print(e)"
    )
    assert "pip install 'fleetscope[torch]'" in run.stdout, run.stderr


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    recorder = Recorder(ME, FakePublisher(), RecorderConfig(queue_max_events=100))
    began = time.monotonic()
    for i in range(1000):
        recorder.python_span("x", i, 1)
    assert time.monotonic() - began < 0.5
    stats = recorder.stats
    assert (stats.recorded, stats.dropped) == (100, 900)


def test_a_stuck_publisher_never_blocks_the_training_thread() -> None:
    gate = threading.Event()
    publisher = FakePublisher(gate)
    recorder = Recorder(ME, publisher, RecorderConfig(queue_max_events=1000, flush_interval_ms=1))
    recorder.start()
    try:
        began = time.monotonic()
        for i in range(50_000):
            recorder.collective("gloo:allreduce", "allreduce", "0", i, 2, 1024, i, 1)
        elapsed = time.monotonic() - began
    finally:
        gate.set()
        recorder.stop()
    assert elapsed < 2.0
    stats = recorder.stats
    assert stats.dropped > 0 and stats.recorded + stats.dropped == 50_000
    assert sum(len(b) for b in publisher.batches) == stats.recorded and publisher.stopped


def test_batches_carry_the_rank_the_declared_streams_and_gapless_sequence_numbers() -> None:
    publisher = FakePublisher()
    recorder = Recorder(ME, publisher, RecorderConfig(max_batch_events=3), streams=("python", "collectives"))
    recorder.start()
    for i in range(7):
        recorder.python_span(f"f{i % 2}", 100 + i, 5, depth=1)
    recorder.collective("gloo:allreduce", "allreduce", "0", 0, 2, 4096, 10, 3)
    recorder.stop()
    recorder.stop()  # idempotent
    kinds = [b.kind for b in publisher.batches]
    assert kinds == [EventKind.HOST] * 3 + [EventKind.COLLECTIVES]
    assert [b.header.seq for b in publisher.batches] == [0, 1, 2, 3]
    assert {b.header.streams for b in publisher.batches} == {("collectives", "python")}
    first = publisher.batches[0]
    assert first.names == ["f0", "f1"] and first["name_id"].tolist() == [0, 1, 0]
    coll = publisher.batches[3]
    assert [coll.names[coll[c][0]] for c in ("name_id", "op_id", "pg_id")] == [
        "gloo:allreduce",
        "allreduce",
        "0",
    ]
    assert coll["launch_ns"].tolist() == [10] and coll["nbytes"].tolist() == [4096]


def test_guard_counts_and_logs_each_failing_site_once(caplog: pytest.LogCaptureFixture) -> None:
    recorder = Recorder(ME, FakePublisher())

    def boom() -> None:
        raise RuntimeError("bug in a hook")

    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert recorder.guard("site", boom, default=7) == 7
    assert recorder.stats.errors_by_site == {"site": 3}
    assert len([r for r in caplog.records if "site" in r.getMessage()]) == 1


def test_a_held_recorder_publishes_the_window_batches_before_its_host_events() -> None:
    publisher = FakePublisher()
    recorder = Recorder(ME, publisher, RecorderConfig(flush_interval_ms=10_000))
    recorder.hold_host_events()
    recorder.python_span("ProfilerStep#0", 0, 10)
    recorder._flush()
    assert publisher.batches == []

    def window() -> list[EventBatch]:
        recorder.release_host_events()
        return [
            EventBatch(
                kind=EventKind.KERNELS,
                header=recorder.next_header(),
                names=["k"],
                columns={"start_ns": [1], "dur_ns": [1], "name_id": [0], "stream": [7]},
            )
        ]

    recorder.submit(window)
    recorder._flush()
    assert [b.kind for b in publisher.batches] == [EventKind.KERNELS, EventKind.HOST]


def test_heartbeats_go_out_on_time_while_the_training_thread_is_blocked_inside_a_collective() -> None:
    publisher = FakePublisher()
    recorder = Recorder(ME, publisher, RecorderConfig(flush_interval_ms=10_000, heartbeat_interval_ms=20))
    recorder.start()
    try:
        recorder.state.step_done(149, 1_000)
        entry = CollectiveEntry("allreduce", "0", (0, 1), 300, 4096, 2_000)
        recorder.state.enter(entry)
        blocked = threading.Event()
        threading.Thread(target=blocked.wait, args=(0.3,)).start()  # the training thread, stuck
        time.sleep(0.3)
        inside = publisher.heartbeats()
        recorder.state.leave(entry)
        recorder.hold_host_events()
        time.sleep(0.1)
    finally:
        recorder.stop()
    assert 8 <= len(inside) <= 20, len(inside)
    last = inside[-1]
    assert last["in_collective"] and (last["last_step"], last["last_step_ns"]) == (149, 1_000)
    assert (last["collective_op"], last["collective_pg"], last["collective_seq"]) == ("allreduce", "0", 300)
    assert (last["collective_group_ranks"], last["collective_nbytes"], last["collective_entered_ns"]) == (
        [0, 1],
        4096,
        2_000,
    )
    after = publisher.heartbeats()[-1]
    assert not after["in_collective"] and after["collective_seq"] == 300 and after["profiling"]
    beats = publisher.heartbeats()
    assert [b["seq"] for b in beats] == list(range(len(beats))) and recorder.stats.heartbeats == len(beats)
    assert {(b["job"], b["rank"], b["world_size"], b["host"]) for b in beats} == {("job", 1, 2, "h")}


def test_a_heartbeat_before_any_step_or_collective_says_so() -> None:
    publisher = FakePublisher()
    recorder = Recorder(ME, publisher, RecorderConfig(heartbeat_interval_ms=10_000))
    recorder.start()
    recorder.stop()
    first = publisher.heartbeats()[0]
    assert (first["last_step"], first["in_collective"], first["collective_seq"], first["profiling"]) == (
        -1,
        False,
        -1,
        False,
    )


# -- with torch ------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")  # installed by `make test`; the lines above need no torch


@pytest.fixture
def hooked() -> tuple[object, Recorder, FakePublisher]:
    import fleetscope.producers.torch_hook as fs

    publisher = FakePublisher()
    recorder = Recorder(ME, publisher, RecorderConfig(flush_interval_ms=10_000))
    mon = fs.Monitor(recorder)
    mon.start()
    fs._monitor = mon
    yield fs, recorder, publisher
    fs._monitor = None
    mon.stop()


def test_hook_exceptions_are_swallowed_counted_and_training_goes_on(hooked, monkeypatch) -> None:
    import torch.distributed as dist

    fs, recorder, _ = hooked

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("bug in fleetscope")

    monkeypatch.setattr(recorder, "python_span", broken)
    monkeypatch.setattr(recorder, "collective", broken)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.ones(4, 4), torch.zeros(4, 1))
    seen = 0
    for x, y in torch.utils.data.DataLoader(data, batch_size=2):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        fs.step()
        seen += 1
    assert seen == 2
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        time.sleep(0.05)  # the async completion callback runs on the backend's thread
    finally:
        dist.destroy_process_group()
    assert t.tolist() == [1.0, 1.0, 1.0]
    errors = recorder.stats.errors_by_site
    assert errors["optimizer"] == 2 and errors["dataloader"] == 2 and errors["step"] == 2
    assert errors["collective"] + errors.get("collective_done", 0) == 2


def test_step_markers_optimizer_spans_and_collectives_with_sequence_numbers(hooked, monkeypatch) -> None:
    import torch.distributed as dist

    monkeypatch.setenv("FLEETSCOPE_TORCH_DDP_HOOK", "1")  # DDP buckets are timed on NCCL only by default
    fs, recorder, publisher = hooked
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.ones(2, 8)).sum().backward()
            opt.step()
            dist.all_reduce(torch.ones(16), group=None)
            fs.step()
    finally:
        dist.destroy_process_group()
    recorder._flush()
    spans = [b for b in publisher.batches if b.kind is EventKind.HOST]
    names = [b.names[i] for b in spans for i, depth in zip(b["name_id"], b["depth"], strict=True) if depth >= 0]
    assert [parse_step_marker(n) for n in names if parse_step_marker(n) is not None] == [0, 1, 2]
    assert names.count("optimizer.step") == 3  # spans; a descheduled one also has its wait row (depth -2)
    # each step's run-queue wait, as a span starting with the step (its length: the wait, here a few ms)
    markers = {int(s): int(b["start_ns"][j]) for b in spans for j, i in enumerate(b["name_id"])
               if (s := parse_step_marker(b.names[i])) is not None}  # fmt: skip
    waits = [(int(b["start_ns"][j]), int(b["dur_ns"][j])) for b in spans for j, i in enumerate(b["name_id"])
             if b.names[i] == CPU_WAIT]  # fmt: skip
    assert [start for start, _ in waits] == [markers[0], markers[1], markers[2]]
    assert all(0 <= wait < 1_000_000_000 for _, wait in waits), waits
    coll = [b for b in publisher.batches if b.kind is EventKind.COLLECTIVES]
    assert [int(s) for b in coll for s in b["seq"]] == list(range(6))  # a DDP bucket + an all_reduce per step
    assert {b.names[i] for b in coll for i in b["op_id"]} == {"allreduce"}
    assert sorted({int(n) for b in coll for n in b["nbytes"]}) == [36, 64]  # 9 fp32 gradients; 16 fp32


def test_a_profiling_window_adds_host_ops_from_the_profilers_memory(hooked) -> None:
    fs, recorder, publisher = hooked
    model = torch.nn.Linear(16, 16)
    fs.profile(0.05)
    for _ in range(20):
        with torch.profiler.record_function("user_region"):
            model(torch.randn(4, 16)).sum().backward()
        fs.step()
        time.sleep(0.005)
    assert fs._monitor._window is None  # closed: at least one recorded step, and its time is over
    recorder._flush()
    spans = [
        (b.names[i], int(start), int(dur))
        for b in publisher.batches
        if b.kind is EventKind.HOST
        for i, start, dur in zip(b["name_id"], b["start_ns"], b["dur_ns"], strict=True)
    ]
    names = {name for name, _, _ in spans}
    assert "user_region" in names and any(n.startswith("aten::") for n in names)
    assert recorder.stats.hook_errors == 0 and not recorder._host_events_held
    # one span covers the window, and the profiler's own events keep their real (epoch) timestamps inside it
    (window,) = [(start, start + dur) for name, start, dur in spans if is_profiling_window(name)]
    profiled = [(start, start + dur) for name, start, dur in spans if name == "user_region"]
    assert profiled and all(window[0] <= a <= b <= window[1] for a, b in profiled)
    steps = [(start, start + dur) for name, start, dur in spans if parse_step_marker(name) is not None]
    inside = [s for s in steps if window[0] <= s[0] and s[1] <= window[1]]
    assert 2 <= len(inside) < len(steps)


def test_garbage_collections_are_host_spans(hooked) -> None:
    import gc

    fs, recorder, publisher = hooked
    garbage = [[i] for i in range(200_000)]
    for _ in range(3):
        began = time.time_ns()
        gc.collect()
        ended = time.time_ns()
        fs.step()
    del garbage
    recorder._flush()
    rows = [
        (int(start), int(dur), int(depth))
        for b in publisher.batches
        if b.kind is EventKind.HOST
        for i, start, dur, depth in zip(b["name_id"], b["start_ns"], b["dur_ns"], b["depth"], strict=True)
        if b.names[i] == GC_PAUSE
    ]
    pauses = [(start, dur) for start, dur, depth in rows if depth == 0]
    assert len(pauses) >= 3 and all(dur >= 100_000 for _, dur in pauses)
    assert began <= pauses[-1][0] and pauses[-1][0] + pauses[-1][1] <= ended
    # a collection's wait (its wall time less its CPU time), where it had any, starts with it and is shorter
    lengths = dict(pauses)
    assert all(0 < dur < lengths[start] for start, dur, depth in rows if depth == SPAN_CPU_WAIT_DEPTH)


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_host_span_carries_the_run_queue_wait_its_thread_had_in_it_and_a_nested_span_its_own(hooked) -> None:
    """The training thread and a CPU hog share one CPU: each span's wait row (same name and start) holds the
    time it waited for that CPU, the nested span's not counted again in the outer one's."""
    fs, recorder, publisher = hooked
    cpu = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        os.sched_setaffinity(0, {cpu})  # this thread: the training thread
        with fs.span("outer"):
            _busy(0.05)
            with fs.span("inner"):
                _busy(0.05)
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()
    recorder._flush()
    rows = {
        (b.names[i], int(depth)): (int(start), int(dur))
        for b in publisher.batches
        if b.kind is EventKind.HOST
        for i, start, dur, depth in zip(b["name_id"], b["start_ns"], b["dur_ns"], b["depth"], strict=True)
    }
    outer, inner = rows[("outer", 0)], rows[("inner", 0)]
    outer_wait, inner_wait = rows[("outer", SPAN_CPU_WAIT_DEPTH)], rows[("inner", SPAN_CPU_WAIT_DEPTH)]
    assert outer_wait[0] == outer[0] and inner_wait[0] == inner[0]
    # ~half of each span's time is the hog's; 50 ms of CPU each
    assert 10_000_000 < inner_wait[1] < inner[1] - 40_000_000, (inner, inner_wait)
    assert 10_000_000 < outer_wait[1] < outer[1] - inner[1] - 40_000_000, (outer, outer_wait, inner)


def test_the_bootstrap_loads_the_hook_only_when_the_process_imports_torch(tmp_path: Path) -> None:
    from fleetscope.producers.torch_bootstrap import bootstrap_env, write_bootstrap

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "sitecustomize.py").write_text("import builtins; builtins.CHAINED = True\n")
    env = bootstrap_env(write_bootstrap(tmp_path / "boot"), {"PYTHONPATH": str(tmp_path / "other")})
    run = _python(
        "import builtins, sys\n"
        "before = 'fleetscope.producers.torch_hook' in sys.modules\n"
        "import torch\n"
        "import fleetscope.producers.torch_hook as fs\n"
        "print(before, 'fleetscope.producers.torch_hook' in sys.modules, fs._auto, builtins.CHAINED)",
        **env,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "True", "True", "True"]


def _port() -> int:
    from fleetscope.broker import free_port

    return free_port()


def test_on_gloo_ddp_gradient_sync_is_timed_without_a_comm_hook(hooked, monkeypatch) -> None:
    """A Python comm hook costs a CPU (Gloo) step an extra pass over the gradients: the sync is timed from
    the end of the backward pass instead, one event per step, and not when DDP skips the sync."""
    import torch.distributed as dist

    monkeypatch.delenv("FLEETSCOPE_TORCH_DDP_HOOK", raising=False)
    fs, recorder, publisher = hooked
    seen: list[object] = []
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(4):
            out = model(torch.ones(2, 8))
            if i == 2:
                with model.no_sync():
                    model(torch.ones(2, 8)).sum().backward()  # no all-reduce: nothing recorded
            out.sum().backward()
            seen.append(recorder.state.inside)
            opt.step()
            fs.step()
        assert not model._comm_hooks
        with torch.no_grad():
            model(torch.ones(2, 8))  # no backward
    finally:
        dist.destroy_process_group()
    recorder._flush()
    coll = [b for b in publisher.batches if b.kind is EventKind.COLLECTIVES]
    assert [int(s) for b in coll for s in b["seq"]] == [0, 1, 2, 3]
    assert {b.names[i] for b in coll for i in b["name_id"]} == {"gloo:allreduce"}
    assert {int(n) for b in coll for n in b["nbytes"]} == {36} and seen == [None] * 4
    last = recorder.state.last
    assert last is not None and (last.op, last.pg, last.group_ranks, last.seq) == ("allreduce", "0", (0,), 3)
    assert recorder.stats.hook_errors == 0


MONITORED_RANK = """
import json, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import test_torch_hook as t
import fleetscope.producers.torch_hook as fs
from fleetscope.schemas import EventKind

publisher = t.FakePublisher()
recorder = t.Recorder(t.ME, publisher, t.RecorderConfig(flush_interval_ms=10_000))
monitor = fs.Monitor(recorder)
"""
"""How each rank of ``_two_ranks`` begins: a recorder into a fake publisher, and its monitor, not started."""


def _two_ranks(script: str, *args: str) -> list[Any]:
    """Run ``MONITORED_RANK`` and ``script`` as both ranks of a gloo job (``sys.argv[2:]``: ``args``); each
    rank's last line of output, read as JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETSCOPE")}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    here = str(Path(__file__).parent)
    ranks = [
        subprocess.Popen([sys.executable, "-c", MONITORED_RANK + script, here, *args], env=env | {"RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]  # fmt: skip
    outputs = [p.communicate(timeout=120) for p in ranks]
    assert all(p.returncode == 0 for p in ranks), outputs
    return [json.loads(out.splitlines()[-1]) for out, _ in outputs]


SHARDED_RANK = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

monitor.start()
fs._monitor = monitor
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
if sys.argv[2] == "fsdp":
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 1))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
else:  # DTensor tensor parallelism: the second layer's partial sums all-reduced, in the forward
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    fs.step()
time.sleep(0.1)  # async completions run on the backend's thread
dist.destroy_process_group()
recorder._flush()
coll = [b for b in publisher.batches if b.kind is EventKind.COLLECTIVES]
calls = [(int(s), b.names[o], int(n)) for b in coll for s, o, n in zip(b["seq"], b["op_id"], b["nbytes"])]
print(json.dumps(sorted(calls)))
"""


@pytest.mark.parametrize(
    ("parallel", "per_step"),
    [("fsdp", {"allgather": 4, "reduce_scatter": 2}), ("tp", {"allreduce": 1})],
)
def test_fsdp2_and_dtensor_collectives_are_timed_alike_on_every_rank(parallel: str, per_step: dict[str, int]) -> None:
    """torch 2.12's FSDP2 calls ``all_gather_single`` and ``reduce_scatter_single``, and DTensor (PyTorch's
    tensor parallelism) the functional collectives, which complete at their result's first use: before they
    were timed, a real 4-rank job of either had no collective at all, and a rank sleeping 30 ms after each
    step got only a ``job_regression`` naming no rank. FSDP2, per step and layer: an all-gather in the
    forward and again in the backward, a reduce-scatter of the gradients; the tensor-parallel pair: an
    all-reduce of the second layer's output. Each rank numbers them alike, as the windower aligns them."""
    recorded = _two_ranks(SHARDED_RANK, parallel)
    assert recorded[0] == recorded[1]
    ops = [op for _, op, _ in recorded[0]]
    assert {op: ops.count(op) for op in ops} == {op: 2 * n for op, n in per_step.items()}, recorded[0]
    assert [seq for seq, _, _ in recorded[0]] == list(range(len(ops)))
    sizes = {n for _, _, n in recorded[0]}
    assert (144 if parallel == "fsdp" else 64) in sizes, sizes  # the first layer's 36 fp32 gathered; 2 x 8 fp32


class _WithoutActivityType:
    """A profiler event as torch 2.11 exposes it: no ``activity_type``, no ``is_python_function``."""

    def __init__(self, event: object) -> None:
        self._event = event

    def __getattr__(self, name: str) -> object:
        if name in ("activity_type", "is_python_function"):
            raise AttributeError(name)
        return getattr(self._event, name)


def test_profiler_events_are_classified_alike_without_activity_type() -> None:
    """torch 2.11 (seen on a real CUDA machine) has no ``_KinetoEvent.activity_type``: the window's events
    must still become the same batches, read from the device, flags and launch-call names instead."""
    from fleetscope.producers.torch_profiling import activity_of, window_batches

    model = torch.nn.Linear(16, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with torch.profiler.record_function("user_region"):
                model(torch.randn(4, 16)).sum().backward()
    events = list(prof.profiler.kineto_results.events())
    old = [_WithoutActivityType(e) for e in events]
    assert not hasattr(old[0], "activity_type")
    kinds = {str(e.activity_type()) for e in events}
    assert {"cpu_op", "user_annotation"} <= kinds
    assert [activity_of(o) for o in old] == [str(e.activity_type()) for e in events]
    seq = iter(range(10**6))

    def header() -> BatchHeader:
        return BatchHeader(job="j", rank=0, world_size=1, producer_id="p", seq=next(seq))

    new_batches, old_batches = window_batches(events, header), window_batches(old, header)
    assert [(b.kind, b.names) for b in old_batches] == [(b.kind, b.names) for b in new_batches]
    pairs = zip(old_batches, new_batches, strict=True)
    assert all((a.columns["start_ns"] == b.columns["start_ns"]).all() for a, b in pairs)


def test_a_rank_blocked_inside_a_window_stops_saying_profiling_once_the_window_should_have_ended() -> None:
    """A window closes at a step boundary: a rank blocked for good inside one still holds its events, but
    its heartbeats say ``profiling`` only until the grace after the window's planned end, so its hang is
    reported."""
    recorder = Recorder(ME, FakePublisher(), RecorderConfig(flush_interval_ms=10_000))
    now = time.time_ns()
    recorder.hold_host_events(now + 1_000_000_000)
    assert recorder.profiling
    recorder.hold_host_events(now - HOLD_GRACE_NS - 1)  # planned to end longer ago than the grace
    assert not recorder.profiling
    recorder.release_host_events()
    assert not recorder.profiling


P2P_RANK = """
from fleetscope.producers import torch_patches

monitor.start()
fs._monitor = monitor
dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.zeros(1024)
last = []
if rank == 0:  # the sender is late twice: the receiver waits in its recv
    time.sleep(0.3)
    dist.send(x, dst=1)
    time.sleep(0.3)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.irecv, x, 1)]):
        work.wait()
else:
    dist.recv(x, src=0)
    last.append(recorder.state.last)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, 0), dist.P2POp(dist.isend, x, 0)]):
        work.wait()
dist.all_reduce(x)  # numbered in its group as if no send or receive came before
last.append(recorder.state.last)
dist.destroy_process_group()
recorder._flush()
coll = [b for b in publisher.batches if b.kind is EventKind.COLLECTIVES]
calls = [(b.names[o], b.names[g], int(s), int(d)) for b in coll
         for o, g, s, d in zip(b["op_id"], b["pg_id"], b["seq"], b["dur_ns"])]
print(json.dumps({"calls": calls, "peers": sorted(torch_patches.PEERS.edges),
                  "entries": [[e.op, e.pg, list(e.group_ranks), e.seq] for e in last]}))
"""


def test_sends_and_receives_are_timed_on_their_pair_and_leave_the_groups_numbering_alone() -> None:
    """A pipeline's stages meet in their sends and receives: a stage held up by the one before it waits in
    its receive, and only that time tells it from the stage that is late of its own (``streams.analysis``'s
    pair and stage rules). Blocking ``send``/``recv`` are timed by their wrappers, batched ``isend``/``irecv``
    from the batch's call to each work's ``wait`` (Gloo's works have no future). The flight recorder numbers
    them per pair, so the group's own collectives keep one numbering on every rank."""
    sender, receiver = _two_ranks(P2P_RANK)
    for got in (sender, receiver):
        assert [(op, pg, seq) for op, pg, seq, _ in got["calls"] if op == "allreduce"] == [("allreduce", "0", 0)]
        assert got["peers"] == [[0, 1], [1, 0]]
        assert got["entries"][-1] == ["allreduce", "0", [0, 1], 0]
    received = [(pg, seq, dur) for op, pg, seq, dur in receiver["calls"] if op == "recv"]
    assert [(pg, seq) for pg, seq, _ in received] == [("0", 0), ("0", 1)], receiver["calls"]
    assert all(dur >= 250_000_000 for _, _, dur in received), received  # it waited for the late sender
    assert receiver["entries"][0] == ["recv", "0:p2p:0-1", [0, 1], 0]
    sent = sorted((op, seq) for op, _, seq, _ in sender["calls"] if op != "allreduce")
    assert sent == [("recv", 2), ("send", 0), ("send", 1)], sender["calls"]  # the pair's count, both ways


PIPELINED_RANK = """
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

dist.init_process_group("gloo")
rank = dist.get_rank()
monitor.start()  # after the job imported torch.distributed.pipelining
fs._monitor = monitor
torch.manual_seed(0)
stage = PipelineStage(torch.nn.Linear(8, 8), rank, 2, torch.device("cpu"))
schedule = Schedule1F1B(stage, n_microbatches=2, loss_fn=lambda out, target: (out - target).pow(2).mean())
for step in range(2):
    if rank == 0:
        time.sleep(0.3)  # the first stage is late: the next one waits for its first activations
        schedule.step(torch.ones(4, 8))
    else:
        schedule.step(target=torch.zeros(4, 8))
    fs.step()
dist.destroy_process_group()
recorder._flush()
coll = [b for b in publisher.batches if b.kind is EventKind.COLLECTIVES]
print(json.dumps([(b.names[o], int(d)) for b in coll for o, d in zip(b["op_id"], b["dur_ns"])]))
"""


def test_torch_pipelinings_own_batches_of_receives_are_timed() -> None:
    """torch.distributed.pipelining issues a batch of receives alone (or of sends alone) with ``irecv`` itself,
    not through ``batch_isend_irecv``: the next stage's wait for its first activations went untimed, and a
    real 1F1B job's next stage, late in its data pair only because it waited there, was named a straggler
    in place of the stage before it (whose own waits were timed). Its ``_batch_p2p`` is wrapped too."""
    first, second = _two_ranks(PIPELINED_RANK)
    assert {op for op, _ in first} == {op for op, _ in second} == {"send", "recv"}, (first, second)
    waited = [dur for op, dur in second if op == "recv" and dur >= 250_000_000]
    assert len(waited) == 2, second  # one a step: its first activations
