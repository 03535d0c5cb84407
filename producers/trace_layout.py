"""The job's layout from its Kineto traces: process groups, p2p peers, then every rank's coordinates.

Why apart from ``kineto``: parsing is one file at a time, but the layout is a property of the whole
job (the stage order needs every stage's p2p edges), so each ``TraceRank`` carries what its file says
(``pg_config``, the NCCL calls' ``Process Group *`` args, ``Src Rank``/``Dst Rank``) and
``job_layouts`` derives once per job with ``schemas.layout``; ``with_layout`` writes the coordinates
into the rank's batch headers. Given sizes (``--tp``/``--pp``) override what the traces say.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from fleetscope.schemas.layout import JobLayout, ProcessGroup, derive_layout, layout_from_sizes

if TYPE_CHECKING:  # kineto imports this module
    from fleetscope.producers.kineto import TraceRank

P2P_OPS = frozenset({"send", "recv"})


def groups_from_pg_config(info: Mapping[str, object]) -> list[ProcessGroup]:
    """``distributedInfo.pg_config`` entries with members: ``{pg_name, pg_desc, backend_config, ranks}``."""
    config = info.get("pg_config")
    out: list[ProcessGroup] = []
    for pg in config if type(config) is list else ():
        if type(pg) is not dict or type(pg.get("pg_name")) not in (str, int):
            continue
        ranks = pg.get("ranks")
        if type(ranks) is not list or not all(type(r) is int and 0 <= r < 2**31 for r in ranks):
            continue
        desc, backend = pg.get("pg_desc"), pg.get("backend_config")
        out.append(
            ProcessGroup(
                name=str(pg["pg_name"]),
                ranks=tuple(ranks),
                desc=desc if type(desc) is str else "",
                backend=backend if type(backend) is str else "",
            )
        )
    return out


@dataclass
class GroupNotes:
    """What one rank's NCCL calls say about its groups and its p2p peers, in call order."""

    rank: int
    descs: dict[str, str] = field(default_factory=dict)
    ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    ops: dict[str, set[str]] = field(default_factory=dict)
    peers: list[tuple[str, str, int]] = field(default_factory=list)
    """(op, pg, peer as written) of each send/recv."""

    def note(self, op: str, pg: str, desc: str | None, ranks: tuple[int, ...] | None, peer: int | None) -> None:
        self.ops.setdefault(pg, set()).add(op)
        if desc and pg not in self.descs:
            self.descs[pg] = desc
        if ranks and pg not in self.ranks:
            self.ranks[pg] = ranks
        if op in P2P_OPS and peer is not None:
            self.peers.append((op, pg, peer))

    def groups(self, configured: Sequence[ProcessGroup]) -> tuple[ProcessGroup, ...]:
        """The configured groups with the ops seen on them, plus groups only the calls name."""
        out = [replace(g, ops=frozenset(self.ops.get(g.name, ()))) for g in configured]
        known = {g.name for g in configured}
        for pg, members in self.ranks.items():
            if pg not in known:
                out.append(
                    ProcessGroup(name=pg, ranks=members, desc=self.descs.get(pg, ""), ops=frozenset(self.ops[pg]))
                )
        return tuple(out)

    def p2p(self, groups: Sequence[ProcessGroup]) -> tuple[tuple[tuple[int, int], ...], str]:
        """Global p2p edges (``src -> dst``) and the first p2p op. A peer below the group's size is
        group-local (how ProcessGroupNCCL numbers it) and is mapped through the group's members."""
        members = {g.name: g.ranks for g in groups}
        edges: dict[tuple[int, int], None] = {}
        for op, pg, peer in self.peers:
            ranks = members.get(pg)
            other = ranks[peer] if ranks and peer < len(ranks) and self.rank in ranks else peer
            if other != self.rank:
                edges[(self.rank, other) if op == "send" else (other, self.rank)] = None
        return tuple(edges), self.peers[0][0] if self.peers else ""


def job_layouts(traces: Iterable[TraceRank], *, tp: int = 0, pp: int = 0) -> dict[str, JobLayout]:
    """One layout per job from its ranks' traces; ``tp``/``pp`` > 0: given sizes in Megatron order."""
    by_job: dict[str, list[TraceRank]] = {}
    for t in traces:
        by_job.setdefault(t.job, []).append(t)
    out: dict[str, JobLayout] = {}
    for job, ranks in by_job.items():
        world = max(t.world_size for t in ranks)
        if tp > 0 or pp > 0:
            out[job] = layout_from_sizes(world, tp=max(tp, 1), pp=max(pp, 1))
            continue
        groups = [g for t in ranks for g in t.groups]
        edges = {e for t in ranks for e in t.p2p}
        first = {t.rank for t in ranks if t.first_p2p == "send"}
        out[job] = derive_layout(groups, world_size=world, p2p=edges, first_senders=first)
    return out


def with_layout(trace: TraceRank, layout: JobLayout) -> TraceRank:
    """The trace with its rank's coordinates in every batch header (unchanged when none are known)."""
    if not layout.known or trace.rank not in layout.roles:
        return trace
    coords = layout.role(trace.rank).header_fields()
    for batch in trace.batches:
        batch.header = replace(batch.header, **coords)
    return trace
