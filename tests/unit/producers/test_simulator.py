"""The simulator is valid and deterministic, lays out TP x PP x DP jobs, and shows each fault the way
DESIGN.md's physics table does (what changes on the culprit, what changes on its peers)."""

from __future__ import annotations

from collections import defaultdict
from functools import cache
from typing import Any

import numpy as np
import pytest

from fleetscope.producers import Fault, SimulatorConfig, parse_fault, simulate
from fleetscope.producers.simulation import MAX_BATCH_EVENTS, METRICS, ExpectedFinding
from fleetscope.producers.simulation.groups import derived_layout
from fleetscope.schemas import (
    EventBatch,
    EventKind,
    decode_event_batch,
    encode_event_batch,
    parse_step_marker,
)

RANKS = 16
ITERATIONS = 8
PEAK = 25e9
Events = dict[int, dict[EventKind, dict[str, np.ndarray]]]


@cache
def run(*faults: str, **kwargs: Any) -> tuple[EventBatch, ...]:
    kwargs = {"ranks": RANKS, "iterations": ITERATIONS, **kwargs}
    return tuple(simulate(SimulatorConfig(faults=tuple(parse_fault(f) for f in faults), **kwargs)))


@cache
def events(*faults: str, **kwargs: Any) -> Events:
    """rank -> kind -> columns over the whole run, with ``name``/``op``/``pg``/``metric`` resolved."""
    parts: dict[int, dict[EventKind, list[dict[str, np.ndarray]]]] = defaultdict(lambda: defaultdict(list))
    for b in run(*faults, **kwargs):
        cols = dict(b.columns)
        names = np.array(b.names)
        for key in ("name", "op", "pg", "metric"):
            if f"{key}_id" in cols:
                cols[key] = names[cols[f"{key}_id"]]
        parts[b.header.rank][b.kind].append(cols)
    return {
        r: {k: {c: np.concatenate([p[c] for p in ps]) for c in ps[0]} for k, ps in kinds.items()}
        for r, kinds in parts.items()
    }


def ranks_of(ev: Events) -> list[int]:
    return sorted(ev)


def kernel_ms(ev: Events, rank: int, name: str = "ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_nn") -> np.ndarray:
    k = ev[rank][EventKind.KERNELS]
    return k["dur_ns"][k["name"] == name] / 1e6


def python_ms(ev: Events, rank: int, name: str) -> np.ndarray:
    """Durations of every call of a host function on one rank."""
    p = ev[rank][EventKind.HOST]
    return p["dur_ns"][p["name"] == name] / 1e6


def collectives(ev: Events, rank: int, pg_prefix: str, op: str = "allreduce") -> dict[str, np.ndarray]:
    """One rank's collectives of one kind, in sequence order, with an ``end_ns`` column."""
    c = ev[rank][EventKind.COLLECTIVES]
    sel = np.char.startswith(c["pg"].astype(str), pg_prefix) & (c["op"] == op)
    out = {k: v[sel] for k, v in c.items()}
    order = np.argsort(out["seq"], kind="stable")
    out = {k: v[order] for k, v in out.items()}
    out["end_ns"] = out["start_ns"] + out["dur_ns"]
    return out


def dp_matrix(ev: Events, column: str) -> np.ndarray:
    """(rank, bucket all-reduce) matrix of a DP collective column (pure data-parallel jobs)."""
    return np.array([collectives(ev, r, "dp")[column] for r in ranks_of(ev)])


def steps(ev: Events, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step numbers, start_ns, end_ns) of a rank's completed ProfilerStep markers."""
    p = ev[rank][EventKind.HOST]
    mark = np.char.startswith(p["name"].astype(str), "ProfilerStep#")
    numbers = np.array([parse_step_marker(n) for n in p["name"][mark]])
    return numbers, p["start_ns"][mark], p["start_ns"][mark] + p["dur_ns"][mark]


def iteration_ms(ev: Events) -> float:
    """Median step period over ranks and steps (after the first step)."""
    return float(np.median([np.diff(steps(ev, r)[1])[1:] for r in ranks_of(ev)]) / 1e6)


def samples(ev: Events, rank: int, metric: str) -> tuple[np.ndarray, np.ndarray]:
    th = ev[rank][EventKind.SAMPLES]
    sel = th["metric"] == metric
    return th["t_ns"][sel], th["value"][sel]


