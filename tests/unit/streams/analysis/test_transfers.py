"""A collective group whose transfer is slower than equivalent groups' is link_slow, from kernel times alone
(``links.score_transfers``): per byte and outright, named on the rank every slow group shares."""

from __future__ import annotations

from math import nan
from typing import Any

import numpy as np
import pytest

from fleetscope.schemas import FunctionKind
from fleetscope.streams.analysis.links import FEW_GROUPS, SteadyTransfers, score_hosts
from fleetscope.streams.analysis.outliers import score_iteration
from fleetscope.streams.analysis.peermatrix import PeerMatrix
from fleetscope.streams.analysis.signals import ScoringConfig

C, K = int(FunctionKind.COLLECTIVE), int(FunctionKind.COMPUTE)
LINKS = {f"{link}_{x}": nan for link in ("nvlink", "pcie") for x in ("mean_bps", "peak_bps", "cv")}


def records(
    tp_ns: dict[int, float],
    tp_bytes: dict[int, int] | None = None,
    dp_ns: dict[int, float] | None = None,
    tp: int = 2,
    hosts: dict[int, str] | None = None,
    kernels: bool = True,
) -> list[dict[str, Any]]:
    """dp 4 x ``tp``: the tensor-parallel group of replica g all-reduces in ``tp_ns[g]`` (its transfer: the
    members arrive together) 8 times; the data-parallel ring of tensor slot s once, in ``dp_ns[s]``; every
    rank on node0 but those ``hosts`` moves. ``kernels``: the ranks run a GPU kernel, else none (gloo)."""
    out = []
    for rank in range(tp * 4):
        g, slot = rank // tp, rank % tp
        functions = {
            **({"gemm": (K, 12e6, 1, 0)} if kernels else {}),
            f"nccl:allreduce[pg={1 + g},<=64MiB]": (C, tp_ns.get(g, 1e6), 8, (tp_bytes or {}).get(g, 48 << 20)),
            f"nccl:allreduce[pg={5 + slot},<=32MiB]": (C, (dp_ns or {}).get(slot, 2e6), 1, 24 << 20),
        }
        out.append(_record(rank, (hosts or {}).get(rank, "node0"), (slot, 0, g), functions))
    return out


def _record(
    rank: int, host: str, coordinates: tuple[int, int, int], functions: dict[str, tuple[int, float, int, int]]
) -> dict[str, Any]:
    """One rank's patterns: its (tp, pp, dp) coordinates, and per function (kind, mean ns, calls, bytes)."""
    tp, pp, dp = coordinates
    return {
        "job": "j", "rank": rank, "host": host, "iteration": 0, "iteration_ns": 25_000_000,
        "tp_rank": tp, "pp_rank": pp, "dp_rank": dp, "function": list(functions),
        "kind": [v[0] for v in functions.values()], "calls": [v[2] for v in functions.values()],
        "mean_ns": [v[1] for v in functions.values()], "max_ns": [v[1] for v in functions.values()],
        "total_ns": [v[1] * v[2] for v in functions.values()],
        "self_ns": [v[1] * v[2] for v in functions.values()], "nbytes": [v[3] for v in functions.values()],
        **{name: [value] * len(functions) for name, value in LINKS.items()},
    }  # fmt: skip


def links(recs: list[dict[str, Any]]) -> list[tuple[int, tuple[int, ...]]]:
    return [(s.rank, s.member_ranks()) for s in score_iteration(recs, ScoringConfig()) if s.category == "link_slow"]


def test_equivalent_groups_that_transfer_alike_give_nothing() -> None:
    assert links(records({0: 1.02e6, 1: 0.98e6, 2: 1.01e6})) == []


def test_a_tensor_parallel_ring_three_times_slower_is_its_group() -> None:
    found = score_iteration(records({2: 3e6}), ScoringConfig())
    assert [(s.category, s.rank, s.member_ranks(), s.subject) for s in found] == [
        ("link_slow", -1, (4, 5), "group:3")
    ]  # and its replica's ranks, late at their data-parallel rings, are no stragglers


