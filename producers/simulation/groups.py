"""The process groups a simulated job creates, as Megatron would: the simulator's published metadata.

Why: the headers' coordinates must come from the same derivation as a real job's (``schemas.layout``),
not from the simulator's own arithmetic, so the quality bench measures the analysis "with the layout
taken from metadata". The groups follow Megatron's ``parallel_state`` (tp fastest, then dp, then pp,
``group_desc`` names); ``described=False`` leaves them undescribed so the layout must come from the
membership pattern and the pipeline's p2p edges.
"""

from __future__ import annotations

import numpy as np

from fleetscope.producers.simulation.config import SimulatorConfig
from fleetscope.schemas.layout import JobLayout, ProcessGroup, derive_layout

DESCS = {"tp": "TENSOR_MODEL_PARALLEL_GROUP", "dp": "DATA_PARALLEL_GROUP", "pp": "PIPELINE_MODEL_PARALLEL_GROUP"}


def process_groups(cfg: SimulatorConfig, *, described: bool = True) -> list[ProcessGroup]:
    """The world group, then every tp, dp and pp group in Megatron's creation order."""
    grid = np.arange(cfg.ranks).reshape(cfg.pp, cfg.dp, cfg.tp)  # [pp][dp][tp]: Megatron's rank order
    members = {
        "tp": grid.reshape(-1, cfg.tp),
        "dp": grid.transpose(0, 2, 1).reshape(-1, cfg.dp),
        "pp": grid.transpose(1, 2, 0).reshape(-1, cfg.pp),
    }
    out = [ProcessGroup(name="0", ranks=tuple(range(cfg.ranks)), desc="default_pg", backend="nccl")]
    for role in ("tp", "dp", "pp"):
        for g in members[role]:
            desc = DESCS[role] if described else "undefined"
            out.append(ProcessGroup(name=str(len(out)), ranks=tuple(int(r) for r in g), desc=desc, backend="nccl"))
    return out


def p2p_edges(cfg: SimulatorConfig) -> list[tuple[int, int]]:
    """Activations forward and gradients back between consecutive stages of each pipeline."""
    block = cfg.dp * cfg.tp
    edges = []
    for r in range(cfg.ranks - block):
        edges += [(r, r + block), (r + block, r)]
    return edges


def derived_layout(cfg: SimulatorConfig, *, described: bool = True) -> JobLayout:
    """The job's layout as the analysis would derive it from the metadata the simulator publishes."""
    first = {r for r in range(cfg.dp * cfg.tp)} if cfg.pp > 1 else set()
    return derive_layout(
        process_groups(cfg, described=described), world_size=cfg.ranks, p2p=p2p_edges(cfg), first_senders=first
    )