def during(t: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return ((t[:, None] >= lo) & (t[:, None] < hi)).any(axis=1)


def transfer_samples(ev: Events, metric: str) -> dict[int, np.ndarray]:
    """rank -> samples of a metric inside the transfer phases [last arrival, end) of the DP all-reduces."""
    lo, hi = dp_matrix(ev, "start_ns").max(axis=0), dp_matrix(ev, "end_ns").max(axis=0)
    out = {}
    for r in ranks_of(ev):
        t, v = samples(ev, r, metric)
        out[r] = v[during(t, lo, hi)]
    return out


def gpu_idle_ms(ev: Events, rank: int) -> float:
    """Mean time per step that the rank's GPU runs neither a kernel nor a collective."""
    k, c = ev[rank][EventKind.KERNELS], ev[rank][EventKind.COLLECTIVES]
    s = np.concatenate([k["start_ns"], c["start_ns"]])
    e = np.concatenate([k["start_ns"] + k["dur_ns"], c["start_ns"] + c["dur_ns"]])
    order = np.argsort(s)
    s, e = s[order], np.maximum.accumulate(e[order])
    _, lo, hi = steps(ev, rank)
    idle = []
    for a, b in zip(lo[1:], hi[1:], strict=True):
        gaps = np.clip(s[1:], a, b) - np.clip(e[:-1], a, b)
        idle.append(np.maximum(gaps, 0).sum() + max(0, min(s[s >= a].min(), b) - a))
    return float(np.mean(idle) / 1e6)


def others(ev: Events, culprits: list[int] | tuple[int, ...]) -> list[int]:
    return [r for r in ranks_of(ev) if r not in culprits]


# -- the wire shape ----------------------------------------------------------------------------------


def test_same_seed_gives_identical_bytes_and_another_seed_differs() -> None:
    def encoded(seed: int) -> list[bytes]:
        cfg = SimulatorConfig(
            ranks=8, iterations=3, seed=seed, tp=2, pp=2, microbatches=2, layers=4,
            glitch_rate=0.3, pause_rate=0.5, clock_skew_ms=2.0,
            faults=(parse_fault("net_congestion:0:1.5"), parse_fault("slow_gpu:3:1.2@1")),
        )  # fmt: skip
        return [encode_event_batch(b) for b in simulate(cfg)]

    assert encoded(7) == encoded(7)
    assert encoded(7) != encoded(8)


def test_every_batch_survives_the_codec_round_trip() -> None:
    for batch in run("hang:2@3", tp=2, pp=2, layers=4, microbatches=2):
        back = decode_event_batch(encode_event_batch(batch))
        assert back.kind == batch.kind and back.header == batch.header and back.names == batch.names
        for column, values in batch.columns.items():
            np.testing.assert_array_equal(back[column], values)


def test_each_rank_iteration_yields_four_kinds_in_order_with_a_gapless_producer_sequence() -> None:
    batches = run()
    assert len(batches) == RANKS * ITERATIONS * 4
    assert [b.kind for b in batches[:4]] == [
        EventKind.KERNELS,
        EventKind.COLLECTIVES,
        EventKind.HOST,
        EventKind.SAMPLES,
    ]
    seqs: dict[str, list[int]] = defaultdict(list)
    for b in batches:
        h = b.header
        seqs[h.producer_id].append(h.seq)
        assert h.host == f"node{h.rank // 8:03d}" and h.local_rank == h.rank % 8
        assert h.world_size == h.dp_size == RANKS and h.dp_rank == h.rank and h.gpu_uuid.startswith("GPU-")
        assert (h.tp_size, h.pp_size, h.tp_rank, h.pp_rank) == (1, 1, 0, 0) and len(b) > 0
    assert len(seqs) == RANKS and all(s == list(range(ITERATIONS * 4)) for s in seqs.values())


def test_headers_carry_megatron_coordinates_and_hosts_hold_consecutive_ranks() -> None:
    cfg = SimulatorConfig(ranks=16, iterations=1, tp=2, pp=2, gpus_per_host=4)
    seen = {}
    for b in simulate(cfg):
        h = b.header
        seen[h.rank] = (h.tp_rank, h.pp_rank, h.dp_rank, h.tp_size, h.pp_size, h.dp_size, h.host)
    for rank, (tp, pp, dp, *sizes, host) in seen.items():
        assert rank == pp * (4 * 2) + dp * 2 + tp and (tp, pp, dp) == cfg.coordinates(rank)
        assert sizes == [2, 2, 4] and host == f"node{rank // 4:03d}"


def test_step_markers_cover_every_iteration_and_contain_its_host_functions() -> None:
    ev = events()
    for rank in ranks_of(ev):
        numbers, lo, hi = steps(ev, rank)
        assert numbers.tolist() == list(range(ITERATIONS))
        p = ev[rank][EventKind.HOST]
        inner = p["depth"] == 1
        s, e = p["start_ns"][inner], p["start_ns"][inner] + p["dur_ns"][inner]
        assert during(s, lo, hi + 1).all() and during(e - 1, lo, hi + 1).all()
    ends = [steps(ev, r)[2][-1] for r in ranks_of(ev)]
    assert np.ptp(ends) < 1_000_000  # iteration times equalise across ranks


def test_kernels_run_in_order_on_the_compute_stream_after_their_launch() -> None:
    for layout in ({}, {"tp": 2, "pp": 2}):
        k = events(**layout)[3][EventKind.KERNELS]
        start, end = k["start_ns"], k["start_ns"] + k["dur_ns"]
        assert (k["launch_ns"] <= start).all() and (start[1:] >= end[:-1]).all() and (k["stream"] == 7).all()


def test_collectives_end_together_in_true_time_and_share_sequence_numbers() -> None:
    ev = events()
    end = dp_matrix(ev, "end_ns")
    assert (end == end[0]).all()
    seq = dp_matrix(ev, "seq")
    assert (seq == seq[0]).all() and (np.diff(seq[0]) == 1).all()


# -- layouts -----------------------------------------------------------------------------------------


def test_tensor_parallel_all_reduces_once_per_layer_and_direction_inside_each_tp_group() -> None:
    cfg = {"tp": 2, "pp": 2, "layers": 12, "microbatches": 4}
    ev = events(**cfg)
    per_iteration = 2 * (12 // 2) * 4
    for rank in (0, 1, 9):
        tp = collectives(ev, rank, "tp")
        assert tp["seq"].size == per_iteration * ITERATIONS and (tp["group_size"] == 2).all()
        assert set(tp["pg"]) == {f"tp{rank // 2}"} and (tp["nbytes"] == 8_000_000).all()
        np.testing.assert_array_equal(tp["end_ns"], collectives(ev, rank ^ 1, "tp")["end_ns"])
    dp = collectives(ev, 9, "dp")
    assert set(dp["pg"]) == {"dp3"} and (dp["group_size"] == 4).all()  # pp 1, tp 1 -> dp group 1*2+1
    assert set(collectives(ev, 9, "pp", "recv")["pg"]) == {"pp1"}  # dp 0, tp 1 -> pipeline 0*2+1


def test_pipeline_sends_meet_receives_and_the_next_stage_waits_in_recv_behind_a_slow_stage() -> None:
    layout = {"tp": 2, "pp": 2, "layers": 4, "microbatches": 4}
    ev = events(**layout)
    send, recv = collectives(ev, 0, "pp", "send"), collectives(ev, 8, "pp", "recv")
    forward = send["seq"] % 8 < 4  # the forward passes' p2p of each step
    np.testing.assert_array_equal(send["end_ns"][forward], recv["end_ns"][recv["seq"] % 8 < 4])
    assert (send["nbytes"] == 16_000_000).all() and (send["group_size"] == 2).all()
    slow = events("stage_imbalance:0:1.5", **layout)
    stage1 = range(8, 16)
    wait = np.median([collectives(ev, r, "pp", "recv")["dur_ns"].mean() for r in stage1])
    slow_wait = np.median([collectives(slow, r, "pp", "recv")["dur_ns"].mean() for r in stage1])
    assert slow_wait > 1.3 * wait
    gemm = {r: np.median(kernel_ms(slow, r)) for r in range(16)}
    assert all(gemm[r] / gemm[r + 8] == pytest.approx(1.5, rel=0.05) for r in range(8))  # every replica


def test_stage_imbalance_slows_every_rank_of_the_stage_alike_and_needs_a_pipeline() -> None:
    ev = events("stage_imbalance:1:1.2", tp=2, pp=2, layers=4, microbatches=4)
    stage1 = [float(np.median(kernel_ms(ev, r))) for r in range(8, 16)]
    stage0 = [float(np.median(kernel_ms(ev, r))) for r in range(8)]
    assert np.ptp(stage1) / np.mean(stage1) < 0.03 and np.mean(stage1) / np.mean(stage0) == pytest.approx(1.2, rel=0.03)
    with pytest.raises(ValueError, match="needs a pipeline"):
        SimulatorConfig(faults=(parse_fault("stage_imbalance:0"),))


def test_a_single_host_job_keeps_its_all_reduces_on_nvlink_and_two_hosts_use_the_nic() -> None:
    one = transfer_samples(events(ranks=8), "pcie_tx_bytes_per_s")
    two = transfer_samples(events(), "pcie_tx_bytes_per_s")
    assert max(v.max() for v in one.values()) < 0.01 * PEAK
    assert min(v.max() for v in two.values()) > 0.9 * PEAK


# -- faults, as in DESIGN.md's table ----------------------------------------------------------------


def test_slow_gpu_rank_has_slow_kernels_and_the_shortest_collectives() -> None:
    ev = events("slow_gpu:5:1.5")
    peers = np.median(np.concatenate([kernel_ms(ev, r) for r in others(ev, [5])]))
    assert np.median(kernel_ms(ev, 5)) / peers == pytest.approx(1.5, rel=0.03)
    dur = dp_matrix(ev, "dur_ns")
    assert (dur.argmin(axis=0) == 5).all()  # it never waits
    assert np.median(np.delete(dur, 5, axis=0)) > 1.5 * np.median(dur[5])


def test_slow_gpu_in_a_tensor_parallel_group_waits_least_in_the_per_layer_all_reduce() -> None:
    ev = events("slow_gpu:3:1.3", tp=2, pp=2, layers=4, microbatches=2)
    assert collectives(ev, 2, "tp")["dur_ns"].mean() > 2 * collectives(ev, 3, "tp")["dur_ns"].mean()


def test_slow_link_rank_runs_low_and_steady_while_healthy_links_burst_at_peak() -> None:
    ev = events("slow_link:12:2")
    nv = transfer_samples(ev, "nvlink_tx_bytes_per_s")
    slow, healthy = nv[12], np.concatenate([v for r, v in nv.items() if r != 12])
    assert slow.size > 20
    assert slow.max() <= 0.51 * PEAK and healthy.max() > 0.95 * PEAK
    assert slow.std() / slow.mean() < 0.05 < healthy.std() / healthy.mean()
    dur = dp_matrix(ev, "dur_ns").mean(axis=1)  # durations do not single out the rank
    assert np.median(dur) * 0.97 < dur[12] < np.median(dur) * 1.03
    assert dur.mean() > 1.6 * dp_matrix(events(), "dur_ns").mean()


def test_healthy_ranks_look_statistically_alike() -> None:
    ev = events()
    medians = np.array([np.median(kernel_ms(ev, r, "flash_bwd_dq_dk_dv_loop_kernel")) for r in ranks_of(ev)])
    assert np.ptp(medians) / medians.mean() < 0.03
    means = np.array([v.mean() for v in transfer_samples(ev, "nvlink_tx_bytes_per_s").values()])
    assert np.ptp(means) / means.mean() < 0.05


def test_pcie_downgrade_paces_inter_node_all_reduces_and_reports_a_lower_link_width() -> None:
    ev = events("pcie_downgrade:6:2")
    pcie = transfer_samples(ev, "pcie_tx_bytes_per_s")
    slow, healthy = pcie[6], np.concatenate([v for r, v in pcie.items() if r != 6])
    assert slow.max() <= 0.51 * PEAK and healthy.max() > 0.95 * PEAK
    assert slow.std() / slow.mean() < 0.05 < healthy.std() / healthy.mean()
    assert dp_matrix(ev, "dur_ns").mean() > 1.6 * dp_matrix(events(), "dur_ns").mean()
    for rank in (6, 7):
        width = samples(ev, rank, "pcie_width")[1]
        assert width.size == samples(ev, rank, "pcie_tx_bytes_per_s")[1].size
        assert set(width) == ({8.0} if rank == 6 else {16.0})
        assert set(samples(ev, rank, "pcie_width_max")[1]) == {16.0}
        assert set(samples(ev, rank, "pcie_gen")[1]) == set(samples(ev, rank, "pcie_gen_max")[1]) == {5.0}
    assert set(samples(events("pcie_downgrade:6:4"), 6, "pcie_gen")[1]) == {3.0}


def test_host_slow_is_a_gc_pause_of_a_share_of_the_iteration_that_idles_the_gpu_and_delays_arrival() -> None:
    healthy, ev = events(), events("host_slow:3:1.1")
    gc = python_ms(ev, 3, "gc.collect")
    assert gc.size == ITERATIONS and np.median(gc) == pytest.approx(0.1 * iteration_ms(healthy), rel=0.05)
    assert iteration_ms(ev) / iteration_ms(healthy) == pytest.approx(1.1, abs=0.02)  # about 10 % of a step
    p = ev[3][EventKind.HOST]
    names = [n for n in p["name"] if not n.startswith("Profiler")][: 5 + 1]
    assert names == [
        "dataloader.next",
        "forward",
        "backward",
        "gc.collect",
        "optimizer.step",
        "dataloader.next",
    ]
    assert gpu_idle_ms(ev, 3) > gpu_idle_ms(ev, 4) + 0.8 * np.median(gc)
    late = dp_matrix(ev, "start_ns")[:, 6:]  # from step 1 on (the first pause ends step 0)
    assert (late.argmax(axis=0) == 3).all()
    peers = np.median(np.concatenate([kernel_ms(ev, r) for r in others(ev, [3])]))
    assert np.median(kernel_ms(ev, 3)) / peers == pytest.approx(1.0, abs=0.02)
    healthy_gc = [python_ms(ev, r, "gc.collect") for r in others(ev, [3])]
    calls = sum(g.size for g in healthy_gc)
    assert 0 < calls < 0.3 * 15 * ITERATIONS and np.median(np.concatenate(healthy_gc)) < 1.0


def test_host_slow_can_name_the_host_function_that_gets_the_extra_time() -> None:
    ev = events("host_slow:3:1.2:optimizer.step")
    opt = python_ms(ev, 3, "optimizer.step") - np.median(python_ms(ev, 4, "optimizer.step"))
    assert np.median(opt) == pytest.approx(0.2 * iteration_ms(events()), rel=0.05)


def test_dataloader_stall_lengthens_dataloader_next_and_starves_the_gpu_at_iteration_start() -> None:
    ev = events("dataloader_stall:9:1.2")
    dl = python_ms(ev, 9, "dataloader.next") - np.median(python_ms(ev, 8, "dataloader.next"))
    assert np.median(dl) == pytest.approx(0.2 * iteration_ms(events()), rel=0.05)
    k = ev[9][EventKind.KERNELS]
    first = k["name"] == "Memcpy HtoD (Pageable -> Device)"
    _, lo, _ = steps(ev, 9)
    assert np.median(k["start_ns"][first] - lo) / 1e6 > 0.9 * np.median(dl)
    assert (dp_matrix(ev, "start_ns").argmax(axis=0) == 9).all()


def test_cpu_contention_stretches_every_host_span_and_leaves_kernels_alone() -> None:
    ev, healthy = events("cpu_contention:2:1.5"), events()
    for fn in ("dataloader.next", "forward", "backward", "optimizer.step"):
        ratio = np.median(python_ms(ev, 2, fn)) / np.median(python_ms(healthy, 2, fn))
        assert ratio == pytest.approx(1.5, rel=0.05), fn
    assert np.median(kernel_ms(ev, 2)) / np.median(kernel_ms(ev, 3)) == pytest.approx(1.0, abs=0.02)
    assert gpu_idle_ms(ev, 2) > gpu_idle_ms(ev, 3) + 1.0
    assert (dp_matrix(ev, "start_ns")[:, 1:].argmax(axis=0) == 2).all()


def test_net_congestion_fluctuates_alike_on_every_rank_of_the_host_and_slows_the_whole_ring() -> None:
    ev = events("net_congestion:node001:2")
    pcie = transfer_samples(ev, "pcie_tx_bytes_per_s")
    host1, host0 = range(8, 16), range(8)
    for r in host1:
        np.testing.assert_array_equal(pcie[r], pcie[8])  # one NIC pattern for the whole host
    congested, healthy = pcie[8], np.concatenate([pcie[r] for r in host0])
    assert congested.mean() == pytest.approx(PEAK / 2, rel=0.15)
    assert congested.std() / congested.mean() > 1.2 * healthy.std() / healthy.mean()
    assert (congested < 0.04 * PEAK).mean() > 0.3 and (healthy < 0.04 * PEAK).mean() == 0
    assert dp_matrix(ev, "dur_ns").mean() > 1.5 * dp_matrix(events(), "dur_ns").mean()
    dur = dp_matrix(ev, "dur_ns").mean(axis=1)
    assert np.ptp(dur) / dur.mean() < 0.05  # durations say nothing about who


def test_job_slowdown_slows_everyone_alike_from_its_start() -> None:
    ev = events("job_slowdown:-:1.2@4")
    gemm = np.array(
        [[np.median(kernel_ms(ev, r)[i * 12 : (i + 1) * 12]) for i in range(ITERATIONS)] for r in range(RANKS)]
    )
    assert np.ptp(gemm[:, 5]) / gemm[:, 5].mean() < 0.03  # no peer outlier
    assert gemm[:, 4:].mean() / gemm[:, :4].mean() == pytest.approx(1.2, rel=0.02)
    periods = np.diff(steps(ev, 0)[1]) / 1e6
    assert periods[4:].mean() > 1.1 * periods[:3].mean()


def test_a_hang_stops_the_job_inside_the_iteration_while_samples_continue() -> None:
    cfg = SimulatorConfig(ranks=RANKS, iterations=ITERATIONS, faults=(parse_fault("hang:5@3"),))
    assert cfg.expected_iterations == 3
    ev = events("hang:5@3")
    last_seq = {}
    for r in ranks_of(ev):
        assert steps(ev, r)[0].tolist() == [0, 1, 2]
        dp = collectives(ev, r, "dp")
        last_seq[r] = dp["seq"].max()
        k = ev[r][EventKind.KERNELS]
        assert (k["dur_ns"] > 0).all() and k["start_ns"].size > 3 * 101  # work of step 3 was done
    assert len(set(last_seq.values())) == 1 and last_seq[0] < 4 * 6 - 1  # everyone stuck at one bucket
    python = ev[5][EventKind.HOST]["name"]
    assert "backward" not in python[-3:] and "backward" in ev[4][EventKind.HOST]["name"][-3:]
    t, _ = samples(ev, 4, "nvlink_tx_bytes_per_s")
    step2_end = steps(ev, 4)[2][-1]
    assert (t.max() - step2_end) / 1e6 > 7 * iteration_ms(events())  # the sampler keeps running
    assert set(samples(ev, 4, "pcie_gen")[1]) == {5.0}


def test_intermittent_faults_act_only_on_their_iterations() -> None:
    ev = events("slow_gpu:7:1.5@2/3")
    ratio = [
        np.median(kernel_ms(ev, 7)[i * 12 : (i + 1) * 12]) / np.median(kernel_ms(ev, 6)[i * 12 : (i + 1) * 12])
        for i in range(ITERATIONS)
    ]
    slow = [i for i, x in enumerate(ratio) if x > 1.3]
    assert slow == [2, 5] and all(abs(x - 1) < 0.05 for i, x in enumerate(ratio) if i not in slow)
    assert parse_fault("slow_gpu:7@2/3").active(5) and not parse_fault("slow_gpu:7@2/3").active(4)


def test_two_faults_at_once_each_show_on_their_own_rank() -> None:
    ev = events("slow_gpu:1:1.4", "dataloader_stall:10:1.2")
    assert np.median(kernel_ms(ev, 1)) / np.median(kernel_ms(ev, 2)) == pytest.approx(1.4, rel=0.03)
    assert np.median(python_ms(ev, 10, "dataloader.next")) > 4 * np.median(python_ms(ev, 2, "dataloader.next"))


# -- noise for negative controls ---------------------------------------------------------------------


def test_glitches_are_one_off_slow_iterations_of_single_ranks() -> None:
    ev = events(glitch_rate=0.1, seed=4)
    ratio = np.array(
        [[np.median(kernel_ms(ev, r)[i * 12 : (i + 1) * 12]) for i in range(ITERATIONS)] for r in range(RANKS)]
    )
    ratio /= np.median(ratio, axis=0)
    slow = ratio > 1.15
    assert 0 < slow.sum() < 0.2 * slow.size and (ratio[slow] < 1.55).all()
    assert slow.sum(axis=1).max() <= 3  # one-offs scattered over ranks, not a persistent fault


def test_pauses_delay_every_rank_alike_and_jitter_is_the_same_on_host_and_gpu() -> None:
    ev = events(pause_rate=0.5, seed=1)
    pauses = [python_ms(ev, r, "checkpoint.save") for r in ranks_of(ev)]
    assert 0 < pauses[0].size < ITERATIONS and all(p.size == pauses[0].size for p in pauses)
    assert np.ptp(np.array(pauses), axis=0).max() < 1e-3 and 20 <= pauses[0].min() and pauses[0].max() <= 100
    plain = events(jitter=0.05)
    fwd = np.concatenate([python_ms(plain, r, "forward") for r in ranks_of(plain)])
    gemm = np.concatenate([kernel_ms(plain, r) for r in ranks_of(plain)])
    assert fwd.std() / fwd.mean() == pytest.approx(gemm.std() / gemm.mean(), rel=0.3)


def test_clock_skew_shifts_every_timestamp_of_a_host_by_one_offset() -> None:
    plain, skewed = run(), run(clock_skew_ms=5.0)
    offsets: dict[str, set[int]] = defaultdict(set)
    for a, b in zip(plain, skewed, strict=True):
        time_col = "t_ns" if a.kind == EventKind.SAMPLES else "start_ns"
        diff = np.unique(b[time_col] - a[time_col])
        assert diff.size == 1
        offsets[a.header.host].add(int(diff[0]))
        if a.kind != EventKind.SAMPLES:
            np.testing.assert_array_equal(a["dur_ns"], b["dur_ns"])
    values = [s.pop() for s in offsets.values() if len(s) == 1]
    assert len(values) == len(offsets) and all(abs(v) <= 5_000_000 for v in values)
    assert len(set(values)) == len(values)


def test_large_batches_are_split_and_keep_the_sequence() -> None:
    batches = list(simulate(SimulatorConfig(ranks=2, iterations=1, layers=520, buckets=8)))
    kernels = [b for b in batches if b.kind == EventKind.KERNELS and b.header.rank == 0]
    assert len(kernels) == 2 and all(len(b) <= MAX_BATCH_EVENTS for b in kernels)
    assert sum(len(b) for b in kernels) == 1 + 8 * 520 + 4
    rank0 = [b for b in batches if b.header.rank == 0]
    assert all(len(b) <= MAX_BATCH_EVENTS for b in rank0)
    assert [b.header.seq for b in rank0] == list(range(len(rank0)))
    th = [b for b in rank0 if b.kind == EventKind.SAMPLES][0]
    assert th.names == list(METRICS) and len(METRICS) == 8


def test_producer_shaped_batches_hold_the_same_events_in_fewer_messages_with_a_gapless_sequence() -> None:
    def span_ns(b: EventBatch) -> int:
        return b.header.sent_ns - int(b["t_ns" if b.kind == EventKind.SAMPLES else "start_ns"].min())

    per_iteration, shaped = run(), run(flush_interval_ms=500)
    assert len(shaped) < len(per_iteration) / 2
    before, after = events(), events(flush_interval_ms=500)  # names resolved through each batch's dictionary
    assert before.keys() == after.keys()
    for rank, kinds in before.items():
        assert kinds.keys() == after[rank].keys()
        for kind, cols in kinds.items():
            assert cols.keys() == after[rank][kind].keys()
            same = [np.array_equal(v, after[rank][kind][c]) for c, v in cols.items() if not c.endswith("_id")]
            assert all(same), (rank, kind)
    longest_one_iteration = max(map(span_ns, per_iteration))
    for rank in range(RANKS):
        mine = [b for b in shaped if b.header.rank == rank]
        assert [b.header.seq for b in mine] == list(range(len(mine)))
        for b in mine:
            assert len(b) <= MAX_BATCH_EVENTS and len(set(b.names)) == len(b.names)
            assert span_ns(b) < 500_000_000 + longest_one_iteration


def test_first_step_numbers_markers_and_collective_sequence() -> None:
    batches = list(simulate(SimulatorConfig(ranks=2, iterations=2, first_step=100, buckets=3)))
    py = [b for b in batches if b.kind == EventKind.HOST and b.header.rank == 1]
    assert [b.names[0] for b in py] == ["ProfilerStep#100", "ProfilerStep#101"]
    coll = [b for b in batches if b.kind == EventKind.COLLECTIVES and b.header.rank == 1]
    assert coll[0]["seq"].tolist() == [300, 301, 302]


# -- ground truth ------------------------------------------------------------------------------------


def test_expected_findings_map_each_fault_to_its_category_and_culprits() -> None:
    specs = (
        "slow_gpu:7", "slow_link:3", "pcie_downgrade:4", "host_slow:5", "dataloader_stall:6@2/4",
        "cpu_contention:9", "net_congestion:node001:1.5@3", "stage_imbalance:1", "job_slowdown:-:1.1@5",
        "hang:2@6",
    )  # fmt: skip
    cfg = SimulatorConfig(ranks=16, pp=2, iterations=10, first_step=100, faults=tuple(map(parse_fault, specs)))
    got = cfg.expected_findings()
    assert [(f.category, f.kind) for f in got] == [
        ("gpu_slow", "slow_gpu"), ("link_slow", "slow_link"), ("link_slow", "pcie_downgrade"),
        ("host_slow", "host_slow"), ("host_slow", "dataloader_stall"), ("host_slow", "cpu_contention"),
        ("link_slow", "net_congestion"), ("stage_imbalance", "stage_imbalance"),
        ("job_regression", "job_slowdown"), ("hang", "hang"),
    ]  # fmt: skip
    assert got[0] == ExpectedFinding("gpu_slow", (7,), "node000", 0, 100, "slow_gpu")
    assert got[4].onset == 102 and got[4].every == 4
    assert got[6].ranks == tuple(range(8, 16)) and got[6].host == "node001" and got[6].stage == 1
    assert got[7].ranks == tuple(range(8, 16)) and got[7].stage == 1
    assert got[8].ranks == tuple(range(16)) and got[8].host == "" and got[8].stage == -1
    assert got[9].ranks == (2,) and got[9].onset == 106 and cfg.expected_iterations == 6


# -- spec grammar and validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("slow_gpu:7:1.5", Fault(kind="slow_gpu", rank=7, factor=1.5)),
        ("slow_link:12", Fault(kind="slow_link", rank=12, factor=2.0)),
        ("host_slow:3", Fault(kind="host_slow", rank=3, factor=1.2, function="gc.collect")),
        (
            "host_slow:3:2.5:optimizer.step",
            Fault(kind="host_slow", rank=3, factor=2.5, function="optimizer.step"),
        ),
        ("slow_gpu:7:1.2@10/3", Fault(kind="slow_gpu", rank=7, factor=1.2, start=10, every=3)),
        ("slow_gpu:7/2", Fault(kind="slow_gpu", rank=7, every=2)),
        ("net_congestion:node001:1.5", Fault(kind="net_congestion", host="node001", factor=1.5)),
        ("net_congestion:1", Fault(kind="net_congestion", host="node001")),
        ("stage_imbalance:1:1.3", Fault(kind="stage_imbalance", stage=1, factor=1.3)),
        ("job_slowdown:-:1.1@60", Fault(kind="job_slowdown", factor=1.1, start=60)),
        ("hang:5@12", Fault(kind="hang", rank=5, start=12)),
        (" pcie_downgrade:4 ", Fault(kind="pcie_downgrade", rank=4, factor=2.0)),
    ],
)
def test_parse_fault_reads_cli_specs(spec: str, expected: Fault) -> None:
    assert parse_fault(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("slow_disk:1", "unknown kind 'slow_disk' (valid: slow_gpu, slow_link, host_slow, pcie_downgrade"),
        ("slow_gpu:x", "rank 'x' is not an integer"),
        ("slow_gpu:-1", "rank must be an integer >= 0"),
        ("slow_gpu:1:0.9", "factor must be a finite slowdown > 1"),
        ("slow_gpu:1:fast", "factor 'fast' is not a number"),
        ("host_slow:1:2:tokenizer", "unknown host function 'tokenizer'"),
        ("slow_gpu:1:2:forward", "function applies to host_slow faults only"),
        ("slow_gpu", "expected kind:target[:factor[:function]][@start][/every]"),
        ("slow_gpu:1:2:forward:x", "expected kind:target[:factor[:function]][@start][/every]"),
        ("slow_gpu:1@x", "start 'x' after '@' is not an integer"),
        ("slow_gpu:1/0", "every must be an integer >= 1"),
        ("slow_gpu:1@-2", "start must be an integer >= 0"),
        ("slow_gpu:1/2@3", "expected kind:target"),
        ("net_congestion:rack7", "host must be a host name like node001 or an index"),
        ("job_slowdown:3:1.1", "job_slowdown targets the whole job: write '-'"),
        ("stage_imbalance:a", "stage 'a' is not an integer"),
        ("hang:3:2@5", "hang takes no factor"),
        ("hang:3@5/2", "a hang is not intermittent"),
    ],
)
def test_parse_fault_names_the_spec_and_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match="bad fault spec") as info:
        parse_fault(spec)
    assert message in str(info.value) and repr(spec) in str(info.value)


