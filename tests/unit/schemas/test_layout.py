"""Layout derivation from process groups: random dp x tp x pp (x ep) jobs, named and unnamed groups."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetscope.schemas.layout import (
    ProcessGroup,
    derive_layout,
    layout_from_sizes,
    role_of_name,
    stage_order,
    stages_reversed,
    stride_of,
)

MEGATRON_DESC = {
    "tp": "TENSOR_MODEL_PARALLEL_GROUP",
    "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
    "dp": "DATA_PARALLEL_GROUP",
}
MESH_DESC = {"tp": "mesh_tp", "pp": "mesh_pp", "dp": "mesh_dp"}


def build(sizes: dict[str, int], order: list[str]) -> dict[int, dict[str, int]]:
    """rank -> coordinate per dim; ``order`` lists the dims fastest-varying first."""
    coords: dict[int, dict[str, int]] = {}
    for idx in itertools.product(*(range(sizes[d]) for d in reversed(order))):
        c = dict(zip(reversed(order), idx, strict=True))
        rank, stride = 0, 1
        for d in order:
            rank, stride = rank + c[d] * stride, stride * sizes[d]
        coords[rank] = c
    return coords


def groups_of(coords: dict[int, dict[str, int]], dim: str) -> list[tuple[int, ...]]:
    buckets: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for r, c in coords.items():
        buckets.setdefault(tuple(v for k, v in sorted(c.items()) if k != dim), []).append((c[dim], r))
    return [tuple(r for _, r in sorted(b)) for b in buckets.values()]


def process_groups(coords: dict[int, dict[str, int]], desc: dict[str, str] | None) -> list[ProcessGroup]:
    out = [ProcessGroup(name="0", ranks=tuple(sorted(coords)), desc="default_pg")]
    for dim in ("tp", "dp", "pp"):
        for g in groups_of(coords, dim):
            out.append(
                ProcessGroup(name=str(len(out)), ranks=tuple(sorted(g)), desc=desc[dim] if desc else "undefined")
            )
    # Megatron's composite groups must not be taken for coordinates.
    out.append(ProcessGroup(name=str(len(out)), ranks=(0, max(coords)), desc="EMBEDDING_GROUP"))
    return out


def p2p(coords: dict[int, dict[str, int]]) -> tuple[list[tuple[int, int]], set[int]]:
    """1F1B traffic: activations forward, gradients backward; the first stage sends first."""
    edges: list[tuple[int, int]] = []
    for g in groups_of(coords, "pp"):
        for a, b in itertools.pairwise(g):
            edges += [(a, b), (b, a)]
    return edges, {r for r, c in coords.items() if c["pp"] == 0}


def check(coords: dict[int, dict[str, int]], layout_groups: list[ProcessGroup], **kw: object) -> None:
    layout = derive_layout(layout_groups, world_size=len(coords), **kw)  # type: ignore[arg-type]
    sizes = {d: 1 + max(c[d] for c in coords.values()) for d in ("tp", "pp", "dp")}
    for r, c in coords.items():
        role = layout.role(r)
        got = {"tp": role.tp_rank, "pp": role.pp_rank, "dp": role.dp_rank}
        assert got == {d: c[d] for d in got}, (r, layout.sources)
        assert (role.tp_size, role.pp_size, role.dp_size) == (sizes["tp"], sizes["pp"], sizes["dp"])


dims = st.fixed_dictionaries(
    {"tp": st.sampled_from([1, 2, 4]), "pp": st.sampled_from([1, 2, 4]), "dp": st.sampled_from([1, 2, 3, 4])}
)


@settings(max_examples=60, deadline=None)
@given(sizes=dims, order=st.permutations(["tp", "pp", "dp"]), names=st.sampled_from([MEGATRON_DESC, MESH_DESC]))
def test_named_groups_give_every_coordinate_in_any_rank_order(
    sizes: dict[str, int], order: list[str], names: dict[str, str]
) -> None:
    coords = build(sizes, order)
    if len(coords) > 1:
        check(coords, process_groups(coords, names))


@settings(max_examples=40, deadline=None)
@given(sizes=dims, ep=st.sampled_from([2, 4]), order=st.permutations(["tp", "pp", "dp"]), unnamed=st.booleans())
def test_expert_groups_inside_the_data_parallel_replicas(
    sizes: dict[str, int], ep: int, order: list[str], unnamed: bool
) -> None:
    """Experts spread over ``ep`` consecutive replicas: named, or unnamed but carrying all-to-all."""
    sizes = {**sizes, "dp": ep * sizes["dp"]}
    coords = build(sizes, order)
    groups = process_groups(coords, MEGATRON_DESC)
    blocks: dict[tuple[int, int, int], list[int]] = {}
    for r, c in sorted(coords.items(), key=lambda rc: rc[1]["dp"]):
        blocks.setdefault((c["tp"], c["pp"], c["dp"] // ep), []).append(r)
    for i, members in enumerate(blocks.values()):
        desc, ops = (
            ("undefined", frozenset({"all_to_all"})) if unnamed else ("EXPERT_MODEL_PARALLEL_GROUP", frozenset())
        )
        groups.append(ProcessGroup(name=f"e{i}", ranks=tuple(members), desc=desc, ops=ops))
    check(coords, groups)
    layout = derive_layout(groups, world_size=len(coords))
    for r, c in coords.items():
        assert (layout.role(r).ep_rank, layout.role(r).ep_size) == (c["dp"] % ep, ep)


@settings(max_examples=60, deadline=None)
@given(sizes=dims, pp_place=st.integers(1, 2), backwards=st.booleans())
def test_unnamed_groups_from_membership_and_p2p(sizes: dict[str, int], pp_place: int, backwards: bool) -> None:
    """No names: tp innermost (as Megatron and torchtitan lay it out), pp anywhere, found by its p2p."""
    if sizes["dp"] == 1 and sizes["tp"] > 1:
        sizes["dp"] = 2  # a lone unexplained family is read as data parallel (documented ambiguity)
    order = ["tp", "dp"]
    order.insert(pp_place, "pp")
    coords = build(sizes, order)
    if len(coords) == 1:
        return
    if backwards:  # stage 0 on the highest ranks: only the p2p direction tells
        for c in coords.values():
            c["pp"] = sizes["pp"] - 1 - c["pp"]
    edges, first = p2p(coords)
    if sizes["tp"] == sizes["pp"] == 1:  # the world group alone: every rank is a peer, as without metadata
        assert not derive_layout(process_groups(coords, None), world_size=len(coords), p2p=edges).known
        return
    check(coords, process_groups(coords, None), p2p=edges, first_senders=first)


def test_stage_order_follows_forward_only_traffic() -> None:
    assert stage_order((0, 4, 8, 12), [(12, 8), (8, 4), (4, 0)]) == (12, 8, 4, 0)
    assert stage_order((0, 4, 8, 12), [(0, 4), (4, 8), (8, 12)]) == (0, 4, 8, 12)
    both = [(0, 4), (4, 0), (4, 8), (8, 4)]
    assert stage_order((0, 4, 8), both, first_senders={8}) == (8, 4, 0)
    assert stage_order((0, 4, 8), both) == (0, 4, 8)
    assert stage_order((0, 4, 8), [(0, 4), (4, 8), (8, 0)]) == (0, 4, 8)  # a ring keeps the group's order


def test_pure_data_parallel_world_group_alone_gives_no_layout() -> None:
    layout = derive_layout([ProcessGroup(name="0", ranks=tuple(range(8)), desc="default_pg")], world_size=8)
    assert not layout.known
    assert layout.role(3).dp_rank == -1 and layout.role(3).header_fields()["tp_rank"] == -1


def test_torchtitan_hsdp_tp_pp_ep() -> None:
    """DeviceMesh dims pp x dp_replicate x dp_shard x tp (tp innermost) and an expert dim over dp_shard."""
    sizes = {"tp": 2, "dp_shard": 2, "dp_replicate": 2, "pp": 2}
    coords = build(sizes, ["tp", "dp_shard", "dp_replicate", "pp"])
    groups = [
        ProcessGroup(name=str(i), ranks=g, desc=f"mesh_{d}")
        for i, (d, g) in enumerate((d, g) for d in sizes for g in groups_of(coords, d))
    ]
    groups += [ProcessGroup(name="ep", ranks=g, desc="mesh_ep") for g in groups_of(coords, "dp_shard")]
    layout = derive_layout(groups, world_size=16)
    for r, c in coords.items():
        role = layout.role(r)
        assert role.dp_rank == c["dp_replicate"] * 2 + c["dp_shard"] and role.dp_size == 4
        assert (role.tp_rank, role.pp_rank, role.shard_rank, role.shard_size) == (c["tp"], c["pp"], c["dp_shard"], 2)
        assert (role.ep_rank, role.ep_size) == (c["dp_shard"], 2)


def test_unnamed_expert_and_zero_groups_from_their_traffic() -> None:
    coords = build({"tp": 1, "dp": 4, "pp": 2}, ["tp", "dp", "pp"])
    groups = [
        ProcessGroup(name=f"d{i}", ranks=g, ops=frozenset({"reduce_scatter", "allgather"}))
        for i, g in enumerate(groups_of(coords, "dp"))
    ]
    groups += [
        ProcessGroup(name=f"e{i}", ranks=g, ops=frozenset({"all_to_all"}))
        for i, g in enumerate(((0, 2), (1, 3), (4, 6), (5, 7)))
    ]
    groups += [
        ProcessGroup(name=f"p{i}", ranks=g, ops=frozenset({"send", "recv"}))
        for i, g in enumerate(groups_of(coords, "pp"))
    ]
    layout = derive_layout(groups, world_size=8)
    assert layout.sources == {
        "pp": "traffic",
        "ep": "traffic",
        "dp": "membership",
        "shard": "membership",
    }
    assert layout.role(6).tp_rank == 0 and layout.role(6).tp_size == 1
    assert [layout.role(r).ep_rank for r in range(4)] == [0, 0, 1, 1]
    assert [layout.role(r).pp_rank for r in (0, 4)] == [0, 1]
    assert layout.role(5).shard_rank == 1 and layout.role(5).shard_size == 4


def test_names_and_strides() -> None:
    assert role_of_name("TENSOR_MODEL_PARALLEL_GROUP") == "tp"
    assert role_of_name("mesh_dp_shard") == "shard"
    assert role_of_name("EMBEDDING_GROUP") is None and role_of_name("undefined", "3") is None
    assert stride_of((4, 0, 8)) == 4 and stride_of((0, 1, 3)) is None


def test_sizes_override_is_megatron_order() -> None:
    layout = layout_from_sizes(16, tp=2, pp=2)
    assert layout.role(13).header_fields() == {
        "tp_rank": 1,
        "pp_rank": 1,
        "dp_rank": 2,
        "tp_size": 2,
        "pp_size": 2,
        "dp_size": 4,
    }
    with pytest.raises(ValueError, match="multiple"):
        layout_from_sizes(10, tp=4)


def test_one_rank_tells_the_stage_direction_from_its_first_p2p_call() -> None:
    """Stage 0 on the highest ranks (pipeline group listed 0, 4, 8, 12 but run 12 -> 8 -> 4 -> 0)."""
    members = (0, 4, 8, 12)
    assert stages_reversed(members, 12, "send", 8) is True  # the first stage sends first
    assert stages_reversed(members, 4, "recv", 8) is True  # activations come from the higher rank
    assert stages_reversed(members, 0, "recv", 4) is True
    assert stages_reversed(members, 0, "send", 4) is False
    assert stages_reversed(members, 8, "recv", 4) is False
    assert stages_reversed(members, 8, "", -1) is None and stages_reversed(members, 3, "send", 0) is None
