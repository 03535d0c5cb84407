"""A CPU job's torch.profiler trace. Its collectives are gloo's: PyTorch annotates each as ``gloo:<op>`` on a
worker thread of its process group (a send or receive on the calling thread), which ``parse_trace`` reads
as the job's collectives, each in its own group. With ``with_stack``, its Python functions are named as
every rank names them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fleetscope.producers import parse_trace
from fleetscope.schemas import EventKind


def gloo(name: str, ts: float, dur: float, tid: int, dims: list[int]) -> dict[str, Any]:
    """A worker thread's annotation as PyTorch 2 writes it: no group, only the tensor's shape and type."""
    args = {"External id": 1, "Input type": ["float"], "Input Dims": [dims]}
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args}


def trace(tmp_path: Path, events: list[dict[str, Any]], groups: list[tuple[str, list[int]]], nccl: bool = False) -> Any:
    """The collectives parsed from rank 0's trace of ``events``; ``groups``: (name, members), a name
    ``"3:PIPELINE"`` for group 3 described as the pipeline's."""
    pg_config = [{"pg_name": name.split(":")[0], "pg_desc": name.partition(":")[2] or "undefined",
                  "pg_size": len(ranks), "ranks": ranks} for name, ranks in groups]  # fmt: skip
    step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 7, "tid": 7, "ts": 0, "dur": 900}
    kernel = {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "pid": 0, "tid": 3,
              "ts": 5, "dur": 4, "args": {"Process Group Name": "0"}}  # fmt: skip
    doc = {"distributedInfo": {"backend": "gloo", "rank": 0, "world_size": 4, "pg_config": pg_config},
           "traceEvents": [step, *events, *([kernel] if nccl else [])]}  # fmt: skip
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps(doc))
    (b,) = [b for b in parse_trace(path).batches if b.kind is EventKind.COLLECTIVES] or [None]
    if b is None:
        return []
    return [
        (b.names[b["op_id"][i]], b.names[b["pg_id"][i]], int(b["seq"][i]), int(b["nbytes"][i]), int(b["group_size"][i]))
        for i in range(len(b))
    ]


def test_one_groups_calls_on_its_two_worker_threads_are_one_sequence(tmp_path: Path) -> None:
    """DDP's two gradient buckets all-reduced on either worker thread: one sequence in start order, sizes
    from the shapes, the group's size from ``pg_config``; each starts where its thread takes it."""
    events = [gloo("gloo:all_reduce", 10, 50, 21, [1000]), gloo("gloo:all_reduce", 30, 40, 22, [500]),
              gloo("gloo:broadcast", 200, 5, 21, [8])]  # fmt: skip
    assert trace(tmp_path, events, [("0", [0, 1, 2, 3])]) == [
        ("allreduce", "0", 0, 4000, 4),
        ("allreduce", "0", 1, 2000, 4),
        ("broadcast", "0", 2, 32, 4),
    ]


def test_threads_of_one_group_carry_its_messages_and_groups_come_in_their_creation_order(tmp_path: Path) -> None:
    """A real tp 2 x dp 2 gloo job's rank 0: its tensor-parallel group's threads (ids 992 and 994, not
    adjacent) carry the 2,560-byte activations, its data-parallel group's (1005, 1006) the gradient buckets,
    and the default group, created first, has no call. Threads that share a size are one group; the groups,
    by their first thread, are the configured ones after the default."""
    events = [gloo("gloo:all_reduce", 10, 5, 992, [64, 10]), gloo("gloo:all_reduce", 100, 5, 1005, [131584]),
              gloo("gloo:all_reduce", 110, 5, 1006, [267786]), gloo("gloo:all_reduce", 300, 5, 994, [64, 10]),
              gloo("gloo:all_reduce", 400, 5, 1006, [131584])]  # fmt: skip
    groups = [("0", [0, 1, 2, 3]), ("1", [0, 1]), ("3", [0, 2])]
    assert [(pg, seq) for _, pg, seq, _, _ in trace(tmp_path, events, groups)] == [
        ("1", 0),
        ("3", 0),
        ("3", 1),
        ("1", 1),
        ("3", 2),
    ]
    world = [gloo("gloo:all_reduce", 500, 5, 980, [1]), gloo("gloo:all_reduce", 600, 5, 981, [1])]  # logging
    assert [pg for _, pg, _, _, _ in trace(tmp_path, events + world, groups)] == ["1", "3", "3", "1", "3", "0", "0"]