def test_config_validation_reports_every_problem_at_once() -> None:
    with pytest.raises(ValueError) as info:
        SimulatorConfig(
            ranks=12,
            tp=8,
            layers=6,
            pp=4,
            buckets=0,
            jitter=-1.0,
            glitch_rate=2.0,
            iterations=5,
            faults=(
                Fault(kind="slow_gpu", rank=40),
                Fault(kind="slow_gpu", rank=40),
                Fault(kind="net_congestion", host="node009"),
                Fault(kind="slow_link", rank=1, start=5),
                Fault(kind="hang", rank=1),
                Fault(kind="hang", rank=2),
            ),
        )
    text = str(info.value)
    for part in (
        "buckets must be >= 1",
        "jitter must be",
        "glitch_rate must be in [0, 1]",
        "ranks (12) must be a multiple of tp * pp (8 * 4)",
        "layers (6) must be a multiple of pp (4)",
        "targets rank 40",
        "duplicate slow_gpu fault on rank 40",
        "targets host node009, but the job has 2 hosts",
        "starts at iteration 5, but iterations = 5",
        "at most one hang fault",
    ):
        assert part in text, part
    assert SimulatorConfig(ranks=2).expected_iterations == 40


@pytest.mark.parametrize(("ranks", "tp", "pp"), [(8, 1, 1), (16, 2, 2), (16, 1, 4), (24, 2, 3), (32, 4, 2), (8, 8, 1)])
@pytest.mark.parametrize("described", [True, False])
def test_published_process_groups_derive_the_simulated_layout(ranks: int, tp: int, pp: int, described: bool) -> None:
    """The headers' coordinates come from the groups the job publishes, not from the simulator's arithmetic."""
    cfg = SimulatorConfig(ranks=ranks, iterations=1, tp=tp, pp=pp)
    layout = derived_layout(cfg, described=described)
    if not described and tp == pp == 1:  # only the world group: every rank a peer, as without metadata
        assert not layout.known
        return
    if not described and cfg.dp == 1 and pp == 1:  # a lone unexplained family reads as data parallel
        return
    for r in range(ranks):
        role = layout.role(r)
        assert (role.tp_rank, role.pp_rank, role.dp_rank) == cfg.coordinates(r)
        assert (role.tp_size, role.pp_size, role.dp_size) == (tp, pp, cfg.dp)


def test_headers_from_undescribed_groups_match_the_described_ones() -> None:
    described = {b.header.rank: b.header for b in simulate(SimulatorConfig(ranks=16, iterations=1, tp=2, pp=2))}
    bare = simulate(SimulatorConfig(ranks=16, iterations=1, tp=2, pp=2, named_groups=False))
    for b in bare:
        h, want = b.header, described[b.header.rank]
        assert (h.tp_rank, h.pp_rank, h.dp_rank, h.tp_size, h.pp_size, h.dp_size) == (
            want.tp_rank,
            want.pp_rank,
            want.dp_rank,
            want.tp_size,
            want.pp_size,
            want.dp_size,
        )
