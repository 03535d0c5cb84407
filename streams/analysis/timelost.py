"""Time saved if a finding were fixed: a what-if estimate every signal carries as its ``loss_ns``.

Replaying the iteration's dependency graph with the culprit's durations set to its peers' median
(the what-if method) needs every event; the differential sees per-function summaries, so it uses a
documented approximation of the same question:

- a rank's own excess (compute kernels, host self time) over its peers' median is what it adds to
  its critical path, and the job can only gain what the other ranks spend waiting for it: the rank's
  arrival lateness at its collectives (how much less it waits than its peers, the largest over its
  collectives). Saved = min(excess, lateness) where the rank has collectives compared with peers;
  without any, its excess.
- a stage's compute excess over the other stages' median, bounded by the time the other stages wait
  for it in p2p (``stages.score_stages``).
- evidence ``saved_ns`` splits it: ``rank`` (fixing this rank alone) and ``stage`` (fixing its
  pipeline stage's imbalance, when one was found in the same iteration).
A straggler's loss is its lateness already; a slow link paces every member of its collectives, so
its loss (the transfer time its lower rate costs) is not bounded by lateness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from fleetscope.schemas.categories import REGISTRY
from fleetscope.schemas.fields import as_int
from fleetscope.streams.analysis.signals import RankSignal
from fleetscope.streams.analysis.stats import F64

BOUNDED_CATEGORIES = tuple(c.value for c, i in REGISTRY.items() if i.bounded_by_lateness)


def bound_by_lateness(signals: dict[int, RankSignal], lateness: F64) -> dict[int, RankSignal]:
    """Rank signals (by row) with ``loss_ns`` bounded by the row's arrival lateness (NaN = no collective
    compared with peers: unbounded); the excess found stays in ``evidence['excess_ns']``."""
    out: dict[int, RankSignal] = {}
    for i, sig in signals.items():
        bound = float(lateness[i]) if lateness.size else float("nan")
        if sig.category not in BOUNDED_CATEGORIES or np.isnan(bound):
            out[i] = sig
            continue
        saved = min(sig.loss_ns, max(bound, 0.0))
        sig.evidence["excess_ns"] = sig.loss_ns
        out[i] = replace(sig, loss_ns=saved)
    return out


def split_shares(signals: list[RankSignal], records: Sequence[dict[str, object]]) -> list[RankSignal]:
    """Evidence ``saved_ns`` on every signal: the single-rank share and its stage's share."""
    stage_saved = {int(s.evidence.get("stage", -1)): s.loss_ns for s in signals if s.category == "stage_imbalance"}
    stage_of = {as_int(r["rank"]): as_int(r.get("pp_rank", -1)) for r in records} if stage_saved else {}
    for sig in signals:
        if "saved_ns" in sig.evidence:
            continue
        stage = stage_saved.get(stage_of.get(sig.rank, -1), 0.0) if sig.rank >= 0 else 0.0
        sig.evidence["saved_ns"] = {"rank": sig.loss_ns, "stage": stage}
    return signals