def test_calls_whose_group_cannot_be_told_are_left_out(tmp_path: Path) -> None:
    """Two groups sending one size merge into one cluster of threads: unequal in number to the others, or
    interleaved with them. More clusters than groups. No group can then be told, and a call matched with
    the wrong peers would make a false finding."""
    groups = [("0", [0, 1, 2, 3]), ("1", [0, 1]), ("3", [0, 2])]
    merged = [gloo("gloo:all_reduce", 10, 5, 992, [64]), gloo("gloo:all_reduce", 20, 5, 1005, [64]),
              gloo("gloo:all_reduce", 30, 5, 1006, [9])]  # fmt: skip
    assert trace(tmp_path, merged, groups) == []
    interleaved = [*merged, gloo("gloo:all_reduce", 40, 5, 994, [9])]  # {992, 1005} and {994, 1006}
    assert trace(tmp_path, interleaved, groups) == []
    three = [gloo("gloo:all_reduce", 10 * i, 5, tid, [i]) for i, tid in enumerate((992, 1100, 1200), 1)]
    assert trace(tmp_path, three, groups[:2]) == []


def test_a_pipelines_sends_are_its_groups_and_leave_the_worker_threads_to_the_others(tmp_path: Path) -> None:
    """A real pp 2 x dp 2 gloo job (Megatron's descriptions): sends and receives run on the calling thread,
    the data-parallel all-reduces on two worker threads, the tensor groups hold one rank. The sends are the
    pipeline group's, the all-reduces the one group left that can hold a collective. Without a
    description the pipeline group is not known: its sends are left out, and the data pair (two groups of
    two could hold the all-reduces) too."""
    grads = [[1024], [1024, 1024], [1024, 1024], [1024]]  # a layer's bias and weight, on either thread
    events = [gloo("gloo:send", 5, 5, 7, [32, 1024]), gloo("gloo:recv", 50, 5, 7, [32, 1024])]
    events[1:1] = [gloo("gloo:all_reduce", 10 + 10 * i, 5, 3087 + i % 2, dims) for i, dims in enumerate(grads)]
    megatron = [("0", [0, 1, 2, 3]), ("1:DATA_PARALLEL_GROUP", [0, 1]), ("3:PIPELINE_MODEL_PARALLEL_GROUP", [0, 2]),
                ("5:TENSOR_MODEL_PARALLEL_GROUP", [0])]  # fmt: skip
    assert [(op, pg, seq) for op, pg, seq, _, _ in trace(tmp_path, events, megatron)] == [
        ("send", "3", 0),
        ("allreduce", "1", 0),
        ("allreduce", "1", 1),
        ("allreduce", "1", 2),
        ("allreduce", "1", 3),
        ("recv", "3", 1),
    ]
    plain = [("0", [0, 1, 2, 3]), ("1", [0, 1]), ("3", [0, 2]), ("5", [0])]
    assert trace(tmp_path, events, plain) == []


def test_a_gpu_jobs_gloo_calls_leave_its_nccl_collectives_alone(tmp_path: Path) -> None:
    """Where NCCL kernels are the collectives, a gloo call beside them (a CPU tensor's barrier) is not one."""
    events = [gloo("gloo:all_reduce", 10, 5, 21, [1])]
    assert [op for op, *_ in trace(tmp_path, events, [("0", [0, 1, 2, 3])], nccl=True)] == ["allreduce"]
    assert len(trace(tmp_path, events, [("0", [0, 1, 2, 3])], nccl=True)) == 1


def test_python_functions_named_with_their_objects_addresses_are_one_function_on_every_rank(tmp_path: Path) -> None:
    """``with_stack``: a built-in method's name carries its object's address, which differs by process.
    Two ranks' traces of the same call give the same function; a name without an address is kept as is."""
    names = []
    for rank, address in ((0, "0x7f9d3c370800"), (1, "0x7fe7f4da7000")):
        call = f"<built-in method run_backward of torch._C._EngineBase object at {address}>"
        events = [{"ph": "X", "cat": "python_function", "name": n, "pid": 7, "tid": 7, "ts": 10, "dur": 5}
                  for n in (call, "train.py(42): forward", "<built-in function sleep>")]  # fmt: skip
        doc = {"distributedInfo": {"rank": rank, "world_size": 2}, "traceEvents": events}
        path = tmp_path / f"rank{rank}.json"
        path.write_text(json.dumps(doc))
        (b,) = [b for b in parse_trace(path).batches if b.kind is EventKind.HOST]
        names.append(sorted(b.names[i] for i in b["name_id"].tolist() if not b.names[i].startswith("fleetscope")))
    assert names[0] == names[1] == [
        "<built-in function sleep>", "<built-in method run_backward of torch._C._EngineBase object>",
        "train.py(42): forward",
    ]  # fmt: skip