@pytest.mark.parametrize("smaller", [0.3, 0.5])
def test_a_group_with_smaller_messages_pays_more_per_byte_but_no_more_time(smaller: float) -> None:
    """Latency-bound: a third or half the bytes in 80 % of the time is more time per byte, no slow link."""
    assert links(records({1: 0.8e6}, {1: int(smaller * (48 << 20))})) == []


def test_every_slow_ring_sharing_one_rank_is_that_ranks_link() -> None:
    """dp 4 x tp 4: rank 9's link slows its tensor-parallel group (replica 2) and its data-parallel ring
    (slot 1); no other rank is in both."""
    assert links(records({2: 3e6}, dp_ns={1: 6e6}, tp=4)) == [(9, (9,))]


def test_a_group_across_hosts_slower_than_its_equivalents_on_one_host_is_no_slow_link() -> None:
    """Replica 2's tensor-parallel pair is split over two hosts and all-reduces in 2.5 ms, not 1 ms: its
    placement. It has no equivalent on two hosts: no link_slow (what it costs is the replay's to say)."""
    assert links(records({2: 2.5e6}, hosts={5: "node1"})) == []


def test_two_equivalent_rings_the_slower_by_half_per_byte_and_outright_is_its_group() -> None:
    """dp 4 x tp 2: two data-parallel rings (one per tensor slot), too few for a median and spread. A link
    cannot be faster than healthy, so the faster ring is the yardstick: 3x slower is slot 1's ring; 1.3x
    slower is within what arrival jitter leaves in a transfer; 3x the bytes in 3x the time is no slower."""
    found = [s for s in score_iteration(records({}, dp_ns={1: 6e6}), ScoringConfig()) if s.category == "link_slow"]
    assert [(s.rank, s.member_ranks(), s.subject, s.evidence[FEW_GROUPS]) for s in found] == [
        (-1, (1, 3, 5, 7), "group:6", True)
    ]
    assert links(records({}, dp_ns={1: 2.6e6})) == []
    assert links(records({}, dp_ns={0: 1.9e6, 1: 2.1e6})) == []


def test_a_ring_slower_than_its_few_equivalents_is_kept_only_while_it_stays_slower() -> None:
    """``SteadyTransfers``: the same ring slower in 4 of the latest 5 iterations is kept; the two rings
    slower in turn (contention moving between them) never are; a judgement among many groups passes.

    Seen on a real 4-rank gloo job sharing 2 cores: each of its four pairs slower than its equivalent by
    half, in turn, 3 iterations at a time."""
    slow_one = score_iteration(records({}, dp_ns={1: 6e6}), ScoringConfig())
    slow_other = score_iteration(records({}, dp_ns={0: 6e6}), ScoringConfig())
    steady, in_turn = SteadyTransfers(), SteadyTransfers()
    kept = [steady.keep(slow_one if it != 2 else [], it) for it in range(6)]
    assert [bool(k) for k in kept] == [False, False, False, False, True, True]
    assert not any(in_turn.keep(slow_one if it % 2 else slow_other, it) for it in range(12))
    many = score_iteration(records({2: 3e6}), ScoringConfig())  # four tensor-parallel groups
    assert SteadyTransfers().keep(many, 0) == many != []


def pipeline_records(stage1_ns: float, kernels: bool) -> list[dict[str, Any]]:
    """pp 2 x dp 2 (Megatron's order: data pairs {0, 1} and {2, 3}, one per stage): each stage's data pair
    all-reduces its gradients once, stage 1's in ``stage1_ns``, stage 0's in 2 ms; ``kernels``: the ranks
    run GPU kernels (NCCL), else none (gloo on CPUs)."""
    out = []
    for rank in range(4):
        stage = rank // 2
        functions = {"gemm": (K, 12e6, 1, 0)} if kernels else {}
        functions[f"nccl:allreduce[pg={1 + stage},<=32MiB]"] = (C, stage1_ns if stage else 2e6, 1, 24 << 20)
        out.append(_record(rank, "node0", (0, stage, rank % 2), functions))
    return out


