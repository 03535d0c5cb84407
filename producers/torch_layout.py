"""This rank's coordinates from torch.distributed's process groups, for the headers it sends.

Why: a running job already says its layout: Megatron creates its groups with a ``group_desc``
(``TENSOR_MODEL_PARALLEL_GROUP``...), DeviceMesh with ``mesh_<dim>``, and every group lists its members.
``LayoutTracker`` reads the groups this rank is in (``_world.pg_map``) at monitoring start and again at a
step boundary after the job created more (a counter compare, nothing else, per step), derives the
coordinates with ``schemas.layout`` (the same rules as the trace parser) and puts them in the recorder's
identity. The peers of its ``send``/``recv`` calls (``torch_patches.PEERS``) order the pipeline stages
where the group's own order does not tell. ``FLEETSCOPE_TP``/``FLEETSCOPE_PP`` override what the groups
say. Never raises into training: a failure leaves the coordinates as they were and is counted by the recorder.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch.distributed as dist

from fleetscope.producers.rank_recorder import Recorder
from fleetscope.producers.torch_patches import PEERS, install_p2p_patches
from fleetscope.schemas.layout import JobLayout, ProcessGroup, derive_layout, layout_from_sizes, stages_reversed

ENV_TP, ENV_PP = "FLEETSCOPE_TP", "FLEETSCOPE_PP"


def process_groups() -> list[ProcessGroup]:
    """The groups this rank is a member of: name, description, backend, members (global ranks)."""
    c10d = dist.distributed_c10d
    out = []
    for pg in list(c10d._world.pg_map):
        ranks = dist.get_process_group_ranks(pg)
        out.append(
            ProcessGroup(
                name=str(c10d._get_process_group_name(pg)),
                ranks=tuple(int(r) for r in ranks),
                desc=str(getattr(pg, "group_desc", "") or ""),
                backend=str(dist.get_backend(pg)),
            )
        )
    return out


def overrides(env: dict[str, str] | None = None) -> tuple[int, int]:
    """``(tp, pp)`` given by ``FLEETSCOPE_TP``/``FLEETSCOPE_PP``; 0 when not given."""
    e = os.environ if env is None else env
    return int(e.get(ENV_TP, "0") or 0), int(e.get(ENV_PP, "0") or 0)


def current_layout(world_size: int) -> JobLayout:
    """The layout as this rank sees it now (its own groups and p2p peers), or the given sizes."""
    tp, pp = overrides()
    if tp > 0 or pp > 0:
        return layout_from_sizes(world_size, tp=max(tp, 1), pp=max(pp, 1))
    me = dist.get_rank()
    first = {me} if PEERS.first == "send" else set()
    layout = derive_layout(process_groups(), world_size=world_size, p2p=tuple(PEERS.edges), first_senders=first)
    return _oriented(layout, me)


def _oriented(layout: JobLayout, me: int) -> JobLayout:
    """This rank's stage counted from the stage that sends first, when its own p2p calls say the
    pipeline group lists the stages last first (PyTorch sorts a group's ranks, not its stages)."""
    pipeline = next((g for g in layout.groups.get("pp", ()) if me in g), None)
    if pipeline is None or stages_reversed(pipeline, me, PEERS.first, PEERS.first_peer) is not True:
        return layout
    role = layout.role(me)
    flipped = replace(role, pp_rank=role.pp_size - 1 - role.pp_rank)
    return replace(layout, roles={**layout.roles, me: flipped})


class LayoutTracker:
    """Keeps the recorder's identity's coordinates in step with the job's process groups."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self._seen = (-1, -1)

    def refresh(self) -> None:
        """Re-derive when the job created groups or saw new p2p peers since the last call."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        state = (int(dist.distributed_c10d._world.group_count), len(PEERS.edges))
        if state == self._seen:
            return
        self._seen = state
        identity = self.recorder.identity
        layout = current_layout(identity.world_size)
        if layout.known:
            self.recorder.identity = replace(identity, **layout.role(identity.rank).header_fields())


def track(recorder: Recorder) -> LayoutTracker:
    """Start following the layout (patches p2p calls); call ``refresh`` at step boundaries."""
    install_p2p_patches()
    tracker = LayoutTracker(recorder)
    recorder.guard("layout", tracker.refresh)
    return tracker
