"""A job's parallel layout from its process groups: which ranks do the same work.

Why it is here: producers (the torch hook, the trace parser, the simulator) and the stream stages all
need the same answer to "what is rank r's tensor slot, pipeline stage and data-parallel replica", and
the job itself says it through the process groups it creates. Frameworks name them (Megatron's
``group_desc`` such as ``TENSOR_MODEL_PARALLEL_GROUP``, DeviceMesh's ``mesh_<dim>`` for torchtitan's
``tp``/``pp``/``dp_shard``/``ep`` dims); where no name is known the role comes from the membership
pattern (groups of one family are arithmetic progressions of the same stride that partition the ranks)
and from the traffic (p2p sends connect pipeline stages; all-to-all is the expert dimension). The
stage order follows the direction of the p2p traffic. Pure functions, stdlib only.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

# Coordinate roles. ``dp`` folds in context parallelism and FSDP/ZeRO sharding: all of them run the
# same work on different data; ``shard`` keeps the sharding group apart for the layouts table.
TP, PP, DP, EP, SHARD = "tp", "pp", "dp", "ep", "shard"
DP_REPLICATE, CP, DP_CP = "dp_replicate", "cp", "dp_cp"
ROLES = (TP, PP, DP, EP, SHARD)

# Group names/descriptions frameworks set -> role (compared lower-case, with a ``mesh_`` prefix and
# separators normalised). Megatron-core ``parallel_state`` group_desc values, DeviceMesh dim names
# (torchtitan: pp, dp_replicate, dp_shard, cp, tp, ep and the flattened dp, dp_cp, dp_shard_cp).
_NAMED_ROLES: dict[str, str] = {
    "tensor_model_parallel_group": TP,
    "tp": TP,
    "tensor": TP,
    "pipeline_model_parallel_group": PP,
    "pp": PP,
    "pipe": PP,
    "pipeline": PP,
    "data_parallel_group_with_cp": DP_CP,
    "dp_cp": DP_CP,
    "data_parallel_group": DP,
    "dp": DP,
    "data": DP,
    "dp_replicate": DP_REPLICATE,
    "ddp": DP_REPLICATE,
    "replicate": DP_REPLICATE,
    "dp_shard": SHARD,
    "fsdp": SHARD,
    "shard": SHARD,
    "zero": SHARD,
    "intra_distributed_optimizer_instance_group": SHARD,
    "expert_model_parallel_group": EP,
    "ep": EP,
    "expert": EP,
    "context_parallel_group": CP,
    "cp": CP,
}
# Descriptions PyTorch gives groups nobody named: such groups are classified by membership and traffic.
_GENERIC = frozenset({"", "undefined", "default_pg", "default", "world"})
_SEPARATORS = re.compile(r"[\s\-.:/]+")
_ALL_TO_ALL = frozenset({"all_to_all", "alltoall", "all_to_allv", "alltoall_base"})
_P2P = frozenset({"send", "recv", "sendrecv", "batch_isend_irecv"})
_SHARDING_OPS = frozenset({"reduce_scatter", "allgather", "all_gather"})


@dataclass(frozen=True)
class ProcessGroup:
    """One process group: its name (PyTorch's ``"0"``, ``"1"``...), description, member global ranks.

    ``ops``: the collective operations seen on it, when known (a trace's NCCL kernels): a hint for
    groups without a known description.
    """

    name: str
    ranks: tuple[int, ...]
    desc: str = ""
    backend: str = ""
    ops: frozenset[str] = frozenset()


class Coordinates(TypedDict, total=False):
    """A rank's place in the job's parallelism, as ``BatchHeader`` carries it."""

    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_size: int
    pp_size: int
    dp_size: int


@dataclass(frozen=True)
class RankRole:
    """One rank's coordinates. ``-1``/``1``: the dimension is unknown or absent."""

    rank: int
    tp_rank: int = -1
    pp_rank: int = -1
    dp_rank: int = -1
    ep_rank: int = -1
    shard_rank: int = -1
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    shard_size: int = 1

    def header_fields(self) -> Coordinates:
        """The ``BatchHeader`` coordinate fields (``tp_rank``... ``dp_size``)."""
        return {
            "tp_rank": self.tp_rank,
            "pp_rank": self.pp_rank,
            "dp_rank": self.dp_rank,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "dp_size": self.dp_size,
        }


@dataclass(frozen=True)
class JobLayout:
    """Every known rank's role, the groups of each role, and where the roles came from."""

    world_size: int
    roles: Mapping[int, RankRole]
    groups: Mapping[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """role -> its groups, members in coordinate order (a pipeline group in stage order)."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """role -> ``"name"`` (a known group description), ``"traffic"`` (p2p/all-to-all), ``"membership"``
    (stride pattern) or ``"complement"`` (what the other roles leave)."""

    def role(self, rank: int) -> RankRole:
        """The rank's role; an unknown rank gets no coordinates."""
        return self.roles.get(rank) or RankRole(rank)

    @property
    def known(self) -> bool:
        """True when at least one dimension was derived."""
        return bool(self.sources)


@functools.lru_cache(maxsize=4096)
def _key(raw: str) -> str:
    return _SEPARATORS.sub("_", raw.strip().lower()).strip("_")


def is_generic(desc: str) -> bool:
    """True for a description no framework chose (PyTorch's defaults, a bare number)."""
    key = _key(desc)
    return key in _GENERIC or key.isdigit()


def role_of_name(*names: str) -> str | None:
    """The role a framework's group name or description stands for (``None``: not a coordinate group)."""
    for raw in names:
        key = _key(raw).removeprefix("mesh_")
        role = _NAMED_ROLES.get(key)
        if role is not None:
            return role
    return None


def stride_of(ranks: Collection[int]) -> int | None:
    """The common difference of the sorted members, None when they are not an arithmetic progression."""
    members = sorted(set(ranks))
    if len(members) < 2:
        return None
    step = members[1] - members[0]
    ok = all(b - a == step for a, b in zip(members, members[1:], strict=False))
    return step if ok else None


def stages_reversed(members: Sequence[int], rank: int, first_op: str, first_peer: int) -> bool | None:
    """Whether ``members`` (a pipeline group in member order) run last stage first, as one rank can tell.

    A rank sees only its own p2p calls, yet its first one says where it is: the first stage starts by
    sending activations forward, every other stage by receiving them from the stage before it. Every
    rank of a job answers alike (None: its calls do not tell, e.g. no p2p yet or an unlisted peer).
    """
    if rank not in members or len(members) < 2:
        return None
    i, last = members.index(rank), len(members) - 1
    if first_op == "send":
        return False if i == 0 else True if i == last else None
    if first_op == "recv":
        if i > 0 and members[i - 1] == first_peer:
            return False
        if i < last and members[i + 1] == first_peer:
            return True
    return None


def stage_order(
    members: Iterable[int], edges: Collection[tuple[int, int]], first_senders: Collection[int] = ()
) -> tuple[int, ...]:
    """Pipeline members in stage order from the p2p edges among them (``src -> dst``).

    Stages form a path: the ends talk to one neighbour. The first stage is the end that only sends
    (forward-only traffic), else the end whose first p2p operation is a send (``first_senders``: it sends
    the first activations, the last stage first receives them), else the end listed first. Traffic that is
    not a path (interleaved schedules wrap around) keeps the given order.
    """
    order = tuple(members)
    inside = set(order)
    adjacent: dict[int, set[int]] = {r: set() for r in order}
    directed: set[tuple[int, int]] = set()
    for src, dst in edges:
        if src in inside and dst in inside and src != dst:
            adjacent[src].add(dst)
            adjacent[dst].add(src)
            directed.add((src, dst))
    ends = [r for r in order if len(adjacent[r]) == 1]
    if len(order) < 2 or len(ends) != 2 or any(len(a) > 2 for a in adjacent.values()):
        return order
    a, b = ends
    out_a = (a, next(iter(adjacent[a]))) in directed
    in_a = (next(iter(adjacent[a])), a) in directed
    out_b = (b, next(iter(adjacent[b]))) in directed
    in_b = (next(iter(adjacent[b])), b) in directed
    if out_a and not in_a and not (out_b and not in_b):
        first = a
    elif out_b and not in_b and not (out_a and not in_a):
        first = b
    elif (a in first_senders) != (b in first_senders):
        first = a if a in first_senders else b
    else:
        first = a
    path, prev = [first], -1
    while len(path) < len(order):
        nxt = [r for r in adjacent[path[-1]] if r != prev]
        if len(nxt) != 1:
            return order
        prev = path[-1]
        path.append(nxt[0])
    return tuple(path) if len(set(path)) == len(order) else order


@dataclass
class _Family:
    """Disjoint groups of one role (or one unnamed size/stride pattern) and the operations they carry."""

    groups: list[tuple[int, ...]]
    role: str | None
    ops: set[str]
    taken: set[int] = field(default_factory=set)
    """Ranks of ``groups``: a rank holds one coordinate per role, so an overlapping group is left out."""


def derive_layout(
    groups: Iterable[ProcessGroup],
    *,
    world_size: int,
    p2p: Collection[tuple[int, int]] = (),
    first_senders: Collection[int] = (),
) -> JobLayout:
    """Each rank's coordinates from the job's process groups and p2p edges (``src -> dst`` sends).

    Named groups win; unnamed families (same size and stride, disjoint) are pipeline when p2p runs
    inside them, expert when they carry all-to-all, then tensor (the smaller stride: Megatron and
    torchtitan put it innermost) and data parallel. A dimension of tp/pp/dp that no group gives is the
    complement of the others (its index: the rank's position among the ranks with the same other
    coordinates). No usable group: an empty layout (the caller keeps its defaults or overrides).
    """
    named, unnamed = _families(groups, world_size)
    by_role: dict[str, list[tuple[int, ...]]] = {role: fam.groups for role, fam in named.items()}
    sources = dict.fromkeys(by_role, "name")
    ops = {role: fam.ops for role, fam in named.items()}
    rest: list[_Family] = []
    for fam in sorted(unnamed, key=lambda f: len(f.groups[0]) >= world_size):  # the world group last
        member_of = {r: i for i, g in enumerate(fam.groups) for r in g}
        inner_p2p = any(member_of.get(s, -1) == member_of.get(d, -2) for s, d in p2p)
        if PP not in by_role and (inner_p2p or (fam.ops and fam.ops <= _P2P)):
            by_role[PP], sources[PP] = fam.groups, "traffic"
        elif EP not in by_role and fam.ops & _ALL_TO_ALL:
            by_role[EP], sources[EP] = fam.groups, "traffic"
        elif len(fam.groups[0]) < world_size:  # the world group is no coordinate but by its traffic
            rest.append(fam)
    has_dp = any(r in by_role for r in (DP, DP_CP, DP_REPLICATE, SHARD))
    free = [r for r in (TP, DP) if r not in by_role and not (r == DP and has_dp)]
    if len(rest) == 1 and free == [TP, DP]:
        free = [DP]  # one unexplained family: the replicas (a tensor family would come with a data one)
    for fam, role in zip(rest, free, strict=False):
        by_role[role], sources[role], ops[role] = fam.groups, "membership", fam.ops
    if PP in by_role:
        sends: dict[int, list[int]] = {}
        for src, dst in p2p:
            sends.setdefault(src, []).append(dst)
        by_role[PP] = [
            stage_order(g, [(s, d) for s in g for d in sends.get(s, ())], first_senders) for g in by_role[PP]
        ]
    if SHARD not in by_role and DP in by_role and ops.get(DP, set()) & _SHARDING_OPS:
        by_role[SHARD], sources[SHARD] = by_role[DP], sources[DP]  # ZeRO: the optimizer shards over dp
    return _coordinates(by_role, sources, world_size)


def _families(groups: Iterable[ProcessGroup], world_size: int) -> tuple[dict[str, _Family], list[_Family]]:
    """Distinct multi-rank groups: by role when named, else by (size, stride) when no framework described
    them (Megatron's composite groups such as ``MODEL_PARALLEL_GROUP`` or ``EMBEDDING_GROUP`` are no
    coordinate)."""
    named: dict[str, _Family] = {}
    pattern: dict[tuple[int, int], _Family] = {}
    for g in groups:
        members = tuple(dict.fromkeys(r for r in g.ranks if 0 <= r < world_size))
        role = role_of_name(g.desc, g.name)
        if len(members) < 2 or (role is None and not is_generic(g.desc)):
            continue
        if role is not None:
            fam = named.setdefault(role, _Family([], role, set()))
        else:
            members = tuple(sorted(members))
            fam = pattern.setdefault((stride_of(members) or world_size, len(members)), _Family([], None, set()))
        fam.ops.update(o.lower() for o in g.ops)
        if fam.taken.isdisjoint(members):  # every rank lists its groups: a repeat is left out here
            fam.groups.append(members)
            fam.taken.update(members)
    return named, [pattern[k] for k in sorted(pattern)]


def _indices(groups: Iterable[tuple[int, ...]]) -> dict[int, tuple[int, int]]:
    """rank -> (position in its group, group size)."""
    return {r: (i, len(g)) for g in groups for i, r in enumerate(g)}


def _radix(*dims: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Nested dimensions as one (outer first): the rank's mixed-radix index and the product of sizes."""
    out: dict[int, tuple[int, int]] = {}
    ranks = set().union(*dims) if dims else set()
    for r in ranks:
        index, size = 0, 1
        for d in dims:
            i, n = d.get(r, (0, 1))
            index, size = index * n + i, size * n
        out[r] = (index, size)
    return out


def _coordinates(by_role: Mapping[str, list[tuple[int, ...]]], sources: dict[str, str], world_size: int) -> JobLayout:
    idx = {role: _indices(gs) for role, gs in by_role.items()}
    if DP_CP in idx:
        dp = idx[DP_CP]
    elif DP in idx:
        dp = _radix(idx[DP], idx[CP]) if CP in idx else idx[DP]
    else:
        parts = [idx[r] for r in (DP_REPLICATE, SHARD, CP) if r in idx]
        dp = _radix(*parts) if parts else {}
    for role in (DP_CP, DP_REPLICATE, CP):
        if role in sources:
            sources.setdefault(DP, sources[role])
    dims = {TP: idx.get(TP, {}), PP: idx.get(PP, {}), DP: dp}
    if not any(dims.values()):
        return JobLayout(world_size=world_size, roles={})
    ranks = range(world_size)
    missing = [d for d, v in dims.items() if not v]
    if missing:  # the ranks the known dimensions leave: one missing dimension, else the replicas
        fill = missing[0] if len(missing) == 1 else (DP if DP in missing else missing[0])
        rest = _complement(ranks, [v for v in dims.values() if v])
        if any(n > 1 for _, n in rest.values()):
            dims[fill], sources[fill] = rest, "complement"
    roles: dict[int, RankRole] = {}
    for r in ranks:
        c = {d: dims[d].get(r, (0, 1) if not dims[d] else (-1, 1)) for d in dims}
        e, s = idx.get(EP, {}).get(r, (-1, 1)), idx.get(SHARD, {}).get(r, (-1, 1))
        roles[r] = RankRole(
            rank=r, tp_rank=c[TP][0], pp_rank=c[PP][0], dp_rank=c[DP][0], ep_rank=e[0], shard_rank=s[0],
            tp_size=c[TP][1], pp_size=c[PP][1], dp_size=c[DP][1], ep_size=e[1], shard_size=s[1],
        )  # fmt: skip
    out_groups = {role: tuple(by_role[role]) for role in (TP, PP, EP, SHARD) if role in by_role}
    out_groups[DP] = _groups_of(roles, DP)
    return JobLayout(
        world_size=world_size,
        roles=roles,
        groups=out_groups,
        sources={k: v for k, v in sources.items() if k in ROLES},
    )


def _complement(ranks: Iterable[int], known: list[dict[int, tuple[int, int]]]) -> dict[int, tuple[int, int]]:
    """The dimension the known ones leave: ranks with equal known coordinates, in rank order."""
    buckets: dict[tuple[int, ...], list[int]] = {}
    for r in ranks:
        buckets.setdefault(tuple(d.get(r, (-1, 1))[0] for d in known), []).append(r)
    return {r: (i, len(b)) for b in buckets.values() for i, r in enumerate(b)}


def _groups_of(roles: Mapping[int, RankRole], role: str) -> tuple[tuple[int, ...], ...]:
    """The ranks that differ only in ``role``'s coordinate, each group ordered by that coordinate."""
    others = [c for c in (TP, PP, DP) if c != role]
    buckets: dict[tuple[int, ...], list[RankRole]] = {}
    for rr in roles.values():
        if getattr(rr, f"{role}_rank") >= 0:
            buckets.setdefault(tuple(getattr(rr, f"{c}_rank") for c in others), []).append(rr)
    groups = (tuple(x.rank for x in sorted(b, key=lambda x: getattr(x, f"{role}_rank"))) for b in buckets.values())
    return tuple(sorted((g for g in groups if len(g) > 1), key=lambda g: g[0]))


def layout_from_sizes(world_size: int, tp: int = 1, pp: int = 1) -> JobLayout:
    """Megatron's rank order (tp fastest, then dp, then pp) for given sizes: the ``--tp/--pp`` override."""
    if tp < 1 or pp < 1 or world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not a multiple of tp {tp} x pp {pp}")
    dp = world_size // (tp * pp)
    roles = {
        r: RankRole(
            rank=r, tp_rank=r % tp, pp_rank=r // (tp * dp), dp_rank=(r // tp) % dp, tp_size=tp, pp_size=pp, dp_size=dp
        )
        for r in range(world_size)
    }
    return JobLayout(world_size=world_size, roles=roles, groups={}, sources=dict.fromkeys((TP, PP, DP), "given"))