def test_data_parallel_rings_of_two_stages_are_equivalent_on_gpus_not_where_ranks_run_no_kernels() -> None:
    """pp 2 x dp 2, stage 1's data-parallel all-reduce 3 times slower than stage 0's: on GPUs the transfer
    runs on the links, whatever each stage computes, so it is stage 1's group; with no kernels (gloo on
    CPUs, as a real healthy pp 2 x dp 2 job sharing 2 cores, whose second stage's all-reduce was slower per
    byte in every step) the all-reduce is CPU work beside each stage's own, and the stages' rings are not
    compared."""
    assert links(pipeline_records(6e6, kernels=True)) == [(-1, (2, 3))]
    assert links(pipeline_records(6e6, kernels=False)) == []
    assert links(pipeline_records(2e6, kernels=True)) == []


def test_a_cpu_jobs_ring_on_one_host_has_no_link_to_be_slow_across_hosts_it_has() -> None:
    """dp 4 x tp 2, slot 1's data-parallel ring 3 times slower than slot 0's. With no kernels (gloo) and
    every rank on one host, each all-reduce is a copy through the host's memory by its CPUs, paced by them
    and their contention (a real healthy tp 2 x dp 2 gloo job: one pair's all-reduce 4 times the other's
    for 8 steps): no link_slow. Spread over hosts, the rings cross the network, and the slow one is named
    again; on GPUs it is named on one host too."""
    assert links(records({}, dp_ns={1: 6e6}, kernels=False)) == []
    assert links(records({2: 3e6}, kernels=False)) == []
    per_replica = {rank: f"node{rank // 2}" for rank in range(8)}
    assert links(records({}, dp_ns={1: 6e6}, hosts=per_replica, kernels=False)) == [(-1, (1, 3, 5, 7))]
    assert links(records({}, dp_ns={1: 6e6}, hosts=per_replica)) == [(-1, (1, 3, 5, 7))]
    assert links(records({}, dp_ns={1: 6e6})) == [(-1, (1, 3, 5, 7))]


def _host_matrix(congested: bool) -> PeerMatrix:
    """A flat ring of 8 hosts x 4 ranks, two of its all-reduces (6 ms x 5 calls, 4 ms x 1). Healthy: every link
    sends at 95 % of its 25 GB/s reach. Host 3 congested 1.5x: its NIC stalls and bursts at full speed (its
    fluctuation high in the larger all-reduce only), the others, paced by it, send at 1/1.5 of their reach."""
    ranks = np.arange(32)
    host = ranks // 4
    wiggle = 1 + 0.01 * np.sin(ranks)[:, None]  # peers are never exactly alike
    cv = np.full((32, 2), 0.6) * wiggle
    mean = np.full((32, 2), 0.95 * 25e9) * wiggle
    if congested:
        mean[host != 3] = 25e9 / 1.5 * wiggle[host != 3]
        mean[host == 3], cv[host == 3, 0] = 24.5e9, 1.2
    features = {
        "mean_ns": np.tile([6e6, 4e6], (32, 1)), "calls": np.tile([5.0, 1.0], (32, 1)),
        "pcie_cv": cv, "pcie_mean_bps": mean, "pcie_peak_bps": np.full((32, 2), 25e9),
    }  # fmt: skip
    return PeerMatrix(
        ranks=ranks, hosts=[f"node{h}" for h in host], functions=["nccl:allreduce[pg=dp0,<=64MiB]",
        "nccl:allreduce[pg=dp0,<=32MiB]"], kind=np.full(2, C), iteration_ns=np.full(32, 90e6), features=features,
    )  # fmt: skip


def test_a_congested_host_costs_the_share_of_its_rings_transfer_the_other_hosts_links_idle() -> None:
    """Host 3's NIC paces every ring it is in, flagged or not: at the other hosts' own pace its rings' 34 ms
    of transfer take a third less (their links send at 1/1.5 of their reach). Not the whole transfer of the
    flagged all-reduce (30 ms), nor nothing (every host sends the same bytes alike). A healthy job: no host."""
    (sig,) = score_hosts(_host_matrix(congested=True))
    assert (sig.subject, sig.member_ranks()) == ("host:node3", (12, 13, 14, 15))
    assert sig.loss_ns == pytest.approx(34e6 * (1 - 1 / 1.5), rel=0.03)
    assert score_hosts(_host_matrix(congested=False)) == []
